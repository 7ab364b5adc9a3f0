"""Rollout-training mismatch: the fast sampler's log-probs are not exactly the training engine's (bf16
kernels, another attention; measured: bench/RESULTS.md, "Current figures: Fast rollout", the health metric),
so the policy that sampled a response is
not quite the policy the PPO ratio is taken against. Importance weights between the two correct for it
(verl's `rollout_is*` keys; Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL
training", Liu, Li et al. 2025 "When speed kills stability").

All functions take per-token `(B, T)` tensors: `old_log_probs` (the training engine's recomputation, the
policy PPO's ratio is taken against), `sampled_log_probs` (the sampler's), `mask` (real response tokens).
"""

from __future__ import annotations

import torch

from shardrl.algos.masked import masked_sum
from shardrl.metrics import Max, SumCount

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask", "reject")


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    sampled_log_probs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Importance weights pi_train / pi_sampler, detached, `(B, T)`, and the loss mask to use, `(B, T)`.

    level: "token" (TIS: one ratio per token), "sequence" (the product of a sequence's token ratios, on
    every token of it), "geometric" (their geometric mean, exp(mean log ratio): length-independent).
    mode: "truncate" caps the weights at `threshold` (TIS); "mask" keeps them and drops from the loss mask
    what leaves the band [threshold_lower, threshold] (a token at level token, the whole sequence otherwise:
    MIS; at level token IcePop's masking), whose weight becomes 0; "reject" drops the same and weighs what stays
    by 1 (rejection alone, verl's `rollout_rs` without `rollout_is`). `threshold_lower` None is 1 / threshold.

    Metrics (sum, count) pairs over real tokens: "weight_mean" (after truncation/masking), "truncated_frac"
    and "masked_frac" (tokens whose weight was capped / dropped).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is_level {level!r}; choose one of {IS_LEVELS}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown rollout_is_mode {mode!r}; choose one of {IS_MODES}")
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    real = mask.bool()
    log_ratio = torch.where(real, (old_log_probs - sampled_log_probs).detach().double(), 0.0)  # (B, T)
    if level == "token":
        log_w = log_ratio
    else:
        seq = log_ratio.sum(-1, keepdim=True)  # (B, 1)
        if level == "geometric":
            seq = seq / mask.sum(-1, keepdim=True).clamp(min=1)
        log_w = seq.expand_as(log_ratio)  # (B, T)
    weights = torch.exp(log_w.clamp(-20.0, 20.0))  # (B, T)
    zeros = torch.zeros_like(weights)
    if mode == "truncate":
        truncated = (weights > threshold) & real
        masked = zeros.bool()
        weights = weights.clamp(max=threshold)
        new_mask = mask
    else:
        truncated = zeros.bool()
        masked = ((weights > threshold) | (weights < lower)) & real
        kept = weights if mode == "mask" else torch.ones_like(weights)
        weights = torch.where(masked, zeros, kept)
        new_mask = mask * (~masked).to(mask.dtype)
    weights = torch.where(real, weights, zeros).to(old_log_probs.dtype)
    count = mask.sum().double()
    metrics = {
        "weight_mean": SumCount(masked_sum(weights.double(), mask), count),
        "truncated_frac": SumCount(truncated.double().sum(), count),
        "masked_frac": SumCount(masked.double().sum(), count),
    }
    return weights, new_mask, metrics


def mismatch_metrics(old_log_probs: torch.Tensor, sampled_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the sampler is from the trainer, as metrics (`shardrl.metrics`):

    "logprob_abs_diff": mean |log pi_train - log pi_sampler| over real tokens;
    "logprob_abs_diff_max": its largest value (a `Max`);
    "kl": KL(sampler || trainer) per sequence, the sum of its tokens' log pi_sampler - log pi_train (the
    responses were drawn from the sampler, so this is the k1 estimator), averaged over sequences;
    "k3_kl": the same with the non-negative k3 estimator, per token, averaged over real tokens. Its log-ratio is
    clamped to [-20, 20] first (so exp cannot overflow on a padded or wildly stale token); verl's does not clamp,
    so the two differ only for a token whose sampler and trainer log-probs are more than 20 nats apart.
    """
    real = mask.bool()
    diff = torch.where(real, (sampled_log_probs - old_log_probs).detach().double(), 0.0)  # (B, T)
    count = mask.sum().double()
    num_seqs = (mask.sum(-1) > 0).double().sum()
    k3 = torch.where(real, torch.expm1(-diff.clamp(-20.0, 20.0)) + diff, 0.0)  # r - 1 - log r, r = p_t / p_s
    return {
        "logprob_abs_diff": SumCount(diff.abs().sum(), count),
        "logprob_abs_diff_max": Max(diff.abs().max() if diff.numel() else diff.new_zeros(())),
        "kl": SumCount(diff.sum(), num_seqs),
        "k3_kl": SumCount(k3.sum(), count),
    }
