"""What the trainer does between sampling and the update for DAPO and rollout correction: dynamic sampling
(generate until a step has enough groups whose rewards differ, decided over all dp ranks) and the
rollout-training mismatch metrics and importance weights. The algorithms are `shardrl.algos.dapo` and
`shardrl.algos.rollout_correction`; this module reads the config and moves batches around (the overlong
shaping is the scorer's).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardrl.algos.dapo import groups_to_keep
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights
from shardrl.batch import Batch
from shardrl.distributed import all_gather_ints, exchange_objects
from shardrl.metrics import Max, SumCount


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


def filter_metric(name: str, scores: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's value `(N,)` of `algorithm.filter_groups.metric` `name` (verl's names): seq_reward and
    seq_final_reward are the reward `scores` (shaped; no KL penalty is in it before the filter, config), the
    others the scorer's per-sample `values` (score: before shaping; a reward function's own keys, e.g. acc).
    A name no sample has is NaN throughout (`draw_groups` says so, on every rank)."""
    if name in ("seq_reward", "seq_final_reward"):
        return scores
    if name in values:
        return values[name].to(torch.float64)
    return torch.full((len(scores),), float("nan"), dtype=torch.float64)


def draw_groups(draw: Callable[[int], tuple[Batch, torch.Tensor, dict, torch.Tensor]], num_groups: int,
                max_gen_batches: int, dp_group=None, metric_name: str = "seq_reward"
                ) -> tuple[Batch, torch.Tensor, dict, dict]:
    """DAPO's dynamic sampling, verl's recipe loop over the dp ranks of `dp_group`: `draw(k)` -> (batch, scores,
    reward metrics, filter metric `(N,)`) of this rank's share of generation batch k. A group (a prompt's
    samples) is kept when its metric is not all equal or it has one sample (`groups_to_keep`); batches are
    drawn until the ranks together keep `num_groups` groups (global), and the step takes the first
    `num_groups` of them in the order drawn (batch k, then rank, then the rank's own order: the order of the
    global batch, so one rank and several keep the same groups), `num_groups // dp` a rank, moved between
    ranks where needed. More than `max_gen_batches` (0: no limit) is a ValueError on every rank.

    Returns this rank's batch and scores, the reward metrics of every sample drawn (errors summed, the others
    averaged; a function's own keys as (sum, count) pairs over the samples that have them), and dynamic_sampling/
    metrics."""
    kept, counts = [], []  # per batch drawn: this rank's kept (batch, scores); every rank's kept group count
    reward_metrics: dict = {}
    drawn_groups = kept_groups = 0
    drawn_scores = []
    while True:
        batch, s, rm, values = draw(len(counts))
        n = float(len(s))
        for k, v in rm.items():
            total, count = reward_metrics.get(k, (0.0, 0.0))
            if isinstance(v, SumCount):  # a reward function's own key: over the samples that have it
                reward_metrics[k] = SumCount(total + float(v.total), count + float(v.count))
            else:
                reward_metrics[k] = (total + float(v) * (1.0 if k == "reward/num_errors" else n), count + n)
        drawn_scores.append(s)
        keep = groups_to_keep(values, batch["prompt_index"])
        rows = keep.nonzero().squeeze(-1)
        kept.append((batch.index(rows), s[rows]))
        here = len(torch.unique(batch["prompt_index"][rows]))
        drawn_groups, kept_groups = drawn_groups + len(torch.unique(batch["prompt_index"])), kept_groups + here
        gathered = all_gather_ints([here, int((~values.isnan()).sum())], dp_group)
        counts.append([g[0] for g in gathered])
        if len(counts) == 1 and sum(g[1] for g in gathered) == 0:
            raise ValueError(f"algorithm.filter_groups.metric={metric_name!r}: no sample has it; filter by "
                             "seq_reward or score, or return it from the reward function (a dict holding "
                             f"'score' and {metric_name!r}, as verl's math_dapo does with 'acc')")
        total = sum(sum(c) for c in counts)
        if total >= num_groups:
            break
        if max_gen_batches and len(counts) >= max_gen_batches:
            raise ValueError(f"dynamic sampling drew {len(counts)} generation batches (algorithm.filter_groups."
                             f"max_num_gen_batches={max_gen_batches}) and kept {total} groups, fewer than "
                             f"data.train_batch_size={num_groups}: too few groups differ in "
                             f"{metric_name!r} (the data are too hard or too easy for the policy). Raise "
                             "max_num_gen_batches (0: no limit) or data.gen_batch_size, or change the data")
    batch, scores = _first_groups_spread(kept, counts, num_groups, dp_group)
    scores_all = torch.cat(drawn_scores)
    metrics = {
        "dynamic_sampling/num_gen_batches": Max(float(len(counts))),
        "dynamic_sampling/informative_frac": SumCount(float(kept_groups), float(drawn_groups)),
        "dynamic_sampling/reward_mean_drawn": SumCount(float(scores_all.sum()), float(len(scores_all))),
    }
    reward_metrics = {k: v if isinstance(v, SumCount) else v[0] if k == "reward/num_errors"
                      else v[0] / max(v[1], 1.0) for k, v in reward_metrics.items()}
    return batch, scores, reward_metrics, metrics


def _first_groups_spread(kept: list[tuple[Batch, torch.Tensor]], counts: list[list[int]], num_groups: int,
                         dp_group) -> tuple[Batch, torch.Tensor]:
    """This rank's share of the first `num_groups` kept groups of the global order, and their scores. `kept`: per
    batch drawn, this rank's kept samples and scores; `counts[k][r]`: rank r's kept groups in batch k. The
    group at global position p goes to rank p // (num_groups // dp)."""
    num_ranks = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
    per_rank = num_groups // num_ranks
    outgoing: list[list] = [[] for _ in range(num_ranks)]  # per destination rank: (global position, group)
    for k, (part, part_scores) in enumerate(kept):
        position = sum(sum(c) for c in counts[:k]) + sum(counts[k][:rank])  # of this rank's first kept group
        for g in dict.fromkeys(part["prompt_index"].tolist()):
            if position >= num_groups:
                break
            g_rows = (part["prompt_index"] == g).nonzero().squeeze(-1)
            outgoing[position // per_rank].append((position, part.index(g_rows), part_scores[g_rows]))
            position += 1
    incoming = sorted((item for items in exchange_objects(outgoing, dp_group) for item in items),
                      key=lambda item: item[0])
    return concat_rollouts([b for _, b, _ in incoming]), torch.cat([s for _, _, s in incoming])


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
