"""An OpenAI Agents SDK agent with a function tool, trained as it is written: `rollout.agent.entrypoint=
examples/agent_frameworks/openai_agents_sdk_tools.py:run`. The endpoint reads the policy's tool calls into
`tool_calls` (`rollout.agent.tool_call_parser`, auto from the chat template); the SDK runs the tool and asks again."""

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # (no traces sent to OpenAI's servers)


@function_tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


async def run(sample, client):
    agent = Agent(name="calculator", tools=[add],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, sample["prompt"], max_turns=4)
    return float(result.final_output.strip() == str(sample["extra"]["ground_truth"]))
