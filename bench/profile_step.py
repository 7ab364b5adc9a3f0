"""Profiles one training step of the engine and of the plain FSDP2 loop (bench/engine.py rows) and
prints the top CUDA kernels of each (rank 0's), to see where the engine's time goes.

    python bench/profile_step.py --rows plain_4,fsdp2_4
    python bench/profile_step.py --world 2 --rows fsdp2_4_compile,fsdp2_8_compile   # collectives included
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.engine import ROWS, engine_step_fn, plain_step_fn  # noqa: E402


def profile_rows(names, world: int):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        kind, seqs, micro, ckpt, extra = ROWS[name]
        step = (plain_step_fn(world, seqs, micro, ckpt) if kind == "plain"
                else engine_step_fn(kind, world, seqs, micro, ckpt, extra))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if dist.get_rank() == 0:
            print(f"==== {name} on {world} GPU(s)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="plain_4,fsdp2_4")
    p.add_argument("--world", type=int, default=1)
    args = p.parse_args()
    from shardrl.testing import run_distributed

    run_distributed(profile_rows, args.world, args.rows.split(","), args.world)
