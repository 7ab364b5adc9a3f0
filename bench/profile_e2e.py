"""Where a whole RL step's GPU time goes, per phase: runs one `bench/e2e.py` case in this process (one GPU,
the config `bench/e2e.py` gives shardrl), profiles one step after the warm-up with torch.profiler, and
prints per phase (weight sync, generation, update) its wall time, the GPU's busy fraction (the union of
kernel intervals over the phase) and the kernel time by kind (matrix products, attention, Triton/compiled
kernels, optimizer, copies, other), with the top kernels.

    python bench/profile_e2e.py --root /tmp/e2e --case var_512 --steps 4 --out results.jsonl

Needs `bench/e2e.py --root ROOT --systems none` first (the models and prompts).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402

KINDS = (  # (kind, substrings of a kernel's name), the first match wins
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "matmul", "_mm_")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("nccl", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("triton", ("triton",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(prof, top: int) -> dict:
    """Per phase ("phase:*" ranges on the CPU): wall ms, GPU busy fraction, kernel ms by kind, top kernels."""
    events = list(prof.events())
    phases = [(e.name[len("phase:"):], e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("phase:")]
    kernels = [e for e in events if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    out = {}
    for name, start, end in phases:
        mine = [k for k in kernels if start <= k.time_range.start < end]
        by_kind, by_name = collections.Counter(), collections.Counter()
        for k in mine:
            us = k.time_range.end - k.time_range.start
            by_kind[kind_of(k.name)] += us
            by_name[k.name[:90]] += us
        wall = end - start
        busy = busy_us([(k.time_range.start, k.time_range.end) for k in mine])
        out[name] = dict(wall_ms=round(wall / 1e3, 2), gpu_busy_ms=round(busy / 1e3, 2),
                         gpu_busy_fraction=round(busy / wall, 3) if wall else None, kernels=len(mine),
                         kernel_ms_by_kind={k: round(v / 1e3, 2) for k, v in by_kind.most_common()},
                         top_kernels_ms={k: round(v / 1e3, 2) for k, v in by_name.most_common(top)})
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/e2e")
    p.add_argument("--case", default="var_512")
    p.add_argument("--steps", type=int, default=4, help="the last one is profiled")
    p.add_argument("--extra", default="", help="extra overrides, space separated")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--tag", default="")
    p.add_argument("--quick", action="store_true", help="bench/e2e.py's tiny cases (a CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29521"))
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import shardrl.trainer.rl as rl
    from bench.e2e import CASES, QUICK_CASES, shardrl_overrides
    from shardrl.trainer.main import resolve_overrides, run

    root = Path(args.root)
    run_dir = root / "runs" / f"profile_{args.case}{args.tag}"
    overrides = shardrl_overrides(root, args.case, QUICK_CASES if args.quick else CASES, args.steps, args.extra.split()) + [
        f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]"]

    def phase(name, fn):
        def wrapped(*a, **kw):
            with record_function(f"phase:{name}"):
                return fn(*a, **kw)
        return wrapped

    rl.RLTrainer._sync_weights = phase("weight_sync", rl.RLTrainer._sync_weights)
    plain_generate = rl.RLTrainer._generate

    def generate(self, *a, **kw):  # the rollout's own call, without the weight sync at its start
        rollout_generate = self.rollout.generate
        self.rollout.generate = phase("generate", rollout_generate)
        try:
            return plain_generate(self, *a, **kw)
        finally:
            self.rollout.generate = rollout_generate
    rl.RLTrainer._generate = generate
    rl.run_updates = phase("update", rl.run_updates)
    plain_step, calls, result = rl.RLTrainer.train_step, [0], {}

    def train_step(self):
        calls[0] += 1
        if calls[0] < args.steps:
            return plain_step(self)
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            with record_function("phase:step"):
                metrics = plain_step(self)
            sync()
        result["phases"] = summarize(prof, args.top)
        result["rollout_stats"] = dict(getattr(self.rollout, "last_stats", {}) or {})
        return metrics

    rl.RLTrainer.train_step = train_step
    run(None, resolve_overrides(None, overrides))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    rec = dict(bench="profile_e2e", case=args.case, tag=args.tag, extra=args.extra,
               step_s=round(last["timing/step_s"], 3), gen_s=round(last["timing/gen_s"], 3),
               update_s=round(last["timing/update_s"], 3), steps_s=[round(r["timing/step_s"], 2) for r in records],
               **result)
    print(json.dumps(rec, indent=1))
    append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
