"""Validation: `rollout.val_kwargs.n` responses (greedy by default) to every validation prompt, scored without
shaping; the mean reward pooled and per data source (`val/<data_source>/reward_mean@n`, and the share of prompts
with a response scoring above 0, `pass@n`), as verl reports it per data source."""

from __future__ import annotations

import torch

from shardrl.metrics import SumCount, reduce_metrics
from shardrl.rollout.episodes.base import AGENT_COUNTS


def validate(cfg, val_set, generate, score, dp_rank: int, dp_size: int, dp_group=None, multi_turn: bool = False,
             keep: int = 0) -> tuple[dict[str, float], list[dict]]:
    """The mean reward over all validation responses (all ranks), per data source too, and for multi-turn rollouts
    the shares of conversations that called a tool and that called tools without an error, and the mean tool
    calls (agent episodes: the means of what they count, `val/agent/<name>_mean`); and this rank's first `keep`
    samples (prompt, response, reward, ground truth; a prompt with images, their names: `data.images.image_name`).
    `generate(items, sampling)` -> batch and `score(batch)` -> (scores, metrics) are the run's (`Generation`,
    `Scorer`)."""
    from shardrl.rollout import SamplingParams

    vk = cfg.rollout.val_kwargs
    sampling = SamplingParams.from_config(cfg.rollout, n=vk.n, temperature=vk.temperature, top_p=vk.top_p,
                                          top_k=vk.top_k, greedy=vk.temperature == 0)
    # every rank runs the same number of generate calls (weight sync and scoring are collective): a rank with
    # fewer prompts repeats one and drops its scores
    index = list(range(dp_rank, len(val_set), dp_size))
    real = len(index)
    index += [index[0] if index else 0] * (-(-len(val_set) // dp_size) - real)
    items = [val_set[i] for i in index]
    scores, calls, errors, kept, prompt_of = [], [], [], [], []
    agent = {key: [] for key in AGENT_COUNTS}
    # data.val_batch_size prompts per round over all ranks (ceil(that / dp) per rank); None: one round
    val_batch = cfg.data.val_batch_size
    per_round = -(-val_batch // dp_size) if val_batch else max(len(items), 1)
    for start in range(0, len(items), per_round):
        chunk = items[start:start + per_round]
        batch = generate(chunk, sampling)
        s, _ = score(batch)
        scores.append(s)
        prompt_of.append(batch["prompt_index"].cpu() + start)  # (chunk x n,) this rank's prompt of each response
        if multi_turn and "agent_calls" in batch:  # agent episodes: no tool calls of ours, their own counts
            for key, values in agent.items():
                values.append(torch.as_tensor(batch[f"agent_{key}"]).float())
        elif multi_turn:
            calls.append(torch.as_tensor(batch["num_tool_calls"]).float())
            errors.append(torch.as_tensor(batch["num_tool_errors"]).float())
        for row in range(len(batch)):  # real prompts only
            if len(kept) >= keep or start + int(batch["prompt_index"][row]) >= real:
                break
            item = chunk[int(batch["prompt_index"][row])]
            kept.append({"prompt": item["prompt_text"], "response": batch["response_text"][row],
                         "reward": float(s[row]), "ground_truth": item["extra"].get("ground_truth"),
                         **({"images": item["image_names"]} if item.get("image_names") else {})})
    all_scores = torch.cat(scores) if scores else torch.zeros(0)
    prompts = torch.cat(prompt_of) if prompt_of else torch.zeros(0, dtype=torch.long)
    is_real = prompts < real  # the repeated prompts of a rank with fewer are dropped
    local, prompts = all_scores[is_real], prompts[is_real]
    n = float(len(local))
    metrics = {"val/reward_mean": SumCount(float(local.sum()), n)}
    metrics.update(per_source_metrics(local, prompts, [items[i]["data_source"] for i in range(real)],
                                      sorted({item["data_source"] for item in val_set}), vk.n))
    if calls:
        c, e = torch.cat(calls)[is_real], torch.cat(errors)[is_real]
        metrics.update({"val/multi_turn/tool_call_rate": SumCount(float((c > 0).sum()), n),
                        "val/multi_turn/clean_call_rate": SumCount(float(((c > 0) & (e == 0)).sum()), n),
                        "val/multi_turn/num_tool_calls_mean": SumCount(float(c.sum()), n)})
    for key, values in agent.items() if agent["calls"] else ():
        metrics[f"val/agent/{key}_mean"] = SumCount(float(torch.cat(values)[is_real].sum()), n)
    return reduce_metrics(metrics, dp_group), kept


def per_source_metrics(scores: torch.Tensor, prompts: torch.Tensor, sources: list[str], all_sources: list[str],
                       n: int) -> dict:
    """`val/<source>/reward_mean@n` (mean over the source's responses) and `val/<source>/pass@n` (share of its
    prompts with a response scoring > 0) for every source of the whole validation set (`all_sources`: the same
    keys on every rank), from this rank's `scores` (R,) of responses to its prompts `prompts` (R,), whose data
    sources are `sources` (by this rank's prompt position)."""
    out = {}
    best = {}  # this rank's prompt -> its best score
    for p, s in zip(prompts.tolist(), scores.tolist()):
        best[p] = max(best.get(p, s), s)
    for source in all_sources:
        mine = torch.tensor([sources[p] == source for p in prompts.tolist()], dtype=torch.bool)
        mine_prompts = [p for p in best if sources[p] == source]
        out[f"val/{source}/reward_mean@{n}"] = SumCount(float(scores[mine].sum()) if len(mine) else 0.0,
                                                        float(mine.sum()))
        out[f"val/{source}/pass@{n}"] = SumCount(float(sum(best[p] > 0 for p in mine_prompts)), float(len(mine_prompts)))
    return out
