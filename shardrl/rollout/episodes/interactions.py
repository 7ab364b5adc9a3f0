"""The interaction of a multi-turn run, from `rollout.multi_turn`: the user's interaction file, verl's tool
config (`tool_config_path`, `shardrl.tools.verl_tools`), or the built-in tools; and the tool schemas its prompts
show the model (the chat template's `tools=`)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from shardrl.rollout.episodes.multiturn import BuiltinToolsInteraction, Interaction, load_interaction
from shardrl.tools.base import ToolCall
from shardrl.tools.verl_tools import BaseTool, ToolResponse, load_tool_config


def build_interaction(mt_cfg) -> Interaction:
    """The interaction `rollout.multi_turn` (a `MultiTurnConfig`) names."""
    if mt_cfg.interaction_path:
        return load_interaction(mt_cfg.interaction_path, mt_cfg.interaction_name)
    if mt_cfg.tool_config_path:
        return VerlToolsInteraction(load_tool_config(mt_cfg.tool_config_path))
    return BuiltinToolsInteraction(mt_cfg.tools)


def prompt_tool_schemas(mt_cfg) -> list[dict] | None:
    """The tool schemas the prompts' chat template gets (`tools=`), or None: on with `tools_in_chat_template`
    (null: with a verl tool config, as verl renders its prompts)."""
    if not mt_cfg.enable:
        return None
    show = mt_cfg.tools_in_chat_template
    if show is None:
        show = bool(mt_cfg.tool_config_path)
    if not show:
        return None
    interaction = build_interaction(mt_cfg)
    if isinstance(interaction, VerlToolsInteraction):
        return interaction.schemas()
    return [tool.schema() for tool in interaction.tools] or None


@dataclass
class _ToolState:
    instances: dict[str, str]  # tool name -> its instance id for this conversation
    execute_kwargs: dict[str, dict]
    tool_rewards: list[float]


class VerlToolsInteraction(Interaction):
    """The interaction of a verl tool config: each conversation creates an instance of every tool (with the
    row's `extra_info.tools_kwargs[name].create_kwargs`), a call runs the tool's `execute`, and the reward
    function scores the conversation (the tools' own rewards are kept in the state)."""

    def __init__(self, tools: list[BaseTool]):
        self.verl_tools = {t.name: t for t in tools}
        self.tools = []  # shardrl's built-in Tool objects: none

    def schemas(self) -> list[dict]:
        return [t.get_openai_tool_schema() for t in self.verl_tools.values()]

    def start(self, sample: dict) -> _ToolState:
        extra = sample.get("extra") or {}
        info = extra.get("extra_info") if isinstance(extra.get("extra_info"), dict) else extra
        kwargs = info.get("tools_kwargs") or {}
        instances = {}
        for name, tool in self.verl_tools.items():
            create = dict((kwargs.get(name) or {}).get("create_kwargs") or {})
            instances[name], _ = asyncio.run(tool.create(str(uuid.uuid4()), **create))
        return _ToolState(instances, {n: dict((kwargs.get(n) or {}).get("execute_kwargs") or {}) for n in instances},
                          [])

    async def step(self, state: _ToolState, call: ToolCall) -> str:
        tool = self.verl_tools.get(call.name)
        if tool is None:
            return f"error: no tool named {call.name!r}; the tools are {sorted(self.verl_tools)}"
        response, reward, _ = await tool.execute(state.instances[call.name], call.arguments,
                                                 **state.execute_kwargs[call.name])
        state.tool_rewards.append(float(reward))
        text = response.text if isinstance(response, ToolResponse) else response
        return "" if text is None else str(text)
