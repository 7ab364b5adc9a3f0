"""Profiles one training step of the engine and of the plain FSDP2 loop (bench/engine.py rows) and
prints the top CUDA kernels of each (rank 0's), to see where the engine's time goes.

    python bench/profile_step.py --rows plain_4,fsdp2_4
    python bench/profile_step.py --world 2 --rows fsdp2_4_compile,fsdp2_8_compile   # collectives included
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.engine import ROWS, engine_step_fn, plain_step_fn  # noqa: E402


KINDS = (  # (kind, substrings of a kernel's name), the first match wins
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("nccl", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("triton", ("triton",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_rows(names, world: int, top: int = 40):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        kind, seqs, micro, ckpt, extra = ROWS[name]
        step = (plain_step_fn(world, seqs, micro, ckpt) if kind == "plain"
                else engine_step_fn(kind, world, seqs, micro, ckpt, extra))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if dist.get_rank() == 0:
            kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            busy = sum(e.self_device_time_total for e in kernels) / 1e6
            print(f"==== {name} on {world} GPU(s): step {wall:.3f} s (profiled), kernels {busy:.3f} s "
                  f"({busy / wall:.0%} of it)")
            by_kind = {}
            for e in kernels:
                kind = kind_of(e.key)
                by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
            print("kernel seconds by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                          sorted(by_kind.items(), key=lambda kv: -kv[1])))
            print(f"top {top} kernels (seconds, calls, kind, name):")
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
                print(f"  {e.self_device_time_total / 1e6:7.3f} {e.count:6d} {kind_of(e.key):9s} {e.key[:110]}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="plain_4,fsdp2_4")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--top", type=int, default=40, help="how many kernels to list by their own time")
    args = p.parse_args()
    from shardrl.testing import run_distributed

    run_distributed(profile_rows, args.world, args.rows.split(","), args.world, args.top)
