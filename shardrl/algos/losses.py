"""Actor and critic losses: pure functions of per-token tensors `(B, T)` and scalars.

Each returns the scalar to backpropagate, aggregated by `agg_loss` (pass the global token / sequence
counts when the batch is one micro-batch of a larger mini-batch), and a dict of metrics, each a detached
(sum, count) pair of 0-dim tensors that the engine adds up over micro-batches and ranks before it divides
(`shardrl.metrics.metric_value`): a token fraction is (tokens where it holds, real tokens); a loss
is `share_metric` of its share, so it comes out as the mini-batch loss whatever the cut.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from shardrl.algos.aggregate import agg_loss, masked_metric, share_metric


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c=None,
    agg_mode: str = "token-mean",
    num_global_tokens=None,
    num_global_seqs=None,
    weights=None,
):
    """PPO clipped surrogate with asymmetric bounds (clip-higher, DAPO) and optional dual-clip.

    ratio = exp(logprob - old_logprob), clipped to [1 - clip_ratio_low, 1 + clip_ratio_high];
    per token pg = max(-A * ratio, -A * clipped ratio). With `clip_ratio_c` (> 1, dual-clip,
    Ye et al. 2020) a token with A < 0 is further bounded: pg = min(pg, -A * clip_ratio_c), so a huge
    ratio on a bad action cannot blow the loss up. `weights` `(B, T)` (rollout-mismatch importance weights,
    `shardrl.algos.rollout_correction`) multiply each token's loss.

    Metrics: "pg_loss" (the loss), "pg_clipfrac" (tokens where the clipped term is the larger),
    "pg_clipfrac_lower" (tokens where the dual-clip bound is active), "ppo_kl" (mean of old - new log-prob).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
    # Clamp so a stale or padded log-prob cannot overflow exp.
    log_ratio = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    pg_unclipped = -advantages * ratio  # (B, T)
    pg_clipped = -advantages * clipped_ratio  # (B, T)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    clipfrac = masked_metric((pg_clipped > pg_unclipped).float(), mask)

    if clip_ratio_c is not None:
        pg_dual = -advantages * clip_ratio_c  # (B, T)
        negative = advantages < 0  # (B, T)
        clipfrac_lower = masked_metric(((pg > pg_dual) & negative).float(), mask)
        pg = torch.where(negative, torch.minimum(pg, pg_dual), pg)  # (B, T)
    else:
        clipfrac_lower = masked_metric(torch.zeros_like(pg), mask)
    if weights is not None:
        pg = pg * weights  # (B, T)

    loss = agg_loss(pg, mask, agg_mode, num_global_tokens, num_global_seqs)
    metrics = {
        "pg_loss": share_metric(loss, mask, agg_mode, num_global_tokens, num_global_seqs),
        "pg_clipfrac": clipfrac,
        "pg_clipfrac_lower": clipfrac_lower,
        "ppo_kl": masked_metric(-log_ratio, mask),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value=None,
    agg_mode: str = "token-mean",
    num_global_tokens=None,
    num_global_seqs=None,
):
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2), aggregated.

    `cliprange_value=None` turns clipping off (plain 0.5 * (v - R)^2). Metrics: "vf_loss" (the loss),
    "vf_clipfrac" (tokens where the clipped term is the larger).
    """
    unclipped = (values - returns) ** 2  # (B, T)
    if cliprange_value is None:
        per_token, clipfrac = unclipped, masked_metric(torch.zeros_like(unclipped), mask)
    else:
        low, high = old_values - cliprange_value, old_values + cliprange_value  # (B, T)
        values_clipped = torch.clamp(values, low, high)  # (B, T)
        clipped = (values_clipped - returns) ** 2  # (B, T)
        per_token = torch.maximum(unclipped, clipped)  # (B, T)
        clipfrac = masked_metric((clipped > unclipped).float(), mask)
    loss = 0.5 * agg_loss(per_token, mask, agg_mode, num_global_tokens, num_global_seqs)
    return loss, {"vf_loss": share_metric(loss, mask, agg_mode, num_global_tokens, num_global_seqs),
                  "vf_clipfrac": clipfrac}


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str = "token-mean",
    num_global_tokens=None,
    num_global_seqs=None,
) -> torch.Tensor:
    """The aggregated per-token entropy `(B, T)`; the caller subtracts coef * this to reward entropy."""
    return agg_loss(entropy, mask, agg_mode, num_global_tokens, num_global_seqs)


from shardrl.algos.gspo import gspo_loss, gspo_token_loss  # noqa: E402  (gspo imports aggregate only)
from shardrl.algos.policy_variants import (  # noqa: E402  (imports aggregate only)
    cispo_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    geo_mean_loss,
    sapo_loss,
)


@dataclass(frozen=True)
class ClipParams:
    """The vanilla PPO loss's settings (named as the actor config's keys, which fill them)."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None = None


@dataclass(frozen=True)
class SequenceClipParams:
    """A clip range, no dual clip: GSPO's, CISPO's (the range of its stopped weight), GMPO's (in log space)."""

    clip_ratio_low: float
    clip_ratio_high: float


@dataclass(frozen=True)
class GateParams:
    """SAPO's settings: the gate's temperature for tokens with positive and with other advantages."""

    tau_pos: float
    tau_neg: float


@dataclass(frozen=True)
class LossMode:
    """A policy loss and the frozen dataclass of the settings it takes. Its call is
    `fn(logprob, old_logprob, advantages, mask, **vars(params), agg_mode=..., num_global_tokens=...,
    num_global_seqs=..., weights=...)` -> (loss, metrics)."""

    fn: Callable
    params: type

    def params_from(self, section) -> object:
        """The settings from the same-named fields of a config section (the actor's)."""
        return self.params(**{f.name: getattr(section, f.name) for f in dataclasses.fields(self.params)})


LOSS_MODES = {
    "vanilla": LossMode(policy_loss, ClipParams),
    "gspo": LossMode(gspo_loss, SequenceClipParams),
    "gspo_token": LossMode(gspo_token_loss, SequenceClipParams),
    "cispo": LossMode(cispo_loss, SequenceClipParams),
    "sapo": LossMode(sapo_loss, GateParams),
    "geo_mean": LossMode(geo_mean_loss, SequenceClipParams),
    "dppo_tv": LossMode(dppo_tv_loss, ClipParams),  # clip_ratio_low/high: divergence bounds; _c: the TIS cap
    "dppo_kl": LossMode(dppo_kl_loss, ClipParams),
}
"""Policy losses by `actor.loss_mode`; a new one is a function, its settings' dataclass and a line here."""
POLICY_LOSSES = {name: mode.fn for name, mode in LOSS_MODES.items()}
"""The functions alone, by name."""
