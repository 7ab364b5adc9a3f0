"""Validation: greedy responses to every validation prompt, scored without shaping."""

from __future__ import annotations

import torch

from shardrl.metrics import SumCount, reduce_metrics


def validate(cfg, val_set, generate, score, dp_rank: int, dp_size: int, dp_group=None, multi_turn: bool = False,
             keep: int = 0) -> tuple[dict[str, float], list[dict]]:
    """The mean reward over all validation prompts (all ranks), and for multi-turn rollouts the shares of
    conversations that called a tool and that called tools without an error, and the mean tool calls; and this
    rank's first `keep` samples (prompt, response, reward, ground truth). `generate(items, sampling)` -> batch and
    `score(batch)` -> (scores, metrics) are the run's (`Generation`, `Scorer`)."""
    from shardrl.rollout import SamplingParams

    sampling = SamplingParams.from_config(cfg.rollout, n=1, greedy=True)
    # every rank runs the same number of generate calls (weight sync and scoring are collective): a rank with
    # fewer prompts repeats one and drops its scores
    index = list(range(dp_rank, len(val_set), dp_size))
    real = len(index)
    index += [index[0] if index else 0] * (-(-len(val_set) // dp_size) - real)
    items = [val_set[i] for i in index]
    scores, calls, errors, kept = [], [], [], []
    # data.val_batch_size prompts per round over all ranks (ceil(that / dp) per rank); None: one round
    val_batch = cfg.data.val_batch_size
    per_round = -(-val_batch // dp_size) if val_batch else max(len(items), 1)
    for start in range(0, len(items), per_round):
        chunk = items[start:start + per_round]
        batch = generate(chunk, sampling)
        s, _ = score(batch)
        scores.append(s)
        if multi_turn:
            calls.append(torch.as_tensor(batch["num_tool_calls"]).float())
            errors.append(torch.as_tensor(batch["num_tool_errors"]).float())
        for row in range(min(len(batch), keep - len(kept), real - start)):  # real prompts only
            item = chunk[int(batch["prompt_index"][row])]
            kept.append({"prompt": item["prompt_text"], "response": batch["response_text"][row],
                         "reward": float(s[row]), "ground_truth": item["extra"].get("ground_truth")})
    local = torch.cat(scores)[:real] if scores else torch.zeros(0)
    n = float(len(local))
    metrics = {"val/reward_mean": SumCount(float(local.sum()), n)}
    if calls:
        c, e = torch.cat(calls)[:real], torch.cat(errors)[:real]
        metrics.update({"val/multi_turn/tool_call_rate": SumCount(float((c > 0).sum()), n),
                        "val/multi_turn/clean_call_rate": SumCount(float(((c > 0) & (e == 0)).sum()), n),
                        "val/multi_turn/num_tool_calls_mean": SumCount(float(c.sum()), n)})
    return reduce_metrics(metrics, dp_group), kept
