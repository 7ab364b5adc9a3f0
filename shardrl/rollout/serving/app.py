"""The serving stack's HTTP app (FastAPI): the OpenAI routes (`Routes`, one small method per endpoint) over a
`Batcher` (`shardrl.rollout.serving.batcher`), the wire schema's checks and bodies
(`shardrl.rollout.serving.schema`), errors in OpenAI's JSON shape, and the uvicorn server that runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardrl.rollout.base import SamplingParams
from shardrl.rollout.serving.batcher import Batcher, Dropped, Stopped
from shardrl.rollout.serving.schema import (LOGPROBS_MODES, ChatRequest, Common, CompletionRequest, RequestError,
                                            chat_max_tokens, chat_prompt, chat_response, check_counts,
                                            check_prompt_chars, check_request, completion_prompts,
                                            completion_response, cut_at_stop_ids, error_body, longest_token_chars,
                                            render_size, sampling_of, tool_tokens)
from shardrl.rollout.serving.responses import (ResponsesRequest, ResponseWriter, as_responses_error, chat_request,
                                               refuse_options)
from shardrl.rollout.serving.streaming import (DONE, ChunkWriter, LiveReply, chat_events, completion_events, event,
                                               live)
from shardrl.rollout.serving.tool_calls import PARSER_CHOICES, check_tools, parse_replies, resolve_parser

log = logging.getLogger(__name__)


EPISODE_HEADER = "x-shardrl-episode"
"""A request carrying this header is recorded under its value (`app.state.records`: episode -> calls)."""
EPISODE_KEY_PREFIX = "shardrl-episode-"
"""An API key `shardrl-episode-<episode>` names the episode as the header does: an agent framework that builds its
own client from the episode's `client.base_url` and `client.api_key` is recorded under it too."""


def episode_of(request: Request) -> str | None:
    """The episode a request belongs to: its `EPISODE_HEADER`, else its API key's (`EPISODE_KEY_PREFIX`)."""
    header = request.headers.get(EPISODE_HEADER)
    if header is not None:
        return header
    token = request.headers.get("authorization", "").partition(" ")[2]
    return token[len(EPISODE_KEY_PREFIX):] if token.startswith(EPISODE_KEY_PREFIX) else None

OFF_LOOP_CHARS = 16_384
"""A request whose prompts cost more characters than this to render and tokenize (`schema.render_size`: their text,
tool calls' arguments, and each message or prompt of a list as `schema.MESSAGE_CHARS`) is templated and tokenized in
a worker thread: on the event loop a 20 MB prompt stalled every other request for 23 s, 200,000 empty messages 12 s,
a tool call's 4.5 MB arguments 11 s. Smaller ones stay on the loop (a thread hop costs more than their tokenizing)."""


@dataclass(frozen=True)
class ServeOptions:
    """The server's own settings (`shardrl serve`'s flags)."""
    max_body_bytes: int = 8 * 2**20
    """A request body larger than this is refused (413) before it is held whole: a 200 MB prompt grew the front end
    to ~24 GB and the OOM killer ended the server. 8 MiB holds a prompt of a million tokens' text (or ids)."""
    logprobs_mode: str = "processed_logprobs"
    """What a reply's log-probs are: the sampled distribution's or the model's own (`schema.LOGPROBS_MODES`)."""
    max_prompts: int = 1024
    """A /v1/completions request of more prompts, or prompts times n, is refused (400) before any is tokenized:
    100,000 short prompts (an 800 KB body) held every other request for minutes."""
    max_messages: int = 4096
    """A chat request of more messages is refused (400) before it is rendered: 200,000 empty ones (7 MB) took 12 s
    to render for their 400."""
    tool_call_parser: str = "auto"
    """How a chat reply's tool calls are read into `tool_calls` when the request gives `tools`: hermes, llama3_json,
    mistral (vLLM's names), or auto: told from the chat template (`shardrl.rollout.serving.tool_calls`)."""

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: a body limit must be >= 1 byte")
        for name in ("max_prompts", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: the limit must be >= 1")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} must be one of {', '.join(LOGPROBS_MODES)}")
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of {', '.join(PARSER_CHOICES)}")


def build_app(batcher: Batcher, model_name: str, max_model_len: int, default_max_tokens: int = 256,
              policy: SamplingParams | None = None, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app serving `batcher`'s rollout as `model_name`; prompts plus `max_tokens` are limited to
    `max_model_len` tokens; a chat request without max_tokens gets `default_max_tokens` (what is left of the
    context if less). `policy` (an RL run's endpoint): every request samples with its temperature, top-p, top-k
    and seed whatever it asks (the trainer's log-probs assume them), at most its max_new_tokens a call, n=1.
    `options`: the server's own settings (`ServeOptions`)."""
    options = options or ServeOptions()

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="shardrl", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)
    app.state.policy = policy  # (an RL run's endpoint sets it per generate call: training, validation)
    app.state.logprobs_mode = options.logprobs_mode
    # an RL run's endpoint: the tokens an episode's trajectory holds after its first prompt (its agent's
    # max_response_tokens); a call samples at most what is left, and one past it is refused (`Routes.episode_budget`)
    app.state.episode_budget = None
    for exc, handler in ((RequestValidationError, invalid_body), (BodyTooLarge, too_large),
                         (StarletteHTTPException, http_error),
                         (RequestError, refused), (Stopped, stopping), (Dropped, dropped), (Exception, failed)):
        app.add_exception_handler(exc, handler)
    routes = Routes(app, batcher, model_name, max_model_len, default_max_tokens, options)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/responses")(routes.responses)
    app.state.batcher, app.state.records = batcher, routes.records
    return app


class Routes:
    """The endpoints of one app: the wire schema's checks turn a request into prompts and `SamplingParams`, the
    batcher generates (the client's connection watched meanwhile), the schema's bodies answer. Requests of an RL
    run's episode (`EPISODE_HEADER`, on an endpoint with a policy) are recorded in `records`."""

    def __init__(self, app: FastAPI, batcher: Batcher, model_name: str, max_model_len: int,
                 default_max_tokens: int, options: ServeOptions):
        self.app, self.batcher, self.model_name, self.options = app, batcher, model_name, options
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens
        self.tok = batcher.tokenizer
        self.vocab = len(self.tok)
        self.token_chars = longest_token_chars(self.tok)  # (a prompt's length checked before it is tokenized)
        self.tool_parser = resolve_parser(options.tool_call_parser, self.tok)
        self.records: dict[str, list[dict]] = {}  # episode -> its calls' choices
        # LoRA adapters over the base (`shardrl serve --lora-modules`), each served under its own name
        self.adapters = {m.name: m for m in getattr(batcher, "lora_modules", None) or []}

    def card(self, model_id: str | None = None) -> dict:
        """The base's card, or an adapter's as vLLM lists it: `root` its folder, `parent` the base."""
        card = {"id": model_id or self.model_name, "object": "model", "created": 0, "owned_by": "shardrl",
                "max_model_len": self.max_model_len}
        if model_id in self.adapters:
            card |= {"root": self.adapters[model_id].path, "parent": self.model_name}
        return card

    async def models(self):
        return {"object": "list", "data": [self.card(), *(self.card(name) for name in self.adapters)]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return self.card(model_id)

    def check_model(self, model_id: str) -> None:
        """A 404 for a name that is neither the base's nor an adapter's."""
        if model_id != self.model_name and model_id not in self.adapters:
            served = ", ".join(repr(x) for x in [self.model_name, *self.adapters])
            raise RequestError(f"the model {model_id!r} does not exist; this server serves {served}", "model", 404,
                               "model_not_found")

    async def chat(self, req: ChatRequest, request: Request):
        check_tools(req)  # (refused before anything is rendered)
        ids = await self.tokenized(chat_prompt, req)
        max_tokens = chat_max_tokens(req, len(ids), self.default_max_tokens, self.max_model_len)
        sampling = self.sampling(req, [ids], max_tokens)
        if req.stream:
            writer = ChunkWriter(req, req.model, self.tok, chat=True)
            reply = LiveReply(writer, ids, None, sampling.stop) if live(req, self.tok) else None
            return self.streamed(request, req, [ids], sampling, [event(writer.role(0, ids))],
                                 lambda outs: chat_events(writer, ids, outs), reply=reply)
        outs = cut_at_stop_ids(req, await self.submit(request, req, [ids], sampling), self.tok)
        parse_replies(req, outs, self.tool_parser, self.tok)  # (what the client sees; the tokens stay as sampled)
        self.record(request, outs)
        return JSONResponse(chat_response(req, ids, outs, req.model, self.tok))

    async def completions(self, req: CompletionRequest, request: Request):
        prompts = await self.tokenized(completion_prompts, req)
        # (OpenAI's 16, in context)
        default = max(1, min(16, self.max_model_len - max((len(x) for x in prompts), default=0)))
        sampling = self.sampling(req, prompts, default if req.max_tokens is None else req.max_tokens)
        if req.stream:
            writer = ChunkWriter(req, req.model, self.tok, chat=False)
            reply = (LiveReply(writer, [], lambda k: prompts[k // sampling.n], sampling.stop) if live(req, self.tok)
                     else None)
            return self.streamed(request, req, prompts, sampling, [],
                                 lambda flat: completion_events(writer, prompts, flat), reply=reply)
        flat = cut_at_stop_ids(req, await self.submit(request, req, prompts, sampling), self.tok)  # prompt-major
        self.record(request, flat)
        return JSONResponse(completion_response(req, prompts, flat, sampling.n, req.model, self.tok))

    async def responses(self, req: ResponsesRequest, request: Request):
        """OpenAI's Responses API on the chat path (`shardrl.rollout.serving.responses`): the same prompt, checks,
        sampling and record as the chat request it means; its refusals name the Responses request's parameters."""
        refuse_options(req)  # (in the Responses request's own names)
        try:
            chat = chat_request(req)
            check_tools(chat)  # (refused before anything is rendered)
            ids = await self.tokenized(chat_prompt, chat)
            max_tokens = chat_max_tokens(chat, len(ids), self.default_max_tokens, self.max_model_len)
            sampling = self.sampling(chat, [ids], max_tokens)
            sampling = self.episode_budget(request, [ids], sampling)  # (its refusal names max_output_tokens)
        except RequestError as e:
            raise as_responses_error(e) from None
        writer = ResponseWriter(req, chat, req.model, self.tok)
        if req.stream:
            return self.streamed(request, chat, [ids], sampling, writer.head(),
                                 lambda outs: writer.events(ids, outs[0]), writer.failure)
        outs = cut_at_stop_ids(chat, await self.submit(request, chat, [ids], sampling), self.tok)
        parse_replies(chat, outs, self.tool_parser, self.tok)  # (function_call items; the tokens as sampled)
        self.record(request, outs)
        return JSONResponse(writer.response(ids, outs[0]))

    def streamed(self, request: Request, req: Common, prompts: list[list[int]], sampling: SamplingParams,
                 head: list[str], events, failure=None, reply: LiveReply | None = None) -> StreamingResponse:
        """A streamed reply (`shardrl.rollout.serving.streaming`): the `head` events at once (a chat's role chunk),
        then, with `reply`, its tokens' events as the batcher hands them over and `reply.end`'s once it is done;
        without, once the batcher's reply is done, `events(outs)`. A client that leaves meanwhile ends its rows
        (`submit` watches it; the HTTP server also cancels this generator, and the batcher then ends them too); a
        failure after the stream began is `failure(message, code)`'s events: by default an error event, then [DONE]
        (vLLM's)."""
        def chat_failure(message: str, code: str | None) -> list[str]:
            return [event({"error": {"message": message, "type": "server_error", "param": None, "code": code}}),
                    DONE]

        failure = failure or chat_failure
        # woken by a hand-over of tokens or by the answer: one plain future a wait (an Event's waiter task and
        # asyncio.wait cost 3x as much, at each of a reply's hand-overs, for each of hundreds of streams)
        loop, came = asyncio.get_running_loop(), []
        wake = [loop.create_future()]

        def wake_up(_=None) -> None:
            if not wake[0].done():
                wake[0].set_result(None)

        def on_tokens(k: int, tokens: list[int]) -> None:
            came.append((k, tokens))
            wake_up()

        # the request goes to the engine now, from this route (`submit`: the front end's `RemoteBatcher` sends it at the
        # call; an in-process `Batcher` takes it when the task first runs), and a refusal there (an episode past its
        # budget, a stopping server) is the plain call's, before the stream's 200
        task = asyncio.ensure_future(self.submit(request, req, prompts, sampling,
                                                 on_tokens if reply is not None else None))
        task.add_done_callback(wake_up)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (read: a body that never ran)

        async def body():
            for x in head:
                yield x
            try:
                while reply is not None and not task.done():  # (each hand-over's tokens as one write)
                    await wake[0]  # (the client left: this generator is cancelled here)
                    wake[0] = loop.create_future()
                    parts, came[:] = list(came), []
                    sent = "".join(x for k, tokens in parts for x in reply.add(k, tokens))
                    if sent:  # (an empty write could read as the body's end)
                        yield sent
                outs = cut_at_stop_ids(req, await task, self.tok)
                if isinstance(req, ChatRequest):
                    parse_replies(req, outs, self.tool_parser, self.tok)
                late = [x for k, tokens in came for x in reply.add(k, tokens)]  # (handed over just before the answer)
            except Dropped:  # (the client left: nobody reads the rest)
                return
            except Stopped as e:
                for x in failure(str(e), "server_stopping"):
                    yield x
                return
            except Exception as e:  # noqa: BLE001 (the status went out already: the error goes in the stream)
                log.exception("a streamed generation failed")
                for x in failure(f"generation failed: {type(e).__name__}: {e}", None):
                    yield x
                return
            finally:
                if not task.done():  # (the client left: this generator was closed or cancelled)
                    task.cancel()
            self.record(request, outs)
            # the reply is whole: its (last) events go out as one write, not one ASGI send (and TCP write) an event
            yield "".join(late + reply.end(outs, prompts) if reply is not None else events(outs))

        return StreamingResponse(body(), media_type="text/event-stream")

    async def tokenized(self, tokenize, req: Common):
        """`tokenize(req, tokenizer)` once the request's prompts or messages are within the server's limits
        (`check_counts`) and the prompt's length in characters fits the context (`check_prompt_chars`); a large
        request's (`OFF_LOOP_CHARS`) in a worker thread, so that the loop goes on answering the other requests."""
        check_counts(req, self.options.max_prompts, self.options.max_messages)
        check_prompt_chars(req, self.token_chars, self.max_model_len)
        if render_size(req) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(tokenize, req, self.tok)
        return tokenize(req, self.tok)

    def sampling(self, req: Common, prompts: list[list[int]], max_tokens: int) -> SamplingParams:
        """The checked request's sampling (`check_request`, `sampling_of`; the app's policy as it is now)."""
        self.check_model(req.model)  # (the base's name or an adapter's: the reply names the one asked for)
        tools = (lambda: tool_tokens(req, prompts[0], self.tok)) if isinstance(req, ChatRequest) else None
        n = check_request(req, prompts, max_tokens, req.model, self.max_model_len, self.vocab, tools)
        return sampling_of(req, n, max_tokens, self.vocab, self.app.state.policy, self.app.state.logprobs_mode)

    def submit(self, request: Request, req: Common, prompts: list[list[int]], sampling: SamplingParams,
               on_tokens=None):
        """`batcher.submit`, the client's connection watched meanwhile (not polled: an ASGI receive after the body
        returns only when the client disconnects or the response is complete) and `connected` telling it. The
        request goes to the batcher at the call (the front end's `RemoteBatcher` sends it then); the coroutine
        returned waits for its outputs. So a streamed reply's request (`streamed`) leaves with its own route, not
        from the response's task, which runs after every request of the burst it came in is parsed: 256 streamed
        requests at once reached the engine 0.3 s after the first plain one would have (the CPU stand-in)."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def connected() -> bool:
            return not watcher.done()

        if getattr(self.batcher, "stopped", False):  # (an in-process `Batcher` says so only once its task runs: a
            raise Stopped("the server is stopping: it takes no more requests")  # streamed reply's 200 would be out)
        sampling = self.episode_budget(request, prompts, sampling)
        # the conversation a request continues: its `session_id`, or an RL run's episode
        session = req.session_id or episode_of(request)
        kwargs = {"on_tokens": on_tokens} if on_tokens is not None else {}  # (stand-in batchers take none)
        if req.model in self.adapters:
            kwargs["adapter"] = req.model
        watcher = asyncio.ensure_future(watch())
        connected.gone = watcher  # (a waiter can wait on it instead of asking)
        connected.left = watcher.done  # (and a generation thread ask without the loop: `_left`)
        try:
            waiting = self.batcher.submit(prompts, sampling, connected, session, **kwargs)
        except BaseException:
            watcher.cancel()
            raise

        async def outputs() -> list[dict]:
            try:
                return await waiting
            finally:
                watcher.cancel()

        return outputs()

    def episode_budget(self, request: Request, prompts: list[list[int]], sampling: SamplingParams) -> SamplingParams:
        """`sampling` with at most the tokens the request's episode has left (`app.state.episode_budget`: its
        trajectory's tokens after its first call's prompt, replies and what the calls between added; a call that
        does not extend the trajectory starts it afresh, as the trainer assembles it); a RequestError once none are
        left: the episode is over its budget, and a reply past it would not be trained on while its reward counted
        the turns it made. Other requests: `sampling` as it is."""
        budget, episode = self.app.state.episode_budget, episode_of(request)
        if budget is None or episode is None or self.app.state.policy is None or len(prompts) != 1:
            return sampling
        start = None  # the trajectory's first prompt
        for p in [*(list(c["prompt_token_ids"]) for c in self.records.get(episode, [])), prompts[0]]:
            if start is None or p[:len(start)] != start:
                start = p
        left = budget - (len(prompts[0]) - len(start))
        if left <= 0:
            raise RequestError(f"this episode's trajectory holds its {budget} tokens after its first prompt "
                               f"(rollout.agent.max_response_tokens): end the episode; a longer one is cut there, "
                               "its reward counting turns that are not trained on", "max_tokens", 400,
                               "episode_budget_spent")
        return dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, left))

    def record(self, request: Request, outs: list[dict]) -> None:
        episode = episode_of(request)
        if episode is not None and self.app.state.policy is not None:  # (an RL run's endpoint: its agent reads them)
            self.records.setdefault(episode, []).extend(outs)


# ---- errors, in OpenAI's JSON shape ----------------------------------------------------------------------
class BodyTooLarge(StarletteHTTPException):
    """A request body over the server's limit (`ServeOptions.max_body_bytes`): a 413."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than this server's limit of {max_bytes:,} bytes: send a "
                              "smaller one (shardrl serve --max-body-mb raises the limit)")


class BodyLimit:
    """ASGI middleware refusing a body over `max_bytes` (`BodyTooLarge`) without holding it: where its
    Content-Length says so before any of it is read, else (a chunked body) as soon as the bytes read pass it. The
    rest is read and dropped (up to `DRAIN_BYTES`) before the answer: a client that writes its whole body before it
    reads (urllib, httpx) got a broken pipe, not the 413, when the server answered and closed mid-body."""

    DRAIN_BYTES = 2**30

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self.drain(receive)
            response = await too_large(None, BodyTooLarge(self.max_bytes))
            return await response(scope, receive, send)
        read = 0

        async def limited():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:  # (FastAPI passes an HTTPException from the body's reading to its handler)
                if message.get("more_body"):
                    await self.drain(receive)
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)

    async def drain(self, receive) -> None:
        left = self.DRAIN_BYTES
        while left > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            left -= len(message.get("body", b""))


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param, code))


async def invalid_body(request, exc):
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # (its loc: the character where the JSON broke)
        at = first.get("loc", ("body", "?"))[-1]
        return error(400, f"invalid request: the body is not valid JSON (at character {at}: "
                          f"{first.get('ctx', {}).get('error', first.get('msg'))})")
    where = error_place(first.get("loc", ()))
    if not where:  # (no body at all, or JSON that is no object)
        if first.get("type") == "missing":
            return error(400, "invalid request: the body is missing: send a JSON object")
        kind = request.headers.get("content-type", "")
        if isinstance(first.get("input"), (bytes, str)) and "json" not in kind:  # (FastAPI did not parse it)
            return error(400, f"invalid request: the body was sent as {kind or 'no content type'}: send it as "
                              "JSON with the header Content-Type: application/json")
        got = type(first.get("input")).__name__.replace("NoneType", "null")
        return error(400, f"invalid request: the body must be a JSON object, not {got}")
    param = re.split(r"[.\[]", where)[0]
    if param == "prompt" and first.get("type") != "missing":  # (a union: pydantic names its first form only)
        return error(400, "invalid request: prompt must be a string, a list of strings, a list of token ids "
                          "(integers) or a list of lists of token ids", "prompt")
    return error(400, f"invalid request: {where}: {first.get('msg', 'malformed body')}", param)


UNION_MEMBER = re.compile(r"(str|int|float|bool|dict|list|none|function-\w+)(\[.*\])?", re.IGNORECASE)


def error_place(loc) -> str:
    """Where in the body a validation error is, as the request spells it (`messages[0].content`): indices in
    brackets, pydantic's names of a union's members (`str`, `list[str]`) left out. Its first name is the `param`."""
    place = ""
    for part in loc:
        if isinstance(part, int):
            place += f"[{part}]"
        elif part != "body" and not UNION_MEMBER.fullmatch(part):
            place += f".{part}" if place else part
    return place


async def too_large(request, exc: BodyTooLarge):
    return error(413, exc.detail, None, "request_too_large")


async def http_error(request, exc):  # (an unknown route or method: in OpenAI's error shape too)
    response = error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    response.headers.update(exc.headers or {})  # (a 405's Allow)
    return response


async def refused(request, exc: RequestError):
    return error(exc.status, str(exc), exc.param, exc.code)


async def stopping(request, exc):
    return JSONResponse(status_code=503, content={"error": {
        "message": str(exc), "type": "server_error", "param": None, "code": "server_stopping"}})


async def dropped(request, exc):  # (nobody reads it: the client is gone)
    return error(499, "the client closed the request before its batch started")


async def failed(request, exc):
    return JSONResponse(status_code=500, content={"error": {
        "message": f"generation failed: {type(exc).__name__}: {exc}", "type": "server_error", "param": None,
        "code": None}})


# ---- running it ------------------------------------------------------------------------------------------
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
