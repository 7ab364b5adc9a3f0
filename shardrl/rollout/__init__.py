"""Generation engines (rollouts): the contract in `base`, backends registered by name in `ROLLOUTS`."""

from __future__ import annotations

import torch

from shardrl.rollout.base import Rollout, RolloutOutput, SamplingParams
from shardrl.rollout.fast.rollout import FastRollout
from shardrl.rollout.hf import HFRollout

ROLLOUTS: dict[str, type[Rollout]] = {"hf": HFRollout, "fast": FastRollout}

__all__ = ["FastRollout", "HFRollout", "ROLLOUTS", "Rollout", "RolloutOutput", "SamplingParams", "build_rollout"]


def build_rollout(name: str, hf_config, tokenizer, device: torch.device | str, dtype: torch.dtype,
                  **kwargs) -> Rollout:
    """The rollout backend `name` (see `ROLLOUTS`); `kwargs` go to its constructor (e.g. `micro_batch_size`)."""
    if name not in ROLLOUTS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(ROLLOUTS)}")
    return ROLLOUTS[name](hf_config, tokenizer, device, dtype, **kwargs)
