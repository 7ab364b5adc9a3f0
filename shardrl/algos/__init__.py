"""RL algorithms as small pure functions of tensors and scalars, looked up by name in plain dicts:
ADVANTAGE_ESTIMATORS, LOSS_MODES (vanilla PPO, GSPO, GSPO-token, CISPO, SAPO, GMPO, DPPO; each entry declares what
it needs),
KL_ESTIMATORS, and AGG_MODES for loss aggregation; rollout-training mismatch correction (rollout_correction) and
DAPO's data-side pieces (dapo)."""

from shardrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    Estimator,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    scores_to_token_rewards,
)
from shardrl.algos.aggregate import AGG_MODES, agg_loss
from shardrl.algos.dapo import groups_to_keep, overlong_penalty
from shardrl.algos.gspo import gspo_loss, gspo_token_loss
from shardrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
)
from shardrl.algos.losses import LOSS_MODES, POLICY_LOSSES, LossMode, entropy_loss, policy_loss, value_loss
from shardrl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LOSS_MODES",
    "POLICY_LOSSES",
    "Estimator",
    "LossMode",
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
    "groups_to_keep",
    "gspo_loss",
    "gspo_token_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "rollout_is_weights",
    "scores_to_token_rewards",
    "value_loss",
]
