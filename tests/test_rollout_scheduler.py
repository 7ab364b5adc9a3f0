"""The fast rollout's host-side scheduler alone (`shardrl.rollout.fast.scheduler`), on plain lists: which rows are
admitted into which slots, which end at a sync, when live rows compact and how many steps run to the next sync."""

from __future__ import annotations

import pytest

from shardrl.rollout.fast.scheduler import (RowScheduler, blocks_for, prefill_chunks, rows_that_fit,
                                            shared_prefix_groups, slot_widths)


def test_blocks_for_rounds_prompt_and_limit_up_to_whole_blocks():
    assert blocks_for(5, 3, 4) == 2 and blocks_for(5, 4, 4) == 3 and blocks_for(1, 1, 64) == 1


def test_rows_fit_while_the_blocks_hold_them_and_later_samples_share_full_blocks():
    lens, limits = [5, 3], [3, 9]  # prompt 0: 2 blocks of 4 (its 2nd sample shares the full one: 1 more); 1: 3
    fit = lambda queue, free, busy, left: rows_that_fit(queue, lens.__getitem__, limits, 2, free, busy, left, 4)  # noqa
    assert fit([0, 1, 2, 3], 4, True, 6) == 3  # 2 + 1 + 3 blocks; the 4th row needs 3 more
    assert fit([0, 1, 2, 3], 4, True, 5) == 2
    assert fit([0, 1, 2, 3], 2, True, 100) == 2  # no more than the free slots
    assert fit([2, 3], 4, True, 2) == 0  # rows decoding: the head waits for blocks
    assert fit([2, 3], 4, False, 2) == 1  # nothing decoding: the head is admitted whatever it needs
    assert fit([1, 2], 4, True, 3) == 1  # row 1 alone in this admission: no full block to share (2 blocks)


def test_compaction_widths_step_down_to_the_narrowest_prefix():
    assert slot_widths(512, 32, None) == [32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert slot_widths(9, 1, 2) == [1, 2, 4, 6, 8, 9] and slot_widths(20, 32, None) == [20]


def admitted_scheduler(num_rows=5, num_slots=4, widths=(2, 4)):
    sched = RowScheduler(num_rows, num_slots, list(widths), max_seq=64)
    sched.sync([1] * num_slots, [0] * num_slots, [0] * num_slots)
    return sched


def test_admission_fills_the_free_slots_in_order_from_the_queue_head():
    sched = admitted_scheduler()
    asked = []
    admitted = sched.admit(lambda free, busy: asked.append((free, busy)) or 3)
    assert admitted == [(0, 0), (1, 1), (2, 2)] and asked == [(4, False)] and list(sched.queue) == [3, 4]
    sched.place(admitted, lambda row: 10 + row)
    assert sched.slot_row == [0, 1, 2, -1] and sched.lengths[:3] == [10, 11, 12] and sched.generated[:3] == [1, 1, 1]
    admitted = sched.admit(lambda free, busy: asked.append((free, busy)) or 5)
    assert admitted == [(3, 3)] and asked[-1] == (1, True) and list(sched.queue) == [4]
    sched.place(admitted, lambda row: 10 + row)
    assert sched.admit(lambda free, busy: 1 / 0) == []  # no free slot: the cache is not even asked
    assert sched.live() == [0, 1, 2, 3] and not sched.idle()


def test_a_sync_stops_cancels_aborts_and_frees_the_right_slots():
    sched = admitted_scheduler(num_rows=6)
    sched.place(sched.admit(lambda free, busy: 4), lambda row: 8)  # rows 0-3 in slots 0-3; 4, 5 wait
    sched.sync([0, 1, 0, 0], [9, 12, 10, 9], [2, 5, 3, 2])  # slot 1's row hit EOS on the device
    assert sched.running() == [0, 2, 3]
    sched.stop([2])  # a stop string in slot 2's row
    assert sched.finished() == [1, 2]
    ended = sched.cancel({3, 1, 5})  # row 1 is done already; row 5 never started
    assert ended == [3] and list(sched.queue) == [4] and sched.finished() == [1, 2, 3]
    sched.free(sched.finished())
    assert sched.slot_row == [0, -1, -1, -1] and sched.lengths == [9, 0, 0, 0] and sched.free_slots() == [1, 2, 3]
    assert sched.rows_in_flight() == [(0, 2)]
    sched.abort()
    assert not sched.queue and sched.finished() == [0] and sched.results[4][0] == [] and sched.results[5] is None
    sched.free([0])
    assert sched.idle()
    assert sched.add_row() == 6 and list(sched.queue) == [6] and not sched.idle()


def test_compaction_moves_the_rows_past_the_narrowest_width_into_free_slots_below_it():
    sched = RowScheduler(8, 8, [2, 4, 8], max_seq=64)
    sched.sync([1] * 8, [0] * 8, [0] * 8)
    sched.place(sched.admit(lambda free, busy: 8), lambda row: 4)
    sched.sync([1, 0, 1, 1, 1, 0, 1, 0], [0, 7, 0, 0, 0, 9, 0, 6], [0, 3, 0, 0, 0, 5, 0, 2])
    sched.free(sched.finished())  # left: slot 1 (row 1), 5 (row 5), 7 (row 7)
    assert sched.compaction() == ([5, 7], [0, 2])  # 3 live rows fit 4 slots
    sched.move([5, 7], [0, 2])
    assert sched.slot_row[:4] == [5, 1, 7, -1] and sched.slot_row[4:] == [-1] * 4
    assert sched.lengths[:3] == [9, 7, 6] and sched.generated[:3] == [5, 3, 2] and sched.stats["compactions"] == 1
    assert sched.compaction() is None  # they fit already
    # the narrowest width past the last live slot; steps: what the longest row still needs, at most sync_every
    limits = [8] * 8
    assert sched.plan(limits, 1, sync_every=16, seq_bucket=8, max_seq=64, bucketed=True) == (4, 6, 16)
    # (the cache positions the steps write: the longest slot, 9, plus the 6 steps, in buckets of 4)
    assert sched.plan(limits, 1, sync_every=16, seq_bucket=4, max_seq=64, bucketed=True) == (4, 6, 16)
    assert sched.plan(limits, 1, sync_every=4, seq_bucket=8, max_seq=64, bucketed=True) == (4, 4, 16)
    assert sched.plan(limits, 1, sync_every=4, seq_bucket=8, max_seq=64, bucketed=False) == (4, 4, 64)
    assert sched.plan(limits, 1, sync_every=4, seq_bucket=8, max_seq=12, bucketed=True) == (4, 4, 12)
    sched.count_steps(4, 4)
    assert {k: sched.stats[k] for k in ("decode_steps", "slot_steps", "row_steps", "peak_rows")} == dict(
        decode_steps=4, slot_steps=16, row_steps=12, peak_rows=3)


def test_prefill_chunks_run_each_distinct_prompt_once_within_the_budget():
    prompts = {0: [1, 2, 3, 4], 1: [1, 2, 3, 4], 2: [5, 6, 7, 8, 9, 10], 3: [7, 7]}
    admitted = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6)]  # n = 2: rows 2b, 2b+1 are prompt b
    chunks, same = prefill_chunks(admitted, 2, prompts.__getitem__, lambda b, toks: 0, budget=10, wide=100)
    assert same == {0: 0, 1: 0, 2: 2, 3: 3}  # prompt 1 has prompt 0's tokens: its rows read that prefill
    # a chunk runs its distinct prompts padded to the longest: prompts 0 (= 1) and 2 are 2 x 6 = 12 > 10 tokens,
    # prompts 2 and 3 too
    assert chunks == [admitted[:4], admitted[4:6], admitted[6:]]
    cached = {0: 2, 1: 2, 2: 4, 3: 0}  # with cached prefixes fewer tokens run: one chunk
    chunks, _ = prefill_chunks(admitted, 2, prompts.__getitem__, lambda b, toks: cached[b], budget=10, wide=100)
    assert chunks == [admitted]
    # but the whole contexts a chunk reads stay bounded too: 3 distinct x 6 > 12
    chunks, _ = prefill_chunks(admitted, 2, prompts.__getitem__, lambda b, toks: cached[b], budget=10, wide=12)
    assert chunks == [admitted[:6], admitted[6:]]


@pytest.mark.parametrize("blocks,want", [
    ([[3, 4, 5], [3, 4, 6], [3, 7], [8, 9]], [([10, 11, 12], 1)]),
    ([[3, 4, 5], [3, 4, 6], [8, 9], [8, 9, 2]], [([10, 11], 2), ([12, 13], 2)]),
    ([[3], [], [4]], []),
])
def test_rows_starting_with_the_same_blocks_form_shared_prefix_groups(blocks, want):
    assert shared_prefix_groups([10, 11, 12, 13][: len(blocks)], blocks) == want


def test_a_row_in_the_first_slot_past_the_narrowest_width_compacts_and_the_steps_cover_the_last_live_slot():
    sched = RowScheduler(4, 4, [2, 4], max_seq=64)
    sched.sync([1] * 4, [0] * 4, [0] * 4)
    sched.place(sched.admit(lambda free, busy: 4), lambda row: 4)
    sched.sync([0, 1, 0, 1], [5] * 4, [1] * 4)
    sched.free(sched.finished())  # rows in slots 0 and 2: two rows, but slot 2 is past the width 2
    assert sched.compaction() == ([2], [1])
    assert sched.plan([8] * 4, 1, 16, 8, 64, True)[0] == 4  # (before the move) the steps must reach slot 2
    sched.move([2], [1])
    assert sched.plan([8] * 4, 1, 16, 8, 64, True)[0] == 2
