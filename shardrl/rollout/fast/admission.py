"""The fast rollout's admission: the rows the scheduler admits are prefilled into their slots' blocks (each distinct
prompt once, from the end of its longest cached prefix, in chunks of `prefill_tokens`), and their first tokens
sampled."""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence

from shardrl.rollout.base import VersionTrack, likeliest_tokens
from shardrl.rollout.fast.scheduler import (RowScheduler, blocks_for, prefill_chunks, rows_that_fit,
                                            shared_prefix_groups)
from shardrl.rollout.fast.step import GREEDY, reported_logits, sample_tokens


class Admission:
    """`FastRollout`'s admission of waiting rows, over the state its `__init__` and `_start` set (`_state`, `_pool`,
    `_groups`, ...)."""

    def _admit_waiting(self, sched: RowScheduler, prompts, limits, n, mode, generator,
                       track: VersionTrack | None) -> float:
        """Prefills the queue's head into the free slots, as many as the pool holds; returns the seconds taken."""
        admitted = sched.admit(lambda free, busy: rows_that_fit(sched.queue, lambda b: len(prompts[b]), limits, n,
                                                                free, busy, self._pool.reclaimable(),
                                                                self.block_size))
        if not admitted:
            return 0.0
        if track is not None:
            for _, row in admitted:
                track.begin(row)
        t0 = time.perf_counter()
        run, cached = self._admit(admitted, prompts, limits, n, mode, generator)
        took = time.perf_counter() - t0
        stats = sched.stats
        stats["admit_s"] += took
        stats["admissions"] += 1
        stats["prefill_tokens"] += run
        stats["cached_tokens"] += cached
        sched.place(admitted, lambda row: len(prompts[row // n]))
        return took

    def _admit(self, admitted, prompts, limits, n, mode, generator) -> tuple[int, int]:
        """Prefills the prompts of `admitted` (slot, row) pairs into their slots' blocks and samples each row's
        first token. Each distinct prompt (by its tokens: a prompt's n samples, and rows whose prompts are equal,
        such as a conversation's copies at its first turn) runs once, from the end of its longest cached prefix
        (`BlockPool.lookup`), in chunks of at most `prefill_tokens` tokens run (and four times that read from the
        cache where SDPA attends to a gathered copy of the cached prefixes, sixteen with the Triton prefill); its
        rows share its full blocks (each gets its own copy of the last, partly filled one). Returns (tokens run,
        prompt tokens read from the cache)."""
        lookup = self.prefix_cache and not self.record_routing  # (R3 records the routing of every prompt token)
        # a chunk's reads of the cache are bounded when they gather it (SDPA); the Triton prefill reads the blocks,
        # but a chunk stays bounded by its whole contexts too: an estimated cached prefix may be evicted by the
        # chunk's own allocations before its lookup, and then runs whole
        wide = (16 if self._block.attention.prefix_from_blocks else 4) * self.prefill_tokens

        def cached_of(b: int, toks: list[int]) -> int:  # (nothing in the chunking changes the pool)
            return self._pool.match(toks, len(toks) - 1, self._keys_of(b)) * self.block_size if lookup else 0

        chunks, same = prefill_chunks(admitted, n, lambda b: self._tokens_of(prompts, b), cached_of,
                                      self.prefill_tokens, wide)
        run = cached = 0
        for chunk in chunks:
            chunk_run, chunk_cached = self._prefill_chunk(chunk, same, prompts, limits, n, mode, generator, lookup)
            run, cached = run + chunk_run, cached + chunk_cached
        return run, cached

    def _prefill_chunk(self, chunk, same: dict[int, int], prompts, limits, n, mode, generator,
                       lookup: bool) -> tuple[int, int]:
        """One chunk of `_admit`: its distinct prompts prefilled, its rows given their blocks and first tokens.
        Returns (tokens run, prompt tokens read from the cache)."""
        st, pool, size, to_dev = self._state, self._pool, self.block_size, self._to_device
        order = list(dict.fromkeys(same[row // n] for _, row in chunk))  # distinct prompts, in order
        index = {b: i for i, b in enumerate(order)}
        index.update({row // n: index[same[row // n]] for _, row in chunk})
        tokens = [self._tokens_of(prompts, b) for b in order]
        first_limit = {}  # each prompt's first row in the chunk takes its blocks: room for that row's limit
        for _, row in chunk:
            first_limit.setdefault(index[row // n], limits[row // n])
        owned, starts = [], []
        for i, toks in enumerate(tokens):  # the first row of each prompt prefills it into its blocks
            # (its last token is run: the logits)
            hit = pool.lookup(toks, len(toks) - 1, self._keys_of(order[i])) if lookup else []
            owned.append(hit + pool.allocate(blocks_for(len(toks), first_limit[i], size) - len(hit)))
            starts.append(len(hit) * size)
        lens = [len(t) - c for t, c in zip(tokens, starts)]
        # the prompts' ids past their cached prefixes, right-padded: from their copies on the device
        ids = pad_sequence([prompts[b][c:] for b, c in zip(order, starts)], batch_first=True,
                           padding_value=self.pad_id).long()
        routes = None
        if st.out_routes is not None:
            routes = torch.empty((ids.numel(), *st.step_routes.shape[1:]), dtype=torch.long, device=self.device)
        images = None
        if self._call_images is not None:  # the tower's output at the placeholders, M-RoPE positions
            images = self._call_images.prefill_inputs(order, tokens, starts, ids.shape[1], to_dev)
        logits = self.model.prefill(ids, lens, st.kv, self._table_rows(owned), starts, self._block, routes,
                                    to_device=to_dev, images=images)
        if self._registering and lookup:
            for b, toks, blocks in zip(order, tokens, owned):
                pool.register(toks, blocks, len(toks), self._keys_of(b))
        # the rows: a prompt's first takes its blocks; the others share its full blocks and copy the partial one
        copies, rows_blocks, firsts = [], [], set()
        for _, row in chunk:
            b = row // n
            i, plen = index[b], len(tokens[index[b]])
            if i not in firsts:
                firsts.add(i)
                rows_blocks.append(owned[i])
                continue
            full = owned[i][: plen // size]
            pool.hold(full)
            own = pool.allocate(blocks_for(plen, limits[b], size) - len(full))
            if plen % size:
                copies.append((owned[i][len(full)], own[0]))
            rows_blocks.append(full + own)
        if copies:
            src, dst = to_dev([c[0] for c in copies]), to_dev([c[1] for c in copies])
            st.kv[:, :, dst] = st.kv[:, :, src]
        if self._groups is not None:  # rows starting with the same blocks read them together in the decode steps
            # (blocks two rows both hold are full and never written again: only a row's own blocks are)
            for members, common in shared_prefix_groups([s for s, _ in chunk], rows_blocks):
                self._groups.add(members, common * size)
        slots = to_dev([s for s, _ in chunk])
        source = to_dev([index[row // n] for _, row in chunk])
        for (slot, _), blocks in zip(chunk, rows_blocks):
            self._slot_blocks[slot] = blocks
        st.table[slots] = self._table_rows(rows_blocks)
        logits = logits.float()[source]  # (k, V)
        if routes is not None:  # each row's prompt: the routing of the prefill that wrote its K/V
            routes = routes.view(*ids.shape, *routes.shape[1:]).to(torch.int16).cpu()
            for (_, row), i in zip(chunk, source.tolist()):
                self._routes[row] = (routes[i, : lens[i]], None)
        limit_t = to_dev([limits[row // n] for _, row in chunk])
        noise = None if mode == GREEDY else torch.empty_like(logits).exponential_(generator=generator)
        tokens_out, log_probs = sample_tokens(logits, mode, noise, st.temperature, st.top_k, st.top_p, st.banned)
        st.tokens[slots] = tokens_out
        st.lengths[slots] = to_dev([len(tokens[index[row // n]]) for _, row in chunk])
        st.num_generated[slots] = 1
        st.max_new[slots] = limit_t
        if self._call_images is not None:  # each row decodes at cache position + its prompt's M-RoPE delta
            call = self._call_images
            st.rope_delta[slots] = to_dev([call.rope_of(order[index[row // n]], tokens[index[row // n]])[1]
                                           for _, row in chunk])
            call.admitted([row // n for _, row in chunk])
        st.out_tokens[slots, 0] = tokens_out
        st.out_log_probs[slots, 0] = log_probs
        if self._top:
            top_ids, top_values = st.top_buffers()
            ids, values = likeliest_tokens(reported_logits(logits, mode, st.temperature), self._top, tokens_out,
                                           log_probs)
            top_ids[slots, 0, :self._top], top_values[slots, 0, :self._top] = ids, values
        st.done[slots] = (tokens_out[:, None] == st.eos).any(-1) | (limit_t <= 1)
        self.totals["prompt_tokens"] += sum(lens)
        self.totals["cached_tokens"] += sum(starts)
        return ids.numel(), sum(starts)

    def _table_rows(self, block_lists: list[list[int]]) -> torch.Tensor:
        """Block-table rows (on the device) for lists of blocks: each list, then the scratch block 0."""
        width = self._state.table.shape[1]
        return self._to_device([blocks + [0] * (width - len(blocks)) for blocks in block_lists])

    def _to_device(self, values) -> torch.Tensor:
        """Integers (a list, nested lists, or a CPU tensor) on the device, sent without waiting for it: a copy from
        pinned memory is queued behind the kernels already launched, where a copy from pageable memory makes the
        host wait for all of them (in the admission, the device then idles while the host prepares each chunk)."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _tokens_of(self, prompts, b: int) -> list[int]:
        """Prompt b's ids on the host (read once per call); a VL prompt's image placeholders stand as their image's
        digest (`vision.identity`), so that the prefix index and the sharing of equal prompts key on the image."""
        if b not in self._prompt_tokens:
            tokens = prompts[b].tolist()
            if self._call_images is not None:
                tokens = self._call_images.identity(b, tokens)
            self._prompt_tokens[b] = tokens
        return self._prompt_tokens[b]

    def _keys_of(self, b: int) -> list[bytes]:
        """The prefix-index keys of prompt b's full blocks (`BlockPool.keys`; made once per call, after
        `_tokens_of`)."""
        if b not in self._prompt_keys:
            toks = self._prompt_tokens[b]
            self._prompt_keys[b] = self._pool.keys(toks, len(toks) // self.block_size)
        return self._prompt_keys[b]
