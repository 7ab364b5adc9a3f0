"""Micro-batching: fixed sizes, token-budget balancing, restoring the order, and agreeing on the count
across data-parallel ranks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from shardrl.batch import Batch
from shardrl.engine.microbatch import (
    balanced_partition,
    num_dynamic_micro_batches,
    restore_order,
    seq_lengths,
    split_micro_batches,
)
from shardrl.testing import random_batch, run_distributed


def with_ids(batch: Batch) -> Batch:
    batch["sample_id"] = torch.arange(len(batch))
    batch["tag"] = [f"t{i}" for i in range(len(batch))]
    return batch


def random_lengths(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, rng.choice([5, 40, 300])) for _ in range(rng.randint(1, 25))] for _ in range(200)]


def test_balanced_partition_small_case():
    # longest first to the lightest part: 9, 7, 5 one each; 3 joins the 5 (8); 2 joins the 7 (9)
    parts = balanced_partition([3, 9, 5, 7, 2], 3)
    loads = sorted(sum([3, 9, 5, 7, 2][i] for i in p) for p in parts)
    assert loads == [8, 9, 9]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    assert all(p == sorted(p) for p in parts)
    with pytest.raises(ValueError, match="num_parts must be >= 1, got 0"):
        balanced_partition([1, 2], 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_partition_properties(seed):
    rng = random.Random(seed)
    for lengths in random_lengths(seed):
        num_parts = rng.randint(1, len(lengths) + 2)
        parts = balanced_partition(lengths, num_parts)
        assert len(parts) == num_parts
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # each index exactly once
        if len(lengths) >= num_parts:
            assert all(len(p) >= 1 for p in parts)
        max_load = max(sum(lengths[i] for i in p) for p in parts)
        assert max_load <= sum(lengths) / num_parts + max(lengths)


def test_balanced_partition_zero_lengths_still_fill_every_part():
    parts = balanced_partition([0, 0, 0, 0, 5], 4)
    assert all(len(p) >= 1 for p in parts)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", [0, 1])
def test_num_dynamic_micro_batches_fits_the_budget(seed):
    rng = random.Random(seed)
    for lengths in random_lengths(seed):
        budget = rng.randint(max(lengths), max(lengths) * 4)
        k = num_dynamic_micro_batches(lengths, budget)
        assert 1 <= k <= len(lengths)
        assert k >= -(-sum(lengths) // budget)  # no fewer than the total forces
        parts = balanced_partition(lengths, k)
        assert max(sum(lengths[i] for i in p) for p in parts) <= budget
        if k > 1:  # the count before it did not fit
            parts = balanced_partition(lengths, k - 1)
            assert max(sum(lengths[i] for i in p) for p in parts) > budget


def test_num_dynamic_micro_batches_numbers():
    assert num_dynamic_micro_batches([10, 10, 10, 10], 20) == 2
    assert num_dynamic_micro_batches([10, 10, 10, 10], 19) == 4
    assert num_dynamic_micro_batches([10, 10, 10], 100) == 1
    assert num_dynamic_micro_batches([6, 5, 5], 10) == 2  # (6) + (5, 5)
    assert num_dynamic_micro_batches([], 10) == 1


def test_num_dynamic_micro_batches_too_long_sequence():
    with pytest.raises(ValueError) as e:
        num_dynamic_micro_batches([5, 37, 8], 32)
    msg = str(e.value)
    assert "37 tokens" in msg and "max_token_len_per_gpu=32" in msg and "at least 37" in msg


def test_split_fixed():
    batch = with_ids(random_batch(10, 12, 50, seed=0))
    mbs, perm = split_micro_batches(batch, micro_batch_size=4)
    assert perm is None
    assert [len(mb) for mb in mbs] == [4, 4, 2]
    assert [mb["sample_id"].tolist() for mb in mbs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert torch.equal(restore_order(mbs, perm)["input_ids"], batch["input_ids"])


@pytest.mark.parametrize("seed, budget", [(0, 40), (1, 25), (2, 64), (3, 1000)])
def test_split_dynamic(seed, budget):
    batch = with_ids(random_batch(13, 24, 50, seed=seed, min_len=3))
    batch.meta["num_tokens"] = 99
    lengths = seq_lengths(batch)
    assert len(set(lengths.tolist())) > 3  # varied lengths, so balancing has work to do
    mbs, perm = split_micro_batches(batch, max_token_len=budget)
    assert len(mbs) == num_dynamic_micro_batches(lengths.tolist(), budget)
    assert sorted(perm.tolist()) == list(range(13))
    ids_in_order = torch.cat([mb["sample_id"] for mb in mbs])
    assert torch.equal(ids_in_order, perm)
    for mb in mbs:
        assert int(mb["attention_mask"].sum()) <= budget
        assert mb.meta == {"num_tokens": 99}
        # samples keep their own rows and fields
        assert torch.equal(mb["input_ids"], batch["input_ids"][mb["sample_id"]])
        assert mb["tag"] == [f"t{i}" for i in mb["sample_id"].tolist()]

    # per-micro-batch results (here: something computed per sample) come back in the original order
    results = [Batch({"sample_id": mb["sample_id"].clone(), "score": mb["input_ids"].sum(-1) * 1.5},
                     {"tag": list(mb["tag"])}) for mb in mbs]
    back = restore_order(results, perm)
    assert back["sample_id"].tolist() == list(range(13))
    assert torch.equal(back["score"], batch["input_ids"].sum(-1) * 1.5)
    assert back["tag"] == [f"t{i}" for i in range(13)]


def test_split_dynamic_budget_forces_many_micro_batches():
    batch = with_ids(random_batch(8, 16, 50, seed=4))
    longest = int(seq_lengths(batch).max())
    mbs, perm = split_micro_batches(batch, max_token_len=longest)
    assert len(mbs) >= 2
    assert all(int(mb["attention_mask"].sum()) <= longest for mb in mbs)
    with pytest.raises(ValueError, match=f"{longest} tokens exceeds max_token_len_per_gpu={longest - 1}"):
        split_micro_batches(batch, max_token_len=longest - 1)


def test_split_needs_exactly_one_mode():
    batch = random_batch(4, 8, 50)
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches(batch)
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches(batch, micro_batch_size=2, max_token_len=100)


def test_restore_order_skips_empty_results():
    batch = with_ids(random_batch(2, 8, 50))
    parts = [[1], [], [0]]
    perm = torch.tensor([1, 0])
    results = [batch.index(p).select(["sample_id"]) for p in parts]
    assert len(results[1]) == 0
    assert restore_order(results, perm)["sample_id"].tolist() == [0, 1]


# ---- two ranks agree on the count ----

BUDGET = 40


def _rank_batch(rank: int) -> Batch:
    if rank == 0:  # 5 long sequences: 30..34 tokens, one per micro-batch under a budget of 40
        lengths = [30, 31, 32, 33, 34]
    else:  # 3 short ones that would fit in one micro-batch
        lengths = [5, 6, 7]
    t = 36
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1
    ids = torch.arange(len(lengths)) + 100 * rank
    return Batch({"attention_mask": mask, "input_ids": mask * 7, "sample_id": ids})


def _agree_on_count() -> list[dict]:
    rank = dist.get_rank()
    batch = _rank_batch(rank)
    local = num_dynamic_micro_batches(seq_lengths(batch).tolist(), BUDGET)
    mbs, perm = split_micro_batches(batch, max_token_len=BUDGET, dp_group=dist.group.WORLD)
    results = [mb.select(["sample_id"]) for mb in mbs]
    out = {
        "local": local,
        "num": len(mbs),
        "sizes": [len(mb) for mb in mbs],
        "tokens": [int(mb["attention_mask"].sum()) for mb in mbs],
        "restored": restore_order(results, perm)["sample_id"].tolist(),
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.multiproc
def test_dynamic_count_agreed_across_ranks():
    r0, r1 = run_distributed(_agree_on_count, 2)
    assert (r0["local"], r1["local"]) == (5, 1)
    assert r0["num"] == r1["num"] == 5
    assert r0["sizes"] == [1, 1, 1, 1, 1]
    assert sorted(r1["sizes"]) == [0, 0, 1, 1, 1]  # 3 samples over 5 micro-batches: two are empty
    assert all(t <= BUDGET for t in r0["tokens"] + r1["tokens"])
    assert sorted(r1["tokens"]) == [0, 0, 5, 6, 7]
    assert r0["restored"] == [0, 1, 2, 3, 4]
    assert r1["restored"] == [100, 101, 102]


def _fixed_counts_agree(sizes):
    from shardrl.distributed import build_device_mesh
    from shardrl.engine.microbatch import split_micro_batches

    mesh = build_device_mesh(-1, 1)
    batch = random_batch(sizes[torch.distributed.get_rank()], 8, 50, seed=1)
    pieces, _ = split_micro_batches(batch, micro_batch_size=2, dp_group=mesh.dp_group)
    every_rank = [None, None]
    torch.distributed.all_gather_object(every_rank, [len(p) for p in pieces])
    return every_rank


@pytest.mark.multiproc
def test_fixed_micro_batch_count_agreed_across_ranks():
    # rank 0 holds 5 samples (3 pieces), rank 1 holds 2 (1 piece): rank 1 runs 2 empty pieces too
    from shardrl.testing import run_distributed

    assert run_distributed(_fixed_counts_agree, 2, [5, 2]) == [[2, 2, 1], [2, 0, 0]]


def _infer_with_an_empty_rank(dynamic: bool):
    from shardrl.config.schema import EngineConfig, ModelConfig
    from shardrl.engine import build_engine
    from shardrl.testing import TINY_MODELS

    kw = dict(use_dynamic_bsz=True, max_token_len_per_gpu=16) if dynamic else dict(micro_batch_size_per_gpu=2)
    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(param_dtype="float32", **kw))
    batch = random_batch(5 if dist.get_rank() == 0 else 0, 8, 101, seed=3)
    shapes = [None, None]
    dist.all_gather_object(shapes, tuple(engine.infer_batch(batch)["log_probs"].shape))
    return shapes


def _infer_with_an_empty_rank_each(settings: tuple[bool, ...]) -> dict:
    """`_infer_with_an_empty_rank` for each setting of `dynamic`, one engine after the other on the same processes."""
    return {dynamic: _infer_with_an_empty_rank(dynamic) for dynamic in settings}


@pytest.fixture(scope="module")
def empty_rank_shapes():
    from shardrl.testing import run_distributed

    return run_distributed(_infer_with_an_empty_rank_each, 2, (False, True))  # both on one pair of processes


@pytest.mark.multiproc
@pytest.mark.parametrize("dynamic", [False, True])
def test_infer_on_a_rank_without_samples(empty_rank_shapes, dynamic):
    # the empty rank runs placeholder micro-batches for the collectives and returns no rows
    assert empty_rank_shapes[dynamic] == [(5, 8), (0, 8)]
