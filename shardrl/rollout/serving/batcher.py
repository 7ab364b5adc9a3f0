"""The serving stack's batcher: the requests waiting on a rollout backend, run through it in a worker thread while
the event loop keeps taking requests (`Batcher`): on the fast backend as one continuous `generate_stream` that rows
join and leave (`_Stream`, its `RowFeed`), elsewhere as `generate` calls over the requests that waited. What the
HTTP side sends it and gets back is in `shardrl.rollout.serving.schema`; the app in `shardrl.rollout.serving.app`."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import inspect
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardrl.rollout.base import MAX_TOP_LOGPROBS, SamplingParams, cut_responses

log = logging.getLogger(__name__)


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


ALIVE_EVERY_S = 0.1
"""How often a running stream asks whether its waiting clients are still connected (`due_for_check`)."""


class Stopped(RuntimeError):
    """A request the server did not answer because it is stopping: a 503 (code `server_stopping`)."""


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
    adapter: str | None = None  # the LoRA adapter it asked for by name (`Batcher.adapters`); None: the base
    # on_tokens(k, tokens), on the event loop: output k's tokens as a stream makes them (a streamed reply's client
    # reads them at once); the last ones come only in the answer. A batch (not a stream) calls it never
    on_tokens: Any = None
    partly_sent: bool = False  # some of its tokens went to on_tokens (a failed stream cannot retry it)


class Dropped(Exception):
    """The request's client went away: before its batch (nothing was generated for it), or while it generated
    (a streaming backend ended its rows at the next host sync)."""


def with_top(result: dict, top: tuple[torch.Tensor, torch.Tensor] | None, k: int) -> dict:
    """`result` (a choice's record) with its tokens' `k` likeliest tokens, as lists (`top_ids`, `top_log_probs`: one
    list of k a token), from `top`: the generation's (ids, log-probs), (L', K) each with L' >= its tokens, K >= k."""
    if top is not None and k:
        length = len(result["token_ids"])
        result["top_ids"], result["top_log_probs"] = (t[:length, :k].tolist() for t in top)
    return result


def _generated_top(sampling: SamplingParams) -> int:
    """The likeliest tokens a generation for requests of `sampling`'s settings records: every request asking any
    shares one stream or batch (`Batcher.settings`), each cut to its own k."""
    return MAX_TOP_LOGPROBS if sampling.top_logprobs else 0


def _deliver(calls: list[tuple[Pending, int, list[int]]]) -> None:
    """(On the loop.) Each streamed request's new tokens to its `on_tokens`, unless it was answered meanwhile."""
    for item, k, tokens in calls:
        if not item.future.done():
            item.partly_sent = True
            try:
                item.on_tokens(k, tokens)
            except Exception:  # noqa: BLE001 (a reader's failure ends nothing: the whole reply still comes)
                log.exception("a streamed request's reader failed")


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
        self.adapter: str | None = None  # (its first request's: one adapter a stream)
        self.cond = threading.Condition()
        self.new: list[tuple[torch.Tensor, int]] = []  # rows not taken yet
        self.rows: dict[int, tuple[Pending, int, list[int]]] = {}  # row -> (request, its output index, prompt)
        self.added = 0  # rows so far (the next one's number)
        self.outs: dict[int, list] = {}  # id(request) -> its outputs so far
        self.left: dict[int, int] = {}
        self.gone: set[int] = set()  # rows of requests whose clients left
        self.just_gone: list[int] = []  # ... not yet handed to the engine
        self.items: list[Pending] = []
        self.streamed: set[int] = set()  # rows of requests that read their tokens as they come (`on_tokens`)
        self.halted: set[int] = set()  # ... that made an end token (EOS, end of turn): nothing more is handed over
        self.unsent: dict[int, list[int]] = {}  # ... their tokens not handed over yet (`Batcher.stream_interval`)
        self.taken, self.open = 0, True

    def key(self) -> tuple:
        return self.batcher.settings(self.sampling)

    def add(self, item: Pending) -> bool:
        """Joins `item` (same settings; every row within need_seq); False if the stream has ended or it does not fit."""
        if self.batcher.settings(item.sampling) != self.key() or item.sampling.seed is not None:
            return False  # (a seeded request is generated in a batch of its own kind: reproducible)
        if item.adapter != self.adapter:
            return False
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
                if item.on_tokens is not None:
                    self.streamed.add(self.added)
                self.added += 1
            self.cond.notify()
        return True

    def close(self) -> None:
        with self.cond:
            self.open = False
            self.cond.notify()

    def cancel(self, item: Pending) -> int:
        with self.cond:
            rows = [r for r, (owner, _, _) in self.rows.items() if owner is item]
            self.gone.update(rows)
            self.just_gone.extend(rows)
        return len(rows)

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

    def streamed_rows(self) -> set[int]:
        """The rows whose tokens go to their request's `on_tokens` as they are made (asked at every sync)."""
        if not self.streamed:
            return self.streamed
        with self.cond:
            return set(self.streamed)

    def progress(self, parts: list[tuple[int, list[int]]]) -> None:
        """Each streamed row's tokens since the last sync, to its request's `on_tokens` (in one hand-over to the
        loop a sync; before the answer, which a later sync hands over)."""
        calls, stops, every = [], self.batcher.stop_ids, self.batcher.stream_interval
        with self.cond:
            for row, tokens in parts:
                if row not in self.rows or row in self.gone or row in self.halted:
                    continue
                end = next((i for i, t in enumerate(tokens) if t in stops), None)
                if end is not None:  # (the reply ends there, whatever the row makes after: the answer says so)
                    tokens = tokens[:end]
                    self.halted.add(row)
                    self.streamed.discard(row)  # (nothing more to read back for it)
                # (held until `every` have come; a row that ended hands over what it has, its end token the sync's
                # first too)
                if every > 1 and (tokens or end is not None):
                    held = self.unsent.setdefault(row, [])
                    held += tokens
                    if len(held) < every and end is None:
                        continue
                    tokens = self.unsent.pop(row)
                if tokens:
                    calls.append((self.rows[row][0], self.rows[row][1], tokens))
        if calls:
            try:
                self.loop.call_soon_threadsafe(_deliver, calls)
            except RuntimeError:  # (the loop closed: the server stopped)
                pass

    def finished(self, row: int, tokens: list[int], log_probs: torch.Tensor,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        with self.cond:
            item, k, prompt = self.rows.pop(row)
            self.unsent.pop(row, None)  # (they come with the answer)
            self.gone.discard(row)
            self.streamed.discard(row)
            self.halted.discard(row)
        if item.future.done():  # (its client left, or it was cancelled: nothing to answer, its entries to forget)
            self.left[id(item)] -= 1
            if self.left[id(item)] == 0:
                self.left.pop(id(item))
                self.outs.pop(id(item))
            return
        b, stop = self.batcher, self.sampling.stop
        lengths, texts = cut_responses(b.tokenizer, b.stop_ids, torch.tensor([tokens], dtype=torch.long), stop)
        ids = tokens[: lengths[0]]
        self.outs[id(item)][k] = with_top(b.choice(prompt, ids, log_probs[: len(ids)].tolist(), texts[0],
                                                   item.sampling.max_new_tokens, stop, len(tokens) > len(ids)),
                                          top, item.sampling.top_logprobs)
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
    prompt plus that within `max_model_len`.

    LoRA adapters (`adapters`, `shardrl.rollout.lora_adapters.ServedAdapters`): a request names one (`submit`'s
    `adapter`); a stream or batch holds one adapter's requests, as it holds one kind of sampling settings, and the
    rollout switches to its adapter before it generates."""

    def __init__(self, rollout, tokenizer, max_batch: int = 64, max_model_len: int | None = None,
                 stream: bool | None = None, idle_s: float = 0.2, overlap: bool = True, adapters=None,
                 stream_interval: int = 1):
        from shardrl.tokenizer import stop_token_ids

        # `stream_interval` (vLLM's): a streamed row's tokens are handed over at a sync once at least this many have
        # come since its last hand-over (1: at every sync, `sync_every` tokens; the rest always come with the answer).
        # Fewer, larger chunks: less work a token for the front end, the clients' text in larger steps
        if stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval}: hand tokens over at least one at a time")
        self.stream_interval = stream_interval

        # `overlap`: the stream admits new rows after it launches the decode steps of those already decoding
        # (`FastRollout.generate_stream`), so the admission's Python launches run while the device decodes. One H100,
        # 256 `openai` clients (bench/RESULTS.md, session 29): 0.85-0.91 of direct calls with it, 0.79-0.83 without
        self.overlap = overlap
        # `adapters`: LoRA adapters over the rollout (`lora_adapters.ServedAdapters`), a request choosing one by name;
        # one adapter a generation (a stream or batch), switched between them (see README, "Several LoRA adapters")
        self.adapters = adapters
        self.lora_modules = adapters.modules if adapters is not None else []
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
        return (s.temperature, s.top_p, s.top_k, s.greedy, s.seed, tuple(s.stop), s.raw_log_probs,
                _generated_top(s))

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
        # (matched in the text the client sees, as the rollout's cut was: special tokens are no text, so a stop
        # string never matches in one, nor fails to match across one)
        decoded = self.tokenizer.decode(token_ids, skip_special_tokens=True) if stop else ""
        hits = [(decoded.find(x), x) for x in stop if x in decoded]  # (the first to occur ended it: its stop_reason)
        ended = cut or len(token_ids) < limit or bool(token_ids and token_ids[-1] in self.stop_ids) or bool(hits)
        return dict(prompt_token_ids=prompt, token_ids=token_ids, text=text, log_probs=log_probs,
                    finish_reason="stop" if ended else "length", stop_reason=min(hits)[1] if hits else None)

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
                     session: str | None = None, adapter: str | None = None, on_tokens=None) -> list[dict]:
        """The request's outputs (`choice` records), once all are made. `on_tokens(k, tokens)` (on this loop) is
        given output k's tokens as a stream makes them (not their last ones: those are in the answer)."""
        if self.stopped:
            raise Stopped("the server is stopping: it takes no more requests")
        if adapter is not None and (self.adapters is None or adapter not in self.adapters.adapters):
            raise ValueError(f"no LoRA adapter named {adapter!r} is served")
        item = Pending(prompts, sampling, asyncio.get_running_loop().create_future(), alive, session, adapter,
                       on_tokens)
        self.open[id(item)] = item
        item.future.add_done_callback(lambda _, key=id(item): self.open.pop(key, None))
        await self.queue.put(item)
        try:
            return await item.future
        except asyncio.CancelledError:  # (a streamed reply's client left: the HTTP server cancelled its task)
            self.abandon(item)
            raise

    def abandon(self, item: Pending) -> None:
        """`item`'s rows in the running stream end at its next sync (a batch ends where every client left:
        `_left`; a request still waiting is dropped when its batch starts, its future being done)."""
        stream = self.current
        if stream is not None and stream.cancel(item):
            self.stats["cancelled"] += 1

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
        for item in live:  # (one adapter a generate call)
            groups.setdefault((self.settings(item.sampling), item.adapter), []).append(item)
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
        stream.adapter = first.adapter
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
            retry = []
            for item in stream.unanswered():  # (a reply whose client has some of its tokens cannot start again)
                if item.partly_sent:
                    _resolve(item.future, RuntimeError("the generation failed after part of this reply was sent"))
                else:
                    retry.append(item)
            for chunk in self._chunks(retry):
                await self._run(chunk)  # (a failing batch is retried one request at a time)
        self.current, self.later = None, []
        for item in stream.unanswered():  # (a row the engine never reported: answered, not left waiting)
            _resolve(item.future, RuntimeError("the generation ended without this request's responses"))
        return later

    def use_adapter(self, name: str | None) -> None:
        """The rollout generates with LoRA adapter `name` (None: the base), on the generation thread."""
        if self.adapters is not None:
            self.adapters.activate(name)

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
                                  max_new_tokens=max(1, stream.need_seq), stop=s.stop, seed=s.seed, greedy=s.greedy,
                                  raw_log_probs=s.raw_log_probs, top_logprobs=_generated_top(s))
        # slots: max_batch, fewer for a long context (at most max_batch * STREAM_SEQ cache positions in all)
        slots = max(1, min(self.max_batch, self.max_batch * STREAM_SEQ // stream.need_seq))
        self.use_adapter(stream.adapter)
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
            if item.future.cancelled():  # (a streamed reply whose client left: the HTTP server cancelled it)
                self.stats["cancelled"] += 1
                continue
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
                                  max_new_tokens=longest, stop=s.stop, seed=s.seed, greedy=s.greedy,
                                  raw_log_probs=s.raw_log_probs, top_logprobs=_generated_top(s))
        pad = self.tokenizer.pad_token_id
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[j, width - len(r):] = 1
        kwargs = {"max_new_tokens": limits} if self.per_row_limits else {}
        self.use_adapter(items[0].adapter)
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
                result = dict(prompt_token_ids=rows[j], token_ids=token_ids, log_probs=log_probs,
                              finish_reason="length", text=self.tokenizer.decode(token_ids, skip_special_tokens=True))
            else:
                result = self.choice(rows[j], token_ids, log_probs, out.response_text[j], limit, s.stop, False)
            if sampling.top_logprobs:
                with_top(result, (out.top_ids[j], out.top_log_probs[j]), items[owner].sampling.top_logprobs)
            if out.token_version is not None:  # weights that change while it generates (partial rollouts)
                result["token_versions"] = out.token_version[j, :len(token_ids)].tolist()
                result["policy_version"] = result["token_versions"][0] if token_ids else None
            results[owner].append(result)
        for item, outs in zip(items, results):
            self.keep_session(item, outs)
        return results
