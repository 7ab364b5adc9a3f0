"""A verifiers environment's rollouts as agent episodes (`rollout.env`): its own loop, unchanged, calls the policy
through the run's agent endpoint (`episodes.agent`, which assembles the trajectory token for token from what the
endpoint sampled), and its rubric's reward is the episode's.

One episode is `env.run_rollout(row, client, "policy", {})` on the prompt row's `verifiers_input` (the environment's
dataset row, `shardrl.data.verifiers`), with the endpoint's `openai.AsyncOpenAI` client wrapped in verifiers' chat
completions client; the rubric scores it (`score_rollout`) and its `reward` is returned. A rollout that verifiers
ends with an error (its `error` field) is a failed episode, scored `rollout.agent.failure_reward` and counted.
"""

from __future__ import annotations

import math


class EnvironmentRolloutError(RuntimeError):
    """A verifiers rollout that ended with an error."""


def environment_episode(env, model: str = "policy", place: str = "rollout.env"):
    """The async `run(sample, client)` of `env`'s episodes (an `agent.entrypoint`); `model`: the endpoint's model
    name; `place`: the environment's, for a failed episode's message (`agent.agent_place`)."""
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    async def run(sample, client):
        row = sample.get("extra", {}).get("verifiers_input")
        if row is None:
            raise ValueError("rollout.env: this prompt row is not one of the environment's (no verifiers_input); "
                             "leave data.train_files and data.val_files empty: the environment's datasets are the "
                             "prompts")
        output = await env.run_rollout(row, OpenAIChatCompletionsClient(client), model, {})
        error = output.get("error")
        if error:
            raise EnvironmentRolloutError(f"the verifiers rollout ended with an error: {error}")
        reward = output.get("reward")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise EnvironmentRolloutError(f"the environment's rubric scored the episode {reward!r}: a reward must be "
                                          "a finite number (see its reward functions)")
        return float(reward)

    run.__qualname__ = f"{type(env).__name__}.run_rollout"
    run.episode_place = place  # (where a failed episode is said to be: the environment, not this wrapper)
    return run
