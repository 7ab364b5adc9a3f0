"""RL algorithms as small pure functions of tensors and scalars, looked up by name in plain dicts:
ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, and AGG_MODES for loss aggregation."""

from shardrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    scores_to_token_rewards,
)
from shardrl.algos.aggregate import AGG_MODES, agg_loss
from shardrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
)
from shardrl.algos.losses import POLICY_LOSSES, entropy_loss, policy_loss, value_loss
from shardrl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_gae",
    "compute_grpo",
    "compute_reinforce_plus_plus",
    "compute_reinforce_plus_plus_baseline",
    "compute_rloo",
    "entropy_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]
