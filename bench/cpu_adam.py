"""AdamW steps on the host's CPU, where an engine with offloaded parameters (`*.engine.offload_params=true`) steps
(issue 62 item 4): torch's per-tensor loop (what such an engine used before), its foreach form, and its fused CPU
kernel (what it uses now), over the same fp32 parameters and gradients, in one process. Prints one JSON line per
variant: seconds a step and parameters a second.

    python bench/cpu_adam.py --params 60e6 --steps 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=60e6, help="parameters, in (4096 x 1024) tensors")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    args = parser.parse_args()
    count = max(1, int(args.params) // (4096 * 1024))
    for name, options in {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4096, 1024)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, **options)
        opt.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        seconds = (time.perf_counter() - start) / args.steps
        n = sum(p.numel() for p in params)
        print(json.dumps({"bench": "cpu_adam", "variant": name, "params": n, "threads": torch.get_num_threads(),
                          "seconds_per_step": round(seconds, 4), "params_per_s": round(n / seconds)}), flush=True)


if __name__ == "__main__":
    main()
