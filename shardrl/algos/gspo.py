"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per sequence, the
length-normalized product of its token ratios, s = exp(mean_t(log pi - log pi_old)), clipped per sequence.

Two modes beside the vanilla PPO loss, with `policy_loss`'s signature less the dual clip (`LOSS_MODES` picks one
by name and passes its `SequenceClipParams`):
- "gspo": the sequence objective max(-A s, -A clip(s)) with A the sequence's advantage (the mean of its
  tokens' advantages: GRPO gives every token the same one).
- "gspo_token": GSPO-token, verl's `loss_mode=gspo`: a ratio per token, sg[s] * pi_t / sg[pi_t], equal to s
  in value, whose gradient flows through each token with that token's own advantage. With one advantage per
  sequence and "seq-mean-token-mean" aggregation its loss and gradient equal "gspo"'s.

The sequence ratio needs a whole sequence in one call: the engine cuts micro-batches between sequences
(padded rows or packed ones alike), and under Ulysses sequence parallelism the loss sees whole gathered rows,
so both modes hold there. The paper aggregates with "seq-mean-token-mean" (actor.loss_agg_mode) and clips
tightly (clip_ratio_low=3e-4, clip_ratio_high=4e-4). There is no dual-clip (`clip_ratio_c` is not taken).
"""

from __future__ import annotations

import torch

from shardrl.algos.aggregate import agg_loss, masked_metric, share_metric
from shardrl.algos.masked import masked_mean


def _seq_log_ratio(logprob, old_logprob, mask):
    real = mask.bool()
    log_ratio = torch.where(real, logprob - old_logprob, torch.zeros_like(logprob))  # (B, T)
    return log_ratio, log_ratio.sum(-1) / mask.sum(-1).clamp(min=1).to(logprob.dtype)  # (B, T), (B,)


def _finish(pg_unclipped, pg_clipped, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs):
    pg = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    if weights is not None:
        pg = pg * weights
    loss = agg_loss(pg, mask, agg_mode, num_global_tokens, num_global_seqs)
    metrics = {
        "pg_loss": share_metric(loss, mask, agg_mode, num_global_tokens, num_global_seqs),
        "pg_clipfrac": masked_metric((pg_clipped > pg_unclipped).float(), mask),
        "pg_clipfrac_lower": masked_metric(torch.zeros_like(pg), mask),
        "ppo_kl": masked_metric(-log_ratio, mask),
    }
    return loss, metrics


def gspo_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
              agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None,
              weights=None):
    """GSPO's sequence-level clipped objective; every token of a sequence carries the sequence's loss, so
    "seq-mean-token-mean" gives the paper's mean over sequences. `weights` `(B, T)` (rollout correction)
    multiply the per-token loss. Metrics as `policy_loss` ("pg_clipfrac": tokens of clipped sequences)."""
    log_ratio, seq_log_ratio = _seq_log_ratio(logprob, old_logprob, mask)
    ratio = torch.exp(seq_log_ratio.clamp(max=10.0))[:, None]  # (B, 1)
    adv = masked_mean(advantages, mask, dim=-1)[:, None]  # (B, 1)
    shape = logprob.shape
    pg_unclipped = (-adv * ratio).expand(shape)  # (B, T)
    pg_clipped = (-adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)).expand(shape)  # (B, T)
    return _finish(pg_unclipped, pg_clipped, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs)


def gspo_token_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
                    agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None,
                    weights=None):
    """GSPO-token: the token ratio sg[s] * exp(logprob - sg[logprob]) (value s, gradient per token), clipped
    like s, each token with its own advantage (verl's `compute_policy_loss_gspo`)."""
    log_ratio, seq_log_ratio = _seq_log_ratio(logprob, old_logprob, mask)
    log_token_ratio = logprob - logprob.detach() + seq_log_ratio.detach()[:, None]  # (B, T)
    ratio = torch.exp(log_token_ratio.clamp(max=10.0))  # (B, T)
    pg_unclipped = -advantages * ratio  # (B, T)
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    return _finish(pg_unclipped, pg_clipped, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs)
