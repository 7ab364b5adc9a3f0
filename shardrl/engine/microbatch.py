"""Cutting a per-rank mini-batch into the micro-batches that meet the device.

Fixed: `micro_batch_size` samples each, in order. Dynamic: at most `max_token_len` real tokens each,
balanced so micro-batches carry similar token counts; the samples are reordered to do so and
`restore_order` puts per-sample results back. Every data-parallel rank must run the same number of
micro-batches (each forward/backward is a round of FSDP collectives), so the dynamic count is agreed
with an all-reduce(max) over the data-parallel group.

`group_size` keeps consecutive rows together (a preference pair: chosen, rejected), for losses of a group's
rows jointly: a fixed micro-batch then holds `micro_batch_size` groups, a dynamic one balances groups by
their summed lengths.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardrl.batch import Batch, inverse_permutation
from shardrl.distributed import collective_device


def seq_lengths(batch: Batch) -> torch.Tensor:
    return batch["attention_mask"].sum(-1).long()  # (B,)


@dataclass(frozen=True)
class RowSizes:
    """What the host knows of a micro-batch before its forward: each row's real tokens (`lengths`) and, for a batch
    scored from a column on (an RL batch's responses), how many positions predict a scored token (`needed`). With
    them the forward's data-dependent shapes (the packed row, its sequences' bounds, the positions the head runs
    on) are made without reading anything back from the device (`torch.nonzero_static`), so a GPU's host queues a
    micro-batch's forward while the one before still runs its backward. `row_sizes` reads them for all of a call's
    micro-batches in one copy."""

    lengths: tuple[int, ...]
    needed: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_sequences(self) -> int:
        """Rows holding a token (an empty row is no sequence of the packed layout)."""
        return sum(1 for n in self.lengths if n)


def row_sizes(micro_batches: list[Batch], score_from: int | None = None) -> list[RowSizes | None]:
    """The `RowSizes` of each micro-batch (None for an empty one), in one device->host copy for all of them.
    `score_from`: the first scored column (as `PolicyModel.forward`'s): a row's `needed` positions are its real
    tokens from that column on, less its first real token if it is one of them (no position predicts a sequence's
    first token)."""
    per = []
    for mb in micro_batches:
        if len(mb) == 0:
            continue
        mask = mb["attention_mask"].bool()
        counts = [mask.sum(1)]
        if score_from is not None:
            first_scored = mask.any(1) & (mask.long().argmax(1) >= score_from)
            counts.append(mask[:, score_from:].sum(1) - first_scored.long())
        per.append(torch.stack(counts))
    if not per:
        return [None] * len(micro_batches)
    flat = torch.cat(per, 1).tolist()
    sizes, at = [], 0
    for mb in micro_batches:
        rows = len(mb)
        if rows == 0:
            sizes.append(None)
            continue
        needed = sum(flat[1][at:at + rows]) if score_from is not None else None
        sizes.append(RowSizes(tuple(flat[0][at:at + rows]), needed))
        at += rows
    return sizes


def balanced_partition(lengths: list[int], num_parts: int) -> list[list[int]]:
    """Greedy longest-first assignment of items to the currently lightest part.

    Every part gets at least one item when there are at least `num_parts` items. Within a part,
    indices are sorted so the original order is kept as far as possible.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    # (load, count, part): the count term makes empty parts take items first when loads tie at 0
    heap = [(0, 0, p) for p in range(num_parts)]
    for i in order:
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, p))
    return [sorted(p) for p in parts]


def num_dynamic_micro_batches(lengths: list[int], max_token_len: int, group_size: int = 1) -> int:
    """The fewest micro-batches under the budget that longest-first balancing reaches (`lengths`: of each
    group of `group_size` rows that must share a micro-batch)."""
    longest = max(lengths, default=0)
    if longest > max_token_len:
        what = f"a sequence of {longest} tokens" if group_size == 1 else \
            f"a group of {group_size} sequences that must share a micro-batch (a preference pair) of {longest} tokens"
        raise ValueError(
            f"{what} exceeds max_token_len_per_gpu={max_token_len}; "
            f"raise max_token_len_per_gpu to at least {longest} (or shorten prompts/responses)"
        )
    k = max(1, math.ceil(sum(lengths) / max_token_len))
    while k < len(lengths):
        parts = balanced_partition(lengths, k)
        if max(sum(lengths[i] for i in p) for p in parts) <= max_token_len:
            break
        k += 1
    return min(k, max(1, len(lengths)))


def split_micro_batches(
    batch: Batch,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    dp_group: dist.ProcessGroup | None = None,
    group_size: int = 1,
) -> tuple[list[Batch], torch.Tensor | None]:
    """Returns the micro-batches and, for dynamic batching, the permutation that was applied.

    With dynamic batching a micro-batch may be empty (a rank with fewer samples than the agreed count);
    the engine still runs it so collectives stay matched. `group_size`: see the module docstring.
    """
    if (micro_batch_size is None) == (max_token_len is None):
        raise ValueError("give exactly one of micro_batch_size and max_token_len")
    if len(batch) % group_size:
        raise ValueError(f"a batch of {len(batch)} rows is not made of groups of {group_size}")
    if micro_batch_size is not None:
        pieces = batch.split(micro_batch_size * group_size)
        # ranks holding fewer samples (e.g. a validation set that does not divide) run empty pieces
        k = _agree_on_count(len(pieces), dp_group)
        return pieces + [batch.index([]) for _ in range(k - len(pieces))], None

    rows = seq_lengths(batch).tolist()
    lengths = [sum(rows[g:g + group_size]) for g in range(0, len(rows), group_size)]
    k = _agree_on_count(num_dynamic_micro_batches(lengths, max_token_len, group_size), dp_group)
    parts = [[g * group_size + j for g in part for j in range(group_size)]
             for part in balanced_partition(lengths, k)]
    perm = torch.tensor([i for p in parts for i in p], dtype=torch.long)
    micro_batches = [batch.index(p) for p in parts]
    return micro_batches, perm


def _agree_on_count(count: int, dp_group) -> int:
    """The largest count over the data-parallel ranks (each micro-batch is a round of collectives)."""
    if dp_group is None or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return count
    count_t = torch.tensor([count], dtype=torch.long, device=collective_device(dp_group))
    dist.all_reduce(count_t, op=dist.ReduceOp.MAX, group=dp_group)
    return int(count_t.item())


def restore_order(results: list[Batch], perm: torch.Tensor | None) -> Batch:
    """Concatenates per-micro-batch results and undoes the permutation `split_micro_batches` made."""
    merged = Batch.concat([r for r in results if len(r) > 0] or results[:1])
    return merged if perm is None else merged.reorder(inverse_permutation(perm))


