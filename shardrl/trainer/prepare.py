"""What happens to a scored batch before the update, as the step plan says: the old log-probs (unless the update
takes them from its own forward), the reference's, the critic's values, the advantages, and rollout correction.

The config sections are read here, once, and turned into the scalars the pure functions of `shardrl.algos` take.
Metrics are this rank's (`shardrl.metrics`), for `reduce_metrics`.
"""

from __future__ import annotations

import time

import torch

from shardrl.algos import ADVANTAGE_ESTIMATORS, apply_kl_in_reward, masked_whiten, scores_to_token_rewards
from shardrl.algos.aggregate import masked_metric
from shardrl.batch import Batch
from shardrl.distributed import all_reduce_sum
from shardrl.engine.base import DISTILL_IDS_KEY
from shardrl.models.config import text_config
from shardrl.metrics import Max, Min, SumCount
from shardrl.plan.step_plan import StepPlan
from shardrl.trainer.sampling import apply_rollout_is, mismatch_step_metrics


def prepare(batch: Batch, scores: torch.Tensor, plan: StepPlan, roles, algo_cfg, kl_coef: float,
            temperature: float) -> dict:
    """Adds to `batch` what the update reads (`old_log_probs`, `ref_log_probs`, `old_values`, `advantages`,
    `returns`, `rollout_is_weights`, as `plan` needs them); returns metrics. `roles`: the run's engines."""
    metrics, t0 = {}, time.perf_counter()
    if not plan.old_from_update:  # else the update's forward gives them and these metrics
        old = roles.actor.infer_batch(batch, temperature=temperature, with_entropy=True,
                                      record_routing=plan.router_replay == "R2",
                                      replay_routing=plan.router_replay == "R3")
        batch["old_log_probs"] = old["log_probs"].cpu()
        if "routed_experts" in old:  # the update forwards are routed as this pass was (R2)
            batch["routed_experts"] = old["routed_experts"].cpu()
        metrics["actor/entropy"] = masked_metric(old["entropy"].cpu(), batch["loss_mask"].float())  # sampling's
        metrics.update(mismatch_step_metrics(batch))  # rollout/logprob_abs_diff (and _max), rollout/kl, k3_kl
        metrics["timing/old_log_prob_s"] = time.perf_counter() - t0
    if plan.uses_ref:
        t0 = time.perf_counter()
        batch["ref_log_probs"] = roles.ref.infer_batch(batch, temperature=temperature)["log_probs"].cpu()
        if not plan.old_from_update:
            metrics["kl/actor_ref"] = masked_metric(batch["old_log_probs"] - batch["ref_log_probs"],
                                                    batch["loss_mask"].float())
        metrics["timing/ref_s"] = time.perf_counter() - t0
    if plan.uses_teacher:  # scored like the reference: the sampled tokens, at the sampler's temperature
        t0 = time.perf_counter()
        # (a teacher's head may have more rows than the student's, as Qwen2.5's larger models have: its top-k is
        # taken among the ids the student can score)
        vocab = text_config(roles.actor.hf_config).vocab_size if plan.distill_top_k else None
        scored = roles.teacher.infer_batch(batch, temperature=temperature, with_top1=True, top_k=plan.distill_top_k,
                                           top_k_vocab=vocab)
        batch["teacher_log_probs"] = scored["log_probs"].cpu()
        metrics.update(distill_metrics(batch["old_log_probs"], batch["teacher_log_probs"], batch["loss_mask"].float(),
                                       scored["top1"].cpu()))
        if plan.distill_top_k:  # the targets of the update's top-k term (`DISTILL_IDS_KEY` is what it scores)
            batch[DISTILL_IDS_KEY] = scored["top_k_ids"].cpu()
            batch["teacher_top_k_log_probs"] = scored["top_k_log_probs"].cpu()
            mass = batch["teacher_top_k_log_probs"].exp().sum(-1)  # (B, R): the responses' columns
            metrics["distill/top_k_mass"] = masked_metric(mass, batch["loss_mask"][:, -mass.shape[1]:].float())
        metrics["timing/teacher_s"] = time.perf_counter() - t0
    if plan.needs_critic:
        t0 = time.perf_counter()
        batch["old_values"] = roles.critic.infer_batch(batch)["values"].cpu()
        metrics["timing/values_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics.update(compute_advantages(batch, scores, algo_cfg, kl_coef, roles.mesh.dp_group, plan))
    metrics["timing/adv_s"] = time.perf_counter() - t0
    # after the advantages: a rejected sample still counts in its group's baseline; without the old pass, the
    # update's loss computes the weights from its own forward
    if plan.rollout_is == "batch":
        metrics.update(apply_rollout_is(batch, algo_cfg))
    return {k: _floats(v) for k, v in metrics.items()}


def distill_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, top1: torch.Tensor) -> dict:
    """On-policy distillation's per-token means over real tokens, as (sum, count): `distill/reverse_kl`, the
    sampled-token estimate of KL(student || teacher), log p_student - log p_teacher; and the teacher's agreement
    with the samples, `distill/teacher_log_prob` (its mean log-prob of them: 0 when it would sample them surely)
    and `distill/teacher_argmax_agree` (the share of them that are the teacher's argmax, `top1` 1.0: the student
    sampled what the teacher would say greedily)."""
    return {"distill/reverse_kl": masked_metric(student - teacher, mask),
            "distill/teacher_log_prob": masked_metric(teacher, mask),
            "distill/teacher_argmax_agree": masked_metric(top1, mask)}


def _floats(metric):
    """A metric of CPU tensors as one of floats (what the trainer's step metrics hold)."""
    return type(metric)(*map(float, metric)) if isinstance(metric, tuple) else metric


def global_masked_stats(values: torch.Tensor, mask: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of `values` over the real tokens of every rank in `group`."""
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    count, total, squares = all_reduce_sum(torch.stack([m.sum(), v.sum(), (v * v).sum()]), group).tolist()
    mean = total / max(count, 1.0)
    var = (squares - count * mean * mean) / max(count - 1.0, 1.0)
    return torch.tensor(mean, dtype=values.dtype), torch.tensor(max(var, 0.0), dtype=values.dtype)


def compute_advantages(batch: Batch, scores: torch.Tensor, algo_cfg, kl_coef: float, dp_group=None,
                       plan: StepPlan | None = None) -> dict:
    """Adds `advantages` and `returns` (B, T) to `batch`; returns metrics (token means as this rank's SumCount).
    The estimator is `plan.estimator` (default: `algorithm.adv_estimator`'s); one that whitens does so over
    the whole batch of all `dp_group` ranks."""
    estimator = plan.estimator if plan is not None else ADVANTAGE_ESTIMATORS[algo_cfg.adv_estimator]
    mask = batch["loss_mask"].float()
    metrics = {}
    token_rewards = scores_to_token_rewards(scores, mask)  # (B, T)
    if algo_cfg.use_kl_in_reward:
        token_rewards, mean_kl = apply_kl_in_reward(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                    mask, kl_coef, algo_cfg.kl_penalty)
        num_tokens = float(mask.sum())
        metrics.update({"kl/in_reward": SumCount(float(mean_kl) * num_tokens, num_tokens), "kl/coef": kl_coef})
    inputs = {"token_rewards": token_rewards, "scores": token_rewards.sum(-1), "mask": mask,
              "index": batch["prompt_index"], "values": batch["old_values"] if estimator.needs_critic else None,
              "gamma": algo_cfg.gamma, "lam": algo_cfg.lam, "norm_by_std": algo_cfg.norm_adv_by_std_in_grpo}
    if estimator.needs_teacher:
        inputs.update(old_log_probs=batch["old_log_probs"], teacher_log_probs=batch["teacher_log_probs"],
                      kl_coef=algo_cfg.opd.kl_coef, reward_coef=algo_cfg.opd.reward_coef,
                      baseline=algo_cfg.opd.baseline)
    adv, ret = estimator.compute(inputs)
    if estimator.whiten:
        adv = masked_whiten(adv, mask, stats=global_masked_stats(adv, mask, dp_group))
    if estimator.returns_are_advantages:
        ret = adv
    batch["advantages"], batch["returns"] = adv, ret
    metrics["adv/mean"] = _floats(masked_metric(adv, mask))
    metrics["adv/abs_mean"] = _floats(masked_metric(adv.abs(), mask))
    metrics.update(value_metrics(token_rewards, adv, ret, batch["old_values"] if estimator.needs_critic else None,
                                 mask, dp_group))
    return metrics


def value_metrics(token_rewards: torch.Tensor, adv: torch.Tensor, ret: torch.Tensor, values: torch.Tensor | None,
                  mask: torch.Tensor, dp_group=None) -> dict:
    """verl's critic/ statistics of a batch: each sequence's reward (token rewards summed, the in-reward KL
    included), and the advantages, returns and (with a critic) values over real tokens: mean, max, min; and the
    share of the returns' variance the values explain, `critic/vf_explained_var` (over every rank's tokens)."""
    has = mask > 0  # (B, T)
    out = {}
    for name, value, per_token in (("rewards", token_rewards.sum(-1), False), ("advantages", adv, True),
                                   ("returns", ret, True), ("values", values, True)):
        if value is None:
            continue
        real = value[has] if per_token else value
        if real.numel() == 0:
            continue
        out[f"critic/{name}/mean"] = SumCount(float(real.sum()), float(real.numel()))
        out[f"critic/{name}/max"], out[f"critic/{name}/min"] = Max(float(real.max())), Min(float(real.min()))
    if values is not None:
        _, residual_var = global_masked_stats(ret - values, mask, dp_group)
        _, return_var = global_masked_stats(ret, mask, dp_group)
        out["critic/vf_explained_var"] = float(1.0 - residual_var / (return_var + 1e-5))  # the same on every rank
    return out
