"""verl's tool config in multi-turn rollouts (`rollout.multi_turn.tool_config_path`).

verl's YAML lists tools as a class name, a config and an OpenAI function schema:

    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

A tool class has verl's `BaseTool` methods, all async: `create(instance_id, **create_kwargs)` per conversation,
`execute(instance_id, parameters, **execute_kwargs) -> (response, tool reward, metrics)`, `calc_reward`,
`release`. `create_kwargs` / `execute_kwargs` come from each row's `extra_info.tools_kwargs[<tool name>]`, as
verl's preprocessing writes them. verl's own gsm8k tool is here (`Gsm8kTool`, the same answers and rewards), so
verl's gsm8k tool example runs without verl; another class is imported by its dotted name (one written for verl
imports `verl.tools.base_tool`: derive it from this module's `BaseTool` instead, which has the same methods).
`shardrl.rollout.episodes.interactions.VerlToolsInteraction` runs them; their schemas go into the chat template (`tools=`).
"""

from __future__ import annotations

import importlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

import yaml

from shardrl.rewards.scorers import score_gsm8k


@dataclass
class ToolResponse:
    """verl's tool answer (text only here: shardrl's models read text)."""

    text: str | None = None


class BaseTool:
    """verl's tool contract (`verl.tools.base_tool.BaseTool`), for tools written for verl."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config or {}, tool_schema
        self.name = tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float,
                                                                                              dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


class Gsm8kTool(BaseTool):
    """verl's `verl.tools.gsm8k_tool.Gsm8kTool`: the model submits an answer, the tool says how verl's flexible
    gsm8k scorer rates it; a submission that does not beat the previous one costs 0.05 (the tool reward)."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.instances: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self.instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self.instances[instance_id]
        return score_gsm8k(state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self.instances.pop(instance_id, None)


VERL_TOOL_CLASSES = {"verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool}
"""verl's own tool classes, by their class_name, that shardrl has."""


def load_tool_config(path: str) -> list[BaseTool]:
    """The tools of verl's tool config YAML at `path`; a ValueError naming the file and entry for a bad one."""
    if not os.path.isfile(path):
        raise ValueError(f"rollout.multi_turn.tool_config_path={path!r}: no such file")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"tool config {path!r} has no list under 'tools:' (verl's layout: tools: - class_name: ... "
                         "tool_schema: ...)")
    tools = []
    for i, entry in enumerate(entries):
        where = f"tool config {path!r}, tool {i}"
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ValueError(f"{where}: needs class_name and tool_schema")
        schema = entry["tool_schema"]
        if not isinstance(schema, dict) or not isinstance(schema.get("function", {}).get("name"), str):
            raise ValueError(f"{where}: tool_schema must be an OpenAI function schema with function.name")
        tools.append(_tool_class(entry["class_name"], where)(entry.get("config") or {}, schema))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool config {path!r} names a tool twice: {names}")
    return tools


def _tool_class(class_name: str, where: str) -> type:
    if class_name in VERL_TOOL_CLASSES:
        return VERL_TOOL_CLASSES[class_name]
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = (" (a tool written for verl imports verl.tools.base_tool: derive it from "
                "shardrl.tools.verl_tools.BaseTool, which has the same methods, or install verl)"
                if "verl" in str(e) else "")
        known = ", ".join(sorted(VERL_TOOL_CLASSES))
        raise ValueError(f"{where}: cannot import {class_name!r}: {e}{hint}; shardrl has verl's {known}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where}: {module_name!r} defines no class {attr!r}")
    return cls
