"""The fast rollout's attention over its paged KV cache (`shardrl.rollout.fast.paged`): the cache writes and
reads (`write_kv`, `gather_blocks`), HF's eager soft-capped attention and window mask, and the two decode
attentions a `DecoderBlock` runs: `SDPADecodeAttention` (any device, a bucketed attended length) and
`TritonDecodeAttention` (the kernels of `shardrl.rollout.fast.decode_kernel`, CUDA, each slot up to its own
length). `LayerConsts` carries what a layer's code needs besides tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def write_kv(k, v, kv_layer, slots, positions, table: torch.Tensor | None = None) -> None:
    """Writes one token's k, v (B, Hkv, D) per slot at `positions` into kv_layer (2, B, Hkv, max_seq, D); with
    `table` (B, max_blocks), into the paged kv_layer (2, num_blocks, Hkv, block_size, D) at each slot's block."""
    if table is not None:
        size = kv_layer.shape[3]
        slots, positions = table[slots, positions // size], positions % size
    kv_layer[0][slots, :, positions] = k
    kv_layer[1][slots, :, positions] = v


def gather_blocks(kv_layer, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, Hkv, length, D) of the first `length` positions of each row of `table` (B, >= blocks)."""
    size = kv_layer.shape[3]
    blocks = kv_layer[:, table[:, : -(-length // size)]]  # (2, B, nb, Hkv, size, D)
    kv = blocks.transpose(2, 3).flatten(3, 4)[:, :, :, :length]  # (2, B, Hkv, nb * size, D) -> length
    return kv[0], kv[1]


class LayerConsts(NamedTuple):
    """What a layer's code needs besides tensors (one compilation per distinct value)."""

    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gemma: bool  # Gemma's layout: (1 + weight) norms, norms after attention and MLP
    act: str  # the MLP's gate activation: 'silu' or 'gelu_tanh'
    scale: float  # attention logits scale
    softcap: float | None  # attention logits soft-cap: cap * tanh(logits / cap) (Gemma 2)
    window: int | None  # sliding window: a query at i sees keys j with i - window < j <= i
    top_k: int = 0  # routed experts per token (0: a dense MLP)
    normalize_top_k: bool = False  # the k routing weights renormalized to sum 1
    fp32_route: bool = False  # the routing weights scale the experts' outputs in fp32


def softcapped_attention(q, k, v, mask, scale: float, softcap: float | None):
    """HF's eager attention: softmax(cap * tanh(q k^T * scale / cap) + mask) v, the softmax in fp32.
    q (..., Hq, L, D), k, v (..., Hkv, S, D) with Hkv dividing Hq; `mask` boolean (True: visible) or additive,
    broadcastable to (..., Hq, L, S). SDPA has no soft-cap, so Gemma 2's layers attend here."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (*queries.shape, *keys.shape): key position j is visible from query position i (j <= i, and
    within the window if any, as HF's `sliding_window_overlay`)."""
    i, j = queries[..., None], keys
    visible = j <= i
    return visible if window is None else visible & (j > i - window)


class SDPADecodeAttention:
    """Decode attention over the first `seq_len` cache positions of every slot, with an additive mask
    (-inf past each slot's position, and before its window on a sliding-window layer): SDPA, any device
    (or `softcapped_attention` for a soft-capped layer). The attended length is a static shape, so the
    caller buckets it (one CUDA graph per bucket)."""

    bucketed = True
    prefix_from_blocks = False  # a prefill over cached prefixes gathers them and attends with a mask (`prefill`)

    def prefill(self, q, k, v, kv_layer, prefix: tuple, c: LayerConsts) -> torch.Tensor:
        """A prefill chunk's attention over its cached prefixes: q (U, H, L, D), the chunk's own k, v (U, Hkv, L, D),
        `prefix` = (blocks (U, nb), visible (U, L, C + L) boolean for the layer's window): the prefixes' C positions
        are gathered from the blocks, the chunk's keys follow them. -> (U, H, L, D)."""
        table, visible = prefix
        length = q.shape[2]
        keys, values = gather_blocks(kv_layer, table, visible.shape[-1] - length)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        if c.softcap is not None:
            return softcapped_attention(q, keys, values, visible[:, None], c.scale, c.softcap)
        # the K/V heads repeated: SDPA's fused kernels take a mask, but not with enable_gqa
        groups = c.num_heads // c.num_kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], scale=c.scale)

    def mask(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype, window: int | None = None):
        """(B, 1, 1, seq_len); made once per step and window: SDPA converts a boolean mask in every layer, and
        ran slower with one (measured: bench/RESULTS.md, "Current figures: Decode step")."""
        visible = visible_keys(positions, torch.arange(seq_len, device=positions.device), window)
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
        return mask[:, None, None, :]

    def __call__(self, q, k, v, kv_layer, table, positions, mask, c: LayerConsts) -> torch.Tensor:
        """Writes k, v (B, Hkv, D) into the paged cache at each slot's position (`write_kv`), then attends to the
        slot's first `seq_len` positions (gathered from its blocks, `table` (B, max_blocks)): q (B, Hkv, G, D)
        (the G query heads of a KV head as its "query positions": GQA without copying the cache) -> (B, Hkv, G, D)."""
        slots = torch.arange(q.shape[0], device=q.device)
        write_kv(k, v, kv_layer, slots, positions, table)
        keys, values = gather_blocks(kv_layer, table, mask.shape[-1])
        if c.softcap is not None:
            return softcapped_attention(q, keys, values, mask, c.scale, c.softcap)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=c.scale)


class TritonDecodeAttention:
    """Decode attention in which each slot reads its cache only from its window's start (0 on a full
    layer) up to its own position: one Triton kernel (`shardrl.rollout.fast.decode_kernel`, CUDA only), which
    also applies the soft-cap. The attended length plays no part, so one CUDA graph serves every length.
    Measured against `SDPADecodeAttention`: bench/RESULTS.md, "Current figures: Decode step". `fuse_kv_write`:
    the kernel writes the new K/V itself, a shorter step than two indexed copies (measured: the same table)."""

    bucketed = False
    prefix_from_blocks = True  # a prefill over cached prefixes reads them through the block table (`prefill`)

    def __init__(self, fuse_kv_write: bool = True):
        from shardrl.rollout.fast.decode_kernel import decode_attention, prefill_attention

        self.attend, self.attend_prefill, self.fuse_kv_write = decode_attention, prefill_attention, fuse_kv_write
        # (shared, groups) of the slots that read a shared prefix together (`decode_kernel`, cascade), set by the
        # rollout for the steps that have such groups; full-attention layers only
        self.cascade: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefix_splits = 2
        # the shared-prefix kernel's programs per (KV head, split); None: its own
        self.prefix_programs: int | None = None

    def mask(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype, window: int | None = None):
        return positions

    def prefill(self, q, kv_layer, prefix: tuple, c: LayerConsts) -> torch.Tensor:
        """A prefill chunk's attention over its cached prefixes, its own K/V already in the blocks: q (U * L, Hkv,
        G, D), `prefix` = (blocks (U, nb), starts (U,), lengths (U,)) -> (U * L, Hkv, G, D) (`prefill_attention`)."""
        table, starts, lengths = prefix
        return self.attend_prefill(q.contiguous(), kv_layer, table, starts, lengths, scale=c.scale, softcap=c.softcap,
                                   window=c.window)

    def __call__(self, q, k, v, kv_layer, table, positions, mask, c: LayerConsts) -> torch.Tensor:
        """As `SDPADecodeAttention`; the kernel reads the blocks through `table`."""
        limits = dict(scale=c.scale, softcap=c.softcap, window=c.window, block_table=table)
        if self.cascade is not None and c.window is None:
            limits.update(cascade=self.cascade, prefix_splits=self.prefix_splits, prefix_programs=self.prefix_programs)
        if self.fuse_kv_write:
            return self.attend(q.contiguous(), kv_layer, positions, k, v, **limits)
        write_kv(k, v, kv_layer, torch.arange(q.shape[0], device=q.device), positions, table)
        return self.attend(q.contiguous(), kv_layer, positions, **limits)
