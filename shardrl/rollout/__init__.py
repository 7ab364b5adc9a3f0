"""Generation engines (rollouts): the contract in `base`, backends registered by name in `ROLLOUTS`."""

from shardrl.rollout.base import Rollout, RolloutOutput, SamplingParams, build_rollout
from shardrl.rollout.fast import FastRollout
from shardrl.rollout.hf import HFRollout

ROLLOUTS: dict[str, type[Rollout]] = {"hf": HFRollout, "fast": FastRollout}

__all__ = ["FastRollout", "HFRollout", "ROLLOUTS", "Rollout", "RolloutOutput", "SamplingParams", "build_rollout"]
