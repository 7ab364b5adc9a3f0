"""The decode attention kernel with and without its shared-prefix cascade, alone, at the long-prompt GRPO shape of
bench/prefix_reuse.py (Qwen2-1.5B's attention: 2 KV heads of 6 query heads, head dim 128; 256 slots = 32 prompts of
2,048 tokens x n=8, each slot with --own entries of its own), for the launch settings worth tuning: prefix splits,
block width, warps. Each variant's time is the median of CUDA-event timings of one layer's call inside a graph of
28 (as a decode step runs them), against the bytes it must read (the K/V once per group plus each slot's own), and
its largest difference from the plain kernel's output. One JSON line per variant (also appended to --out).

    python bench/cascade_kernel.py --out results.jsonl            # one GPU
    TRITON_INTERPRET=1 python bench/cascade_kernel.py --quick     # CPU: small shapes, the outputs only, no timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.profile_decode import graph_ms  # noqa: E402

HBM_TB_S = 4.8  # an H200's memory bandwidth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--own", type=int, default=128, help="entries past the shared prompt each slot holds")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="CPU under Triton's interpreter: small shapes, no timing")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.n, args.prompt_len, args.own, args.block_size = 2, 4, 64, 8, 16

    from shardrl.rollout.decode_kernel import decode_attention
    from shardrl.rollout.kernel_support import cascade_members

    dev, dtype = ("cpu", torch.float32) if args.quick else ("cuda", torch.bfloat16)
    hkv, g, d, size = 2, 6, 128, args.block_size
    b = args.prompts * args.n
    shared_blocks = args.prompt_len // size
    own_blocks = -(-(args.own + 1) // size)
    per_slot = shared_blocks + own_blocks
    num_blocks = 1 + args.prompts * shared_blocks + b * own_blocks
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(2, num_blocks, hkv, size, d, generator=gen, device=dev, dtype=dtype)
    table = torch.zeros(b, per_slot, dtype=torch.long)
    for slot in range(b):
        prompt = slot // args.n
        table[slot, :shared_blocks] = 1 + prompt * shared_blocks + torch.arange(shared_blocks)
        first_own = 1 + args.prompts * shared_blocks + slot * own_blocks
        table[slot, shared_blocks:] = first_own + torch.arange(own_blocks)
    table = table.to(dev)
    positions = torch.full((b,), args.prompt_len + args.own, dtype=torch.long, device=dev)
    q = torch.randn(b, hkv, g, d, generator=gen, device=dev, dtype=dtype)
    k_new, v_new = torch.randn(2, b, hkv, d, generator=gen, device=dev, dtype=dtype)
    members = min(cascade_members(g), args.n)
    groups = torch.full((b // 2, members), -1, dtype=torch.long)
    for i, start in enumerate(range(0, b, members)):
        groups[i, : min(members, b - start)] = torch.arange(start, min(start + members, b))
    groups, shared = groups.to(dev), torch.full((b,), shared_blocks * size, dtype=torch.long, device=dev)
    entry = hkv * d * 2 * 2  # K and V bytes of one cache entry, all KV heads
    flat_bytes = b * (args.prompt_len + args.own) * entry
    cascade_bytes = (args.prompts * -(-args.n // members) * args.prompt_len + b * args.own) * entry

    def run(**kw):
        return decode_attention(q, kv, positions, k_new, v_new, block_table=table, **kw)

    want = run().float()
    variants = [dict(name="flat", kw={})]
    variants += [dict(name="flat", kw=dict(splits=s)) for s in (2, 4)]
    for ps in (1, 2, 4, 8, 16, 32) if not args.quick else (1, 4):
        for block_n in (64, 128) if not args.quick else (16,):
            for warps in (4, 8) if not args.quick else (4,):
                variants.append(dict(name="cascade", kw=dict(cascade=(shared, groups), prefix_splits=ps,
                                                              block_n=block_n, prefix_warps=warps)))
    for v in variants:
        try:
            diff = (run(**v["kw"]).float() - want).abs().max().item()
            ms = float("nan") if args.quick else graph_ms(lambda: run(**v["kw"]))
        except Exception as e:  # noqa: BLE001 (a launch setting the GPU cannot take: recorded, the rest go on)
            rec = dict(bench="cascade_kernel", variant=v["name"], error=repr(e)[:300],
                       **{k: x for k, x in v["kw"].items() if k != "cascade"})
        else:
            need = cascade_bytes if v["name"] == "cascade" else flat_bytes
            rec = dict(bench="cascade_kernel", variant=v["name"], us=round(ms * 1000, 1), max_abs_diff=diff,
                       bytes_mb=round(need / 1e6, 1), floor_us=round(need / (HBM_TB_S * 1e12) * 1e6, 1),
                       **{k: x for k, x in v["kw"].items() if k != "cascade"})
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
