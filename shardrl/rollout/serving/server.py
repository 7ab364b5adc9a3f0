"""An OpenAI-compatible HTTP endpoint on a rollout backend (`shardrl serve`, and the endpoint of an RL run's agent
episodes): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (FastAPI on uvicorn), for agents that call a chat-completions API.

Requests are batched (`Batcher`): on the fast backend continuously (a request's rows join the running
`generate_stream` at its next host sync and leave as they end), elsewhere one `generate` call at a time over the
requests that waited for it (those with equal sampling settings share a call; the longest `max_tokens` of a call
is generated and each response is cut at its own). Each choice carries the exact token ids and per-token
log-probs of the sampler (`token_ids`, `logprobs`) and the response the prompt's ids (`prompt_token_ids`), as
vLLM's token-in-token-out extension does, so an RL trainer can train on precisely what was sampled; where the
weights may change while a batch generates (an RL run's partial rollouts), also each token's policy version
(`token_versions`) and the first's (`policy_version`). A request whose
client went away before its batch started is dropped from the batch.

Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 404 for an unknown model, 400 for a malformed
body, a prompt plus `max_tokens` over the context length, or options this server does not take (`stream`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import inspect
import json
import logging
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardrl.rollout.base import SamplingParams, cut_responses

log = logging.getLogger(__name__)


MAX_N = 128
"""Samples a request may ask for (n) at most."""
GREEDY_BELOW = 1e-5
"""A requested temperature below this is greedy (as vLLM's): dividing the logits by it would overflow them."""

STREAM_SEQ = 4096
"""Cache positions a stream's slot holds at least (up to the context), for the requests that join it."""

ALIVE_CHECKS = 32
"""How many waiting requests a running stream checks for a client that left, every 0.1 s (in turn, when more wait)."""
SWITCH_INTERVAL_S = 0.00005
"""The interpreter's thread switch interval while a batcher runs (`sys.setswitchinterval`; Python's default is 5 ms).
The generation thread gives up the interpreter lock at every CUDA call it waits on and needs it back to launch the
next decode step; with the HTTP thread busy on requests it waited up to the interval each time, and the GPU sat idle
between steps. One H200, Qwen2-1.5B shape, bench/serve.py: at 64 slots (session 18), 3.37 ms a decode step at 5 ms
against 2.41 for direct calls, 2.43 at 0.5 ms; at 256 slots (session 23), 5.4 ms a step at 0.5 ms and 2.96 at
0.05 ms, against 3.06 for direct calls (bench/RESULTS.md, "Current figures: Prefix reuse and the server")."""


class Message(BaseModel):
    """A chat message (tool calls and names pass as extra fields: the chat template reads them). `content`: a
    string, a list of parts (the text parts are joined), or null (an assistant turn that only calls tools)."""
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            others = [part.get("type") for part in self.content if part.get("type") not in ("text", "refusal")]
            if others:
                raise RequestError(f"a content part of type {others[0]!r} is not supported by this server (it serves "
                                   "a text model): send text parts only", "messages")
            message["content"] = "".join(part.get("text", part.get("refusal", "")) for part in self.content)
        message.setdefault("content", "")
        for call in message.get("tool_calls") or ():  # (OpenAI's arguments are a JSON string; templates render an
            function = call.get("function") if isinstance(call, dict) else None  # object: parsed, as vLLM does)
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    parsed = json.loads(function["arguments"])
                except ValueError:
                    continue  # (not JSON: rendered as sent)
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
        return message


class Common(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (unknown ones are accepted and ignored)."""
    model_config = ConfigDict(extra="allow")
    model: str
    temperature: StrictFloat | None = None  # (null as the client sends an unset value: the default, 1)
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # (vLLM's extension; 0 or -1: off)
    n: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    session_id: str | None = None  # (shardrl's: the fast backend keeps the conversation's K/V for its next request)
    stop_token_ids: list[StrictInt] | None = None  # (vLLM's: a reply ends at the first of them, kept in token_ids)


class ChatRequest(Common):
    messages: list[Message]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None  # (alternatives: not given; 0 or null taken)
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None  # (vLLM's: e.g. {"enable_thinking": false})
    add_generation_prompt: StrictBool = True  # (vLLM's)
    continue_final_message: StrictBool = False  # (vLLM's: the last message's text is continued, not closed)


class CompletionRequest(Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # (strict: true is no token id)
    max_tokens: StrictInt | None = None  # (null: 16, as OpenAI's)
    logprobs: StrictInt | None = None


UNSUPPORTED = {  # option -> whether a value asks for something (the defaults clients send are no ask)
    "logit_bias": bool, "presence_penalty": bool, "frequency_penalty": bool, "echo": bool, "suffix": bool,
    "best_of": lambda v: v not in (None, 1),
    "response_format": lambda v: bool(v) and v != {"type": "text"},
    # vLLM's extensions that change what is sampled
    "repetition_penalty": lambda v: v not in (None, 1), "min_p": bool, "min_tokens": bool, "ignore_eos": bool,
    "guided_json": bool, "guided_regex": bool, "guided_choice": bool, "guided_grammar": bool,
    "structured_outputs": bool, "allowed_token_ids": bool, "bad_words": bool, "use_beam_search": bool,
    "logits_processors": bool,
    # OpenAI's that a text model served without tool-call parsing cannot honour (tool calls stay in the text)
    "tool_choice": lambda v: v not in (None, "auto", "none"), "modalities": lambda v: v not in (None, ["text"]),
    "audio": bool, "reasoning_effort": bool, "prediction": bool, "web_search_options": bool,
}
"""OpenAI's (and vLLM's) request options this server does not apply: a request that asks for one is refused (400),
not answered as if it had been applied."""


ALIVE_EVERY_S = 0.1
"""How often a running stream asks whether its waiting clients are still connected (`due_for_check`)."""


class Stopped(RuntimeError):
    """A request the server did not answer because it is stopping: a 503 (code `server_stopping`)."""


class RequestError(ValueError):
    """A bad request: answered with `status` and an OpenAI-style JSON error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _left(item) -> bool:
    """Whether `item`'s client has left, asked from any thread (an `alive` with a `left` attribute: build_app's,
    the engine service's); False where it cannot be told without the event loop."""
    left = getattr(item.alive, "left", None)
    return left is not None and left()


@dataclass
class Pending:
    """One request's prompts waiting for a batch."""
    prompts: list[list[int]]
    sampling: SamplingParams
    future: asyncio.Future
    alive: Any = None  # async () -> bool: whether the client is still connected
    session: str | None = None  # the conversation it continues: its K/V is kept for the next request


class Dropped(Exception):
    """The request's client went away: before its batch (nothing was generated for it), or while it generated
    (a streaming backend ended its rows at the next host sync)."""


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        (future.set_exception if isinstance(value, BaseException) else future.set_result)(value)


class _Stream:
    """The feed of one `FastRollout.generate_stream` (its `RowFeed`): requests join while it runs (`add`, on the
    event loop), their rows are taken at the engine's host syncs (`take`, on the generation thread) and each
    request is answered when its last row ends (`finished`). The stream ends when no row is left and none came for
    `idle_s`, or when closed (a request with other sampling settings, or a longer context, waits for the next).
    Rows of a request whose client left end at the next sync (`cancel`)."""

    def __init__(self, batcher: Batcher, loop, sampling: SamplingParams, need_seq: int, idle_s: float):
        self.batcher, self.loop, self.sampling, self.need_seq, self.idle_s = batcher, loop, sampling, need_seq, idle_s
        self.cond = threading.Condition()
        self.new: list[tuple[torch.Tensor, int]] = []  # rows not taken yet
        self.rows: dict[int, tuple[Pending, int, list[int]]] = {}  # row -> (request, its output index, prompt)
        self.added = 0  # rows so far (the next one's number)
        self.outs: dict[int, list] = {}  # id(request) -> its outputs so far
        self.left: dict[int, int] = {}
        self.gone: set[int] = set()  # rows of requests whose clients left
        self.just_gone: list[int] = []  # ... not yet handed to the engine
        self.items: list[Pending] = []
        self.taken, self.open = 0, True

    def key(self) -> tuple:
        return self.batcher.settings(self.sampling)

    def add(self, item: Pending) -> bool:
        """Joins `item` (same settings; every row within need_seq); False if the stream has ended or it does not fit."""
        if self.batcher.settings(item.sampling) != self.key() or item.sampling.seed is not None:
            return False  # (a seeded request is generated in a batch of its own kind: reproducible)
        if any(len(p) + item.sampling.max_new_tokens > self.need_seq for p in item.prompts):
            return False
        with self.cond:
            if not self.open:
                return False
            rows = [(p, k) for k, p in enumerate(p for p in item.prompts for _ in range(item.sampling.n))]
            self.outs[id(item)], self.left[id(item)] = [None] * len(rows), len(rows)
            self.items.append(item)
            for p, k in rows:
                self.new.append((torch.tensor(p, dtype=torch.long), item.sampling.max_new_tokens))
                self.rows[self.added] = (item, k, p)
                self.added += 1
            self.cond.notify()
        return True

    def close(self) -> None:
        with self.cond:
            self.open = False
            self.cond.notify()

    def cancel(self, item: Pending) -> None:
        with self.cond:
            rows = [r for r, (owner, _, _) in self.rows.items() if owner is item]
            self.gone.update(rows)
            self.just_gone.extend(rows)

    # ---- the generation thread --------------------------------------------------------------------------
    def take(self, block: bool) -> list[tuple[torch.Tensor, int]]:
        with self.cond:
            if block:
                deadline = time.monotonic() + self.idle_s
                while not self.new and self.open and (left := deadline - time.monotonic()) > 0:
                    self.cond.wait(left)
                if not self.new:
                    self.open = False  # idle: the stream ends (a later request starts the next)
            new, self.new = self.new, []
            first, self.taken = self.taken, self.taken + len(new)
            # (a row whose client left before it was taken makes one token, unanswered)
            return [(p, 1 if first + i in self.gone else limit) for i, (p, limit) in enumerate(new)]

    def cancelled(self) -> list[int]:
        with self.cond:
            rows, self.just_gone = self.just_gone, []
            return rows

    def finished(self, row: int, tokens: list[int], log_probs: torch.Tensor) -> None:
        with self.cond:
            item, k, prompt = self.rows.pop(row)
            self.gone.discard(row)
        if item.future.done():
            return
        b, stop = self.batcher, self.sampling.stop
        lengths, texts = cut_responses(b.tokenizer, b.stop_ids, torch.tensor([tokens], dtype=torch.long), stop)
        ids = tokens[: lengths[0]]
        self.outs[id(item)][k] = b.choice(prompt, ids, log_probs[: len(ids)].tolist(), texts[0],
                                          item.sampling.max_new_tokens, stop, len(tokens) > len(ids))
        self.left[id(item)] -= 1
        if self.left[id(item)] == 0:
            b.stats["requests"] += 1
            self.left.pop(id(item))
            b.keep_session(item, self.outs[id(item)])
            try:
                self.loop.call_soon_threadsafe(_resolve, item.future, self.outs.pop(id(item)))
            except RuntimeError:  # (the loop closed: the server stopped, and answered it)
                pass

    def unanswered(self) -> list[Pending]:
        """The requests not answered yet (the answered ones are forgotten: a stream may run for hours)."""
        self.items = [item for item in self.items if not item.future.done()]
        return self.items


def due_for_check(waiting: list, last_check: dict[int, tuple], now: float,
                  limit: int = ALIVE_CHECKS) -> tuple[list, dict[int, tuple]]:
    """The waiting requests whose clients to check for having left now: at most `limit` (each check takes the
    interpreter lock from the generation thread; hundreds of clients checked ten times a second slowed its decode
    steps), in turn: those checked longest ago first, a new one as if checked when first seen (requests keep coming
    and must not take every check), ties in arrival order. Kept by request, not by position: answered requests leave
    the list, and a cursor into it skipped those behind them. Returns them and `last_check` (id(request) -> when it
    was last checked or first seen, as below) for the requests still waiting."""
    # (when, 0) first seen then, (when, 1) checked then: one seen at a tick goes before one checked at it
    last_check = {id(item): last_check.get(id(item), (now, 0)) for item in waiting}
    due = heapq.nsmallest(limit, waiting, key=lambda item: last_check[id(item)])
    for item in due:
        last_check[id(item)] = (now, 1)
    return due, last_check


class Batcher:
    """Runs the waiting requests through the rollout in a worker thread (the event loop keeps taking requests
    meanwhile).

    Streaming (a backend with `generate_stream`, the fast one; `stream`, default on where it can): continuous
    batching. One `generate_stream` runs while requests come; each request's rows join the running batch at the
    engine's next host sync and leave it as they end, each with its own `max_tokens`, and a request is answered
    when its rows are done. Requests with other sampling settings (or a longer context than the stream's cache)
    wait for the stream to drain. A request whose client leaves while it generates ends at the next sync, its
    slot free (`stats["cancelled"]`). Not while the weights may change inside a call (partial rollouts: a weight
    hook) or the rollout records routing: then batches.

    Batches (otherwise): one `generate` at a time over the waiting requests. A batch holds at most `max_batch`
    rows (a request's prompts times its n); a rollout that takes a limit per prompt (the fast one) gets each row's
    own `max_tokens`, others generate the batch's longest for every row, so a batch then also keeps its longest
    prompt plus that within `max_model_len`."""

    def __init__(self, rollout, tokenizer, max_batch: int = 64, max_model_len: int | None = None,
                 stream: bool | None = None, idle_s: float = 0.2, overlap: bool = True):
        from shardrl.tokenizer import stop_token_ids

        # `overlap`: the stream admits new rows after it launches the decode steps of those already decoding
        # (`FastRollout.generate_stream`), so the admission's Python launches run while the device decodes. One H100,
        # 256 `openai` clients (bench/RESULTS.md, session 29): 0.85-0.91 of direct calls with it, 0.79-0.83 without
        self.overlap = overlap
        self.rollout, self.tokenizer, self.max_batch, self.max_model_len = rollout, tokenizer, max_batch, max_model_len
        self.per_row_limits = "max_new_tokens" in inspect.signature(rollout.generate).parameters
        self.stop_ids = set(getattr(rollout, "stop_ids", None) or stop_token_ids(tokenizer))
        can_stream = hasattr(rollout, "generate_stream")
        if stream and not can_stream:
            raise ValueError(f"stream=True needs a backend with generate_stream (the fast one), not "
                             f"{type(rollout).__name__}")
        self.stream, self.idle_s = can_stream if stream is None else stream, idle_s
        self.queue: asyncio.Queue[Pending] | None = None
        self.task: asyncio.Task | None = None
        self.current: _Stream | None = None  # the running stream
        self.later: list[Pending] = []  # requests that wait for it to drain
        self.paused = False  # (`pause`): no generation starts
        self.busy = False  # a generation runs
        self.idle = threading.Event()  # no generation thread runs (one of a cancelled task runs on to its end)
        self.idle.set()
        self.held: list[Pending] = []  # requests taken from the queue while paused
        self.stats = {"batches": 0, "streams": 0, "requests": 0, "dropped": 0, "cancelled": 0, "failed": 0}
        self.open: dict[int, Pending] = {}  # id -> every request not answered yet (`stop` answers them)
        self.stopped = False

    @staticmethod
    def settings(s: SamplingParams) -> tuple:
        """What requests sharing a generate call must agree on."""
        return (s.temperature, s.top_p, s.top_k, s.greedy, s.seed, tuple(s.stop))

    def pause(self, timeout_s: float = 60.0) -> None:
        """From another thread: no generation starts until `unpause` (requests wait), the running stream ends as soon
        as its rows do, and this returns when no generation runs, so the rollout is free (an RL run moves weights;
        requests an episode left behind wait for the next step)."""
        self.paused = True
        stream = self.current
        if stream is not None:
            stream.close()
        deadline = time.monotonic() + timeout_s
        while (self.busy or not self.idle.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)
        if self.busy or not self.idle.is_set():
            raise RuntimeError(f"the endpoint's generation did not end within {timeout_s:g} s")

    def unpause(self) -> None:
        self.paused = False

    def keep_session(self, item: Pending, outs: list[dict]) -> None:
        """A request of a session (on the generating thread): its conversation's K/V kept for the next one."""
        pin = getattr(self.rollout, "pin_session", None)
        if item.session is not None and pin is not None and outs and outs[0] is not None:
            pin(item.session, outs[0]["prompt_token_ids"] + outs[0]["token_ids"])

    def streaming(self) -> bool:
        return (self.stream and getattr(self.rollout, "weight_hook", None) is None
                and not getattr(self.rollout, "record_routing", False))

    def choice(self, prompt: list[int], token_ids: list[int], log_probs: list[float], text: str, limit: int,
               stop: list[str], cut: bool) -> dict:
        """One choice's record: `token_ids` cut to the response (`cut`: tokens past a stop string or an end token
        were dropped); finish_reason "length" only for a response that reached `limit` without ending."""
        stopped = bool(stop) and any(x in self.tokenizer.decode(token_ids) for x in stop)
        ended = cut or len(token_ids) < limit or bool(token_ids and token_ids[-1] in self.stop_ids) or stopped
        return dict(prompt_token_ids=prompt, token_ids=token_ids, text=text, log_probs=log_probs,
                    finish_reason="stop" if ended else "length")

    async def start(self) -> None:
        if not await asyncio.to_thread(self.idle.wait, 60):  # (started again: the last generation ends first)
            raise RuntimeError("the batcher's last generation did not end within 60 s of its stop")
        self.stopped = False
        self.queue = asyncio.Queue()
        self.task = asyncio.create_task(self._loop())
        self._switch_interval = sys.getswitchinterval()  # (restored by stop)
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def stop(self) -> None:
        """Stops taking requests: the running stream's rows end at its next host sync (waited for, up to 5 s; a batch
        already generating ends at its next step where the backend can (`Rollout.abort`), else runs to its end, unread),
        and every request not answered yet gets an error (`Stopped`)."""
        if self.stopped:  # (once: a uvicorn server stops it, then its lifespan again)
            return
        self.stopped = True
        if getattr(self, "_switch_interval", None) is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        stream = self.current
        if stream is not None:
            stream.close()
            for item in stream.unanswered():
                stream.cancel(item)
        for item in list(self.open.values()):
            _resolve(item.future, Stopped("the server stopped before this request was answered"))
        if stream is not None:
            await asyncio.wait({self.stream_task}, timeout=5)  # (it ends at its next sync)

    async def submit(self, prompts: list[list[int]], sampling: SamplingParams, alive=None,
                     session: str | None = None) -> list[dict]:
        if self.stopped:
            raise Stopped("the server is stopping: it takes no more requests")
        item = Pending(prompts, sampling, asyncio.get_running_loop().create_future(), alive, session)
        self.open[id(item)] = item
        item.future.add_done_callback(lambda _, key=id(item): self.open.pop(key, None))
        await self.queue.put(item)
        return await item.future

    def _chunks(self, items: list[Pending]) -> list[list[Pending]]:
        """`items` (equal sampling settings) cut into batches of at most `max_batch` rows (a larger request alone)
        whose rows fit the context where every row generates the batch's longest."""
        chunks, current, rows, prompt, new = [], [], 0, 0, 0
        for item in items:
            r = len(item.prompts) * item.sampling.n
            p = max(len(x) for x in item.prompts)
            m = item.sampling.max_new_tokens
            too_long = (not self.per_row_limits and self.max_model_len is not None
                        and max(prompt, p) + max(new, m) > self.max_model_len)
            if current and (rows + r > self.max_batch or too_long):
                chunks.append(current)
                current, rows, prompt, new = [], 0, 0, 0
            current.append(item)
            rows, prompt, new = rows + r, max(prompt, p), max(new, m)
        if current:
            chunks.append(current)
        return chunks

    async def _alive(self, item: Pending) -> bool:
        """False (and the request answered Dropped) if its client left before it started."""
        if item.future.done() or (item.alive is not None and not await item.alive()):
            self.stats["dropped"] += 1
            _resolve(item.future, Dropped())
            return False
        return True

    async def _loop(self) -> None:
        deferred: list[Pending] = []
        while True:
            waiting = deferred or [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            self.held = waiting
            while True:  # (busy first: a `pause` from now on waits for this generation)
                self.busy = True
                if not self.paused:
                    break
                self.busy = False
                await asyncio.sleep(0.005)
                while not self.queue.empty():
                    waiting.append(self.queue.get_nowait())
            self.held = []
            try:
                live = [item for item in waiting if await self._alive(item)]
                deferred = []
                if not live:
                    continue
                if self.streaming() and live[0].sampling.seed is None:
                    deferred = await self._run_stream(live)
                else:
                    await self._run_batches(live)
            finally:
                self.busy = False

    async def _run_batches(self, live: list[Pending]) -> None:
        groups: dict[tuple, list[Pending]] = {}
        for item in live:
            groups.setdefault(self.settings(item.sampling), []).append(item)
        for items in groups.values():
            seeded = items[0].sampling.seed is not None  # (each such request a call of its own: reproducible)
            for chunk in ([[item] for item in items] if seeded else self._chunks(items)):
                await self._run(chunk)

    async def _run_stream(self, live: list[Pending]) -> list[Pending]:
        """One stream from the first of `live`'s settings until it drains; returns the requests left for later."""
        first = live[0]
        need = max(len(p) + item.sampling.max_new_tokens for item in live for p in item.prompts
                   if self.settings(item.sampling) == self.settings(first.sampling))
        need = max(need, min(self.max_model_len or need, STREAM_SEQ))  # room for what comes while it runs
        stream = _Stream(self, asyncio.get_running_loop(), first.sampling, need, self.idle_s)
        later = [item for item in live if not stream.add(item)]
        if later:  # (they wait for this one to drain; new requests go to the next stream)
            stream.close()
        self.current, self.later = stream, later
        run = self.stream_task = asyncio.create_task(asyncio.to_thread(self._generating, self._stream_generate,
                                                                        stream))
        checked, last_check = time.monotonic(), {}  # id(request) -> when its client was last checked (due_for_check)
        getter = None  # (a request's arrival wakes this loop: it joins the stream at once, not at a poll)
        try:
            while not run.done():
                getter = getter or asyncio.ensure_future(self.queue.get())
                due = max(0.0, ALIVE_EVERY_S - (time.monotonic() - checked))  # (the next check of the clients)
                await asyncio.wait({run, getter}, timeout=due, return_when=asyncio.FIRST_COMPLETED)
                arrived = []
                if getter.done():
                    arrived.append(getter.result())
                    getter = None
                while not self.queue.empty():
                    arrived.append(self.queue.get_nowait())
                for item in arrived:
                    if item.future.done():
                        continue
                    if not stream.add(item):
                        later.append(item)
                        stream.close()  # (it drains; the next stream takes them)
                if time.monotonic() - checked >= ALIVE_EVERY_S:  # clients that left: rows end at the next sync
                    checked = time.monotonic()
                    waiting, last_check = due_for_check(stream.unanswered(), last_check, checked)
                    for item in waiting:
                        if item.alive is not None and not await item.alive() and not item.future.done():
                            stream.cancel(item)
                            self.stats["cancelled"] += 1
                            _resolve(item.future, Dropped())
        finally:  # (also when this task is cancelled: no getter left waiting on the queue)
            if getter is not None:
                if getter.done() and not getter.cancelled():  # (an alive() that awaited let one in: the next's)
                    later.append(getter.result())
                else:
                    getter.cancel()  # (a request that arrives meanwhile stays in the queue)
        try:
            run.result()
        except Exception:  # noqa: BLE001 (the server stays up; one bad request must not fail the others)
            log.exception("a stream failed; its unanswered requests are retried in batches")
            for chunk in self._chunks(list(stream.unanswered())):
                await self._run(chunk)  # (a failing batch is retried one request at a time)
        self.current, self.later = None, []
        for item in stream.unanswered():  # (a row the engine never reported: answered, not left waiting)
            _resolve(item.future, RuntimeError("the generation ended without this request's responses"))
        return later

    def _generating(self, generate, *args):
        """`generate(*args)` (on a worker thread), `idle` clear meanwhile."""
        self.idle.clear()
        try:
            return generate(*args)
        except StopIteration as e:  # (it cannot cross into the awaiting coroutine: the request would hang)
            raise RuntimeError(f"the generation raised StopIteration: {e!r}") from e
        finally:
            self.idle.set()

    def _stream_generate(self, stream: _Stream) -> None:
        self.stats["streams"] += 1
        s = stream.sampling
        sampling = SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  max_new_tokens=max(1, stream.need_seq), stop=s.stop, seed=s.seed, greedy=s.greedy)
        # slots: max_batch, fewer for a long context (at most max_batch * STREAM_SEQ cache positions in all)
        slots = max(1, min(self.max_batch, self.max_batch * STREAM_SEQ // stream.need_seq))
        self.rollout.generate_stream([], [], sampling, stream, stream.need_seq, num_slots=slots, overlap=self.overlap)

    async def _run(self, chunk: list[Pending]) -> None:
        try:
            outs = await asyncio.to_thread(self._generating, self._generate, chunk)
        except Exception as e:  # noqa: BLE001 (the requests fail, the server stays up)
            if len(chunk) > 1:  # one bad request must not fail the others: each alone
                for item in chunk:
                    await self._run([item])
                return
            log.exception("generation failed")
            self.stats["failed"] += 1
            outs = [e]
        for item, out in zip(chunk, outs):
            if item.future.done():
                continue
            if _left(item):  # (its client gone: the batch may have ended early for it, `Rollout.abort`)
                self.stats["cancelled"] += 1
                _resolve(item.future, Dropped())
                continue
            if isinstance(out, Exception):
                item.future.set_exception(out)
            else:
                item.future.set_result(out)

    def _generate(self, items: list[Pending]) -> list[list[dict]]:
        """One `generate` over every prompt of `items` (each prompt once per sample: n may differ per request); a
        seeded request (alone) one call per prompt, so that a prompt's samples do not depend on the others."""
        if items[0].sampling.seed is not None and len(items) == 1 and len(items[0].prompts) > 1:
            parts = [self._generate([dataclasses.replace(items[0], prompts=[p])])[0] for p in items[0].prompts]
            return [[out for part in parts for out in part]]
        rows, owners = [], []
        for i, item in enumerate(items):
            for p in item.prompts:
                for _ in range(item.sampling.n):
                    rows.append(p)
                    owners.append(i)
        s = items[0].sampling
        limits = [items[o].sampling.max_new_tokens for o in owners]
        longest = max(limits)
        sampling = SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  max_new_tokens=longest, stop=s.stop, seed=s.seed, greedy=s.greedy)
        pad = self.tokenizer.pad_token_id
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[j, width - len(r):] = 1
        kwargs = {"max_new_tokens": limits} if self.per_row_limits else {}
        # a stop, or every client of the batch gone, ends it where the backend can (hf): nobody would read it
        self.rollout.abort = lambda: self.stopped or all(_left(item) for item in items)
        try:
            out = self.rollout.generate(ids, mask, sampling, **kwargs)
        finally:
            self.rollout.abort = None
        self.stats["batches"] += 1
        self.stats["requests"] += len(items)
        results: list[list[dict]] = [[] for _ in items]
        for j, owner in enumerate(owners):
            limit = limits[j]
            length = int(out.response_mask[j].sum())
            token_ids = out.response_ids[j, :min(length, limit)].tolist()
            log_probs = out.sampled_log_probs[j, :len(token_ids)].tolist()
            if length > limit:  # generated for a longer request of the batch: cut at this one's limit
                result = dict(prompt_token_ids=rows[j], token_ids=token_ids, log_probs=log_probs, finish_reason="length",
                              text=self.tokenizer.decode(token_ids, skip_special_tokens=True))
            else:
                result = self.choice(rows[j], token_ids, log_probs, out.response_text[j], limit, s.stop, False)
            if out.token_version is not None:  # weights that change while it generates (partial rollouts)
                result["token_versions"] = out.token_version[j, :len(token_ids)].tolist()
                result["policy_version"] = result["token_versions"][0] if token_ids else None
            results[owner].append(result)
        for item, outs in zip(items, results):
            self.keep_session(item, outs)
        return results


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


EPISODE_HEADER = "x-shardrl-episode"
"""A request carrying this header is recorded under its value (`app.state.records`: episode -> calls)."""


def build_app(batcher: Batcher, model_name: str, max_model_len: int, default_max_tokens: int = 256,
              policy: SamplingParams | None = None):
    """The FastAPI app serving `batcher`'s rollout as `model_name`; prompts plus `max_tokens` are limited to
    `max_model_len` tokens; a chat request without max_tokens gets `default_max_tokens` (what is left of the
    context if less). `policy` (an RL run's endpoint): every request samples with its temperature, top-p, top-k
    and seed whatever it asks (the trainer's log-probs assume them), at most its max_new_tokens a call, n=1."""
    from contextlib import asynccontextmanager


    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="shardrl", lifespan=lifespan)
    app.state.policy = policy  # (an RL run's endpoint sets it per generate call: training, validation)
    tok = batcher.tokenizer

    def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                                   "param": param, "code": code}})

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # (its loc: the character where the JSON broke)
            at = first.get("loc", ("body", "?"))[-1]
            return error(400, f"invalid request: the body is not valid JSON (at character {at}: "
                              f"{first.get('ctx', {}).get('error', first.get('msg'))})")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if not where:  # (no body at all, or JSON that is no object)
            if first.get("type") == "missing":
                return error(400, "invalid request: the body is missing: send a JSON object")
            kind = request.headers.get("content-type", "")
            if isinstance(first.get("input"), (bytes, str)) and "json" not in kind:  # (FastAPI did not parse it)
                return error(400, f"invalid request: the body was sent as {kind or 'no content type'}: send it as "
                                  "JSON with the header Content-Type: application/json")
            got = type(first.get("input")).__name__.replace("NoneType", "null")
            return error(400, f"invalid request: the body must be a JSON object, not {got}")
        if where.startswith("prompt."):  # (a union: pydantic names its first form only)
            return error(400, "invalid request: prompt must be a string, a list of strings, a list of token ids "
                              "(integers) or a list of lists of token ids", "prompt")
        return error(400, f"invalid request: {where}: {first.get('msg', 'malformed body')}", where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # (an unknown route or method: in OpenAI's error shape too)
        response = error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        response.headers.update(exc.headers or {})  # (a 405's Allow)
        return response

    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        return error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(Stopped)
    async def stopping(request, exc):
        return JSONResponse(status_code=503, content={"error": {
            "message": str(exc), "type": "server_error", "param": None, "code": "server_stopping"}})

    @app.exception_handler(Dropped)
    async def dropped(request, exc):  # (nobody reads it: the client is gone)
        return error(499, "the client closed the request before its batch started")

    @app.exception_handler(Exception)
    async def failed(request, exc):
        return JSONResponse(status_code=500, content={"error": {
            "message": f"generation failed: {type(exc).__name__}: {exc}", "type": "server_error", "param": None,
            "code": None}})

    vocab = len(tok)

    def check(req: Common, prompts: list[list[int]], max_tokens: int) -> SamplingParams:
        refuse_unsupported(req)
        if isinstance(req, ChatRequest) and req.top_logprobs:
            raise RequestError(f"top_logprobs={req.top_logprobs} is not supported by this server (it gives no "
                               "alternative tokens): logprobs=true gives each sampled token's log-prob; leave "
                               "top_logprobs out", "top_logprobs")
        if isinstance(req, CompletionRequest) and req.logprobs is not None and not 0 <= req.logprobs <= 1:
            raise RequestError(f"logprobs={req.logprobs} is not supported by this server (it gives no alternative "
                               "tokens): send logprobs=0 or 1 for each sampled token's log-prob (token_logprobs)",
                               "logprobs")
        if req.model != model_name:
            raise RequestError(f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                               "model", 404, "model_not_found")
        if req.stream:
            raise RequestError("stream=true is not supported by this server; leave it false", "stream")
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise RequestError(f"n={n} must be in [1, {MAX_N}]", "n")
        if not prompts or any(not p for p in prompts):
            raise RequestError("the prompt is empty", "prompt")
        bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        bad = next((t for t in req.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        longest = max(len(p) for p in prompts)
        if longest >= max_model_len:
            raise RequestError(f"this model's context is {max_model_len} tokens and the prompt has {longest}: "
                               "shorten the prompt", "messages" if isinstance(req, ChatRequest) else "prompt",
                               code="context_length_exceeded")
        if max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
        if longest + max_tokens > max_model_len:
            raise RequestError(f"this model's context is {max_model_len} tokens; the prompt has {longest} and "
                               f"max_tokens asks {max_tokens} more: shorten the prompt or lower max_tokens",
                               "max_tokens", code="context_length_exceeded")
        policy = app.state.policy
        if policy is not None:
            if n != 1:
                raise RequestError(f"n={n}: an RL run's endpoint samples one reply a call; send n=1", "n")
            return dataclasses.replace(policy, n=1, max_new_tokens=min(max_tokens, policy.max_new_tokens),
                                       stop=_stop_list(req.stop) or policy.stop)
        try:
            temperature = 1.0 if req.temperature is None else req.temperature
            top_p = 1.0 if req.top_p is None else req.top_p
            # (top_p 0 keeps only the likeliest token, as OpenAI's; a temperature below 1e-5 is greedy, as vLLM's)
            greedy = 0 <= temperature < GREEDY_BELOW or top_p == 0
            # (greedy draws nothing: its seed and temperature are dropped, so it batches with the other greedy
            # requests, not in a call of its own; its log-probs are at temperature 1 whatever was sent)
            return SamplingParams(n=n, temperature=1.0 if greedy else temperature, top_p=top_p or 1.0,
                                  top_k=0 if req.top_k in (None, -1) or req.top_k >= vocab else req.top_k,
                                  max_new_tokens=max_tokens,
                                  stop=_stop_list(req.stop), seed=None if greedy else req.seed, greedy=greedy)
        except ValueError as e:  # SamplingParams names the field
            field = re.match(r"SamplingParams\.(\w+)", str(e))
            param = None if field is None else field.group(1).replace("max_new_tokens", "max_tokens")
            raise RequestError(str(e).replace("SamplingParams.", "").replace("max_new_tokens", "max_tokens"), param)

    def refuse_unsupported(req: Common) -> None:
        """OpenAI's options that would change what is sampled, which this server does not apply: refused, not
        ignored (a trainer must not think a bias or penalty shaped the tokens it trains on)."""
        extra = req.model_extra or {}
        for name, applies in UNSUPPORTED.items():
            if name in extra and applies(extra[name]):
                raise RequestError(f"{name}={extra[name]!r} is not supported by this server; leave it out", name)

    async def submit(request: Request, req, prompts: list[list[int]], sampling: SamplingParams) -> list[dict]:
        """`batcher.submit`, the client's connection watched meanwhile (not polled: an ASGI receive after the body
        returns only when the client disconnects or the response is complete) and `connected` telling it."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def connected() -> bool:
            return not watcher.done()

        watcher = asyncio.ensure_future(watch())
        connected.gone = watcher  # (a waiter can wait on it instead of asking)
        connected.left = watcher.done  # (and a generation thread ask without the loop: `_left`)
        try:
            return await batcher.submit(prompts, sampling, connected, session(request, req))
        finally:
            watcher.cancel()

    app_records: dict[str, list[dict]] = {}

    def cut_at_stop_ids(req: Common, outs: list[dict]) -> list[dict]:
        """Each reply ended at the first of the request's `stop_token_ids` (generated past it, then cut: the stop
        token stays in token_ids, out of the text, as vLLM's): its log-probs and versions cut alike."""
        ends = set(req.stop_token_ids or ())
        for o in outs if ends else ():
            at = next((i for i, t in enumerate(o["token_ids"]) if t in ends), None)
            if at is None:
                continue
            keep = at + 1
            for key in ("token_ids", "log_probs", "token_versions"):
                if key in o:
                    o[key] = o[key][:keep]
            text = tok.decode(o["token_ids"][:at], skip_special_tokens=True)
            for x in _stop_list(req.stop):  # (a stop string before it cuts the text as before)
                text = text.split(x, 1)[0]
            o["text"], o["finish_reason"] = text, "stop"
        return outs

    def session(request: Request, req: Common) -> str | None:
        """The conversation a request continues: its `session_id`, or an RL run's episode."""
        return req.session_id or request.headers.get(EPISODE_HEADER)

    def record(request: Request, outs: list[dict]) -> None:
        episode = request.headers.get(EPISODE_HEADER)
        if episode is not None and app.state.policy is not None:  # (an RL run's endpoint: its agent reads them)
            app_records.setdefault(episode, []).extend(outs)

    def versions(o: dict) -> dict:
        """A choice's policy versions, where the weights may change while it generates (partial rollouts)."""
        return {k: o[k] for k in ("policy_version", "token_versions") if k in o}

    def usage(prompts, choices) -> dict:
        prompt = sum(len(p) for p in prompts)
        completion = sum(len(c["token_ids"]) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "shardrl",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                               "model", 404, "model_not_found")
        return card()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        messages = [m.for_template() for m in req.messages]
        if not messages:
            raise RequestError("messages is empty: send at least one message", "messages")
        if not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            if req.continue_final_message and req.add_generation_prompt:
                raise RequestError("continue_final_message=true continues the last message: send it with "
                                   "add_generation_prompt=false", "continue_final_message")
            options = {"add_generation_prompt": req.add_generation_prompt,  # (the kwargs win, as vLLM's)
                       "continue_final_message": req.continue_final_message,
                       **({"tools": req.tools} if req.tools else {}), **(req.chat_template_kwargs or {})}
            ids = tok.apply_chat_template(messages, tokenize=True, **options)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 (the template's own checks, e.g. alternating roles)
            raise RequestError(f"the chat template refused the messages: {e}", "messages")
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = given if given is not None else max(1, min(default_max_tokens, max_model_len - len(ids)))
        sampling = check(req, [ids], max_tokens)
        outs = cut_at_stop_ids(req, await submit(request, req, [ids], sampling))
        record(request, outs)
        choices = []
        for i, o in enumerate(outs):
            choice = {"index": i, "message": {"role": "assistant", "content": o["text"]},
                      "finish_reason": o["finish_reason"], "token_ids": o["token_ids"], "logprobs": None,
                      **versions(o)}
            if req.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(o["token_ids"], o["log_probs"])]}
            choices.append(choice)
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": model_name, "choices": choices,
                             "prompt_token_ids": ids, "usage": usage([ids], outs)})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        p = req.prompt
        if isinstance(p, str):
            prompts = [tok(p, add_special_tokens=False)["input_ids"]]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [list(x) if isinstance(x, list) else tok(x, add_special_tokens=False)["input_ids"] for x in p]
        default = max(1, min(16, max_model_len - max((len(x) for x in prompts), default=0)))  # (OpenAI's 16, in context)
        sampling = check(req, prompts, default if req.max_tokens is None else req.max_tokens)
        n = sampling.n
        flat = cut_at_stop_ids(req, await submit(request, req, prompts, sampling))  # prompt-major
        record(request, flat)
        choices = []
        for outs in [flat[i * n:(i + 1) * n] for i in range(len(prompts))]:
            for o in outs:
                choice = {"index": len(choices), "text": o["text"], "finish_reason": o["finish_reason"],
                          "token_ids": o["token_ids"], "prompt_token_ids": o["prompt_token_ids"], "logprobs": None,
                          **versions(o)}
                if req.logprobs is not None:
                    choice["logprobs"] = {"tokens": tok.convert_ids_to_tokens(o["token_ids"]),
                                          "token_logprobs": o["log_probs"], "top_logprobs": None,
                                          "text_offset": None}
                choices.append(choice)
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": model_name, "choices": choices,
                             "usage": usage(prompts, flat)})

    app.state.batcher, app.state.records = batcher, app_records
    return app



def free_port(host: str) -> int:
    """A port on `host` that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def uvicorn_server(config):
    """A `uvicorn.Server` for `config` (its app: `build_app`'s) that, when told to stop (SIGTERM, Ctrl-C,
    `should_exit`), first stops the app's batcher: the requests still waiting are answered (503) and a running
    generation ends, so that uvicorn's wait for the open connections is short (it waited for the generation)."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            try:
                await config.app.state.batcher.stop()
            except Exception:  # noqa: BLE001 (the rest of the shutdown still runs)
                log.exception("stopping the batcher failed")
            await super().shutdown(sockets=sockets)

    return StoppingServer(config)


class ServerThread:
    """An app served by uvicorn in a thread of this process on a free loopback port (`url`: its /v1 base)."""

    def __init__(self, app, host: str = "127.0.0.1", timeout_s: float = 60):
        import threading

        import uvicorn

        self.port = free_port(host)
        self.app = app
        self.server = uvicorn_server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server on {host}:{self.port} did not start")
            time.sleep(0.05)
        self.url = f"http://{host}:{self.port}/v1"

    @property
    def batcher(self) -> Batcher:
        return self.app.state.batcher

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
