"""What the trainer does between sampling and the update for DAPO and rollout correction: dynamic sampling
(generate until a step has enough informative groups) and the rollout-training mismatch metrics and importance
weights. The algorithms are `shardrl.algos.dapo` and `shardrl.algos.rollout_correction`; this module reads the
config and moves batches around (the overlong shaping is the scorer's).
"""

from __future__ import annotations

from typing import Callable

import torch

from shardrl.algos.dapo import informative_groups
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights
from shardrl.batch import Batch
from shardrl.metrics import Max, Min, Sum, SumCount, reduce_metrics


def concat_rollouts(batches: list[Batch]) -> Batch:
    """One batch of several rollout batches whose widths differ: each prompt part is left-padded and each
    response part right-padded to the widest, and `prompt_index` is made unique (batch k's indices are offset
    by the prompts of the batches before it, counted as max index + 1)."""
    if len(batches) == 1:
        return batches[0]
    resp = max(b["response_mask"].shape[1] for b in batches)
    prompt = max(b["input_ids"].shape[1] - b["response_mask"].shape[1] for b in batches)
    padded, offset = [], 0
    for b in batches:
        r = b["response_mask"].shape[1]
        p = b["input_ids"].shape[1] - r
        out = Batch(dict(b.tensors), dict(b.fields), dict(b.meta))
        for k, v in b.tensors.items():
            if k == "response_mask":
                out[k] = torch.nn.functional.pad(v, (0, resp - r))
            elif v.dim() == 2 and v.shape[1] == p + r:  # (N, P+R) per-token: [left-padded prompt | response]
                out[k] = torch.nn.functional.pad(v, (prompt - p, resp - r))
        out["prompt_index"] = b["prompt_index"] + offset
        offset += int(b["prompt_index"].max()) + 1 if len(b) else 0
        padded.append(out)
    return Batch.concat(padded)


def draw_informative_groups(draw: Callable[[int], tuple[Batch, torch.Tensor, dict]], num_groups: int,
                            max_rounds: int, dp_group=None) -> tuple[Batch, torch.Tensor, dict, dict]:
    """DAPO's dynamic sampling on this rank: `draw(round)` -> (batch, scores, reward metrics) of a fresh batch
    of prompts; rounds go on until every rank of `dp_group` holds `num_groups` groups whose rewards are not all
    equal, or `max_rounds` were drawn (every rank draws as many: generation and scoring are collective). Keeps
    the first `num_groups` informative groups, topped up with uninformative ones if too few were found.

    Returns the batch, its scores, the reward metrics of every sample drawn (errors summed, a function's own
    keys averaged), and dynamic_sampling/ metrics."""
    batches, scores, kept_groups, rounds = [], [], 0, 0
    reward_metrics: dict = {}
    while True:
        batch, s, rm = draw(rounds)
        rounds += 1
        batches.append(batch)
        scores.append(s)
        n = float(len(s))
        for k, v in rm.items():
            total, count = reward_metrics.get(k, (0.0, 0.0))
            reward_metrics[k] = (total + float(v) * (1.0 if k == "reward/num_errors" else n), count + n)
        informative = informative_groups(s, batch["prompt_index"])
        kept_groups += len(torch.unique(batch["prompt_index"][informative]))
        fewest = reduce_metrics({"g": Min(float(kept_groups))}, dp_group)["g"]
        if fewest >= num_groups or rounds >= max_rounds:
            break
    batch = concat_rollouts(batches)
    scores_all = torch.cat(scores)
    informative = informative_groups(scores_all, batch["prompt_index"])
    groups = batch["prompt_index"]
    order = list(dict.fromkeys(groups[informative].tolist()))  # informative groups first, in drawn order
    fillers = [g for g in dict.fromkeys(groups.tolist()) if g not in set(order)]
    chosen = (order + fillers)[:num_groups]
    num_filler = max(0, num_groups - len(order))
    rows = torch.cat([(groups == g).nonzero().squeeze(-1) for g in chosen])
    drawn_groups = len(torch.unique(groups))
    metrics = {
        "dynamic_sampling/num_gen_batches": Max(float(rounds)),
        "dynamic_sampling/informative_frac": SumCount(float(len(order)), float(drawn_groups)),
        "dynamic_sampling/num_filler_groups": Sum(float(num_filler)),
        "dynamic_sampling/reward_mean_drawn": SumCount(float(scores_all.sum()), float(len(scores_all))),
    }
    reward_metrics = {k: (total if k == "reward/num_errors" else total / max(count, 1.0))
                      for k, (total, count) in reward_metrics.items()}
    return batch.index(rows), scores_all[rows], reward_metrics, metrics


def mismatch_step_metrics(batch: Batch) -> dict:
    """This rank's rollout-vs-trainer metrics from `old_log_probs` and `sampled_log_probs`, for
    `reduce_metrics`: rollout/logprob_abs_diff (token mean), rollout/logprob_abs_diff_max, rollout/kl (KL of
    sampler to trainer per sequence, mean over sequences), rollout/k3_kl (token mean)."""
    m = mismatch_metrics(batch["old_log_probs"], batch["sampled_log_probs"], batch["loss_mask"].float())
    return {f"rollout/{k}": type(v)(*map(float, v)) for k, v in m.items()}


def apply_rollout_is(batch: Batch, algo_cfg) -> dict:
    """Adds `rollout_is_weights` (B, T) to `batch` and, in mask mode, drops the rejected tokens from its
    `loss_mask` (after the advantages: a rejected sample still counts in its group's baseline). Returns this
    rank's rollout_is/ metrics."""
    weights, mask, m = rollout_is_weights(batch["old_log_probs"], batch["sampled_log_probs"], batch["loss_mask"],
                                          algo_cfg.rollout_is_level, algo_cfg.rollout_is_mode,
                                          algo_cfg.rollout_is_threshold, algo_cfg.rollout_is_threshold_lower)
    batch["rollout_is_weights"] = weights
    batch["loss_mask"] = mask
    return {f"rollout_is/{k}": type(v)(*map(float, v)) for k, v in m.items()}
