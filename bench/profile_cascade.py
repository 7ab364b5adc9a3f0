"""The shared-prefix (cascade) decode attention alone, at the GRPO long-prompt shape of bench/prefix_reuse.py, on one
GPU: one layer's attention for 256 slots (32 prompts of 2,048 tokens, n = 8, each slot 1-256 entries of its own), as
the fast rollout runs it (paged blocks of 64, the new K/V written by the kernel), timed in CUDA graphs of 28 calls.

Rows: the per-slot kernel reading every entry (`flat`, the cascade off), the cascade at its defaults and at session
20's settings, with its knobs varied (the shared-prefix kernel beside the per-slot one on a second stream or after
it, its programs per (KV head, split), prefix splits, the per-slot kernel's entries per step and stages), the
shared-prefix kernel alone (the per-slot kernel and the merge are the difference), and groups of fewer members (more
groups, fewer rows per product, the prefix read more times). Each row's output is checked against `flat`. The floor: the K/V bytes a step must read
(each prompt's shared entries once, each slot's own entries) at 4.3 TB/s.

    python bench/profile_cascade.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.profile_decode import graph_ms  # noqa: E402


def build(prompts: int, n: int, hkv: int, g: int, d: int, shared: int, own: int, bs: int, dtype, seed: int = 0):
    """A paged cache: each prompt's `shared` entries in blocks of its own, each slot's own entries after them in
    blocks of the slot's; positions shared + U[0, own) (the entry the step writes)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = prompts * n
    per_prompt, per_slot = shared // bs, -(-own // bs) + 1
    num_blocks = 1 + prompts * per_prompt + b * per_slot
    kv = torch.randn(2, num_blocks, hkv, bs, d, device="cuda", dtype=dtype, generator=gen)
    table = torch.zeros(b, per_prompt + per_slot, dtype=torch.long, device="cuda")
    for s in range(b):
        p = s // n
        table[s, :per_prompt] = 1 + p * per_prompt + torch.arange(per_prompt, device="cuda")
        table[s, per_prompt:] = 1 + prompts * per_prompt + s * per_slot + torch.arange(per_slot, device="cuda")
    positions = shared + torch.randint(0, own, (b,), device="cuda", generator=gen)
    q = torch.randn(b, hkv, g, d, device="cuda", dtype=dtype, generator=gen)
    k_new, v_new = torch.randn(2, b, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return kv, table, positions, q, k_new, v_new


def groups_of(prompts: int, n: int, members: int, shared: int):
    """(shared (B,), groups (B / 2, members)): each prompt's n slots in groups of `members`, as SharedPrefixGroups
    lays them out (the unused rows -1)."""
    b = prompts * n
    groups = torch.full((b // 2, members), -1, dtype=torch.long)
    row = 0
    for p in range(prompts):
        slots = list(range(p * n, (p + 1) * n))
        for i in range(0, n, members):
            part = slots[i: i + members]
            groups[row, : len(part)] = torch.tensor(part)
            row += 1
    return torch.full((b,), shared, dtype=torch.long).cuda(), groups.cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=6, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shared", type=int, default=2048)
    parser.add_argument("--own", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.shared % args.block_size:
        parser.error(f"--shared {args.shared} must be whole blocks of --block-size {args.block_size}")

    from shardrl.rollout.fast.decode_kernel import decode_attention, shared_prefix_parts
    from shardrl.rollout.fast.kernel_support import cascade_members

    dtype = torch.bfloat16
    kv, table, positions, q, k_new, v_new = build(args.prompts, args.n, args.kv_heads, args.group, args.head_dim,
                                                  args.shared, args.own, args.block_size, dtype)
    b, scale = q.shape[0], args.head_dim ** -0.5
    default_m = cascade_members(args.group)
    cascades = {m: groups_of(args.prompts, args.n, m, args.shared) for m in sorted({default_m, 4, 2})}
    kv0 = kv.clone()
    base = decode_attention(q, kv, positions, k_new, v_new, block_table=table)  # the new entries written

    def flat(**kw):
        return lambda: decode_attention(q, kv, positions, k_new, v_new, block_table=table, **kw)

    def cascade(m=default_m, **kw):
        return lambda: decode_attention(q, kv, positions, k_new, v_new, block_table=table, cascade=cascades[m], **kw)

    def prefix_only(m=default_m, **kw):
        shared, groups = cascades[m]
        return lambda: shared_prefix_parts(q, kv, table, shared, groups, scale, None, **kw)

    rows_of = {m: c[1].shape[0] for m, c in cascades.items()}  # one program per row of groups (empty ones too)
    session20 = dict(prefix_block_n=64, prefix_stages=2, prefix_programs=rows_of[default_m], overlap=False)
    rows = {"flat": flat(), "flat_split2": flat(splits=2),
            "cascade (defaults)": cascade(),
            "cascade, session 20's settings (n64 s2, a program per row, one stream)": cascade(**session20),
            "cascade overlap=False": cascade(overlap=False),
            "cascade programs=rows": cascade(prefix_programs=rows_of[default_m]),
            "cascade programs=rows overlap=False": cascade(prefix_programs=rows_of[default_m], overlap=False),
            "prefix_only (defaults)": prefix_only(),
            "prefix_only programs=rows": prefix_only(programs=rows_of[default_m]),
            "prefix_only n64 s2": prefix_only(block_n=64, num_stages=2),
            "cascade, the prefix kernel as session 21's (128 entries a step, one stage)": cascade(
                prefix_block_n=128, prefix_stages=1),
            "cascade, per-slot at 4 warps": cascade(num_warps=4),
            "prefix_only n128 s1 (session 21's)": prefix_only(block_n=128, num_stages=1),
            "prefix_only blocks s2": prefix_only(num_stages=2)}
    for programs in (8, 16, 32, 64):
        rows[f"cascade programs={programs}"] = cascade(prefix_programs=programs)
        rows[f"prefix_only programs={programs}"] = prefix_only(programs=programs)
    for ps in (1, 4, 8):
        rows[f"cascade ps{ps}"] = cascade(prefix_splits=ps)
        rows[f"cascade ps{ps} overlap=False"] = cascade(prefix_splits=ps, overlap=False)
    for bn, st in itertools.product((32, 64, 128), (1, 2, 3)):  # the per-slot kernel's own settings
        rows[f"cascade, per-slot n{bn} s{st}"] = cascade(block_n=bn, num_stages=st)
    for m in cascades:
        if m != default_m:  # more groups (of fewer members): the programs walk several rows each
            rows[f"cascade members{m}"] = cascade(m)
            rows[f"cascade members{m} programs=rows"] = cascade(m, prefix_programs=rows_of[m])
            rows[f"cascade members{m} programs=rows overlap=False"] = cascade(m, prefix_programs=rows_of[m],
                                                                             overlap=False)
    own = (positions - args.shared + 1).sum().item()
    bytes_per_entry = 2 * args.kv_heads * args.head_dim * kv.element_size()
    floor_bytes = (args.prompts * args.shared + own) * bytes_per_entry
    flat_bytes = (positions + 1).sum().item() * bytes_per_entry
    results = {"floor_ms (shared once + own, 4.3 TB/s)": round(floor_bytes / 4.3e12 * 1e3, 4),
               "flat_floor_ms (every slot its whole context)": round(flat_bytes / 4.3e12 * 1e3, 4),
               "shared_only_floor_ms": round(args.prompts * args.shared * bytes_per_entry / 4.3e12 * 1e3, 4)}
    for name, fn in rows.items():
        kv.copy_(kv0)
        try:
            out = fn()
            err = None if name.startswith("prefix_only") else (out.float() - base.float()).abs().max().item()
            ms = graph_ms(fn)
            results[name] = {"ms": round(ms, 4), "max_abs_diff_vs_flat": err}
        except Exception as e:  # a setting the compiler refuses (shared memory, registers)
            results[name] = f"{type(e).__name__}: {str(e)[:160]}"
        print(json.dumps({name: results[name]}), flush=True)
    timed = {k: v["ms"] for k, v in results.items() if isinstance(v, dict) and k.startswith("cascade")}
    best = min(timed, key=timed.get)
    line = {"bench": "profile_cascade", "shape": vars(args), "best_cascade": best, "best_ms": timed[best],
            "gpu": torch.cuda.get_device_name(), **results}
    print(json.dumps(line))
    if args.out:
        append_jsonl(args.out, [line])


if __name__ == "__main__":
    main()
