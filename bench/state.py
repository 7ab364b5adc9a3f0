"""Engine state on GPUs: weight-export throughput and what offload frees, for the Qwen2-1.5B shape.

Export: `engine.export_weights(bf16)` consumed tensor by tensor (each is dropped after a checksum), in
GB/s of bf16 weights delivered, against a plain loop over the FSDP2 module's DTensor parameters doing
`p.full_tensor().to(bf16)` in the same run; the median of 5 timings each, taken alternately. Offload: `torch.cuda.memory_allocated` before and after
`engine.offload()` (params, grads and AdamW state after one step), and the time of offload and onload.

    python bench/state.py --world 2 --strategies fsdp2,fsdp [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.engine import QWEN2_1P5B  # noqa: E402


REPEATS = 5  # export timings: the median of this many, the engine and the baseline alternating


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_strategy(strategy: str):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardrl.batch import Batch
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    engine = build_engine(ModelConfig(tiny=QWEN2_1P5B), EngineConfig(strategy=strategy, micro_batch_size_per_gpu=2),
                          OptimConfig(lr=1e-5))
    ids = torch.randint(0, QWEN2_1P5B["vocab_size"], (2, 1024), device="cuda")
    ones = torch.ones_like(ids)
    engine.train_batch(Batch({"input_ids": ids, "attention_mask": ones, "loss_mask": ones}),
                       lambda out, mb, nt, ns: (-(out["log_probs"] * mb["loss_mask"]).sum() / nt, {}))
    rows = []

    def consume(pairs):
        nbytes = 0
        check = torch.zeros((), device="cuda")
        for _, t in pairs:
            nbytes += t.numel() * t.element_size()
            check += t.float().sum()  # touch every tensor so nothing is skipped
        consume.nbytes = nbytes

    def plain():
        return ((n, p.full_tensor().to(torch.bfloat16) if isinstance(p, DTensor) else p.to(torch.bfloat16))
                for n, p in engine.module.named_parameters())

    variants = {"export": lambda: engine.export_weights(torch.bfloat16)}
    if strategy == "fsdp2":
        variants["export_baseline_full_tensor_loop"] = plain
    times: dict[str, list[float]] = {k: [] for k in variants}
    for make in variants.values():  # warm-up
        consume(make())
    for _ in range(REPEATS):  # alternating, so drift in the machine hits both alike
        for what, make in variants.items():
            times[what].append(_timed(lambda: consume(make())))
    for what, ts in times.items():
        seconds = sorted(ts)[len(ts) // 2]
        rows.append(dict(what=what, strategy=strategy, world=dist.get_world_size(), gb=round(consume.nbytes / 1e9, 3),
                         seconds=round(seconds, 4), gb_per_s=round(consume.nbytes / 1e9 / seconds, 2),
                         repeats=len(ts), seconds_all=[round(t, 4) for t in ts]))

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    t_off = _timed(engine.offload)
    after = torch.cuda.memory_allocated()
    t_on = _timed(engine.onload)
    back = torch.cuda.memory_allocated()
    rows.append(dict(what="offload", strategy=strategy, world=dist.get_world_size(),
                     allocated_before_gib=round(before / 2**30, 2), allocated_offloaded_gib=round(after / 2**30, 2),
                     freed_gib=round((before - after) / 2**30, 2), allocated_onloaded_gib=round(back / 2**30, 2),
                     offload_s=round(t_off, 3), onload_s=round(t_on, 3)))
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--strategies", default="fsdp2,fsdp")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from shardrl.testing import run_distributed

    rows = []
    for s in args.strategies.split(","):
        rows += run_distributed(run_strategy, args.world, s)
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
