"""Profiles one training step of the engine and of the plain FSDP2 loop (bench/engine.py rows) and
prints the top CUDA kernels of each, to see where the engine's time goes.

    python bench/profile_step.py --rows plain_4,fsdp2_4
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.engine import ROWS, engine_step_fn, plain_step_fn  # noqa: E402


def profile_rows(names):
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        kind, seqs, micro, ckpt, extra = ROWS[name]
        step = plain_step_fn(1, seqs, micro, ckpt) if kind == "plain" else engine_step_fn(kind, 1, seqs, micro, ckpt, extra)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"==== {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="plain_4,fsdp2_4")
    args = p.parse_args()
    from shardrl.testing import run_distributed

    run_distributed(profile_rows, 1, args.rows.split(","))
