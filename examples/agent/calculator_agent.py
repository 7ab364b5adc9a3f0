"""The tools example's calculator task as an agent episode (`rollout.agent.entrypoint=
examples/agent/calculator_agent.py:run`): the agent's own code asks the policy, parses its tool call, runs the
calculator and puts the answer back into the conversation, up to MAX_TURNS replies; the reward is the tools
example's (the number after '####' right, + 0.1 when every call worked).

The conversation is plain chat messages, so the endpoint renders it with the model's chat template; the reply
that called the tool goes back as the assistant's message with its closing marker (the stop string the reply
ended at), and the tool's answer as a user turn in the rollout's own `<tool_response>` format.
"""

from __future__ import annotations

import json
import re

from shardrl.rewards.manager import gsm8k_score
from shardrl.tools import CalculatorTool

MAX_TURNS = 4
MAX_TOKENS = 128
TOOL_BONUS = 0.1
CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.S)
CALCULATOR = CalculatorTool()


def parse_call(text: str) -> str | None:
    """The expression of a reply that ends in an open `<tool_call>{"name": "calculator", ...}` (its closing tag
    was the stop string), else None."""
    match = CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != "calculator":
        return None
    expression = (call.get("arguments") or {}).get("expression")
    return expression if isinstance(expression, str) else None


async def run(sample, client) -> float:
    messages = list(sample["prompt"])
    calls = failed = 0
    text = ""
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS,
                                                     stop=["</tool_call>"])
        text = reply.choices[0].message.content
        expression = parse_call(text) if reply.choices[0].finish_reason == "stop" else None
        if expression is None or turn == MAX_TURNS - 1:
            break
        calls += 1
        answer = CALCULATOR.call({"expression": expression})
        failed += answer.startswith("error:")
        messages += [{"role": "assistant", "content": text + "</tool_call>"},
                     {"role": "user", "content": f"<tool_response>\n{answer}\n</tool_response>"}]
    truth = (sample.get("extra") or {}).get("ground_truth")
    return gsm8k_score("gsm8k", text, truth) + (TOOL_BONUS if calls and not failed else 0.0)
