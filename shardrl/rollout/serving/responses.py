"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: a Responses request is turned into the chat request
it means (`chat_request`: `instructions` a system message first, the `input` items as chat messages, function tools
in chat's shape), which the routes template, check, sample and record exactly as a /v1/chat/completions call; the
reply is answered as a `response` object (`response_body`) or, streamed, as the Responses API's typed events
(`ResponseEvents`: response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta per token, the matching .done events, then response.completed, or response.incomplete
when max_output_tokens cut the reply).

This server keeps no responses (`store` is answered false whatever is asked): a request that continues a stored one
(`previous_response_id`, `conversation`, an `item_reference`) is refused; send the conversation's items as `input`
(the agent frameworks do). Options that would change what is sampled and are not applied are refused, as chat's
are (`schema.UNSUPPORTED`)."""

from __future__ import annotations

import re
import time
import uuid

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, ValidationError

from shardrl.rollout.serving.logprobs import token_logprobs
from shardrl.rollout.serving.schema import UNSUPPORTED, ChatRequest, Message, RequestError, usage, versions
from shardrl.rollout.serving.streaming import event, text_deltas
from shardrl.rollout.serving.tool_calls import check_function

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` entry that asks for each output token's log-prob (OpenAI's; `top_logprobs` as chat's)."""
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "refusal")


class ResponsesRequest(BaseModel):
    """A /v1/responses body (fields this server does not read, e.g. metadata or user, are accepted and ignored)."""
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool | None = None
    store: bool | None = None  # (answered false: nothing is kept)
    previous_response_id: str | None = None
    metadata: dict | None = None


REFUSED = {  # option -> (whether a value asks for it, why it is refused)
    "previous_response_id": (bool, "this server stores no responses: send the whole conversation as input (the "
                                   "earlier response's output items, then the new ones)"),
    "conversation": (bool, "this server keeps no conversations: send the whole conversation as input"),
    "background": (bool, "this server answers in the foreground only: leave background out"),
    "prompt": (bool, "this server has no stored prompt templates: send the prompt as instructions and input"),
    "reasoning": (lambda v: bool(v) and (not isinstance(v, dict) or any(x is not None for x in v.values())),
                  "this server's model takes no reasoning settings: leave reasoning out"),
    "truncation": (lambda v: v not in (None, "disabled"),
                   "this server does not drop input to fit the context: send truncation='disabled' or leave it out"),
    "text": (lambda v: bool(v) and (not isinstance(v, dict) or not isinstance(v.get("format") or {}, dict)
                                    or (v.get("format") or {"type": "text"}).get("type") != "text"),
             "this server samples free text only (no structured output): leave text.format out"),
    "max_tool_calls": (lambda v: v is not None, "this server runs no built-in tools: leave max_tool_calls out"),
    "n": (lambda v: v not in (None, 1), "a response is one reply: send several requests, or use "
                                         "/v1/chat/completions with n"),
    # (chat's names, which a Responses request spells otherwise: ignored, they left the reply's length unset)
    "max_tokens": (lambda v: v is not None, "the Responses API's name for it is max_output_tokens"),
    "max_completion_tokens": (lambda v: v is not None, "the Responses API's name for it is max_output_tokens"),
    "messages": (lambda v: v is not None, "the Responses API takes the conversation as input (and instructions)"),
}


def refuse_options(req: ResponsesRequest) -> None:
    fields = {**(req.model_extra or {}), "previous_response_id": req.previous_response_id}
    for name, (asks, why) in REFUSED.items():
        if name in fields and asks(fields[name]):
            raise RequestError(f"{name}={fields[name]!r} is not supported: {why}", name)
    if req.top_logprobs and LOGPROBS_INCLUDE not in (req.include or ()):
        raise RequestError(f"top_logprobs={req.top_logprobs} asks for log-probs: send include="
                           f"['{LOGPROBS_INCLUDE}'] with it", "top_logprobs")


def part_text(content, where: str) -> str | None:
    """A Responses content (a string, or a list of parts) as chat's text: the text parts joined; other parts (an
    image, a file, audio) refused, as chat's are."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise RequestError(f"{where}.content[{k}] is a part of type {kind!r}, which this server does not "
                               "support (it serves a text model): send text parts only", "input")
        texts.append(part.get("refusal") if kind == "refusal" else part.get("text", ""))
    return "".join(x for x in texts if isinstance(x, str))


CHAT_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
              "logprobs": "include"}
"""Chat's parameters that a Responses request spells otherwise: a refusal from the chat path names the request's."""


def as_responses_error(e: RequestError) -> RequestError:
    """A refusal of the chat request a Responses request means (`chat_request`), naming the Responses request's
    parameters (max_output_tokens, input), in its `param` and its message."""
    message = re.sub(r"(?<=\d) messages\b", " input items", str(e))  # ("the request holds 5,000 messages")
    message = re.sub(r"(?<![-\w])(max_completion_tokens|max_tokens|messages)\b", lambda m: CHAT_NAMES[m.group(1)],
                     message)  # (not a flag's name: --max-messages)
    return RequestError(message, CHAT_NAMES.get(e.param, e.param), e.status, e.code)


def require(item: dict, where: str, fields: dict, why: str) -> None:
    """Refuses (400 naming input) an input item whose `fields` (name -> type) are missing or of another type."""
    for name, kind in fields.items():
        if not isinstance(item.get(name), kind) or item[name] == "" and name != "arguments":
            got = "missing" if item.get(name) is None else f"{item[name]!r}"
            raise RequestError(f"{where}.{name} is {got}: {why}", "input")


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages a Responses request's `instructions` and `input` mean. A function call joins the assistant
    message before it (its text, then its calls: as a chat client sends one turn that says something and calls
    tools), and a function call's output is a tool message."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role={role!r} must be one of user, assistant, system, developer",
                                   "input")
            if item.get("content") is None:
                raise RequestError(f"{where}.content is missing: a message item needs its text (a string or a list "
                                   "of text parts)", "input")
            messages.append({"role": role, "content": part_text(item.get("content"), where)})
        elif kind == "function_call":
            require(item, where, {"name": str, "arguments": str, "call_id": str}, "a function_call item needs its "
                    "call_id, name and arguments (a JSON string), as the response gave them")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            require(item, where, {"call_id": str, "output": (str, list)}, "a function_call_output item needs the "
                    "call_id of its call and its output (a string or a list of text parts)")
            output = item.get("output")
            text = output if isinstance(output, str) else part_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "item_reference":
            raise RequestError(f"{where} is an item_reference: this server stores no items; send the item itself",
                               "input")
        else:
            raise RequestError(f"{where} is an item of type {kind!r}, which this server does not support: send "
                               "messages, function_call and function_call_output items", "input")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (name, description and parameters at the top) in chat's shape (under function),
    each checked as chat's are (`tool_calls.check_function`)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}] is a {tool.get('type')!r} tool, which this server does not run: send "
                               "function tools (the agent runs them)", "tools")
        check_function(tool, f"tools[{i}]")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    """A Responses tool_choice in chat's shape ({"type": "function", "name": n} -> under function)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request means (`chat_messages`, `chat_tools`), its sampling fields carried over:
    what the chat path then checks, templates and samples (the request's own refusals, `refuse_options`, first)."""
    # (vLLM's sampling extensions, applied as chat applies them; chat's options it does not apply, refused there)
    extra = {k: v for k, v in (req.model_extra or {}).items()
             if k in ("top_k", "seed", "session_id", "stop", "stop_token_ids") or k in UNSUPPORTED}
    if req.tool_choice is not None:
        extra["tool_choice"] = chat_tool_choice(req.tool_choice)
    logprobs = LOGPROBS_INCLUDE in (req.include or ())
    messages, tools = chat_messages(req), chat_tools(req.tools)
    try:  # (the extensions carried over are checked here: one of the wrong type was a 500)
        return ChatRequest(model=req.model, messages=[Message(**m) for m in messages],
                           max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                           logprobs=logprobs or None, top_logprobs=req.top_logprobs, tools=tools,
                           parallel_tool_calls=req.parallel_tool_calls, **extra)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise RequestError(f"invalid request: {param}: {first['msg']}", param) from None


class ResponseWriter:
    """The `response` object of one request, and its streamed events (one id, one numbering of the events). A reply
    whose tool calls parsed (`tool_calls.parse_replies`) is its text before them as a message (where there is any),
    then a `function_call` item a call."""

    def __init__(self, req: ResponsesRequest, chat: ChatRequest, model_name: str, tok):
        self.req, self.chat, self.model_name, self.tok = req, chat, model_name, tok
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def body(self, status: str, output: list[dict], **more) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, "instructions": self.req.instructions,
                "max_output_tokens": self.req.max_output_tokens, "model": self.model_name, "output": output,
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "temperature": self.req.temperature,
                "top_p": self.req.top_p, "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "tool_choice": self.req.tool_choice or "auto", "tools": self.req.tools or [],
                "metadata": self.req.metadata, "usage": None, **more}

    def output(self, o: dict, status: str) -> list[dict]:
        """The reply's output items: its message (none for a reply of calls alone), then its function calls."""
        calls = o.get("tool_calls") or []
        text = o["content"] if calls else o["text"]
        items = [self.message(text, o, status)] if text or not calls else []
        return items + [{"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                         "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                        for c in calls]

    def message(self, text: str | None, o: dict | None, status: str) -> dict:
        """The assistant message item of the text `text` of the reply `o` (None: the empty one a stream opens)."""
        content = [] if o is None else [self.text_part(text, o)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def text_part(self, text: str, o: dict) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if self.chat.logprobs:
            part["logprobs"] = token_logprobs(self.tok, o)  # (chat's entries: the Responses API's shape too)
        return part

    def response(self, ids: list[int], o: dict) -> dict:
        """The finished `response` object: completed, or incomplete where max_output_tokens cut the reply. Beside
        OpenAI's fields, as chat's reply: the prompt's and the reply's token ids (and policy versions)."""
        cut = o["finish_reason"] == "length"
        status = "incomplete" if cut else "completed"
        use = usage([ids], [o])
        return self.body(status, self.output(o, status),
                         incomplete_details={"reason": "max_output_tokens"} if cut else None,
                         completed_at=None if cut else int(time.time()), prompt_token_ids=ids,
                         token_ids=o["token_ids"], **versions(o),
                         usage={"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
                                "total_tokens": use["total_tokens"],
                                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                "output_tokens_details": {"reasoning_tokens": 0}})

    # ---- streamed ------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return event({"type": kind, "sequence_number": self.sequence - 1, **fields})

    def head(self) -> list[str]:
        """The events sent at once, before the reply is done."""
        opened = self.body("in_progress", [])
        return [self.event("response.created", response=opened), self.event("response.in_progress", response=opened)]

    def events(self, ids: list[int], o: dict):
        """The reply's events after the head: each output item opened, its text a delta a token (a call's arguments
        in one delta), closed; then the end."""
        done = self.response(ids, o)
        for index, item in enumerate(done["output"]):
            if item["type"] == "message":
                yield from self.message_events(index, item, o)
            else:
                where = {"item_id": item["id"], "output_index": index}
                yield self.event("response.output_item.added", output_index=index,
                                 item={**item, "status": "in_progress", "arguments": ""})
                yield self.event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
                yield self.event("response.output_item.done", output_index=index, item=item)
        yield self.event(f"response.{done['status']}", response=done)

    def message_events(self, index: int, item: dict, o: dict):
        where = {"item_id": self.item_id, "output_index": index}
        yield self.event("response.output_item.added", output_index=index,
                         item=self.message(None, None, "in_progress"))
        yield self.event("response.content_part.added", **where, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})
        part = item["content"][0]
        logprobs = part.get("logprobs")
        # (a delta a token of the text; with tool calls the text is the reply's first part, the calls the rest)
        for k, delta in enumerate(text_deltas(self.tok, o["token_ids"], part["text"])):
            lp = [] if logprobs is None else [  # (a delta's entries carry no bytes: the Responses API's)
                {"token": x["token"], "logprob": x["logprob"],
                 "top_logprobs": [{"token": y["token"], "logprob": y["logprob"]} for y in x["top_logprobs"]]}
                for x in logprobs[k:k + 1]]
            if delta or lp:
                yield self.event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=lp)
        yield self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                         logprobs=logprobs or [])
        yield self.event("response.content_part.done", **where, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)

    def failure(self, message: str, code: str | None) -> list[str]:
        """A failure after the stream began: an error event, then the response failed."""
        failed = self.body("failed", [], error={"code": code or "server_error", "message": message})
        return [self.event("error", code=code, message=message, param=None),
                self.event("response.failed", response=failed)]
