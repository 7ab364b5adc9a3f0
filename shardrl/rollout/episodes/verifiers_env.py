"""A verifiers environment's rollouts as agent episodes (`rollout.env`): its own loop, unchanged, calls the policy
through the run's agent endpoint (`episodes.agent`, which assembles the trajectory token for token from what the
endpoint sampled), and its rubric's reward is the episode's.

One episode is `env.run_rollout(row, client, "policy", {})` on the prompt row's `verifiers_input` (the environment's
dataset row, `shardrl.data.verifiers`), with the endpoint's `openai.AsyncOpenAI` client wrapped in verifiers' chat
completions client; the rubric scores it (`score_rollout`) and its `reward` is returned. A rollout that verifiers
ends with an error (its `error` field) is a failed episode, scored `rollout.agent.failure_reward` and counted.
"""

from __future__ import annotations


class EnvironmentRolloutError(RuntimeError):
    """A verifiers rollout that ended with an error."""


def environment_episode(env, model: str = "policy"):
    """The async `run(sample, client)` of `env`'s episodes (an `agent.entrypoint`); `model`: the endpoint's model
    name."""
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    async def run(sample, client):
        row = sample.get("extra", {}).get("verifiers_input")
        if row is None:
            raise ValueError("rollout.env: this prompt row is not one of the environment's (no verifiers_input); "
                             "leave data.train_files empty: the environment's dataset is the prompts")
        output = await env.run_rollout(row, OpenAIChatCompletionsClient(client), model, {})
        error = output.get("error")
        if error:
            raise EnvironmentRolloutError(f"the verifiers rollout ended with an error: {error}")
        return float(output["reward"])

    run.__qualname__ = f"{type(env).__name__}.run_rollout"
    return run
