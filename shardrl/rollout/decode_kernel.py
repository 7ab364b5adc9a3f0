"""Decode attention as one Triton kernel: each slot reads its own cache entries up to its position, no further.

Imported only on CUDA (Triton is not needed elsewhere). One program per (slot, KV head): its G query heads
(GQA) are the rows of a small matrix multiplied against blocks of the slot's keys and values, with the
softmax kept online (running max and sum) as in FlashAttention. Reading stops at the slot's position, so
a step's attention reads the bytes of the live context and not those of a padded common length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention(q_ptr, kv_ptr, out_ptr, pos_ptr, scale,
                      stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    end = tl.load(pos_ptr + b) + 1  # entries 0..position
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
    out = acc / running_sum[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < G)


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, positions: torch.Tensor,
                     block_n: int = 64) -> torch.Tensor:
    """q (B, Hkv, G, D) contiguous, kv_layer (2, B, Hkv, max_seq, D) with unit stride in D, positions (B,):
    softmax(q k^T / sqrt(D)) v over each slot's entries 0..position. Returns (B, Hkv, G, D) like q. fp32
    inputs are multiplied in full fp32 (no TF32)."""
    b, hkv, g, d = q.shape
    if d < 16 or d & (d - 1) or kv_layer.stride(-1) != 1 or not q.is_contiguous():
        raise ValueError(f"decode_attention needs a contiguous q and a power-of-two head dim >= 16, got {d}")
    out = torch.empty_like(q)
    _decode_attention[(b, hkv)](
        q, kv_layer, out, positions, d**-0.5, q.stride(0), q.stride(1), *kv_layer.stride()[:4],
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    return out
