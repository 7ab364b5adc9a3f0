"""The fast rollout's host side: which rows a call admits into which decode slots, which it stops, aborts,
cancels and retires at a host sync, when the live rows compact into a narrower prefix of the slots, how many steps
run until the next sync, and the call's counts. Plain host code over lists of ints (no device, no model), so each
decision can be checked on the CPU; `shardrl.rollout.fast.rollout.FastRollout` applies them to the device state
(`shardrl.rollout.fast.step`)."""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence

import torch


class RowFeed(Protocol):
    """What `FastRollout.generate_stream` talks to (the multi-turn rollout's agent loop)."""

    def finished(self, row: int, tokens: list[int], log_probs: torch.Tensor) -> None:
        """Row `row` ended: its uncut tokens (through EOS, its limit, or past a stop string) and log-probs; a call
        whose `SamplingParams.top_logprobs` is k > 0 also passes `top`: each token's k likeliest tokens' (ids,
        log-probs), (L, k) each."""

    def take(self, block: bool) -> list[tuple[torch.Tensor, int]]:
        """New rows (prompt ids, limit), numbered on from the last; `block`: wait for at least one, or return
        [] when none will come any more."""

    # optional: def cancelled(self) -> list[int]: rows to end now (their slots free at once; `finished` still
    # reports what they made), asked at every host sync
    # optional: def streamed_rows(self) -> set[int]: rows whose tokens to report as they are made, asked at every
    # host sync; def progress(self, parts: list[tuple[int, list[int]]]): each such row still decoding, with the
    # tokens it made since the last report (a row's last ones go to `finished`)


def blocks_for(prompt_len: int, limit: int, block_size: int) -> int:
    """Blocks a row of a `prompt_len`-token prompt and up to `limit` new tokens holds."""
    return -(-(prompt_len + limit) // block_size)


def slot_widths(num_slots: int, min_width: int, width_step: int | None) -> list[int]:
    """The slot prefixes a decode step may run on, narrowest first: `min_width`, the multiples of `width_step`
    above it, and num_slots. A step's cost grows with its width (the K/V it reads, the logits it samples), so the
    finer the steps the less the tail pays for finished rows; each width costs a graph capture. `width_step`
    None: an eighth of the slots, above 8 rounded up to a multiple of 8."""
    if min_width >= num_slots:
        return [num_slots]
    step = width_step
    if step is None:
        step = -(-num_slots // 8)
        step = step if step <= 8 else -(-step // 8) * 8
    return sorted({num_slots, *range(step * (-(-min_width // step)), num_slots, step), min_width})


def rows_that_fit(queue: Sequence[int], prompt_len: Callable[[int], int], limits: Sequence[int], n: int, free: int,
                  busy: bool, blocks_left: int, block_size: int) -> int:
    """How many rows from the head of `queue` (at most `free`) `blocks_left` blocks hold at their longest (prompt
    + limit; a prompt's later rows in the same admission without its full blocks, which they share), so that no
    row runs out of cache while it decodes. With nothing decoding (`busy` false), the head row is admitted
    whatever it needs (the pool then says how short it is). Row r is prompt r // n, `prompt_len(b)` its length."""
    left, seen, count = blocks_left, set(), 0
    for row in queue:
        if count == free:
            break
        b = row // n
        plen = prompt_len(b)
        need = blocks_for(plen, limits[b], block_size) - (plen // block_size if b in seen else 0)
        if need > left and (count or busy):
            break
        left, count = left - need, count + 1
        seen.add(b)
    return count


def prefill_chunks(admitted: list[tuple[int, int]], n: int, tokens_of: Callable[[int], list[int]],
                   cached_of: Callable[[int, list[int]], int], budget: int, wide: int
                   ) -> tuple[list[list[tuple[int, int]]], dict[int, int]]:
    """The admitted (slot, row) pairs cut into prefill chunks: each chunk runs at most `budget` tokens (a distinct
    prompt counted once, from the end of its cached prefix: `cached_of(b, tokens)` positions) and reads at most
    `wide` (whole prompts). Also maps each prompt b to the first admitted prompt with the same tokens (whose
    prefill its rows read). Row r is prompt r // n; `tokens_of(b)` prompt b's ids."""
    same: dict[int, int] = {}  # prompt b -> the first admitted prompt with the same tokens
    first_of: dict[tuple, int] = {}
    estimate: dict[int, int] = {}  # prompt b -> positions its longest cached prefix would give it now
    chunks, current, distinct, longest, widest = [], [], set(), 0, 0
    for slot, row in admitted:
        b = row // n
        toks = tokens_of(b)  # (the same tokens as prompt a's)
        if b not in same:  # once per prompt, not per sample: nothing here changes the pool
            same[b] = first_of.setdefault(tuple(toks), b)
            estimate[b] = cached_of(b, toks)
        a, cached = same[b], estimate[b]
        grown = len(distinct | {a})
        if current and (max(longest, len(toks) - cached) * grown > budget or max(widest, len(toks)) * grown > wide):
            chunks.append(current)
            current, distinct, longest, widest = [], set(), 0, 0
        current.append((slot, row))
        distinct.add(a)
        longest, widest = max(longest, len(toks) - cached), max(widest, len(toks))
    chunks.append(current)
    return chunks, same


def shared_prefix_groups(slots: list[int], rows_blocks: list[list[int]]) -> list[tuple[list[int], int]]:
    """Rows admitted together whose caches start with the same blocks (a prompt's n samples; prompts that read one
    cached prefix, such as a shared system prompt or a conversation's earlier turns): (their slots, the number of
    leading blocks they all hold), for each first block two or more rows start with."""
    by_first: dict[int, list[int]] = {}
    for i, blocks in enumerate(rows_blocks):
        if blocks:
            by_first.setdefault(blocks[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = rows_blocks[members[0]]
        common = min(next((j for j, (x, y) in enumerate(zip(first, rows_blocks[i])) if x != y),
                          min(len(first), len(rows_blocks[i]))) for i in members[1:])
        groups.append(([slots[i] for i in members], common))
    return groups


class RowScheduler:
    """One call's rows over `num_slots` decode slots, on the host. Rows wait in `queue` (row r is sample r % n of
    prompt r // n); `slot_row[s]` is the row slot s decodes (-1: empty); `lengths[s]` and `generated[s]` its cache
    length and tokens made, as of the last sync (`sync`); `results[row]` the (tokens, log-probs) of a finished row.
    `stats` counts the call's work (the rollout adds the seconds)."""

    def __init__(self, num_rows: int, num_slots: int, widths: list[int], max_seq: int):
        self.num_slots, self.widths = num_slots, widths
        self.queue: deque[int] = deque(range(num_rows))
        self.slot_row = [-1] * num_slots
        self.done = [1] * num_slots
        self.lengths = [0] * num_slots
        self.generated = [0] * num_slots
        self.results: list = [None] * num_rows
        self.stats = dict(decode_steps=0, syncs=0, prefill_tokens=0, cached_tokens=0, num_slots=num_slots,
                          max_seq=max_seq, slot_steps=0, row_steps=0, compactions=0, cascade_steps=0, peak_rows=0,
                          admissions=0,
                          decode_s=0.0, launch_s=0.0, admit_s=0.0, feed_wait_s=0.0,
                          host_s=0.0)  # (seconds: where the wall time went)

    # ---- what the slots hold --------------------------------------------------------------------
    def sync(self, done: list[int], lengths: list[int], generated: list[int]) -> None:
        """The device's counters, read back at a host sync."""
        self.done, self.lengths, self.generated = done, lengths, generated
        self.stats["syncs"] += 1

    def live(self) -> list[int]:
        """The slots decoding a row, in order."""
        return [s for s in range(self.num_slots) if self.slot_row[s] >= 0]

    def running(self) -> list[int]:
        """The live slots not yet done (whose responses a stop string may now end)."""
        return [s for s in self.live() if not self.done[s]]

    def idle(self) -> bool:
        """Nothing waits and nothing decodes."""
        return not self.queue and all(row < 0 for row in self.slot_row)

    def rows_in_flight(self) -> list[tuple[int, int]]:
        """(row, index of the token it samples next) of each live slot."""
        return [(self.slot_row[s], self.generated[s]) for s in self.live()]

    # ---- ending rows ----------------------------------------------------------------------------
    def stop(self, slots: list[int]) -> None:
        """These slots' rows end at this sync (a stop string)."""
        for s in slots:
            self.done[s] = True

    def abort(self) -> None:
        """Nobody will read the rest: the waiting rows end empty (never admitted: no tokens), the live ones now."""
        for row in self.queue:
            self.results[row] = ([], torch.empty(0))
        self.queue.clear()
        for s in self.live():
            self.done[s] = True

    def cancel(self, gone: set[int]) -> list[int]:
        """Rows `gone` end now: the waiting ones leave the queue (never admitted, never reported); returns the live
        slots this ends (the others were done already)."""
        self.queue = deque(row for row in self.queue if row not in gone)
        ended = [s for s in range(self.num_slots) if self.slot_row[s] in gone and not self.done[s]]
        self.stop(ended)
        return ended

    def finished(self) -> list[int]:
        """The live slots whose rows are done: to retire at this sync."""
        return [s for s in self.live() if self.done[s]]

    def free(self, slots: list[int]) -> None:
        """These slots' rows were retired: the slots are empty."""
        for s in slots:
            self.slot_row[s], self.lengths[s] = -1, 0

    # ---- new rows -------------------------------------------------------------------------------
    def add_row(self) -> int:
        """A row that arrived during the call (a stream's), queued; its number."""
        self.results.append(None)
        self.queue.append(len(self.results) - 1)
        return len(self.results) - 1

    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if self.slot_row[s] < 0]

    def admit(self, fits: Callable[[int, bool], int]) -> list[tuple[int, int]]:
        """(slot, row) pairs for the queue's head in the free slots: as many as `fits(free slots, busy)` says the
        cache holds."""
        free = self.free_slots()
        count = fits(len(free), len(free) < self.num_slots) if self.queue and free else 0
        return [(s, self.queue.popleft()) for s in free[:count]]

    def place(self, admitted: list[tuple[int, int]], prompt_lens: Callable[[int], int]) -> None:
        """The admitted rows decode in their slots, their prompts prefilled and first tokens sampled."""
        for s, row in admitted:
            self.slot_row[s], self.lengths[s], self.generated[s] = row, prompt_lens(row), 1

    # ---- the steps until the next sync ----------------------------------------------------------
    def compaction(self) -> tuple[list[int], list[int]] | None:
        """(src, dst): the live rows in slots past the narrowest width that holds them all and the free slots
        below it they move into, or None when the live rows fit the narrowest width already."""
        live = self.live()
        width = next(w for w in self.widths if w >= len(live))
        if live[-1] < width:
            return None
        src = [s for s in range(width, self.num_slots) if self.slot_row[s] >= 0]
        dst = [s for s in range(width) if self.slot_row[s] < 0][: len(src)]
        assert len(dst) == len(src), "compaction needs as many free slots below the width as rows above it"
        return src, dst

    def move(self, src: list[int], dst: list[int]) -> None:
        """The rows of slots `src` now decode in the empty slots `dst`."""
        for s, d in zip(src, dst):
            self.slot_row[d], self.lengths[d], self.generated[d] = self.slot_row[s], self.lengths[s], self.generated[s]
            self.slot_row[s], self.lengths[s], self.generated[s] = -1, 0, 0
        self.stats["compactions"] += 1

    def plan(self, limits: Sequence[int], n: int, sync_every: int, seq_bucket: int, max_seq: int,
             bucketed: bool) -> tuple[int, int, int]:
        """(width, steps, seq_len) of the steps until the next sync: the narrowest width holding every live slot,
        at most `sync_every` steps and no more than the longest live row still needs, and the cache positions
        every step's writes stay below (the longest slot after the steps, rounded up to `seq_bucket`; all of
        `max_seq` unless the attention is `bucketed`)."""
        live = self.live()
        width = next(w for w in self.widths if w > live[-1])
        num_steps = min(sync_every, max(limits[self.slot_row[s] // n] - self.generated[s] for s in live))
        # every position written in these steps lies below seq_len; empty slots sit at 0
        seq_len = min(max_seq, -(-(max(self.lengths) + num_steps) // seq_bucket) * seq_bucket)
        return width, num_steps, seq_len if bucketed else max_seq

    def count_steps(self, num_steps: int, width: int) -> None:
        num_live = len(self.live())
        self.stats["decode_steps"] += num_steps
        self.stats["slot_steps"] += num_steps * width
        self.stats["row_steps"] += num_steps * num_live
        self.stats["peak_rows"] = max(self.stats["peak_rows"], num_live)
