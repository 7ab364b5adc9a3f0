"""An OpenAI Agents SDK agent, trained as it is written: `shardrl train rollout.agent.entrypoint=
examples/agent_frameworks/openai_agents_sdk.py:run` (the demo's sums; any prompts with a ground truth)."""

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

set_tracing_disabled(True)  # (no traces sent to OpenAI's servers)


async def run(sample, client):
    # client: the run's endpoint (openai.AsyncOpenAI); the trainer records what it samples, token for token
    agent = Agent(name="adder", model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, sample["prompt"], max_turns=1)
    return float(result.final_output.strip() == str(sample["extra"]["ground_truth"]))
