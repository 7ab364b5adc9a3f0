"""KL between the policy and the reference model: per-token estimators and the penalty coefficient.

The estimators follow http://joschu.net/blog/kl-approx.html with the samples drawn from the policy, and
take verl's names with verl's meaning (`verl.trainer.ppo.core_algos.kl_penalty`):

- "kl" / "k1": log p - log ref (unbiased, high variance);
- "abs": |log p - log ref|;
- "mse" / "k2": (log p - log ref)^2 / 2;
- "low_var_kl" / "k3": r - log r - 1 with r = ref / p (unbiased, never negative); the log-ratio is
  clamped to [-20, 20] before exp and the estimate to [-10, 10], so k3 and low_var_kl are one estimator.

A "+" suffix ("k3+", "low_var_kl+", "k1+", ...) keeps the estimator's value and takes the gradient of k2
(straight-through: k2 - k2.detach() + value.detach()), whose expected gradient is the true KL's gradient;
"k2+" / "mse+" equal "k2".
"""

import math

import torch

from shardrl.algos.aggregate import agg_loss
from shardrl.algos.masked import masked_mean


def _k1(logprob, ref_logprob):
    return logprob - ref_logprob  # (B, T)


def _abs(logprob, ref_logprob):
    return (logprob - ref_logprob).abs()  # (B, T)


def _k2(logprob, ref_logprob):
    return 0.5 * (logprob - ref_logprob) ** 2  # (B, T)


def _k3(logprob, ref_logprob):
    # Clamp the log-ratio first so exp cannot overflow, then the estimate itself (as verl does).
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)  # (B, T)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


_BASE_ESTIMATORS = {"kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3}
STRAIGHT_THROUGH = "+"
"""Suffix of an estimator name: its value, with k2's gradient."""
KL_ESTIMATORS = {**_BASE_ESTIMATORS, **{name + STRAIGHT_THROUGH: fn for name, fn in _BASE_ESTIMATORS.items()}}
"""Every accepted name -> its value function; a name ending in "+" also takes k2's gradient in `kl_penalty`."""


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate `(B, T)` of the policy from the reference, by estimator name (see the module doc)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {tuple(KL_ESTIMATORS)}")
    value = KL_ESTIMATORS[kind](logprob, ref_logprob)
    if not kind.endswith(STRAIGHT_THROUGH):
        return value
    k2 = _k2(logprob, ref_logprob)
    return k2 - k2.detach() + value.detach()


def apply_kl_in_reward(
    token_rewards: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
):
    """Subtract coef * KL from every real token's reward. Returns (new token rewards `(B, T)`,
    masked token mean of the KL as a 0-dim tensor, for the adaptive controller and metrics)."""
    kl = torch.where(mask.bool(), kl_penalty(logprob, ref_logprob, kind), 0.0)  # (B, T)
    return token_rewards - coef * kl, masked_mean(kl, mask)


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg_mode: str = "token-mean",
    num_global_tokens=None,
    num_global_seqs=None,
) -> torch.Tensor:
    """KL as a loss term (GRPO style) rather than in the reward: the aggregated per-token estimate."""
    kl = kl_penalty(logprob, ref_logprob, kind)  # (B, T)
    return agg_loss(kl, mask, agg_mode, num_global_tokens, num_global_seqs)


def top_k_forward_kl(student_top_k: torch.Tensor, teacher_top_k: torch.Tensor, mask: torch.Tensor,
                     agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None) -> torch.Tensor:
    """On-policy distillation toward the teacher's distribution: at each token the forward KL over the teacher's
    k likeliest tokens, sum_i p_teacher(i) (log p_teacher(i) - log p_student(i)), from the two models' log-probs
    of those tokens `(B, T, k)` (the teacher's mass outside them left out), aggregated as a loss."""
    kl = (teacher_top_k.exp() * (teacher_top_k - student_top_k)).sum(-1)  # (B, T)
    return agg_loss(kl, mask, agg_mode, num_global_tokens, num_global_seqs)


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, init_coef: float):
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, "Fine-tuning language
    models from human preferences", sec. 2.2): moves the coefficient so the KL tracks `target`."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target=} {horizon=}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """`current_kl`: the KL measured this step; `n_steps`: samples (or steps) since the last update."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"KL controller got a non-finite KL {current_kl}; the coefficient is left as is")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
