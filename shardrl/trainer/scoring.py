"""The one place a sample's reward is computed: `Scorer`.

A batch's scores come from the reward model (`reward.model_path`), or a multi-turn interaction's own final
rewards, or the reward function (a user file, or the built-in of each row's data_source); then DAPO's overlong
shaping. Whether every sample failed (or every agent episode) is decided on the global count, so every rank stops
together.
"""

from __future__ import annotations

import torch

from shardrl.algos.dapo import overlong_penalty
from shardrl.metrics import Sum, reduce_metrics
from shardrl.rewards.manager import RewardManager
from shardrl.rollout.episodes.multiturn import score_with_interaction


class Scorer:
    def __init__(self, rewards: RewardManager, reward_model=None, dp_group=None, multi_turn: bool = False,
                 overlong=None, length_limit: int = 0, missing_eos_penalty: float | None = None,
                 reward_inputs=None):
        """`reward_model`: an engine with a score head, or None for `rewards`' function; `reward_inputs`: batch
        -> the reward model's input_ids and attention_mask when its tokenizer is not the policy's
        (`shardrl.rewards.model_inputs.Retokenize`), None: the policy's ids as they are; `overlong`: the
        `reward.overlong_buffer` section (None or disabled: no shaping); `length_limit`: the response length
        it shapes against (`rollout.max_new_tokens`; multi-turn: the conversation's budget,
        `rollout.multi_turn.max_response_tokens`, which its model and tool tokens share);
        `missing_eos_penalty`: subtracted from responses cut at `length_limit`."""
        self.rewards, self.reward_model = rewards, reward_model
        self.dp_group = dp_group
        self.multi_turn = multi_turn
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.length_limit = length_limit
        self.missing_eos_penalty = missing_eos_penalty
        self.reward_inputs = reward_inputs or (lambda batch: batch.select(["input_ids", "attention_mask"]))

    def score(self, batch, shape: bool = True) -> tuple[torch.Tensor, dict]:
        """(scores (B,), this rank's reward metrics: "reward/num_errors" a count, the others means over its
        samples). `shape=False` leaves out the overlong shaping (validation reports the raw reward)."""
        scores, metrics, _ = self.score_with_values(batch, shape)
        return scores, metrics

    def score_with_values(self, batch, shape: bool = True) -> tuple[torch.Tensor, dict, dict[str, torch.Tensor]]:
        """`score`'s (scores, metrics) and per-sample values (B,) beside them: "score", the score before any
        shaping, and each numeric key of the reward function's dict (NaN where a sample has none)."""
        if "agent_error" in batch:
            self.stop_if_every_episode_failed(batch["agent_error"])
        values: dict[str, torch.Tensor] = {}

        def responses(b):
            scores, metrics, found = self._score_responses(b)
            values.update(found)
            return scores, metrics
        if self.multi_turn:  # the interaction's rewards, or the reward function's
            scores, metrics = score_with_interaction(batch, responses)
        else:
            scores, metrics = responses(batch)
        values["score"] = scores.clone()
        if shape and self.overlong is not None:
            penalty = overlong_penalty(self.response_lengths(batch), self.length_limit, self.overlong.len,
                                       self.overlong.penalty_factor)  # (N,)
            scores = scores + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean()) if len(penalty) else 0.0
        if shape and self.missing_eos_penalty is not None:
            cut = self.response_lengths(batch) >= self.length_limit  # (N,)
            scores = scores - self.missing_eos_penalty * cut.to(scores.dtype)
            metrics["reward/missing_eos_frac"] = float(cut.float().mean()) if len(cut) else 0.0
        return scores, metrics, values

    def stop_if_every_episode_failed(self, errors: list[str | None]) -> None:
        """A `ValueError` quoting this rank's first failure when every agent episode of the step failed, on every
        rank (nothing to learn; decided on the global count). `errors`: per row, a failed episode's error and its
        place in the agent's file, else None."""
        failures = [e for e in errors if e is not None]
        counts = reduce_metrics({"failed": Sum(len(failures)), "episodes": Sum(len(errors))}, self.dp_group,
                                same_keys=True)
        if counts["episodes"] > 0 and counts["failed"] == counts["episodes"]:
            first = failures[0] if failures else "?"
            # (an environment's episodes are placed at it: `verifiers_env.environment_episode`)
            fix = (f"the environment ({first.split(': ', 1)[0]}" if first.startswith("rollout.env")
                   else "the agent (rollout.agent.entrypoint")
            raise ValueError(f"every agent episode of this step failed ({round(counts['episodes'])} of them), so "
                             f"there is nothing to learn from; the first at {first}. Fix {fix}; an episode that "
                             "fails scores rollout.agent.failure_reward only while others succeed)")

    def response_lengths(self, batch) -> torch.Tensor:
        """Tokens per response `(N,)` as the length limit counts them: a conversation's tool tokens too."""
        if not self.multi_turn:
            return batch["response_mask"].sum(-1)
        prompt_width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        return batch["attention_mask"][:, prompt_width:].sum(-1)  # (N,) model and tool tokens

    def _score_responses(self, batch) -> tuple[torch.Tensor, dict, dict]:
        if self.reward_model is not None:
            scores = self.reward_model.infer_batch(self.reward_inputs(batch))["scores"].cpu()
            return scores, {}, {}
        items = [{"data_source": ds, "response_text": text, "extra": extra}
                 for ds, text, extra in zip(batch["data_source"], batch["response_text"], batch["extra"])]
        scores, metrics, values = self.rewards.score_with_values(items, fail_if_all_fail=False)
        # all samples failing stops the run; decided on the global count so that every rank agrees
        counts = reduce_metrics({"errors": Sum(metrics["reward/num_errors"]), "samples": Sum(len(items))},
                                self.dp_group, same_keys=True)
        if counts["samples"] > 0 and counts["errors"] == counts["samples"]:
            raise self.rewards.all_failed_error(round(counts["samples"]))
        return scores, metrics, values
