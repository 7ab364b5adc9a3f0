"""A pydantic-ai agent, trained as it is written: `rollout.agent.entrypoint=
examples/agent_frameworks/pydantic_ai_agent.py:run`."""

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


async def run(sample, client):
    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
    result = await Agent(model).run(sample["prompt"])
    return float(result.output.strip() == str(sample["extra"]["ground_truth"]))
