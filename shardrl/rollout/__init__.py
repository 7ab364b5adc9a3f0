"""Generation engines (rollouts): the contract in `base`, backends registered by name in `ROLLOUTS`."""

from shardrl.rollout.base import Rollout, RolloutOutput, SamplingParams, build_rollout
from shardrl.rollout.hf import HFRollout

ROLLOUTS: dict[str, type[Rollout]] = {"hf": HFRollout}

__all__ = ["HFRollout", "ROLLOUTS", "Rollout", "RolloutOutput", "SamplingParams", "build_rollout"]
