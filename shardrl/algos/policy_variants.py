"""The policy losses of 2025-26 beside PPO's clip, each with `policy_loss`'s signature less what it does not take,
and the formula and settings' names of verl's registered loss of the same name (`LOSS_MODES` picks one):

- "cispo" (MiniMax-M1, Chen et al. 2025, arXiv:2506.13585): REINFORCE on every token, weighted by the clipped
  importance ratio with its gradient stopped, -sg(clip(r, 1 - low, 1 + high)) * A * log pi. No token is dropped:
  a clipped token still pushes its log-prob with the capped weight (PPO's clip zeroes its gradient).
- "sapo" (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): the hard clip replaced by a
  smooth gate, -f(r) * A with f(r) = 4 / tau * sigmoid(tau * (r - 1)): slope 1 at r = 1 (PPO's gradient there),
  fading as r leaves 1, at a rate tau_pos for A > 0 and tau_neg otherwise.
- "geo_mean" (GMPO, Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): one ratio per
  sequence, the geometric mean of its token ratios, each token's log-ratio first clipped to [-low, high] on the
  side that matters for the advantage's sign; -A * exp(mean_t clipped log r). A is the sequence's mean advantage.
- "dppo_tv", "dppo_kl" (DPPO, Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
  arXiv:2602.04879): the ratio clip replaced by a mask on a divergence between the token's new and old
  probabilities, total variation |p - p_old| or the binary KL of (p_old, 1 - p_old) to (p, 1 - p); a token
  whose update would move that divergence past clip_ratio_high (A > 0) or clip_ratio_low (A <= 0) in the
  advantage's direction gives no gradient; the rest: REINFORCE weighted by the stopped ratio, truncated at
  clip_ratio_c (TIS), -sg(min(r, c)) * A * log pi.

Like verl, CISPO's and DPPO's loss value contains log pi itself, so their `pg_loss` is not on PPO's scale; its
gradient is what counts. All read padding through `torch.where`, so garbage there reaches neither the loss nor the
gradient.
"""

from __future__ import annotations

import torch

from shardrl.algos.aggregate import agg_loss, masked_metric, share_metric
from shardrl.algos.masked import masked_mean


def _real(logprob, old_logprob, mask):
    """The log-probs with padding replaced by 0 (so a NaN there has no gradient path) and the log-ratio."""
    real = mask.bool()
    logprob = torch.where(real, logprob, torch.zeros_like(logprob))  # (B, T)
    old_logprob = torch.where(real, old_logprob, torch.zeros_like(old_logprob))  # (B, T)
    return logprob, old_logprob, torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)


def _finish(pg, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs, clipfrac, clipfrac_lower):
    if weights is not None:
        pg = pg * weights  # (B, T)
    loss = agg_loss(pg, mask, agg_mode, num_global_tokens, num_global_seqs)
    metrics = {
        "pg_loss": share_metric(loss, mask, agg_mode, num_global_tokens, num_global_seqs),
        "pg_clipfrac": masked_metric(clipfrac.float(), mask),
        "pg_clipfrac_lower": masked_metric(clipfrac_lower.float(), mask),
        "ppo_kl": masked_metric(-log_ratio, mask),
    }
    return loss, metrics


def cispo_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
               agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None, weights=None):
    """CISPO: -sg(clip(r)) * A * log pi per token. "pg_clipfrac": tokens whose ratio was clipped (either side)."""
    logprob, _, log_ratio = _real(logprob, old_logprob, mask)
    ratio = torch.exp(log_ratio)  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    # the stop-gradient is the method: the weight is a constant, the gradient is REINFORCE's on every token
    pg = -clipped.detach() * advantages * logprob  # (B, T)
    return _finish(pg, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs,
                   ratio != clipped, torch.zeros_like(mask, dtype=torch.bool))


def sapo_loss(logprob, old_logprob, advantages, mask, tau_pos: float, tau_neg: float,
              agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None, weights=None):
    """SAPO: -4 / tau * sigmoid(tau * (r - 1)) * A per token, tau = tau_pos where A > 0, else tau_neg. Nothing is
    clipped: "pg_clipfrac" and "pg_clipfrac_lower" are 0 (as verl logs them)."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    _, _, log_ratio = _real(logprob, old_logprob, mask)
    ratio = torch.exp(log_ratio)  # (B, T)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)  # (B, T)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # (B, T)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(-gate * advantages, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs,
                   none, none)


def geo_mean_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
                  agg_mode: str = "token-mean", num_global_tokens=None, num_global_seqs=None, weights=None):
    """GMPO: the sequence's loss -A * exp(mean_t sgn(A) * min(sgn(A) log r, sgn(A) clip(log r, -low, high))) on
    each of its tokens, so "seq-mean-token-mean" is the paper's (and verl's) mean over sequences. `weights` `(B, T)`
    enter as their geometric mean over the sequence (verl's). "pg_clipfrac" / "pg_clipfrac_lower": tokens whose
    log-ratio left [-low, high] with A > 0 / A < 0."""
    _, _, log_ratio = _real(logprob, old_logprob, mask)
    sign = torch.sign(advantages)  # (B, T)
    log_clipped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)  # (B, T)
    # the pessimistic side, as PPO's max of the two losses: the clip binds only where it lowers the objective
    log_r = sign * torch.minimum(sign * log_ratio, sign * log_clipped)  # (B, T)
    seq_ratio = torch.exp(masked_mean(log_r, mask, dim=-1))[:, None]  # (B, 1)
    adv = masked_mean(advantages, mask, dim=-1)[:, None]  # (B, 1)
    pg = (-adv * seq_ratio).expand(logprob.shape)  # (B, T)
    if weights is not None:
        log_w = torch.log(weights.clamp(min=1e-10))
        weights = torch.exp(masked_mean(log_w, mask, dim=-1))[:, None].expand(logprob.shape)  # (B, T)
    clipped = log_ratio != log_clipped
    return _finish(pg, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs,
                   clipped & (advantages > 0), clipped & (advantages < 0))


def _dppo(valid, logprob, log_ratio, advantages, mask, clip_ratio_c, weights, agg_mode, num_global_tokens,
          num_global_seqs):
    ratio = torch.exp(log_ratio)  # (B, T)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()  # (B, T), TIS
    pg = -advantages * truncated * logprob * valid.detach().to(logprob.dtype)  # (B, T)
    return _finish(pg, log_ratio, mask, weights, agg_mode, num_global_tokens, num_global_seqs,
                   ~valid, (ratio > clip_ratio_c) & valid)


def dppo_tv_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: float = 20.0, agg_mode: str = "token-mean", num_global_tokens=None,
                 num_global_seqs=None, weights=None):
    """DPPO-Binary-TV: a token gives gradient unless p - p_old > clip_ratio_high (A > 0) or < -clip_ratio_low
    (A <= 0). "pg_clipfrac": tokens masked; "pg_clipfrac_lower": kept tokens whose ratio was truncated at
    clip_ratio_c (verl's)."""
    logprob, old_logprob, log_ratio = _real(logprob, old_logprob, mask)
    diff = torch.exp(logprob) - torch.exp(old_logprob)  # (B, T)
    valid = torch.where(advantages > 0, diff <= clip_ratio_high, diff >= -clip_ratio_low)  # (B, T)
    return _dppo(valid, logprob, log_ratio, advantages, mask, clip_ratio_c, weights, agg_mode, num_global_tokens,
                 num_global_seqs)


def dppo_kl_loss(logprob, old_logprob, advantages, mask, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: float = 20.0, agg_mode: str = "token-mean", num_global_tokens=None,
                 num_global_seqs=None, weights=None):
    """DPPO-Binary-KL: KL(Bern(p_old) || Bern(p)) past clip_ratio_high while p rises (A > 0), or past
    clip_ratio_low while p falls (A <= 0), masks the token. Metrics as `dppo_tv_loss`."""
    logprob, old_logprob, log_ratio = _real(logprob, old_logprob, mask)
    p, p_old = torch.exp(logprob), torch.exp(old_logprob)  # (B, T)
    kl = p_old * (old_logprob - logprob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(advantages > 0, (kl <= clip_ratio_high) | (p <= p_old), (kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(valid, logprob, log_ratio, advantages, mask, clip_ratio_c, weights, agg_mode, num_global_tokens,
                 num_global_seqs)

