"""The base of the episode drivers: a rollout whose `generate` runs episodes (multi-turn conversations with tools,
`shardrl.rollout.episodes.multiturn`; agent episodes against an endpoint, `shardrl.rollout.episodes.agent`) on
another rollout, the backend, which generates every model turn."""

from __future__ import annotations

from shardrl.rollout.base import Rollout, check_prompts

AGENT_COUNTS = ("errors", "timeouts", "prefix_breaks", "calls", "tool_parse_failures")
"""What an agent run counts per episode (the batch's `agent_<name>`, logged as `agent/<name>_mean` and in validation
`val/agent/<name>_mean`): failed episodes (raised or returned no reward), timed-out ones, rewritten histories, model
calls, replies that looked like a tool call but did not parse (`shardrl.rollout.serving.tool_calls`)."""


class EpisodeRollout(Rollout):
    """Drives episodes on `rollout` (the backend: fast, hf, or another driver). What is not about episodes goes
    to the backend: its weights and memory (`load_weights`, `release`, `resume`) and, through attribute lookup,
    anything else a trainer asks of it (its device, `totals`, `stop_ids`, `load_lora`, ...)."""

    def __init__(self, rollout: Rollout, tokenizer):
        self.rollout, self.tokenizer = rollout, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def backend(self) -> Rollout:
        """The generation engine under every driver."""
        inner = self.rollout
        while isinstance(inner, EpisodeRollout):
            inner = inner.rollout
        return inner

    @staticmethod
    def episode_samples(prompt_ids, attention_mask, samples: list[dict] | None) -> list[dict]:
        """Each prompt's row (its prompt, data_source, extra; `{}` each when not given), after the prompts' checks."""
        check_prompts(prompt_ids, attention_mask)
        num_prompts = prompt_ids.shape[0]
        samples = samples if samples is not None else [{} for _ in range(num_prompts)]
        if len(samples) != num_prompts:
            raise ValueError(f"{len(samples)} samples for {num_prompts} prompts")
        return samples

    # ---- the backend's weights and memory --------------------------------------------------------
    def load_weights(self, weights) -> None:
        self.rollout.load_weights(weights)

    def release(self) -> None:
        self.rollout.release()

    def resume(self) -> None:
        self.rollout.resume()

    def __getattr__(self, name: str):  # anything else a trainer asks of the backend (e.g. its device)
        if name == "rollout":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.rollout, name)
