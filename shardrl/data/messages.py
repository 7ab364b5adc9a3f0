"""Chat messages as data rows hold them (SFT, preference and RL prompt rows alike), checked once before a chat
template sees them.

A message is {"role", "content"} with a role of `ROLES` (lower case, as every chat template spells them) and a
string content; an assistant message may instead carry `tool_calls` (OpenAI's and TRL's tool-calling format:
{"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}),
which the template renders. Other keys (`tool_call_id`, `name`, ...) travel to the template as they are; a key
whose value is null is dropped, as a Parquet file gives every message each key any message of the column has.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_role(role, where: str) -> None:
    """A ValueError naming the message (`where`, e.g. "messages[2]") unless `role` is one of `ROLES`."""
    if role in ROLES:
        return
    hint = ""
    if isinstance(role, str) and role.strip().lower() in ROLES:
        hint = f"; roles are lower case: {role.strip().lower()!r}"
    raise ValueError(f"{where}: role {_short(role)} is not one of {', '.join(ROLES)}{hint}")


def check_message(message, where: str) -> dict:
    """The message ready for a chat template (its null-valued keys dropped, role and content kept), or a
    ValueError naming it (`where`) and what is wrong."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message is an object {{'role', 'content'}}, found {type(message).__name__} "
                         f"{_short(message)}")
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    check_role(role, where)
    if calls == []:  # some exports write an empty list on every message: no calls
        message, calls = {k: v for k, v in message.items() if k != "tool_calls"}, None
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}: only an assistant message calls tools; this one's role is {role!r}")
        if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) for c in calls):
            raise ValueError(f"{where}: tool_calls must be a non-empty list of calls "
                             "({'type': 'function', 'function': {'name', 'arguments'}}), found " + _short(calls))
    if not isinstance(content, str) and not (content is None and calls):
        found = f"found {_short(content)}" if "content" in message else f"it has none (keys: {sorted(message)})"
        raise ValueError(f"{where}: content must be a string (null only on an assistant message with tool_calls); "
                         + found)
    return {"role": role, "content": content, **{k: v for k, v in message.items()
                                                 if k not in ("role", "content") and v is not None}}


def check_messages(value, key: str) -> list[dict]:
    """Column `key` of a row as a list of checked messages (`check_message`), each named in an error by its
    index (`messages[2]: ...`)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a non-empty list of {{'role', 'content'}} messages, found "
                         f"{type(value).__name__} {_short(value)}")
    return [check_message(m, f"{key}[{i}]") for i, m in enumerate(value)]


def is_empty_reply(message: dict) -> bool:
    """An assistant message with nothing to train on: no text and no tool call."""
    return not message.get("tool_calls") and not (message.get("content") or "").strip()
