"""Experiment (session 22): shared-prefix kernel variants that read a whole cache block per step (no masks), through
pointer loads or TMA descriptor loads, pipelined by Triton, against the current kernel; checked against a torch
reference of attention over each slot's shared entries. Writes one JSON line.

    python bench/exp_cascade.py --out x.json         # timings in CUDA graphs
    python bench/exp_cascade.py --ncu                # a few launches of each, for ncu
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from shardrl.rollout.decode_kernel import (_accumulate, _combine_splits, _merge_prefix, _prefix_offset, _scores,  # noqa: E402
                                           _side_stream, shared_prefix_parts)


@triton.jit
def _group_blocks(q_ptr, kv_ptr, kv_desc, prefix_ptr, shared_ptr, groups_ptr, table_ptr, grp, first_slot, h, split,
                  num_heads, v_rows, scale, softcap, stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh,
                  stride_kvs, stride_tb, stride_gg, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                  BLOCK_R: tl.constexpr, PS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                  BS: tl.constexpr, TMA: tl.constexpr, MODE: tl.constexpr):
    rows, dims, cols = tl.arange(0, BLOCK_R), tl.arange(0, D), tl.arange(0, BS)
    member, head = rows // G, rows % G
    slot = tl.load(groups_ptr + grp * stride_gg + member, mask=member < M, other=-1)
    live = slot >= 0
    nblk = tl.load(shared_ptr + first_slot) // BS
    per = tl.cdiv(nblk, PS)
    b0 = split * per
    b1 = tl.minimum(b0 + per, nblk)
    q = tl.load(q_ptr + slot[:, None] * stride_qb + h * stride_qh + head[:, None] * D + dims[None, :],
                mask=live[:, None], other=0.0)
    table = table_ptr + first_slot * stride_tb
    running_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    blk = tl.load(table + b0, mask=b0 < b1, other=0)
    first_blk = blk
    for j in range(b0, b1):
        if MODE == 0:
            blk = tl.load(table + j)
        elif MODE == 1:  # (an experiment: the test's blocks are consecutive)
            blk = first_blk + (j - b0)
        if TMA:
            krow = ((blk * num_heads + h) * BS).to(tl.int32)
            k = kv_desc.load([krow, 0])
        else:
            offsets = blk * stride_kvb + h * stride_kvh + cols[:, None] * stride_kvs + dims[None, :]
            k = tl.load(kv_ptr + offsets)
        scores = _scores(q, k, scale, softcap, IEEE, SOFTCAP)
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        if TMA:
            v = kv_desc.load([krow + v_rows, 0])
        else:
            v = tl.load(kv_ptr + stride_kvkind + offsets)
        acc = _accumulate(acc, rescale, p, v, IEEE)
        running_max = new_max
        if MODE == 2:  # the next block's id, loaded a step ahead
            blk = tl.load(table + j + 1, mask=j + 1 < b1, other=0)
    base = prefix_ptr + _prefix_offset(tl.maximum(slot, 0), h, split, num_heads, G, D, PS)
    tl.store(base[:, None] + head[:, None] * D + dims[None, :], acc, mask=live[:, None])
    tl.store(base + G * D + head, running_max, mask=live)
    tl.store(base + G * D + G + head, running_sum, mask=live)


@triton.jit
def _shared_blocks(q_ptr, kv_ptr, kv_desc, prefix_ptr, shared_ptr, groups_ptr, table_ptr, num_groups, v_rows, scale,
                   softcap, stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs, stride_tb,
                   stride_gg, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr,
                   PS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, BS: tl.constexpr, TMA: tl.constexpr,
                   MODE: tl.constexpr):
    h, split, grp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first_slot = tl.load(groups_ptr + grp * stride_gg, mask=grp < num_groups, other=-1)
    while first_slot >= 0:
        _group_blocks(q_ptr, kv_ptr, kv_desc, prefix_ptr, shared_ptr, groups_ptr, table_ptr, grp, first_slot, h,
                      split, tl.num_programs(0), v_rows, scale, softcap, stride_qb, stride_qh, stride_kvkind,
                      stride_kvb, stride_kvh, stride_kvs, stride_tb, stride_gg, G, D, M, BLOCK_R, PS, IEEE, SOFTCAP,
                      BS, TMA, MODE)
        grp += tl.num_programs(2)
        first_slot = tl.load(groups_ptr + grp * stride_gg, mask=grp < num_groups, other=-1)


def blocks_parts(q, kv, table, shared, groups, scale, ps=4, tma=True, warps=4, stages=2, programs=None, out=None,
                 mode=0):
    b, hkv, g, d = q.shape
    rows, m = groups.shape
    bs = kv.shape[3]
    prefix = out if out is not None else torch.empty(b * hkv * ps * g * (d + 2), dtype=torch.float32,
                                                     device=q.device)
    flat = kv.view(-1, d)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [bs, d]) if tma else flat
    programs = programs or rows
    v_rows = kv.shape[1] * hkv * bs
    compiled = _shared_blocks[(hkv, ps, programs)](
        q, kv, desc, prefix, shared, groups, table, rows, v_rows, scale, 1.0, q.stride(0), q.stride(1),
        *kv.stride()[:4], table.stride(0), groups.stride(0), G=g, D=d, M=m,
        BLOCK_R=max(16, triton.next_power_of_2(m * g)), PS=ps, IEEE=q.dtype == torch.float32, SOFTCAP=False,
        BS=bs, TMA=tma, MODE=mode, num_warps=warps, num_stages=stages)
    return prefix, compiled


def merged(prefix, b, hkv, g, d, ps):
    """Each slot's normalized attention over its shared entries, from its PS parts."""
    parts = prefix.view(b, hkv, ps, g * (d + 2))
    acc = parts[..., : g * d].view(b, hkv, ps, g, d)
    mx = parts[..., g * d: g * d + g]
    sm = parts[..., g * d + g:]
    top = mx.max(2, keepdim=True).values
    w = torch.where(mx == float("-inf"), 0.0, torch.exp(mx - top))
    return (acc * w[..., None]).sum(2) / (sm * w).sum(2)[..., None]


def reference(q, kv, table, shared_len, bs):
    b, hkv, g, d = q.shape
    nblk = shared_len // bs
    blocks = table[:, :nblk]  # (b, nblk)
    k = kv[0][blocks].permute(0, 2, 1, 3, 4).reshape(b, hkv, nblk * bs, d).float()
    v = kv[1][blocks].permute(0, 2, 1, 3, 4).reshape(b, hkv, nblk * bs, d).float()
    s = torch.einsum("bhgd,bhnd->bhgn", q.float(), k) * d ** -0.5
    return torch.einsum("bhgn,bhnd->bhgd", s.softmax(-1), v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--own", action="store_true")
    args = parser.parse_args()
    if args.own:
        return own_main(args.out)
    from bench.profile_cascade import build, groups_of
    from bench.profile_decode import graph_ms
    from shardrl.rollout.decode_kernel import decode_attention
    from shardrl.rollout.kernel_support import cascade_members

    prompts, n, hkv, g, d, shared_len, own, bs = 32, 8, 2, 6, 128, 2048, 256, 64
    kv, table, positions, q, k_new, v_new = build(prompts, n, hkv, g, d, shared_len, own, bs, torch.bfloat16)
    b, scale = q.shape[0], d ** -0.5
    shared, groups = groups_of(prompts, n, cascade_members(g), shared_len)
    ref = reference(q, kv, table, shared_len, bs)
    variants = {"cur": lambda out=None, ps=4: (shared_prefix_parts(q, kv, table, shared, groups, scale, None, ps,
                                                                   out=out), None)}
    for tma in (False, True):
        for stages in (2, 3):
            for mode in (0, 1, 2):
                for programs in (32, 128):
                    name = f"{'tma' if tma else 'ptr'} s{stages} mode{mode} programs{programs}"
                    variants[name] = (lambda tma=tma, stages=stages, mode=mode, programs=programs, out=None:
                                      blocks_parts(q, kv, table, shared, groups, scale, 4, tma, 4, stages,
                                                   programs=programs, out=out, mode=mode))
    if args.ncu:
        for name in ("cur", "tma s2 mode0 programs32"):
            for _ in range(2):
                variants[name]()
        torch.cuda.synchronize()
        print("per-slot kernel:")
        for _ in range(2):
            decode_attention(q, kv, positions, k_new, v_new, block_table=table, cascade=(shared, groups),
                             overlap=False)
        torch.cuda.synchronize()
        return
    results = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
               "shared_only_floor_ms": round(prompts * shared_len * 2 * hkv * d * 2 / 4.3e12 * 1e3, 4)}
    for name, fn in variants.items():
        ps = getattr(fn, "ps", 4)
        try:
            prefix, compiled = fn()
            err = (merged(prefix, b, hkv, g, d, ps) - ref).abs().max().item()
            out = torch.empty_like(prefix)
            ms = graph_ms(lambda: fn(out=out))
            info = {"ms": round(ms, 4), "err": err}
            if compiled is not None:
                info.update(regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared)
        except Exception as e:
            info = f"{type(e).__name__}: {str(e)[:200]}"
        results[name] = info
        print(json.dumps({name: info}), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(results) + "\n")



@triton.jit
def _own(q_ptr, kv_ptr, part_ptr, prefix_ptr, out_ptr, pos_ptr, table_ptr, k_new_ptr, v_new_ptr, shared_ptr, scale, stride_qb, stride_qh,
         stride_kvkind, stride_kvb, stride_kvh, stride_kvs, stride_tb, stride_kb, stride_kh, stride_vb, stride_vh,
         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HOIST: tl.constexpr,
         MERGE: tl.constexpr):
    """A slot's own entries [shared, position) a block at a time, the new entry written and attended; its part
    stored as `_decode_attention` with SPLITS=1 and PARTS does."""
    b, h = tl.program_id(0), tl.program_id(1)
    position = tl.load(pos_ptr + b)
    shared = tl.load(shared_ptr + b)
    rows, dims, cols = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, BS)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * D + dims[None, :], mask=rows[:, None] < G,
                other=0.0)
    table = table_ptr + b * stride_tb
    k_base = kv_ptr + h * stride_kvh
    v_base = k_base + stride_kvkind
    if HOIST:
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        at = tl.load(table + position // BS) * stride_kvb + (position % BS) * stride_kvs + dims
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for i in range(shared // BS, tl.cdiv(position, BS)):
        blk = tl.load(table + i)
        live = i * BS + cols < position
        offsets = blk * stride_kvb + cols[:, None] * stride_kvs + dims[None, :]
        k = tl.load(k_base + offsets, mask=live[:, None], other=0.0)
        scores = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_base + offsets, mask=live[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    if not HOIST:
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        at = tl.load(table + position // BS) * stride_kvb + (position % BS) * stride_kvs + dims
    tl.store(k_base + at, k_new)
    tl.store(v_base + at, v_new)
    score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
    new_max = tl.maximum(running_max, score)
    rescale = tl.exp(running_max - new_max)
    p_new = tl.exp(score - new_max)
    running_sum = running_sum * rescale + p_new
    acc = acc * rescale[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
    if MERGE:
        acc, new_max, running_sum = _merge_prefix(acc, new_max, running_sum, prefix_ptr, b, h, tl.num_programs(1),
                                                  shared, G, BLOCK_G, D, 4)
        out = acc / running_sum[:, None]
        tl.store(out_ptr + b * stride_qb + h * stride_qh + rows[:, None] * D + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < G)
    else:
        base = part_ptr + (b * tl.num_programs(1) + h) * BLOCK_G * (D + 2)
        tl.store(base + rows[:, None] * D + dims[None, :], acc)
        tl.store(base + BLOCK_G * D + rows, new_max)
        tl.store(base + BLOCK_G * D + BLOCK_G + rows, running_sum)


def own_part(q, kv, positions, table, k_new, v_new, shared, part, hoist=True, warps=4, stages=2, prefix=None,
             out=None):
    b, hkv, g, d = q.shape
    merge = out is not None
    return _own[(b, hkv)](q, kv, part, prefix if merge else part, out if merge else q, positions, table, k_new, v_new, shared, d ** -0.5, q.stride(0), q.stride(1),
                          *kv.stride()[:4], table.stride(0), k_new.stride(0), k_new.stride(1), v_new.stride(0),
                          v_new.stride(1), G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BS=kv.shape[3],
                          HOIST=hoist, MERGE=merge, num_warps=warps, num_stages=stages)


def cur_part(q, kv, positions, table, k_new, v_new, shared, prefix, part, block_n=64, warps=4, stages=2):
    from shardrl.rollout.decode_kernel import _decode_attention
    b, hkv, g, d = q.shape
    out = torch.empty_like(q)
    return _decode_attention[(b, hkv, 1)](
        q, kv, out, part, positions, table, k_new, v_new, shared, prefix, d ** -0.5, 1.0, 0, q.stride(0), q.stride(1),
        *kv.stride()[:4], table.stride(0), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, SPLITS=1, IEEE=False, WRITE=True,
        SOFTCAP=False, WINDOW=False, BS=kv.shape[3], CASCADE=True, PS=4, PARTS=True, num_warps=warps,
        num_stages=stages)


def own_main(out_path):
    """The per-slot kernel (own entries past the shared prefix) against variants; each output checked through
    `_combine_splits` against the plain per-slot kernel reading everything."""
    from bench.profile_cascade import build, groups_of
    from bench.profile_decode import graph_ms
    from shardrl.rollout.decode_kernel import _combine_splits, decode_attention
    from shardrl.rollout.kernel_support import cascade_members

    prompts, n, hkv, g, d, shared_len, own, bs = 32, 8, 2, 6, 128, 2048, 256, 64
    kv, table, positions, q, k_new, v_new = build(prompts, n, hkv, g, d, shared_len, own, bs, torch.bfloat16)
    b = q.shape[0]
    shared, groups = groups_of(prompts, n, cascade_members(g), shared_len)
    kv0 = kv.clone()
    base = decode_attention(q, kv, positions, k_new, v_new, block_table=table)
    kv.copy_(kv0)
    prefix = shared_prefix_parts(q, kv, table, shared, groups, d ** -0.5, None, 4)
    block_g = 16
    part = torch.zeros(b * hkv * block_g * (d + 2), dtype=torch.float32, device="cuda")

    def combined():
        out = torch.empty_like(q)
        _combine_splits[(b, hkv)](part, out, shared, prefix, out.stride(0), out.stride(1), G=g, BLOCK_G=block_g, D=d,
                                  SPLITS=1, CASCADE=True, PS=4, num_warps=4)
        return out

    rows = {}
    for bn, st, w in ((64, 2, 4),):
        rows[f"cur n{bn} s{st} w{w}"] = lambda bn=bn, st=st, w=w: cur_part(q, kv, positions, table, k_new, v_new,
                                                                            shared, prefix, part, bn, w, st)
    for hoist in (True,):
        for st in (2, 3):
            for w in (2,):
                rows[f"own hoist={hoist} s{st} w{w}"] = (lambda hoist=hoist, st=st, w=w: own_part(
                    q, kv, positions, table, k_new, v_new, shared, part, hoist, w, st))
    side = _side_stream(q.device)
    pre_out = torch.empty_like(prefix)
    out_m = torch.empty_like(q)

    def combo(tma, overlap, merge, mode=0):
        def run():
            main = torch.cuda.current_stream()
            if overlap:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    blocks_parts(q, kv, table, shared, groups, d ** -0.5, 4, tma, 4, 3 if not tma else 2,
                                 programs=32, out=pre_out, mode=mode)
            else:
                blocks_parts(q, kv, table, shared, groups, d ** -0.5, 4, tma, 4, 3 if not tma else 2, programs=32,
                             out=pre_out, mode=mode)
            own_part(q, kv, positions, table, k_new, v_new, shared, part, True, 2, 2,
                     prefix=pre_out if merge else None, out=out_m if merge else None)
            if overlap:
                main.wait_stream(side)
            if merge:
                return out_m
            out = torch.empty_like(q)
            _combine_splits[(b, hkv)](part, out, shared, pre_out, out.stride(0), out.stride(1), G=g, BLOCK_G=block_g,
                                      D=d, SPLITS=1, CASCADE=True, PS=4, num_warps=4)
            return out
        return run

    combos = {"combo cur (decode_attention defaults)": lambda: decode_attention(
        q, kv, positions, k_new, v_new, block_table=table, cascade=(shared, groups))}
    for tma in (False, True):
        for overlap, merge in ((True, False), (False, False), (False, True)):
            for mode in (0, 2):
                combos[f"combo tma={tma} overlap={overlap} merge_in_own={merge} mode{mode}"] = combo(tma, overlap,
                                                                                                  merge, mode)
    no_own = shared.clone()  # positions at the shared length: only the new entry (the fixed chain of loads)
    rows["cur, no own entries"] = lambda: cur_part(q, kv, no_own, table, k_new, v_new, shared, prefix, part)
    rows["own hoist, no own entries"] = lambda: own_part(q, kv, no_own, table, k_new, v_new, shared, part)
    results = {"own_floor_ms": round(((positions - shared_len + 1).sum().item()) * 2 * hkv * d * 2 / 4.3e12 * 1e3, 4)}
    for name, fn in rows.items():
        try:
            kv.copy_(kv0)
            part.zero_()
            compiled = fn()
            err = None if "no own" in name else (combined().float() - base.float()).abs().max().item()
            ms = graph_ms(fn)
            results[name] = {"ms": round(ms, 4), "err": err, "regs": compiled.n_regs, "smem": compiled.metadata.shared}
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps({name: results[name]}), flush=True)
    for name, fn in combos.items():
        try:
            kv.copy_(kv0)
            err = (fn().float() - base.float()).abs().max().item()
            results[name] = {"ms": round(graph_ms(fn), 4), "err": err}
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps({name: results[name]}), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
