"""The tool contract of multi-turn rollouts, the parsing of a model's tool call, and concurrent tool runs.

A tool has a `name`, a `description`, JSON-schema `parameters` (an "object" schema), and `call(args) -> str`
(or `async acall(args) -> str`). The model calls a tool in the Hermes / Qwen chat format:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
    </tool_call>

`parse_tool_call` reads the last such block of a model turn; anything it cannot read becomes a `ToolCall`
with an `error`, whose message is the tool's answer (the model sees what it did wrong and may retry).
`run_tool_calls` runs a round's calls concurrently (sync tools in a thread pool, async ones on one event
loop), each with a time limit; a call that raises or runs past its limit answers with an error message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


class Tool:
    """A tool the model may call. Subclasses set `name`, `description`, `parameters` and define `call`
    (or `acall`, a coroutine, for tools that wait on I/O)."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}
    """JSON schema of the arguments (an "object"); `check_arguments` enforces its required keys and types."""

    def __init_subclass__(cls, **kwargs):
        """A tool class must define `call(args) -> str` or `async acall(args) -> str`: said when the class is
        defined (the user's interaction file is imported), not when the model first calls it mid-run."""
        super().__init_subclass__(**kwargs)
        if not callable(getattr(cls, "call", None)) and not callable(getattr(cls, "acall", None)):
            raise TypeError(f"tool class {cls.__name__} defines neither call(self, args) -> str nor "
                            "async acall(self, args) -> str")

    def schema(self) -> dict:
        """The OpenAI / HF `tools=` entry, e.g. for `tokenizer.apply_chat_template(messages, tools=[...])`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One parsed call: `name` and `arguments`, or an `error` saying why the model's text is not a call."""

    name: str | None = None
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    text: str = ""
    """The raw text between the call markers."""


def parse_tool_call(text: str, start: str = CALL_START, end: str = CALL_END) -> ToolCall:
    """The last `start ... end` block of a model turn's `text`, read as {"name": ..., "arguments": {...}}.

    Lenient where it costs nothing: code fences around the JSON, "parameters" for "arguments", arguments
    given as a JSON string, trailing text after the block. Everything else is an error call."""
    cut = text.rfind(end)
    body_end = cut if cut >= 0 else len(text)
    begin = text.rfind(start, 0, body_end) if start else 0
    if begin < 0:
        return ToolCall(error=f"no {start} before {end}: write {start}{{\"name\": ..., \"arguments\": {{...}}}}{end}",
                        text=text[:body_end])
    raw = text[begin + len(start): body_end].strip()
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", raw)
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})", text=raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(error='the tool call must be a JSON object with a string "name"', text=raw)
    args = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=payload["name"], error='"arguments" is a string that is not a JSON object', text=raw)
    if not isinstance(args, dict):
        return ToolCall(name=payload["name"], error='"arguments" must be a JSON object', text=raw)
    return ToolCall(name=payload["name"], arguments=args, text=raw)


def parse_tool_calls(text: str, start: str = CALL_START, end: str = CALL_END) -> list[ToolCall]:
    """Every `start ... end` block of a model turn's `text`, in order, each read as `parse_tool_call` reads one."""
    calls, pos = [], 0
    while (close := text.find(end, pos)) >= 0:
        calls.append(parse_tool_call(text[pos:close + len(end)], start, end))
        pos = close + len(end)
    return calls or [parse_tool_call(text, start, end)]


def check_arguments(schema: dict, args: dict) -> str | None:
    """None when `args` fits the object `schema` (required keys present, declared types right, no unknown
    keys unless additionalProperties allows them), else what is wrong."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {missing}; the tool takes {sorted(props)}"
    if not schema.get("additionalProperties", False):
        unknown = sorted(set(args) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    for key, value in args.items():
        kind = props.get(key, {}).get("type")
        types = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        wrong = types is not None and not isinstance(value, types)
        if wrong or (kind in ("integer", "number") and isinstance(value, bool)):  # JSON's true is no number
            return f"argument {key!r} must be of type {kind}, got {type(value).__name__}"
    return None


def call_tool(tool: Tool, args: dict) -> str | Awaitable[str]:
    """`tool.acall(args)` (a coroutine) when the tool has it, else `tool.call(args)`; arguments checked first."""
    problem = check_arguments(tool.parameters, args)
    if problem is not None:
        return f"error: {problem}"
    acall = getattr(tool, "acall", None)
    return acall(args) if acall is not None else tool.call(args)


class DaemonThreadPool(concurrent.futures.Executor):
    """A thread pool whose workers are daemon threads. `ThreadPoolExecutor`'s workers are joined when the
    interpreter exits, so one tool call that never returns (a hung tool, long past its time limit) would keep the
    whole process, and under torchrun every rank, from exiting after the run is done. A daemon worker is left to
    die with the process instead."""

    def __init__(self, num_workers: int, name: str = "shardrl-tool"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed, self._num_workers = False, num_workers
        for i in range(num_workers):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("cannot submit a tool call to a pool that was shut down")
        future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the caller sees it as the call's answer
                future.set_exception(e)

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stops the idle workers (a hung one is left to the process's exit); never waits for a running call."""
        self._closed = True
        while cancel_futures:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(self._num_workers):  # one stop per worker; a hung worker never reads its own
            self._jobs.put(None)


def run_tool_calls(jobs: list[Callable[[], Any]], timeout_s: float,
                   pool: concurrent.futures.Executor) -> list[str]:
    """Runs `jobs` (each returns a str, or a coroutine giving one) concurrently; their answers in order.

    A sync job runs on `pool`; a coroutine runs on this call's event loop. A job that raises answers
    "error: <Type>: <message>"; one that runs past `timeout_s` (counted from submission) answers
    "error: the tool timed out ...". Python cannot stop a thread: a timed-out sync job runs on in its
    worker and its answer is dropped, so tools should bound their own work (the Python tool kills its
    subprocess at its own limit)."""
    if not jobs:
        return []

    async def one(job):
        loop = asyncio.get_running_loop()
        try:
            async def body():
                result = await loop.run_in_executor(pool, job)
                if inspect.isawaitable(result):
                    result = await result
                return result
            result = await asyncio.wait_for(body(), timeout_s)
        except asyncio.TimeoutError:
            return f"error: the tool timed out after {timeout_s:g} s"
        except Exception as e:  # a tool's own failure is its answer
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result) if _jsonable(result) else str(result)

    async def all_jobs():
        return await asyncio.gather(*(one(job) for job in jobs))

    return asyncio.run(all_jobs())


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
