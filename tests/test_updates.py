"""Advantages in the trainer: estimators that whiten over the batch whiten over every data-parallel
rank's share, so 2 ranks with half the batch each get exactly the advantages of 1 rank with all of it."""

from __future__ import annotations

import types

import pytest
import torch

from shardrl.batch import Batch
from shardrl.testing import run_distributed
from shardrl.trainer.prepare import compute_advantages

ALGO = dict(norm_adv_by_std_in_grpo=True, gamma=0.9, lam=0.8, use_kl_in_reward=False)


def _batch() -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 7, (8,), generator=g)
    mask = (torch.arange(8)[None] < lengths[:, None]).long()  # (8, 8)
    batch = Batch({"loss_mask": mask, "old_values": torch.randn(8, 8, generator=g) * mask,
                   "prompt_index": torch.arange(8) // 2})
    return batch, torch.randn(8, generator=g)


def _advantages(estimator: str):
    import torch.distributed as dist

    batch, scores = _batch()
    world, rank = dist.get_world_size(), dist.get_rank()
    part = batch.chunk(world)[rank]
    cfg = types.SimpleNamespace(adv_estimator=estimator, **ALGO)
    compute_advantages(part, scores.chunk(world)[rank], cfg, 0.0, dist.group.WORLD)
    gathered = [None] * world
    dist.all_gather_object(gathered, part["advantages"])
    return torch.cat(gathered)


@pytest.mark.multiproc
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo"])
def test_two_ranks_get_the_advantages_of_one(estimator):
    batch, scores = _batch()
    compute_advantages(batch, scores, types.SimpleNamespace(adv_estimator=estimator, **ALGO), 0.0, None)
    split = run_distributed(_advantages, 2, estimator)
    torch.testing.assert_close(split, batch["advantages"], atol=1e-6, rtol=1e-5)
    mask = batch["loss_mask"].bool()
    if estimator != "grpo":  # whitened: mean 0 over the real tokens of the whole batch
        assert abs(float(batch["advantages"][mask].mean())) < 1e-5
