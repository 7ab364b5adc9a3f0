"""The GPU learning run of an OpenAI Agents SDK agent: SmolLM2-135M-Instruct answers examples/smollm2's word
problems through an Agents SDK `Agent` on the run's endpoint; the reward is the run's own scorer on the last reply
(gsm8k's "#### n", as examples/smollm2/gpu.yaml scores plain GRPO). `bash examples/smollm2/gpu_run.sh` with
EXTRA="rollout.agent.entrypoint=examples/agent_frameworks/smollm2_agents_sdk.py:run rollout.agent.max_response_tokens=128"."""

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

set_tracing_disabled(True)  # (no traces sent to OpenAI's servers)


async def run(sample, client):
    agent = Agent(name="solver", model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=128))
    await Runner.run(agent, sample["prompt"], max_turns=1)
    return None  # (None: the reward function scores the episode's last reply)
