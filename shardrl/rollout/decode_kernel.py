"""Decode attention as one Triton kernel: each slot reads its own cache entries up to its position, no further.

Imported only on CUDA (Triton is not needed elsewhere). One program per (slot, KV head): its G query heads
(GQA) are the rows of a small matrix multiplied against blocks of the slot's keys and values, with the
softmax kept online (running max and sum) as in FlashAttention. Reading stops at the slot's position, so
a step's attention reads the bytes of the live context and not those of a padded common length.

Given the step's new key and value (`k_new`, `v_new`), the kernel also writes them into the cache at the
slot's position and attends to them from registers, which saves the two indexed copies per layer that
write them otherwise (not yet measured on a GPU, so not the default; see bench/profile_decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention(q_ptr, kv_ptr, out_ptr, pos_ptr, k_new_ptr, v_new_ptr, scale,
                      stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs,
                      stride_kb, stride_kh, stride_vb, stride_vh,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr, WRITE: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    position = tl.load(pos_ptr + b)
    end = position if WRITE else position + 1  # the entries read from the cache
    rows, dims, cols = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, BLOCK_N)
    q_offsets = b * stride_qb + h * stride_qh + rows[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows[:, None] < G, other=0.0)
    k_base = kv_ptr + b * stride_kvb + h * stride_kvh
    v_base = k_base + stride_kvkind
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(0, end, BLOCK_N):
        entries = start + cols
        live = entries < end
        offsets = entries[:, None] * stride_kvs + dims[None, :]
        k = tl.load(k_base + offsets, mask=live[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_base + offsets, mask=live[:, None], other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    if WRITE:  # the new entry: into the cache, and into the softmax from registers (no read after the write)
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        tl.store(k_base + position * stride_kvs + dims, k_new)
        tl.store(v_base + position * stride_kvs + dims, v_new)
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (BLOCK_G,)
        new_max = tl.maximum(running_max, score)
        rescale = tl.exp(running_max - new_max)
        p_new = tl.exp(score - new_max)
        running_sum = running_sum * rescale + p_new
        acc = acc * rescale[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
    out = acc / running_sum[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < G)


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, positions: torch.Tensor,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     block_n: int = 64) -> torch.Tensor:
    """q (B, Hkv, G, D) contiguous, kv_layer (2, B, Hkv, max_seq, D) with unit stride in D, positions (B,):
    softmax(q k^T / sqrt(D)) v over each slot's entries 0..position. With k_new, v_new (B, Hkv, D), unit
    stride in D, they are first written at each slot's position (slot b is row b). Returns (B, Hkv, G, D)
    like q. fp32 inputs are multiplied in full fp32 (no TF32)."""
    b, hkv, g, d = q.shape
    if d < 16 or d & (d - 1) or kv_layer.stride(-1) != 1 or not q.is_contiguous():
        raise ValueError(f"decode_attention needs a contiguous q and a power-of-two head dim >= 16, got {d}")
    write = k_new is not None
    if write and (v_new is None or k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
        raise ValueError("decode_attention takes k_new and v_new together, each with unit stride in D")
    k_new, v_new = (k_new, v_new) if write else (q, q)  # placeholders the kernel does not read
    out = torch.empty_like(q)
    _decode_attention[(b, hkv)](
        q, kv_layer, out, positions, k_new, v_new, d**-0.5, q.stride(0), q.stride(1), *kv_layer.stride()[:4],
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        WRITE=write, num_warps=4, num_stages=2)
    return out
