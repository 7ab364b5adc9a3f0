"""Ulysses sequence parallelism on GPUs: the longest single sequence that trains, and tokens/s at 32k.

Model: the Qwen2-1.5B shape of bench/engine.py, gradient checkpointing on, bf16 compute. One sequence per
step (one micro-batch). For each sp, lengths are tried in increasing order until one runs out of memory;
the last that trained is the answer.

    python bench/ulysses.py --world 2 --sp 1,2 [--lengths 16384,32768,...] [--out results.jsonl]
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
from bench.engine import QWEN2_1P5B, model_flops_per_token  # noqa: E402

LENGTHS = [16384, 32768, 49152, 65536, 98304, 131072, 196608, 262144]


def run_sp(sp: int, lengths: list[int], steps: int, warmup: int = 1):
    import gc

    import torch.distributed as dist

    from shardrl.batch import Batch
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    tiny = dict(QWEN2_1P5B, max_position_embeddings=max(lengths))
    engine = build_engine(ModelConfig(tiny=tiny, gradient_checkpointing=True),
                          EngineConfig(param_dtype="bfloat16", micro_batch_size_per_gpu=1,
                                       ulysses_sequence_parallel_size=sp, logprob_chunk_size=4096),
                          OptimConfig(lr=1e-5))
    dp = engine.mesh.dp_size

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        return -(outputs["log_probs"] * mb["loss_mask"]).sum() / num_tokens, {}

    results = []
    for length in lengths:
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, QWEN2_1P5B["vocab_size"], (1, length), device="cuda", generator=g)
        ones = torch.ones_like(ids)
        batch = Batch({"input_ids": ids, "attention_mask": ones, "loss_mask": ones})
        torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(warmup):
                engine.train_batch(batch, loss_fn)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.train_batch(batch, loss_fn)
            torch.cuda.synchronize()
            elapsed = (time.perf_counter() - t0) / steps
            ok = torch.tensor([1.0], device="cuda")
        except torch.OutOfMemoryError:
            ok = torch.tensor([0.0], device="cuda")
            elapsed = float("nan")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        tok_s = dp * length / elapsed if ok.item() else 0.0
        row = dict(sp=sp, world=dist.get_world_size(), seq_len=length, trained=bool(ok.item()),
                   tokens_per_s=round(tok_s), step_s=round(elapsed, 3),
                   tflops_per_gpu=round(tok_s * model_flops_per_token(QWEN2_1P5B, length) / 1e12 / dist.get_world_size(), 1),
                   peak_gib=round(float(peak), 1))
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
        results.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        if not ok.item():
            break
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sp", default="1,2")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (0 for very long sequences: the "
                   "one timed step then includes the first step's allocations)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from shardrl.testing import run_distributed

    rows = []
    for sp in map(int, args.sp.split(",")):
        rows += run_distributed(run_sp, args.world, sp, [int(x) for x in args.lengths.split(",")], args.steps,
                                args.warmup)
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
