"""A stand-in for the fast rollout on a GPU, for timing the server's path on a machine without one
(`bench/serve.py --backend sim`): it generates no real tokens but keeps the fast rollout's time structure and its
use of the interpreter lock, as measured on one H100 for the Qwen2-1.5B shape (bench/RESULTS.md, session 28):

- a decode step takes `step_ms` on the device; the host launches `sync_every` of them (CUDA graphs: no Python to
  speak of) and waits at the sync with the interpreter lock released (`time.sleep` here);
- an admission prefills the new rows: `admit_host_ms` of Python launches holding the interpreter lock (a busy loop
  here: other threads get it only at the switch interval, as between the real launches), then
  `admit_ms_per_row` a row on the device (lock released);
- each row ends at an end token with probability `hazard` a token after its first, or at its limit (the bench model's
  `eos_hazard`, 1/400).

Rows, `RowFeed` calls (a streamed row's tokens at each sync too) and `last_stats` are the fast rollout's, so the
real `Batcher`, front end and clients run unchanged in front of it. What it cannot show: the device's own contention (a prefill slowing the decode steps)."""

from __future__ import annotations

import random
import time
from collections import deque

import torch

from shardrl.rollout.base import RolloutOutput


def hold_lock(ms: float) -> None:
    """Python work for `ms` (the interpreter lock held but for the switch interval's hand-overs)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class SimRollout:
    weight_hook = None
    record_routing = False
    abort = None

    def __init__(self, max_batch: int = 256, step_ms: float = 3.3, sync_every: int = 16, admit_host_ms: float = 15.0,
                 admit_ms_per_row: float = 1.38, hazard: float = 1 / 400, seed: int = 0, token_id: int = 5):
        self.max_batch, self.step_ms, self.sync_every = max_batch, step_ms, int(sync_every)
        self.admit_host_ms, self.admit_ms_per_row, self.hazard = admit_host_ms, admit_ms_per_row, hazard
        self.seed, self.rng, self.token_id = seed, random.Random(seed), token_id
        self.last_stats: dict = {}
        self.captures = 0

    def _length(self, limit: int) -> int:
        length = 1
        while length < limit and self.rng.random() >= self.hazard:
            length += 1
        return length

    def _decode(self, limits: list[int], num_slots: int, feed=None, overlap: bool = False) -> dict[int, int]:
        """Rows 0.. of `limits` (and those `feed` hands over) through the slots; returns row -> tokens made."""
        queue, live, made = deque(range(len(limits))), {}, {}  # live: row -> (target, generated)
        if feed is not None:  # (each stream draws the same lengths in turn: runs compared differ in the server alone)
            self.rng = random.Random(self.seed)
        reported: dict[int, int] = {}  # streamed row -> its tokens handed to the feed
        stats = dict(decode_steps=0, syncs=0, num_slots=num_slots, row_steps=0, slot_steps=0, admissions=0,
                     captures=0, decode_s=0.0, launch_s=0.0, admit_s=0.0, feed_wait_s=0.0, host_s=0.0,
                     wall_start=time.time())

        def admit() -> None:
            k = min(num_slots - len(live), len(queue))
            if k <= 0:
                return
            t0 = time.perf_counter()
            hold_lock(self.admit_host_ms)
            time.sleep(k * self.admit_ms_per_row / 1000)
            for _ in range(k):
                row = queue.popleft()
                live[row] = (self._length(limits[row]), 1)
            stats["admit_s"] += time.perf_counter() - t0
            stats["admissions"] += 1

        while True:
            stats["syncs"] += 1
            clock = time.perf_counter()
            for row, (target, generated) in list(live.items()):
                if generated >= target:
                    del live[row]
                    made[row] = target
                    if feed is not None:
                        feed.finished(row, [self.token_id] * target, torch.full((target,), -1.0))
            streamed = feed.streamed_rows() if feed is not None and hasattr(feed, "streamed_rows") else None
            if streamed:  # (as the fast rollout: each streamed row's tokens since the last sync)
                parts = [(row, [self.token_id] * (generated - reported.get(row, 0)))
                         for row, (_, generated) in live.items()
                         if row in streamed and generated > reported.get(row, 0)]
                reported.update((row, live[row][1]) for row, _ in parts)
                if parts:
                    feed.progress(parts)
            if feed is not None:
                gone = set(feed.cancelled()) if hasattr(feed, "cancelled") else set()
                if gone:  # (as the fast rollout: queued rows dropped unreported, live ones end at this sync)
                    queue = deque(row for row in queue if row not in gone)
                    for row in gone & live.keys():
                        live[row] = (live[row][1], live[row][1])
                t0 = time.perf_counter()
                taken = feed.take(block=not queue and not live)
                stats["feed_wait_s"] += (waited := time.perf_counter() - t0)
                clock += waited  # (host_s: the sync's bookkeeping alone)
                for _, limit in taken:
                    limits.append(int(limit))
                    queue.append(len(limits) - 1)
            stats["host_s"] += time.perf_counter() - clock
            later = overlap and bool(live)
            if not later:
                admit()
            if not live:
                break
            steps = min(self.sync_every, max(target - generated for target, generated in live.values()))
            t0 = time.perf_counter()
            time.sleep(steps * self.step_ms / 1000)
            stats["decode_s"] += time.perf_counter() - t0
            stats["decode_steps"] += steps
            stats["slot_steps"] += steps * num_slots
            stats["row_steps"] += steps * len(live)
            for row, (target, generated) in live.items():
                live[row] = (target, min(target, generated + steps))
            if later:
                admit()
        stats["wall_end"] = time.time()
        self.last_stats = stats
        return made

    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, sampling,
                 max_new_tokens=None, num_slots: int | None = None) -> RolloutOutput:
        n, rows = sampling.n, prompt_ids.shape[0] * sampling.n
        limits = ([sampling.max_new_tokens] * rows if max_new_tokens is None
                  else [int(m) for m in max_new_tokens for _ in range(n)])
        made = self._decode(limits, min(rows, num_slots or self.max_batch))
        width = max(made.values())
        mask = torch.zeros(rows, width, dtype=torch.long)
        for row, k in made.items():
            mask[row, :k] = 1
        index = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
        return RolloutOutput(prompt_ids[index], attention_mask[index], mask * self.token_id, mask,
                             -mask.float(), ["w" * k for _, k in sorted(made.items())], index)

    def generate_stream(self, prompts, limits, sampling, feed, need_seq: int, num_slots: int | None = None,
                        overlap: bool = False) -> None:
        self._decode(list(limits), num_slots or self.max_batch, feed, overlap)
