"""The fast rollout's host loop (`shardrl.rollout.fast.rollout`'s docstring): from one sync to the next, the rows
that ended are retired (their tokens to the host, their blocks to the prefix index), new rows are taken and admitted,
the live ones compacted and stepped; and the call's output is assembled from the rows'."""

from __future__ import annotations

import time

from array import array

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.profiler import record_function

from shardrl.rollout.base import (RolloutOutput, VersionTrack, assemble_output, contains_stop, cut_responses,
                                  stop_window)
from shardrl.rollout.fast.scheduler import RowFeed, RowScheduler, slot_widths


class DecodeLoop:
    """`FastRollout`'s host loop, over the state its `__init__` and `_start` set (`_state`, `_pool`, `_groups`, ...);
    the prefill of the rows it admits is `Admission`'s (`shardrl.rollout.fast.admission`)."""

    def _decode_rows(self, prompts, limits, n, mode, stop, generator, track: VersionTrack | None = None,
                     feed: RowFeed | None = None, overlap: bool = False) -> list[tuple[list[int], torch.Tensor]]:
        """(tokens, log-probs) of every row b*n+j, uncut: through EOS, the limit, or past a stop string.
        With `track`, its weight hook runs at every host sync (between decode steps: the next step reads the
        new weights) and records which rows it splits where. With `feed` (n == 1; `prompts` and `limits` grow),
        finished rows are reported at each sync and new rows taken: waited for when nothing else is left.
        The decisions are the scheduler's (`RowScheduler`); here they are applied to the device state."""
        st = self._state
        sched = RowScheduler(len(prompts) * n, st.num_slots, self._widths(st.num_slots), st.max_seq)
        stats = sched.stats
        self._routes = {}
        self._registering = track is None  # a row that saw a weight change holds K/V of two versions
        self._prompt_tokens: dict[int, list[int]] = {}
        self._prompt_keys: dict[int, list[bytes]] = {}
        self._reported: dict[int, int] = {}  # row -> its tokens the feed was given so far (`_report_progress`)
        captures = self.captures
        clock = time.perf_counter()
        stats["wall_start"] = time.time()  # (a server's bench: where its clients' span was not this call's)
        while True:
            with record_function("rollout.sync"):  # (the marks name the host's work for bench/profile_e2e.py)
                sched.sync(*torch.stack([st.done.long(), st.lengths, st.num_generated]).tolist())
            now = time.perf_counter()
            stats["decode_s"] += now - clock  # the steps since the last sync, to their end (launches included)
            clock, inner = now, 0.0
            with record_function("rollout.end_rows"):
                self._end_rows(sched, prompts, n, stop, feed)
            if feed is not None:
                self._report_progress(sched, feed)
                inner += self._take_rows(sched, prompts, limits, feed)
            if track is not None:
                track.poll(sched.rows_in_flight)
            # `overlap` with rows decoding: their next steps are launched first and the admission runs while the
            # device runs them. Its host work (a prefill's launches: 20-40 ms for a few prompts of the Qwen2-1.5B
            # shape on one H200, of a few ms on the device) then leaves the device idle no longer; its rows decode
            # from the next sync on
            later = overlap and bool(sched.live())
            if not later:
                with record_function("rollout.admit"):
                    inner += self._admit_waiting(sched, prompts, limits, n, mode, generator, track)
            if not sched.live():
                break
            move = sched.compaction()  # rows left decoding in slots past the narrowest prefix that holds them
            if move is not None:
                with record_function("rollout.compact"):
                    self._compact(*move, sched)
            with record_function("rollout.plan"):
                width, num_steps, seq_len = sched.plan(limits, n, self.sync_every, self.seq_bucket, st.max_seq,
                                                       self._block.attention.bucketed)
            cascade = self._groups is not None and self._groups.active()
            if cascade:
                self._groups.push()
                stats["cascade_steps"] += num_steps
            now = time.perf_counter()
            stats["host_s"] += now - clock - inner  # bookkeeping at the sync (not the feed's wait or the prefill)
            clock = now
            with record_function("rollout.launch"):
                for _ in range(num_steps):
                    self._run_step(mode, seq_len, generator, width, cascade)
            stats["launch_s"] += time.perf_counter() - clock  # (of decode_s: the host's share, launching the steps)
            sched.count_steps(num_steps, width)
            if later:
                clock += self._admit_waiting(sched, prompts, limits, n, mode, generator, track)  # (admit_s)
        stats["captures"] = self.captures - captures
        stats["wall_end"] = time.time()
        self.last_stats = stats
        return sched.results

    def _end_rows(self, sched: RowScheduler, prompts, n: int, stop, feed: RowFeed | None) -> None:
        """A sync's endings: the rows a stop string ends, all of them once the caller aborts (`generate` only),
        those the feed cancels; then every done row is retired (its output to `sched.results`, and to the feed)."""
        if stop:
            sched.stop(self._find_stops(sched.running(), sched.generated, stop))
        if feed is None and self.abort is not None and self.abort():  # nobody will read the rest (a server)
            sched.abort()  # (`_retire` marks the slots done on the device)
        if feed is not None and hasattr(feed, "cancelled"):
            gone = set(feed.cancelled())
            ended = sched.cancel(gone) if gone else []
            if ended:
                self._state.done[torch.tensor(ended, dtype=torch.long, device=self.device)] = True
        finished = sched.finished()
        if not finished:
            return
        self._retire(finished, sched.slot_row, sched.generated, sched.results, prompts, n)
        if feed is not None:
            for s in finished:
                row = sched.slot_row[s]
                # (the likeliest tokens only where the call asks: a feed that never does takes no such argument)
                top = {"top": self._tops.pop(row)} if self._top else {}
                feed.finished(row, *sched.results[row], **top)
                # a stream may run for hours: what a finished row held goes (its prompt, its output)
                prompts[row] = sched.results[row] = None
                self._reported.pop(row, None)
                self._prompt_tokens.pop(row, None)
                self._prompt_keys.pop(row, None)
        sched.free(finished)

    def _report_progress(self, sched: RowScheduler, feed: RowFeed) -> None:
        """The tokens each row the feed streams (`feed.streamed_rows()`: its client reads the reply as it is made)
        made since the last sync, for those still decoding (a row that ended goes to `finished`), in one transfer:
        `feed.progress([(row, tokens), ...])`."""
        streamed = feed.streamed_rows() if hasattr(feed, "streamed_rows") else None
        if not streamed:
            return
        spans = [(s, self._reported.get(sched.slot_row[s], 0), sched.generated[s]) for s in sched.running()
                 if sched.slot_row[s] in streamed]
        spans = [span for span in spans if span[1] < span[2]]
        if not spans:
            return
        # each row's own window (its new tokens, about sync_every), not one span from the least reported to the most
        # generated over all rows (rows of different ages: thousands of columns read back for a few new ones)
        st, width = self._state, max(b - a for _, a, b in spans)
        idx = self._to_device([s for s, _, _ in spans])
        starts = self._to_device([a for _, a, _ in spans])
        cols = (starts[:, None] + torch.arange(width, device=starts.device)).clamp_(max=st.out_tokens.shape[1] - 1)
        tokens = st.out_tokens[idx[:, None], cols].tolist()
        parts = []
        for i, (s, a, b) in enumerate(spans):
            row = sched.slot_row[s]
            parts.append((row, tokens[i][:b - a]))
            self._reported[row] = b
        feed.progress(parts)

    def _take_rows(self, sched: RowScheduler, prompts, limits, feed: RowFeed) -> float:
        """Queues the rows the feed hands over, waiting for them only when nothing is queued or decoding; returns
        the seconds waited."""
        idle = sched.idle()
        t0 = time.perf_counter()
        taken = feed.take(block=idle)
        sched.stats["feed_wait_s"] += (waited := time.perf_counter() - t0)
        for prompt, limit in taken:
            # its ids on the host now: read back from the device in the admission, they would wait for the decode
            # steps queued before it (`overlap`)
            self._prompt_tokens[len(prompts)] = prompt.tolist()
            prompts.append(prompt.to(self.device))
            limits.append(int(limit))
            sched.add_row()
        return waited

    def _widths(self, num_slots: int) -> list[int]:
        """The slot prefixes a decode step may run on (`slot_widths`)."""
        return slot_widths(num_slots, self.min_width, self.width_step)

    def _compact(self, src: list[int], dst: list[int], sched: RowScheduler) -> None:
        """Moves the rows decoding in slots `src` into the free slots `dst` (`RowScheduler.compaction`): their
        block-table rows (the K/V stays where it is), next token, counters and outputs, in one indexed copy per
        tensor; the scheduler, the slots' blocks and the shared-prefix groups follow."""
        st = self._state
        s_t = torch.tensor(src, dtype=torch.long, device=self.device)
        d_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        made = max(sched.generated[s] for s in src)
        for t in (st.table, st.tokens, st.lengths, st.done, st.num_generated, st.max_new, st.rope_delta):
            if t is not None:
                t[d_t] = t[s_t]
        st.table[s_t] = 0
        st.out_tokens[d_t, :made] = st.out_tokens[s_t, :made]
        st.out_log_probs[d_t, :made] = st.out_log_probs[s_t, :made]
        if st.out_routes is not None:
            st.out_routes[d_t, :made] = st.out_routes[s_t, :made]
        if self._top:
            for t in st.top_buffers():
                t[d_t, :made] = t[s_t, :made]
        st.lengths[s_t] = 0
        st.done[s_t] = True
        for s, d in zip(src, dst):
            if self._groups is not None:
                self._groups.move(s, d)
            self._slot_blocks[d], self._slot_blocks[s] = self._slot_blocks[s], []
        sched.move(src, dst)

    def _retire(self, finished, slot_row, generated, results, prompts, n: int) -> None:
        """Copies the finished slots' tokens to the host (one transfer), indexes the full blocks of what each
        row's cache holds (prompt and fed tokens; `prefix_cache`), releases the rows' blocks and marks the slots
        empty."""
        st = self._state
        idx = self._to_device(finished)
        width = max(generated[s] for s in finished)
        tokens = st.out_tokens[idx, :width].tolist()
        log_probs = st.out_log_probs[idx, :width].cpu()
        if self._top:
            top_ids, top_values = (t[idx, :width, :self._top].cpu() for t in st.top_buffers())
        for i, s in enumerate(finished):
            results[slot_row[s]] = (tokens[i][: generated[s]], log_probs[i, : generated[s]])
            if self._top:
                self._tops[slot_row[s]] = (top_ids[i, : generated[s]], top_values[i, : generated[s]])
            blocks = self._slot_blocks[s]
            if self.prefix_cache and self._registering and not self.record_routing:
                prompt = self._tokens_of(prompts, slot_row[s] // n)
                self._pool.register(prompt + results[slot_row[s]][0], blocks, len(prompt) + generated[s] - 1,
                                    self._keys_of(slot_row[s] // n))
            self._pool.release(blocks)
            self._slot_blocks[s] = []
            if self._groups is not None:
                self._groups.remove(s)
        if st.out_routes is not None:  # the tokens fed: all but the last
            routes = st.out_routes[idx, : max(width - 1, 1)].cpu()
            for i, s in enumerate(finished):
                row = slot_row[s]
                self._routes[row] = (self._routes[row][0], routes[i, : generated[s] - 1])
        st.lengths[idx] = 0
        st.done[idx] = True
        st.table[idx] = 0

    def _find_stops(self, live: list[int], generated: list[int], stop: list[str]) -> list[int]:
        """The live slots whose response now holds a stop string (marked done on the device too). Only the
        tail a check can have missed is decoded first, as `hf._StopStringCriteria` does."""
        if not live:
            return []
        st = self._state
        idx = torch.tensor(live, dtype=torch.long, device=self.device)
        rows = st.out_tokens[idx, : max(generated[s] for s in live)].cpu().tolist()
        window = self.sync_every + 1 + stop_window(stop)
        ids = [row[: generated[s]] for row, s in zip(rows, live)]
        tails = self.tokenizer.batch_decode([r[-window:] for r in ids], skip_special_tokens=True)
        decode = lambda r: self.tokenizer.decode(r, skip_special_tokens=True)  # noqa: E731
        hits = [s for s, tail, r in zip(live, tails, ids)
                if contains_stop(tail, stop) and contains_stop(decode(r), stop)]
        if hits:
            st.done[torch.tensor(hits, dtype=torch.long, device=self.device)] = True
        return hits

    def _assemble(self, prompt_ids, attention_mask, rows, n, stop) -> RolloutOutput:
        """The `RolloutOutput` of the uncut rows, cut by the HF reference's own rule (`cut_responses`)."""
        # each row's list through an array of its own (one nested list of every row, padded, took 120 ms at 512 rows
        # of ~550 tokens; torch.tensor of each list 75 ms, this 25)
        full = pad_sequence([torch.frombuffer(array("q", tokens), dtype=torch.int64) if tokens else
                             torch.zeros(0, dtype=torch.long) for tokens, _ in rows],
                            batch_first=True, padding_value=self.pad_id)
        lengths, texts = cut_responses(self.tokenizer, self.stop_ids, full, stop)
        # a row shorter than `full` without EOS ended at its own limit (or a stop string): padding is no response
        lengths = [min(length, len(tokens)) for length, (tokens, _) in zip(lengths, rows)]
        responses = [(full[r, :length], rows[r][1][:length]) for r, length in enumerate(lengths)]
        tops = None
        if self._top:  # (a row never admitted (`abort`) has none)
            none = (torch.zeros(0, self._top, dtype=torch.long), torch.zeros(0, self._top))
            tops = [self._tops.get(r, none) for r in range(len(rows))]
            self._tops = {}
        out = assemble_output(prompt_ids, attention_mask, n, responses, texts, self.pad_id, tops)
        if self.record_routing:
            out.routed_experts = self._routed_experts(out, lengths, n)
        return out

    def _routed_experts(self, out: RolloutOutput, lengths: list[int], n: int) -> torch.Tensor:
        """(N, P+R, L, k) int16: the recorded routing of each row laid out as `out.to_batch()`'s input_ids; -1
        where nothing was run (padding; the last response token, never fed)."""
        width = out.prompt_ids.shape[1]
        routed = torch.full((len(out), width + out.response_ids.shape[1], *self._state.step_routes.shape[1:]), -1,
                            dtype=torch.int16)
        for r, length in enumerate(lengths):
            if r not in self._routes:  # (never admitted: a call ended by `abort`)
                continue
            prompt, response = self._routes[r]
            routed[r, width - prompt.shape[0]:width] = prompt
            fed = min(length, response.shape[0])
            routed[r, width:width + fed] = response[:fed]
        self._routes = {}
        return routed
