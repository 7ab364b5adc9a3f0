"""What happens to a rollout batch after rewards: advantages, then actor and critic updates.

Each function takes tensors, plain numbers and an engine; the config sections are read here, once, and
turned into the scalars the pure algorithm functions in `shardrl.algos` take.
"""

from __future__ import annotations

import torch

from shardrl.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    apply_kl_in_reward,
    entropy_loss,
    kl_loss,
    masked_whiten,
    scores_to_token_rewards,
    value_loss,
)
from shardrl.algos.aggregate import masked_metric, share_metric
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights
from shardrl.batch import Batch
from shardrl.distributed import all_reduce_sum
from shardrl.engine.base import NonFiniteParametersError
from shardrl.trainer.metrics import SumCount


def global_masked_stats(values: torch.Tensor, mask: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of `values` over the real tokens of every rank in `group`."""
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    count, total, squares = all_reduce_sum(torch.stack([m.sum(), v.sum(), (v * v).sum()]), group).tolist()
    mean = total / max(count, 1.0)
    var = (squares - count * mean * mean) / max(count - 1.0, 1.0)
    return torch.tensor(mean, dtype=values.dtype), torch.tensor(max(var, 0.0), dtype=values.dtype)


def compute_advantages(batch: Batch, scores: torch.Tensor, algo_cfg, kl_coef: float, dp_group=None) -> dict:
    """Adds `advantages` and `returns` (B, T) to `batch`; returns metrics (token means as this rank's
    SumCount, for `reduce_over_ranks`). Estimators that whiten over the batch (GAE, REINFORCE++ and its
    baseline variant) whiten over the whole batch of all `dp_group` ranks."""
    mask = batch["loss_mask"].float()
    metrics = {}
    token_rewards = scores_to_token_rewards(scores, mask)  # (B, T)
    if algo_cfg.use_kl_in_reward:
        token_rewards, mean_kl = apply_kl_in_reward(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                    mask, kl_coef, algo_cfg.kl_penalty)
        num_tokens = float(mask.sum())
        metrics.update({"kl/in_reward": SumCount(float(mean_kl) * num_tokens, num_tokens), "kl/coef": kl_coef})
    name = algo_cfg.adv_estimator
    index = batch["prompt_index"]
    fn = ADVANTAGE_ESTIMATORS[name]
    if name == "gae":
        adv, ret = fn(token_rewards, batch["old_values"], mask, algo_cfg.gamma, algo_cfg.lam, whiten=False)
    elif name == "grpo":
        adv, ret = fn(token_rewards.sum(-1), mask, index, norm_by_std=algo_cfg.norm_adv_by_std_in_grpo)
    elif name == "reinforce_plus_plus":
        adv, ret = fn(token_rewards, mask, algo_cfg.gamma, whiten=False)
    elif name == "reinforce_plus_plus_baseline":
        adv, ret = fn(token_rewards.sum(-1), mask, index, whiten=False)
        ret = adv
    else:  # rloo: per-sample scores and groups, no whitening
        adv, ret = fn(token_rewards.sum(-1), mask, index)
    if name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = masked_whiten(adv, mask, stats=global_masked_stats(adv, mask, dp_group))
        if name == "reinforce_plus_plus_baseline":
            ret = adv
    batch["advantages"], batch["returns"] = adv, ret
    metrics["adv/mean"] = SumCount(*map(float, masked_metric(adv, mask)))
    metrics["adv/abs_mean"] = SumCount(*map(float, masked_metric(adv.abs(), mask)))
    return metrics


def actor_loss_fn(actor_cfg, agg_mode: str, old_from_forward: bool = False, rollout_is=None):
    """The actor's loss. `old_from_forward` (the trainer decides: `defaults.old_log_probs_from_update`):
    the step's only update takes its old log-probs from this forward, detached, instead of
    `mb["old_log_probs"]`, and measures here what the trainer would have measured on them. The policy loss is
    `POLICY_LOSSES[actor_cfg.loss_mode]`, weighted by `mb["rollout_is_weights"]` when the batch has them.
    `rollout_is` (the algorithm config, with `old_from_forward` only, truncate mode only): those weights are
    computed here from the detached forward against `mb["sampled_log_probs"]`, as `apply_rollout_is` would
    have computed them before the update, with its rollout_is/ metrics."""
    policy_loss = POLICY_LOSSES[actor_cfg.loss_mode]
    if rollout_is is not None and (not old_from_forward or rollout_is.rollout_is_mode != "truncate"):
        raise ValueError("rollout_is weights are computed in the loss only from the update's own forward "
                         "(old_from_forward) and in truncate mode; otherwise the trainer adds them to the batch")

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        mask = mb["loss_mask"]
        old = outputs["log_probs"].detach() if old_from_forward else mb["old_log_probs"]
        weights = mb["rollout_is_weights"] if "rollout_is_weights" in mb else None
        is_metrics = {}
        if rollout_is is not None:
            weights, _, is_metrics = rollout_is_weights(
                old, mb["sampled_log_probs"], mask, rollout_is.rollout_is_level, "truncate",
                rollout_is.rollout_is_threshold, rollout_is.rollout_is_threshold_lower)
        loss, metrics = policy_loss(outputs["log_probs"], old, mb["advantages"], mask,
                                    actor_cfg.clip_ratio_low, actor_cfg.clip_ratio_high, actor_cfg.clip_ratio_c,
                                    agg_mode, num_tokens, num_seqs, weights=weights)
        # (sum, count) tensor pairs: the engine adds them up over micro-batches and ranks, syncing once
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics.update({f"rollout_is/{k}": v for k, v in is_metrics.items()})
        if old_from_forward:
            mismatch = mismatch_metrics(old, mb["sampled_log_probs"], mask)  # its max needs a max over ranks: not here
            metrics.update({f"rollout/{k}": v for k, v in mismatch.items() if k != "logprob_abs_diff_max"})
            if "ref_log_probs" in mb:
                metrics["kl/actor_ref"] = masked_metric(old - mb["ref_log_probs"], mask)
            # the sampling policy's token-mean entropy (the trainer asks this forward for it)
            metrics["actor/entropy"] = masked_metric(outputs["entropy"].detach(), mask)
        if actor_cfg.entropy_coeff:
            ent = entropy_loss(outputs["entropy"], mask, agg_mode, num_tokens, num_seqs)
            loss = loss - actor_cfg.entropy_coeff * ent
            # the loss's term (loss_agg_mode, averaged over the updates); actor/entropy is the sampling policy's
            metrics["actor/entropy_loss"] = share_metric(ent, mask, agg_mode, num_tokens, num_seqs)
        if actor_cfg.use_kl_loss:
            kl = kl_loss(outputs["log_probs"], mb["ref_log_probs"], mask, actor_cfg.kl_loss_type, agg_mode,
                         num_tokens, num_seqs)
            loss = loss + actor_cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = share_metric(kl, mask, agg_mode, num_tokens, num_seqs)
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic_cfg, agg_mode: str):
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        loss, metrics = value_loss(outputs["values"], mb["old_values"], mb["returns"], mb["loss_mask"],
                                   critic_cfg.cliprange_value, agg_mode, num_tokens, num_seqs)
        return loss, {f"critic/{k}": v for k, v in metrics.items()}

    return loss_fn


def run_updates(engine, batch: Batch, loss_fn, mini_batch_samples: int, epochs: int, shuffle: bool,
                generator: torch.Generator, prefix: str, temperature: float = 1.0,
                with_entropy: bool = False) -> dict[str, float]:
    """`epochs` passes over `batch` in mini-batches of `mini_batch_samples` (per rank), one optimizer step
    each; metrics are averaged over the steps. Parameters a step left non-finite stop the run with a
    NonFiniteParametersError that names the learning rate to lower (`<prefix>.optim.lr`)."""
    totals: dict[str, float] = {}
    num_steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=generator) if shuffle else torch.arange(len(batch))
        for mb in batch.reorder(order).split(mini_batch_samples):
            try:
                metrics = engine.train_batch(mb, loss_fn, temperature=temperature, with_entropy=with_entropy)
            except NonFiniteParametersError as e:
                raise NonFiniteParametersError(f"{prefix} update: {e}; lower {prefix}.optim.lr "
                                               f"(now {engine.optim_cfg.lr:g})") from None
            for k, v in metrics.items():
                key = k if "/" in k else f"{prefix}/{k}"
                totals[key] = totals.get(key, 0.0) + v
            num_steps += 1
    return {k: v / max(num_steps, 1) for k, v in totals.items()}
