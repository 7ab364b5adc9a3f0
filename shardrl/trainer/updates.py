"""The update: actor and critic loss functions for the engine's `train_batch`, and the PPO epochs over
mini-batches. The config sections are read here, once, into the settings the pure losses of `shardrl.algos`
take; what the loss reads from a micro-batch is said by the caller (the step plan), not guessed from its keys.
"""

from __future__ import annotations

import torch

from shardrl.algos import LOSS_MODES, entropy_loss, kl_loss, value_loss
from shardrl.algos.kl import top_k_forward_kl
from shardrl.algos.aggregate import masked_metric, share_metric
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights
from shardrl.batch import Batch
from shardrl.engine.base import NonFiniteParametersError
from shardrl.metrics import Sum
from shardrl.plan.step_plan import StepPlan


def actor_loss_from_plan(actor_cfg, algo_cfg, plan: StepPlan):
    """The actor's loss for a step that follows `plan`."""
    return actor_loss_fn(actor_cfg, actor_cfg.loss_agg_mode, plan.old_from_update,
                         algo_cfg if plan.rollout_is == "loss" else None, batch_weights=plan.rollout_is == "batch",
                         with_ref=plan.uses_ref, distill_coef=algo_cfg.opd.top_k_coef if plan.distill_top_k else 0.0)


def actor_loss_fn(actor_cfg, agg_mode: str, old_from_forward: bool = False, rollout_is=None,
                  batch_weights: bool = False, with_ref: bool = False, distill_coef: float = 0.0):
    """The actor's loss. `old_from_forward` (`StepPlan.old_from_update`): the step's only update takes its old
    log-probs from this forward, detached, instead of `mb["old_log_probs"]`, and measures here what the trainer
    would have measured on them. The policy loss is `LOSS_MODES[actor_cfg.loss_mode]` with its settings from
    `actor_cfg`, weighted by `mb["rollout_is_weights"]` when `batch_weights`. `rollout_is` (the algorithm config,
    with `old_from_forward` only, truncate mode only): those weights are computed here from the detached forward
    against `mb["sampled_log_probs"]`, as `apply_rollout_is` would have computed them before the update, with
    its rollout_is/ metrics. `with_ref`: the micro-batch holds `ref_log_probs` (the KL loss reads them; with
    `old_from_forward` kl/actor_ref is measured here). `distill_coef` > 0: the micro-batch holds its teacher's top-k
    (`teacher_top_k_log_probs`, the forward's `distill_log_probs` the student's of the same tokens), and the loss adds
    `distill_coef` x their forward KL (algorithm.opd.top_k)."""
    mode = LOSS_MODES[actor_cfg.loss_mode]
    params = vars(mode.params_from(actor_cfg))
    if rollout_is is not None and (not old_from_forward or rollout_is.rollout_is_mode != "truncate"):
        raise ValueError("rollout_is weights are computed in the loss only from the update's own forward "
                         "(old_from_forward) and in truncate mode; otherwise the trainer adds them to the batch")

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        mask = mb["loss_mask"]
        old = outputs["log_probs"].detach() if old_from_forward else mb["old_log_probs"]
        weights = mb["rollout_is_weights"] if batch_weights else None
        is_metrics = {}
        if rollout_is is not None:
            weights, _, is_metrics = rollout_is_weights(
                old, mb["sampled_log_probs"], mask, rollout_is.rollout_is_level, "truncate",
                rollout_is.rollout_is_threshold, rollout_is.rollout_is_threshold_lower)
        loss, metrics = mode.fn(outputs["log_probs"], old, mb["advantages"], mask, **params, agg_mode=agg_mode,
                                num_global_tokens=num_tokens, num_global_seqs=num_seqs, weights=weights)
        # shardrl.metrics metrics of tensors: the engine adds them up over micro-batches and ranks, syncing once
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics.update({f"rollout_is/{k}": v for k, v in is_metrics.items()})
        if old_from_forward:
            # its maximum stays the separate pass's metric, as it always was (the engine could reduce it: a Max)
            mismatch = mismatch_metrics(old, mb["sampled_log_probs"], mask)
            metrics.update({f"rollout/{k}": v for k, v in mismatch.items() if k != "logprob_abs_diff_max"})
            if with_ref:
                metrics["kl/actor_ref"] = masked_metric(old - mb["ref_log_probs"], mask)
            # the sampling policy's token-mean entropy (the trainer asks this forward for it)
            metrics["actor/entropy"] = masked_metric(outputs["entropy"].detach(), mask)
        if actor_cfg.entropy_coeff:
            ent = entropy_loss(outputs["entropy"], mask, agg_mode, num_tokens, num_seqs)
            loss = loss - actor_cfg.entropy_coeff * ent
            # the loss's term (loss_agg_mode, averaged over the updates); actor/entropy is the sampling policy's
            metrics["actor/entropy_loss"] = share_metric(ent, mask, agg_mode, num_tokens, num_seqs)
        if actor_cfg.router_aux_loss_coef:  # per micro-batch, weighted by its share of the loss tokens
            share = mask.sum() / num_tokens
            loss = loss + actor_cfg.router_aux_loss_coef * outputs["router_aux_loss"] * share
            metrics["actor/router_aux_loss"] = Sum(outputs["router_aux_loss"].detach() * share)
        if actor_cfg.use_kl_loss:
            kl = kl_loss(outputs["log_probs"], mb["ref_log_probs"], mask, actor_cfg.kl_loss_type, agg_mode,
                         num_tokens, num_seqs)
            loss = loss + actor_cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = share_metric(kl, mask, agg_mode, num_tokens, num_seqs)
        if distill_coef:
            scored = mask[:, mask.shape[1] - mb["teacher_top_k_log_probs"].shape[1]:]  # (the responses' columns)
            distill = top_k_forward_kl(outputs["distill_log_probs"], mb["teacher_top_k_log_probs"], scored, agg_mode,
                                       num_tokens, num_seqs)
            loss = loss + distill_coef * distill
            metrics["distill/top_k_kl"] = share_metric(distill, scored, agg_mode, num_tokens, num_seqs)
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
