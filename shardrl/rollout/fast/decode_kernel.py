"""Decode attention as one Triton kernel: each slot reads its own cache entries up to its position, no further.

The cache is paged: a slot's entry j lies in block `block_table[slot, j // BS]` at offset j % BS (a contiguous
per-slot cache is the case of one block per slot).

Imported only on CUDA (Triton is not needed elsewhere). One program per (slot, KV head): its G query heads
(GQA) are the rows of a small matrix multiplied against blocks of the slot's keys and values, with the
softmax kept online (running max and sum) as in FlashAttention. Reading stops at the slot's position, so
a step's attention reads the bytes of the live context and not those of a padded common length.

Given the step's new key and value (`k_new`, `v_new`), the kernel also writes them into the cache at the
slot's position and attends to them from registers, which saves the two indexed copies per layer that
write them otherwise (the fast rollout's default; bench/profile_decode.py times both).

Shared prefixes (cascade attention): the n samples of a GRPO prompt read the same blocks of the prompt's K/V, which
the per-slot kernel reads n times a step. With `cascade` = (shared, groups), a first kernel
(`_shared_prefix_attention`) reads each group's shared blocks once for all its members: one program per (group,
KV head, split) multiplies the stacked queries of up to M member slots (M x G rows) against the blocks and keeps
each row's unnormalized result with its running max and sum; the per-slot kernel then reads only the slot's own
entries past `shared[slot]` and merges the group's parts into its softmax (log-sum-exp, as it merges splits). On a
2,048-token prompt with n=8 that is about an eighth of the K/V bytes a step.

Prefill over a cached prefix (`prefill_attention`): a chunk of new tokens per prompt, whose K/V are already written
into the prompt's blocks, attends to the blocks from the start of its cache (the prefix earlier turns or a shared
prompt left there, then its own tokens, causally). One program per (prompt, tile of query tokens, KV head): the tile's
tokens times their G query heads are the rows of one product against BLOCK_N entries at a time, read through the
block table, each row masked to its own position (and window). No gathered copy of the prefix, no mask tensor, and
the keys past the tile's last position are not read.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from shardrl.rollout.fast.kernel_support import triton_head_dim


@triton.jit
def _scores(q, k, scale, softcap, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """q k^T * scale for a block of entries, soft-capped with SOFTCAP: cap * tanh(scores / cap), as
    2 sigmoid(2x) - 1 for tanh."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    if SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores


@triton.jit
def _accumulate(acc, rescale, p, v, IEEE: tl.constexpr):
    """The online softmax's accumulator rescaled, plus the block's p v."""
    if IEEE:
        return acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _attend_entries(q, k_base, v_base, table, first, stop, running_max, running_sum, acc, scale, softcap, stride_kvb,
                    stride_kvs, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                    BS: tl.constexpr):
    """The rows of `q` attend to cache entries [first, stop) (their blocks through `table`), BLOCK_N at a time, the
    softmax kept online: (running max, running sum, unnormalized accumulator) carried in and returned."""
    dims, cols = tl.arange(0, D), tl.arange(0, BLOCK_N)
    for start in range(first, stop, BLOCK_N):
        entries = start + cols
        live = entries < stop
        blocks = tl.load(table + entries // BS, mask=live, other=0)  # (int64: no overflow past 2**31 elements)
        offsets = blocks[:, None] * stride_kvb + (entries % BS)[:, None] * stride_kvs + dims[None, :]
        k = tl.load(k_base + offsets, mask=live[:, None], other=0.0)
        scores = tl.where(live[None, :], _scores(q, k, scale, softcap, IEEE, SOFTCAP), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_base + offsets, mask=live[:, None], other=0.0)
        acc = _accumulate(acc, rescale, p, v, IEEE)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit
def _attend_blocks(q, k_base, v_base, table, first, stop, running_max, running_sum, acc, scale, softcap, stride_kvb,
                   stride_kvs, D: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, BS: tl.constexpr,
                   MASKED: tl.constexpr):
    """As `_attend_entries`, a whole cache block a step: one block id read per step (the next one's a step ahead),
    its BS entries at consecutive addresses. MASKED: entries outside [first, stop) are left out (without it, first
    and stop must be multiples of BS)."""
    dims, cols = tl.arange(0, D), tl.arange(0, BS)
    begin = first // BS
    end = tl.where(stop > first, tl.cdiv(stop, BS), begin)  # (an empty range reads no block)
    blk = tl.load(table + begin, mask=begin < end, other=0)
    for i in range(begin, end):
        offsets = blk * stride_kvb + cols[:, None] * stride_kvs + dims[None, :]
        if MASKED:
            entries = i * BS + cols
            live = (entries >= first) & (entries < stop)
            k = tl.load(k_base + offsets, mask=live[:, None], other=0.0)
            scores = tl.where(live[None, :], _scores(q, k, scale, softcap, IEEE, SOFTCAP), float("-inf"))
        else:
            k = tl.load(k_base + offsets)
            scores = _scores(q, k, scale, softcap, IEEE, SOFTCAP)
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + offsets, mask=live[:, None], other=0.0)
        else:
            v = tl.load(v_base + offsets)
        acc = _accumulate(acc, rescale, p, v, IEEE)
        running_max = new_max
        blk = tl.load(table + i + 1, mask=i + 1 < end, other=0)
    return running_max, running_sum, acc


@triton.jit
def _attend(q, k_base, v_base, table, first, stop, scale, softcap, stride_kvb, stride_kvs, ROWS: tl.constexpr,
            D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, BS: tl.constexpr,
            BLOCKWISE: tl.constexpr, MASKED: tl.constexpr):
    """The ROWS rows of `q` against cache entries [first, stop): (running max, running sum, unnormalized
    accumulator), a block a step (`_attend_blocks`) with BLOCKWISE, else BLOCK_N entries a step."""
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    if BLOCKWISE:
        running_max, running_sum, acc = _attend_blocks(q, k_base, v_base, table, first, stop, running_max,
                                                       running_sum, acc, scale, softcap, stride_kvb, stride_kvs, D,
                                                       IEEE, SOFTCAP, BS, MASKED)
    else:
        running_max, running_sum, acc = _attend_entries(q, k_base, v_base, table, first, stop, running_max,
                                                        running_sum, acc, scale, softcap, stride_kvb, stride_kvs, D,
                                                        BLOCK_N, IEEE, SOFTCAP, BS)
    return running_max, running_sum, acc


@triton.jit
def _decode_attention(q_ptr, kv_ptr, out_ptr, part_ptr, pos_ptr, table_ptr, k_new_ptr, v_new_ptr, shared_ptr,
                      prefix_ptr, scale, softcap, window, stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh,
                      stride_kvs, stride_tb, stride_kb, stride_kh, stride_vb, stride_vh,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLITS: tl.constexpr, IEEE: tl.constexpr, WRITE: tl.constexpr, SOFTCAP: tl.constexpr,
                      WINDOW: tl.constexpr, BS: tl.constexpr, CASCADE: tl.constexpr, PS: tl.constexpr,
                      PARTS: tl.constexpr, BLOCKWISE: tl.constexpr):
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    position = tl.load(pos_ptr + b)
    end = position if WRITE else position + 1  # the entries read from the cache
    begin = 0
    if WINDOW:  # a sliding-window layer: keys j with position - window < j
        begin = tl.maximum(position - window + 1, 0)
    shared = 0
    if CASCADE:  # entries [0, shared) were read by the group's program (`_shared_prefix_attention`)
        shared = tl.load(shared_ptr + b)
        begin = shared
    chunk = tl.cdiv(tl.cdiv(end - begin, SPLITS), BLOCK_N) * BLOCK_N  # this program's share: [first, stop)
    first = begin + split * chunk
    stop = tl.minimum(first + chunk, end)
    rows, dims = tl.arange(0, BLOCK_G), tl.arange(0, D)
    q_offsets = b * stride_qb + h * stride_qh + rows[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows[:, None] < G, other=0.0)
    k_base = kv_ptr + h * stride_kvh
    v_base = k_base + stride_kvkind
    table = table_ptr + b * stride_tb
    if WRITE:  # (the new entry's loads first: they wait beside the cache's)
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        at = tl.load(table + position // BS) * stride_kvb + (position % BS) * stride_kvs + dims
    running_max, running_sum, acc = _attend(q, k_base, v_base, table, first, stop, scale, softcap, stride_kvb,
                                            stride_kvs, BLOCK_G, D, BLOCK_N, IEEE, SOFTCAP, BS, BLOCKWISE, True)
    if WRITE:  # the new entry, in the last split: into the cache, and into the softmax from registers
        if split == SPLITS - 1:
            tl.store(k_base + at, k_new)
            tl.store(v_base + at, v_new)
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (BLOCK_G,)
            if SOFTCAP:
                score = softcap * (2.0 * tl.sigmoid(2.0 * score / softcap) - 1.0)
            new_max = tl.maximum(running_max, score)
            rescale = tl.exp(running_max - new_max)
            p_new = tl.exp(score - new_max)
            running_sum = running_sum * rescale + p_new
            acc = acc * rescale[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            running_max = new_max
    if not PARTS:  # one split, merged here (with CASCADE: with its group's parts)
        if CASCADE:
            acc, running_max, running_sum = _merge_prefix(acc, running_max, running_sum, prefix_ptr, b, h,
                                                          tl.num_programs(1), shared, G, BLOCK_G, D, PS)
        out = acc / running_sum[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < G)
    else:  # unnormalized, with its running max and sum, for `_combine_splits`
        _store_part(part_ptr, b, h, split, tl.num_programs(1), acc, running_max, running_sum,
                    SPLITS, BLOCK_G, D)


@triton.jit
def _part_offset(b, h, split, num_heads, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
    """Where a split's partial result starts: per (b, h, split), BLOCK_G x D accumulators, then the
    BLOCK_G maxima and the BLOCK_G sums (fp32)."""
    return ((b * num_heads + h) * SPLITS + split) * BLOCK_G * (D + 2)


@triton.jit
def _store_part(part_ptr, b, h, split, num_heads, acc, running_max, running_sum,
                SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
    rows, dims = tl.arange(0, BLOCK_G), tl.arange(0, D)
    base = part_ptr + _part_offset(b, h, split, num_heads, SPLITS, BLOCK_G, D)
    tl.store(base + rows[:, None] * D + dims[None, :], acc)
    tl.store(base + BLOCK_G * D + rows, running_max)
    tl.store(base + BLOCK_G * D + BLOCK_G + rows, running_sum)


@triton.jit
def _combine_splits(part_ptr, out_ptr, shared_ptr, prefix_ptr, stride_ob, stride_oh, G: tl.constexpr,
                    BLOCK_G: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, CASCADE: tl.constexpr,
                    PS: tl.constexpr):
    """One program per (slot, KV head): the softmax-weighted sum of its splits' partial results (and, with
    CASCADE, of its group's shared-prefix parts)."""
    b, h = tl.program_id(0), tl.program_id(1)
    rows, dims = tl.arange(0, BLOCK_G), tl.arange(0, D)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for split in tl.static_range(SPLITS):
        base = part_ptr + _part_offset(b, h, split, tl.num_programs(1), SPLITS, BLOCK_G, D)
        part_max = tl.load(base + BLOCK_G * D + rows)
        new_max = tl.maximum(running_max, part_max)
        # an empty split (or none seen yet) has max -inf and weighs nothing: no exp(-inf - -inf)
        old_weight = tl.where(running_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        weight = tl.where(part_max == float("-inf"), 0.0, tl.exp(part_max - new_max))
        running_sum = running_sum * old_weight + weight * tl.load(base + BLOCK_G * D + BLOCK_G + rows)
        acc = acc * old_weight[:, None] + weight[:, None] * tl.load(base + rows[:, None] * D + dims[None, :])
        running_max = new_max
    if CASCADE:
        acc, running_max, running_sum = _merge_prefix(acc, running_max, running_sum, prefix_ptr, b, h,
                                                      tl.num_programs(1), tl.load(shared_ptr + b), G, BLOCK_G, D,
                                                      PS)
    out = acc / running_sum[:, None]
    offsets = b * stride_ob + h * stride_oh + rows[:, None] * D + dims[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < G)

@triton.jit
def _prefix_offset(slot, h, split, num_heads, G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
    """Where a slot's shared-prefix part for (KV head h, split) starts: G x D accumulators, G maxima, G sums."""
    return ((slot * num_heads + h) * PS + split) * G * (D + 2)


@triton.jit
def _merge_prefix(acc, running_max, running_sum, prefix_ptr, b, h, num_heads, shared, G: tl.constexpr,
                  BLOCK_G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
    """(acc, max, sum) of slot b's own entries merged with its group's PS shared-prefix parts (none when
    `shared`, the entries its group read, is 0: nothing is read)."""
    rows, dims = tl.arange(0, BLOCK_G), tl.arange(0, D)
    live = (rows < G) & (rows * 0 + shared > 0)
    for split in tl.static_range(PS):
        base = prefix_ptr + _prefix_offset(b, h, split, num_heads, G, D, PS)
        part_max = tl.load(base + G * D + rows, mask=live, other=float("-inf"))
        part_sum = tl.load(base + G * D + G + rows, mask=live, other=0.0)
        part_acc = tl.load(base + rows[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
        new_max = tl.maximum(running_max, part_max)  # running_max is finite: the slot's own entries are >= 1
        old_weight = tl.exp(running_max - new_max)
        weight = tl.where(part_max == float("-inf"), 0.0, tl.exp(part_max - new_max))
        running_sum = running_sum * old_weight + weight * part_sum
        acc = acc * old_weight[:, None] + weight[:, None] * part_acc
        running_max = new_max
    return acc, running_max, running_sum


@triton.jit
def _shared_group(q_ptr, kv_ptr, prefix_ptr, shared_ptr, groups_ptr, table_ptr, grp, first_slot, h, split, num_heads,
                  scale, softcap, stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs, stride_tb,
                  stride_gg, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, PS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, BS: tl.constexpr,
                  BLOCKWISE: tl.constexpr):
    """Group `grp` (its first member `first_slot`), KV head h, split `split`: the members' M x G query rows against
    the group's shared entries (the first member's blocks; BLOCKWISE: a block a step, BLOCK_N = BS), each row's
    unnormalized result, running max and sum stored for the per-slot kernel to merge."""
    rows, dims = tl.arange(0, BLOCK_R), tl.arange(0, D)
    member, head = rows // G, rows % G
    slot = tl.load(groups_ptr + grp * stride_gg + member, mask=member < M, other=-1)
    live = slot >= 0
    length = tl.load(shared_ptr + first_slot)
    chunk = tl.cdiv(tl.cdiv(length, PS), BLOCK_N) * BLOCK_N
    first = split * chunk
    stop = tl.minimum(first + chunk, length)
    q = tl.load(q_ptr + slot[:, None] * stride_qb + h * stride_qh + head[:, None] * D + dims[None, :],
                mask=live[:, None], other=0.0)
    k_base = kv_ptr + h * stride_kvh
    v_base = k_base + stride_kvkind
    table = table_ptr + first_slot * stride_tb
    # (unmasked: the shared length is a multiple of BS, and so are the splits' bounds)
    running_max, running_sum, acc = _attend(q, k_base, v_base, table, first, stop, scale, softcap, stride_kvb,
                                            stride_kvs, BLOCK_R, D, BLOCK_N, IEEE, SOFTCAP, BS, BLOCKWISE, False)
    base = prefix_ptr + _prefix_offset(tl.maximum(slot, 0), h, split, num_heads, G, D, PS)
    tl.store(base[:, None] + head[:, None] * D + dims[None, :], acc, mask=live[:, None])
    tl.store(base + G * D + head, running_max, mask=live)
    tl.store(base + G * D + G + head, running_sum, mask=live)


@triton.jit
def _shared_prefix_attention(q_ptr, kv_ptr, prefix_ptr, shared_ptr, groups_ptr, table_ptr, num_groups, scale, softcap,
                             stride_qb, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs, stride_tb,
                             stride_gg, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_N: tl.constexpr, PS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                             BS: tl.constexpr, BLOCKWISE: tl.constexpr):
    """Grid (KV heads, PS splits, P programs): program p takes the groups in rows p, p + P, ... of `groups` (each row a
    group's member slots, -1 past them) up to the first empty row. The live rows come first (`SharedPrefixGroups`),
    so no program is spent on an empty group beyond one load."""
    h, split, grp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first_slot = tl.load(groups_ptr + grp * stride_gg, mask=grp < num_groups, other=-1)
    while first_slot >= 0:
        _shared_group(q_ptr, kv_ptr, prefix_ptr, shared_ptr, groups_ptr, table_ptr, grp, first_slot, h, split,
                      tl.num_programs(0), scale, softcap, stride_qb, stride_qh, stride_kvkind, stride_kvb,
                      stride_kvh, stride_kvs, stride_tb, stride_gg, G, D, M, BLOCK_R, BLOCK_N, PS, IEEE, SOFTCAP, BS,
                      BLOCKWISE)
        grp += tl.num_programs(2)
        first_slot = tl.load(groups_ptr + grp * stride_gg, mask=grp < num_groups, other=-1)


_SIDE_STREAMS: dict = {}  # device -> the stream the shared-prefix kernel runs on beside the per-slot kernel
_SM_COUNTS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        # high priority: a stream of its own pool (not one the capture or default streams could be handed), and the
        # kernel the merge waits for goes first
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device]


def _group_programs(device: torch.device, rows: int, hkv: int, splits: int) -> int:
    """Programs per (KV head, split) of the shared-prefix kernel: enough for about two per SM over the grid (more
    would wait for an SM anyway), at most one per row of groups."""
    if device.type != "cuda":
        return rows
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, -(-2 * _SM_COUNTS[device] // (hkv * splits))))


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, positions: torch.Tensor,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     block_n: int = 64, splits: int = 1, num_warps: int | None = None, num_stages: int = 2,
                     scale: float | None = None, softcap: float | None = None,
                     window: int | None = None, block_table: torch.Tensor | None = None,
                     cascade: tuple[torch.Tensor, torch.Tensor] | None = None, prefix_splits: int = 2,
                     prefix_warps: int = 4, prefix_block_n: int | None = None, prefix_stages: int | None = None,
                     prefix_programs: int | None = None, overlap: bool = True) -> torch.Tensor:
    """q (B, Hkv, G, D) contiguous, kv_layer (2, B, Hkv, max_seq, D) with unit stride in D, positions (B,):
    softmax(q k^T * scale) v over each slot's entries 0..position (scale: 1 / sqrt(D) unless given); with
    `softcap`, the logits are softcap * tanh(logits / softcap); with `window`, only the entries j with
    position - window < j are read (a sliding-window layer). With k_new, v_new (B, Hkv, D), unit
    stride in D, they are first written at each slot's position (slot b is row b). Returns (B, Hkv, G, D)
    like q. fp32 inputs are multiplied in full fp32 (no TF32). `splits` > 1 cuts each slot's entries into
    that many programs (more parallel loads) whose partial results a second kernel combines; it and the
    launch settings are tuning knobs that bench/profile_decode.py times. With `block_table` (B, max_blocks) long,
    kv_layer is paged, (2, num_blocks, Hkv, block_size, D): slot b's entry j at block block_table[b, j // block_size],
    offset j % block_size; where `block_n` is the block size, the kernel reads a block a step (`_attend_blocks`).
    `num_warps` None: 2 with a cascade (a slot's own entries are few), else 4.

    `cascade` = (shared (>= B,) long, groups (num_groups, M) long): slots that share their first shared[slot] cache
    entries (a multiple of the block size, the same blocks in their table rows) are listed together in a row of
    `groups` (slot ids from column 0 on, -1 after; the live rows first, then only empty ones; a slot in no group has
    shared 0); each group's entries are read once, by `prefix_splits` programs per KV head (module docstring;
    `shared_prefix_parts` takes the prefix_* settings, timed by bench/profile_cascade.py at 0a7d397). With `overlap` (CUDA),
    that kernel runs on a second stream beside the per-slot kernel, which then leaves its result unnormalized for
    the merge kernel that waits for both. Not with `window`."""
    b, hkv, g, d = q.shape
    if not triton_head_dim(d) or kv_layer.stride(-1) != 1 or not q.is_contiguous():
        raise ValueError(f"decode_attention needs a contiguous q and a power-of-two head dim >= 16, got {d}")
    write = k_new is not None
    if write and (v_new is None or k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
        raise ValueError("decode_attention takes k_new and v_new together, each with unit stride in D")
    k_new, v_new = (k_new, v_new) if write else (q, q)  # placeholders the kernel does not read
    if block_table is None:  # one block per slot
        block_table = torch.arange(b, dtype=torch.long, device=q.device)[:, None]
    overlap = overlap and cascade is not None
    parts = splits > 1 or overlap  # the per-slot kernel leaves its result to `_combine_splits`
    streams = overlap and q.is_cuda  # (elsewhere, Triton's interpreter: the same kernels, one after the other)
    out = torch.empty_like(q)
    block_g = max(16, triton.next_power_of_2(g))
    part = torch.empty(b * hkv * splits * block_g * (d + 2) if parts else 1, dtype=torch.float32, device=q.device)
    scale = d**-0.5 if scale is None else scale
    ieee, bs = q.dtype == torch.float32, kv_layer.shape[3]
    shared, prefix, ps = positions, part, 1  # placeholders the kernels do not read without a cascade
    if cascade is not None:
        if window is not None:
            raise ValueError("decode_attention: a shared-prefix cascade on a sliding-window layer is not supported")
        shared, groups = cascade
        ps = prefix_splits
        if ps < 1:  # (before the fork: an error between it and the join would leave a graph capture unjoined)
            raise ValueError(f"prefix_splits={ps} must be >= 1")
        prefix = torch.empty(b * hkv * ps * g * (d + 2), dtype=torch.float32, device=q.device)
        if streams:
            main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
            side.wait_stream(main)
    try:
        if cascade is not None:
            with torch.cuda.stream(side) if streams else contextlib.nullcontext():
                shared_prefix_parts(q, kv_layer, block_table, shared, groups, scale, softcap, ps, prefix_block_n,
                                    prefix_warps, prefix_stages, prefix_programs, prefix)
        _decode_attention[(b, hkv, splits)](
            q, kv_layer, out, part, positions, block_table, k_new, v_new, shared, prefix, scale,
            softcap or 1.0, window or 0, q.stride(0), q.stride(1), *kv_layer.stride()[:4], block_table.stride(0),
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            G=g, BLOCK_G=block_g, D=d, BLOCK_N=block_n, SPLITS=splits, IEEE=ieee, WRITE=write,
            SOFTCAP=softcap is not None, WINDOW=window is not None, BS=bs, CASCADE=cascade is not None, PS=ps,
            PARTS=parts, BLOCKWISE=block_n == bs, num_warps=num_warps or (2 if cascade is not None else 4),
            num_stages=num_stages)
    finally:
        if streams:
            main.wait_stream(side)
    if parts:
        _combine_splits[(b, hkv)](part, out, shared, prefix, out.stride(0), out.stride(1), G=g, BLOCK_G=block_g,
                                  D=d, SPLITS=splits, CASCADE=cascade is not None, PS=ps, num_warps=4)
    return out


def shared_prefix_parts(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, shared: torch.Tensor,
                        groups: torch.Tensor, scale: float, softcap: float | None, prefix_splits: int = 2,
                        block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                        programs: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first kernel of the cascade (`decode_attention`'s `cascade`): each group's shared entries read once for
    all its members, by `prefix_splits` x `programs` programs per KV head (None: `_group_programs`). `block_n` None:
    a cache block a step (`_attend_blocks`), `num_stages` (None: 3, or 2 where a block's K tile passes 16 KB) in
    flight; blocks under 16 or over 128 entries or not a power of 2, or a `block_n` given: `block_n` entries a step
    (None: 128, or 64 past D = 128, whose tiles would outgrow the shared memory of smaller GPUs; `num_stages` None:
    1). Returns the flat fp32 buffer (`out`, if given) of the members' unnormalized parts (`_prefix_offset`), which
    the per-slot kernel or `_combine_splits` merges; a slot in no group has none written."""
    b, hkv, g, d = q.shape
    if prefix_splits < 1:
        raise ValueError(f"prefix_splits={prefix_splits} must be >= 1")
    rows, m = groups.shape
    prefix = torch.empty(b * hkv * prefix_splits * g * (d + 2), dtype=torch.float32, device=q.device) \
        if out is None else out
    programs = programs or _group_programs(q.device, rows, hkv, prefix_splits)
    bs = kv_layer.shape[3]
    blockwise = block_n is None and 16 <= bs <= 128 and bs & (bs - 1) == 0  # (a tile's sides: powers of 2, >= 16)
    if blockwise:  # a block a step, three in flight where two blocks' K and V tiles stay under 64 KB
        block_n, num_stages = bs, num_stages or (3 if bs * d * kv_layer.element_size() <= 16384 else 2)
    else:
        block_n, num_stages = block_n or (128 if d <= 128 else 64), num_stages or 1
    _shared_prefix_attention[(hkv, prefix_splits, programs)](
        q, kv_layer, prefix, shared, groups, block_table, rows, scale, softcap or 1.0, q.stride(0), q.stride(1),
        *kv_layer.stride()[:4], block_table.stride(0), groups.stride(0), G=g, D=d, M=m,
        BLOCK_R=max(16, triton.next_power_of_2(m * g)), BLOCK_N=block_n, PS=prefix_splits,
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, BS=bs, BLOCKWISE=blockwise, num_warps=num_warps,
        num_stages=num_stages)
    return prefix


@triton.jit
def _prefill_attention(q_ptr, kv_ptr, out_ptr, table_ptr, start_ptr, len_ptr, scale, softcap, window, length,
                       stride_qt, stride_qh, stride_kvkind, stride_kvb, stride_kvh, stride_kvs, stride_tb,
                       G: tl.constexpr, TM: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                       BS: tl.constexpr):
    """One program per (prompt u, tile of TM query tokens, KV head): rows are (token, query head) pairs; token i of
    prompt u sits at position start[u] + i and attends to the entries j <= its position (within the window) of u's
    blocks. Tiles past the prompt's length store nothing."""
    u, tile, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(len_ptr + u)
    first_token = tile * TM
    if first_token < n:
        start = tl.load(start_ptr + u)
        rows, dims, cols = tl.arange(0, BLOCK_R), tl.arange(0, D), tl.arange(0, BLOCK_N)
        token, head = first_token + rows // G, rows % G
        live = (rows < TM * G) & (token < n)
        position = start + token
        q_offsets = (u * length + token).to(tl.int64) * stride_qt + h * stride_qh + head * D  # (past 2**31)
        q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=live[:, None], other=0.0)
        stop = start + tl.minimum(first_token + TM, n)  # past the tile's last position
        begin = 0
        if WINDOW:  # the first entry the tile's first token sees
            begin = tl.maximum(start + first_token - window + 1, 0)
        k_base = kv_ptr + h * stride_kvh
        v_base = k_base + stride_kvkind
        table = table_ptr + u * stride_tb
        running_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for at in range(begin, stop, BLOCK_N):
            entries = at + cols
            inside = entries < stop
            blocks = tl.load(table + entries // BS, mask=inside, other=0)
            offsets = blocks[:, None] * stride_kvb + (entries % BS)[:, None] * stride_kvs + dims[None, :]
            k = tl.load(k_base + offsets, mask=inside[:, None], other=0.0)
            scores = _scores(q, k, scale, softcap, IEEE, SOFTCAP)
            visible = inside[None, :] & (entries[None, :] <= position[:, None])
            if WINDOW:
                visible = visible & (entries[None, :] > position[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            # a row that has seen no visible entry yet (a window starting later than the tile's first token's)
            # keeps max -inf: measured from 0 instead, so that exp never sees -inf - -inf
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - base)
            p = tl.exp(scores - base[:, None])
            running_sum = running_sum * rescale + tl.sum(p, 1)
            v = tl.load(v_base + offsets, mask=inside[:, None], other=0.0)
            acc = _accumulate(acc, rescale, p, v, IEEE)
            running_max = new_max
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + q_offsets[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                      lengths: torch.Tensor, scale: float | None = None, softcap: float | None = None,
                      window: int | None = None, block_r: int | None = None, block_n: int = 64,
                      num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Causal attention of U prompts' new tokens over their paged caches. q (U * L, Hkv, G, D) contiguous: prompt u's
    token i (i < lengths[u], right-padded to L) at position starts[u] + i; kv_layer (2, num_blocks, Hkv, block_size,
    D) paged as in `decode_attention`, with every token's K/V already written; block_table (U, max_blocks) long.
    Each token attends to its prompt's entries 0..its position (from its window's start with `window`; the logits
    soft-capped with `softcap`). Returns a tensor like q, zero in the padding's rows. `block_r`: query rows
    per program (tokens x G; default 64, 128 when G > 4 and D <= 128)."""
    t, hkv, g, d = q.shape
    u = block_table.shape[0]
    if not triton_head_dim(d) or kv_layer.stride(-1) != 1 or not q.is_contiguous() or t % u:
        raise ValueError(f"prefill_attention needs a contiguous q of U * L tokens and a power-of-two head dim >= 16, "
                         f"got q {tuple(q.shape)} for {u} prompts")
    block_r = block_r or (64 if g <= 4 or d > 128 else 128)  # (128 rows of D = 256 outgrow shared memory)
    block_r = max(block_r, triton.next_power_of_2(g), 16)
    tm, length = block_r // g, t // u
    out = torch.zeros_like(q)
    scale = d**-0.5 if scale is None else scale
    _prefill_attention[(u, triton.cdiv(length, tm), hkv)](
        q, kv_layer, out, block_table, starts, lengths, scale, softcap or 1.0, window or 0, length, q.stride(0),
        q.stride(1), *kv_layer.stride()[:4], block_table.stride(0), G=g, TM=tm, BLOCK_R=block_r, D=d,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, WINDOW=window is not None,
        BS=kv_layer.shape[3], num_warps=num_warps, num_stages=num_stages)
    return out
