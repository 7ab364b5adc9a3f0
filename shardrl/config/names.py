"""The algorithms a config may name, without torch: the names of `shardrl.algos`' registries and what the
config's rules need to know of each estimator. The registries hold the functions under the same names
(tests/test_config.py checks that the two agree)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the run (`shardrl.algos.advantages.Estimator` declares the same)."""

    needs_critic: bool = False
    """Takes values: the run trains a critic."""
    group_baseline: bool = False
    """Compares the responses to one prompt (with rollout.n=1 no baseline is subtracted: a warning)."""
    needs_teacher: bool = False
    """Reads a teacher's log-probs of the sampled tokens (on-policy distillation): the run builds teacher.model_path."""


ADVANTAGE_ESTIMATORS = {
    "gae": EstimatorNeeds(needs_critic=True),
    "grpo": EstimatorNeeds(group_baseline=True),
    "rloo": EstimatorNeeds(group_baseline=True),
    "reinforce_plus_plus": EstimatorNeeds(),
    "reinforce_plus_plus_baseline": EstimatorNeeds(group_baseline=True),
    "opd": EstimatorNeeds(needs_teacher=True),
}
"""`algorithm.adv_estimator`'s choices (`shardrl.algos.ADVANTAGE_ESTIMATORS`)."""

LOSS_MODES = ("vanilla", "gspo", "gspo_token", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")
"""`actor.loss_mode`'s choices (`shardrl.algos.LOSS_MODES`)."""

PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                     "apo_down", "sigmoid_norm", "simpo")
"""`dpo.loss_type`'s choices (`shardrl.algos.preference.PREFERENCE_LOSSES`)."""

REFERENCE_FREE_LOSSES = ("simpo",)
"""The preference losses that read no reference policy (`PreferenceLoss.uses_ref` is false): dpo.ref_model_path is
unused with them."""

SMOOTHED_LOSSES = ("sigmoid", "robust", "exo_pair", "simpo")
"""The preference losses that read dpo.label_smoothing."""
