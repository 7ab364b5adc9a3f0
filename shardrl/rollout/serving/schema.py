"""The OpenAI wire schema of the serving stack: the request bodies (`ChatRequest`, `CompletionRequest`) and their
checks, each turned into the `SamplingParams` it asks for (or refused with a `RequestError`: an OpenAI-style JSON
error naming the field), the prompts a request holds, and the response bodies built from the batcher's choices.
Plain functions of the request, the tokenizer and the served model's limits; the routes that call them are
`shardrl.rollout.serving.app`'s."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt

from shardrl.rollout.base import MAX_TOP_LOGPROBS, SamplingParams
from shardrl.rollout.serving.logprobs import completion_logprobs, token_logprobs


MAX_N = 128
"""Samples a request may ask for (n) at most."""
GREEDY_BELOW = 1e-5
"""A requested temperature below this is greedy (as vLLM's): dividing the logits by it would overflow them."""

class RequestError(ValueError):
    """A bad request: answered with `status` and an OpenAI-style JSON error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Message(BaseModel):
    """A chat message (tool calls and names pass as extra fields: the chat template reads them). `content`: a
    string, a list of parts (the text parts are joined), or null (an assistant turn that only calls tools)."""
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def for_template(self, index: int = 0) -> dict:
        """The message as the chat template reads it (`index`: its place in the request, for a refusal's message)."""
        message = self.model_dump(exclude_none=True)
        if self.content is None and self.role != "assistant":  # (an assistant's turn may be its tool calls alone)
            raise RequestError(f"messages[{index}].content is missing: a {self.role} message needs its text (a "
                               "string or a list of text parts)", "messages")
        if isinstance(self.content, list):
            for k, part in enumerate(self.content):
                kind = part.get("type")
                if kind not in ("text", "refusal"):
                    raise RequestError(f"messages[{index}].content[{k}] is a part of type {kind!r}, which is not "
                                       "supported by this server (it serves a text model): send text parts only",
                                       "messages")
                if not isinstance(part.get(kind), str):
                    raise RequestError(f"messages[{index}].content[{k}].{kind} must be a string: send "
                                       f'{{"type": "{kind}", "{kind}": "..."}}', "messages")
            message["content"] = "".join(part[part["type"]] for part in self.content)
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
    stream: StrictBool | None = None
    stream_options: dict | None = None  # ({"include_usage": true}: a last chunk of usage alone)
    session_id: str | None = None  # (shardrl's: the fast backend keeps the conversation's K/V for its next request)
    stop_token_ids: list[StrictInt] | None = None  # (vLLM's: a reply ends at the first of them, kept in token_ids)


class ChatRequest(Common):
    messages: list[Message]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None  # (0..20 alternatives a token, with logprobs=true)
    tools: list[dict] | None = None  # (`tool_calls.check_tools` checks each)
    tool_choice: str | dict | None = None  # ("auto" with tools, "none"; `tool_calls.tool_choice_of` checks it)
    parallel_tool_calls: StrictBool | None = None  # (false: a reply's first call alone)
    chat_template_kwargs: dict | None = None  # (vLLM's: e.g. {"enable_thinking": false})
    add_generation_prompt: StrictBool = True  # (vLLM's)
    continue_final_message: StrictBool = False  # (vLLM's: the last message's text is continued, not closed)


class CompletionRequest(Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # (strict: true is no token id)
    max_tokens: StrictInt | None = None  # (null: 16, as OpenAI's)
    logprobs: StrictInt | None = None  # (0..20: each token's log-prob and its alternatives')


UNSUPPORTED = {  # option -> whether a value asks for something (the defaults clients send are no ask)
    "logit_bias": bool, "presence_penalty": bool, "frequency_penalty": bool, "echo": bool, "suffix": bool,
    "best_of": lambda v: v not in (None, 1),
    "response_format": lambda v: bool(v) and v != {"type": "text"},
    # vLLM's extensions that change what is sampled
    "repetition_penalty": lambda v: v not in (None, 1), "min_p": bool, "min_tokens": bool, "ignore_eos": bool,
    "guided_json": bool, "guided_regex": bool, "guided_choice": bool, "guided_grammar": bool,
    "structured_outputs": bool, "allowed_token_ids": bool, "bad_words": bool, "use_beam_search": bool,
    "logits_processors": bool, "prompt_logprobs": lambda v: v is not None,  # (the prefill keeps no logits)
    # vLLM's extensions that change the text or the prompt from what this server gives
    "include_stop_str_in_output": bool, "skip_special_tokens": lambda v: v is False,
    "truncate_prompt_tokens": lambda v: v is not None,
    # OpenAI's that a text model cannot honour
    "modalities": lambda v: v not in (None, ["text"]),
    "audio": bool, "reasoning_effort": bool, "prediction": bool, "web_search_options": bool,
}
"""OpenAI's (and vLLM's) request options this server does not apply: a request that asks for one is refused (400),
not answered as if it had been applied."""


LEGACY = {"functions": "tools", "function_call": "tool_choice"}
"""OpenAI's deprecated chat options and what replaced them: refused (the functions would never reach the model)."""


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: 404s are `not_found_error`, other refusals `invalid_request_error`."""
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_text(value, where: str, param: str) -> None:
    """Refuses a string in `value` (a string, or lists and objects holding strings) that is not valid Unicode: a
    lone UTF-16 surrogate, which JSON can spell ("\\ud800") but no tokenizer encodes. The message names the character,
    the field (`where`, e.g. "messages[0].content") and the position in it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            char = f"U+{ord(value[e.start]):04X}"
            raise RequestError(f"{where} holds an invalid character at position {e.start}: {char}, a lone UTF-16 "
                               "surrogate (half of a pair; no Unicode text): send valid text, or the pair's two "
                               "halves together", param) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, f"{where}.{key}", param)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_text(item, f"{where}[{i}]", param)


def refuse_unsupported(req: Common) -> None:
    """OpenAI's options that would change what is sampled, which this server does not apply: refused, not
    ignored (a trainer must not think a bias or penalty shaped the tokens it trains on)."""
    extra = req.model_extra or {}
    for name, now in LEGACY.items() if isinstance(req, ChatRequest) else ():
        if extra.get(name) is not None:
            raise RequestError(f"{name} is OpenAI's deprecated form of {now}, which this server does not read: send "
                               f"{now} (tools=[{{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"parameters\": {...}}}])", name)
    for name, applies in UNSUPPORTED.items():
        if name in extra and applies(extra[name]):
            raise RequestError(f"{name}={extra[name]!r} is not supported by this server; leave it out", name)


def check_request(req: Common, prompts: list[list[int]], max_tokens: int, model_name: str, max_model_len: int,
                  vocab: int, tool_tokens=None) -> int:
    """Refuses what this server cannot answer as asked (`RequestError`); returns the request's n. `tool_tokens()`:
    how many of a chat prompt's tokens its tools are (asked only to say so in a refusal of its length)."""
    refuse_unsupported(req)
    check_text(req.stop, "stop", "stop")
    top_logprobs(req)
    if req.model != model_name:
        raise RequestError(f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "model", 404, "model_not_found")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only for a streamed request: send it with stream=true",
                           "stream_options")
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
    if longest < max_model_len and max_tokens >= 1 and longest + max_tokens <= max_model_len:
        return n
    tools = tool_tokens() if tool_tokens is not None and getattr(req, "tools", None) else 0
    share = (f", {tools:,} of them the {len(req.tools)} tools' (the chat template renders them into the prompt)"
             if tools > 0 else "")
    if longest >= max_model_len:
        param = ("tools" if longest - tools < max_model_len
                 else "messages" if isinstance(req, ChatRequest) else "prompt")
        fix = "send fewer or shorter tools, or shorten the messages" if share else "shorten the prompt"
        raise RequestError(f"this model's context is {max_model_len} tokens and the prompt has {longest:,} "
                           f"tokens{share}: {fix}", param, code="context_length_exceeded")
    if max_tokens < 1:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise RequestError(f"{name}={max_tokens} must be >= 1", name)
    raise RequestError(f"this model's context is {max_model_len} tokens; the prompt has {longest:,} tokens{share} and "
                       f"max_tokens asks {max_tokens} more: shorten the prompt or lower max_tokens",
                       "max_tokens", code="context_length_exceeded")


def top_logprobs(req: Common) -> int:
    """The alternatives a token the request asks for (chat's `top_logprobs` with logprobs=true, completions'
    `logprobs`), refused outside [0, MAX_TOP_LOGPROBS] as OpenAI and vLLM refuse them."""
    chat = isinstance(req, ChatRequest)
    param = "top_logprobs" if chat else "logprobs"
    k = getattr(req, param) or 0
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{param}={k} must be in [0, {MAX_TOP_LOGPROBS}]: the most alternatives a token this server "
                           "gives (as OpenAI's and vLLM's default)", param)
    if chat and k and not req.logprobs:
        raise RequestError(f"top_logprobs={k} needs logprobs=true (as OpenAI's)", "top_logprobs")
    return k


LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
"""What a reply's log-probs are (`shardrl serve --logprobs-mode`; vLLM's names). processed_logprobs (the default):
log softmax(logits / temperature) over the whole vocabulary, the distribution the token was drawn from before
top-k/top-p, which shardrl's trainer recomputes (vLLM's processed_logprobs renormalize over the top-k/top-p tokens
too); raw_logprobs: log softmax(logits), the model's own (vLLM's default). An RL run's endpoint always gives the
processed ones: its trainer's importance ratios and mismatch metrics compare them with its own."""


def sampling_of(req: Common, n: int, max_tokens: int, vocab: int, policy: SamplingParams | None,
                logprobs_mode: str = "processed_logprobs") -> SamplingParams:
    """What a checked request samples with, its log-probs as `logprobs_mode` says (`LOGPROBS_MODES`). `policy` (an
    RL run's endpoint): its temperature, top-p, top-k and seed whatever the request asks, at most its
    max_new_tokens, n=1, the processed log-probs."""
    try:
        temperature = 1.0 if req.temperature is None else req.temperature
        # (a temperature below 1e-5 is greedy, as vLLM's; top_p 0 is refused, as vLLM and the trainer's config do)
        greedy = 0 <= temperature < GREEDY_BELOW
        # (greedy draws nothing: its seed and temperature are dropped, so it batches with the other greedy
        # requests, not in a call of its own; its log-probs are at temperature 1 whatever was sent)
        asked = SamplingParams(n=n, temperature=1.0 if greedy else temperature,
                               top_p=1.0 if req.top_p is None else req.top_p,
                               top_k=0 if req.top_k in (None, -1) or req.top_k >= vocab else req.top_k,
                               max_new_tokens=max_tokens,
                               stop=stop_list(req.stop), seed=None if greedy else req.seed, greedy=greedy,
                               # (greedy's are at temperature 1 already: it batches with the rest)
                               raw_log_probs=logprobs_mode == "raw_logprobs" and not greedy,
                               top_logprobs=top_logprobs(req))
    except ValueError as e:  # SamplingParams names the field
        field = re.match(r"SamplingParams\.(\w+)", str(e))
        param = None if field is None else field.group(1).replace("max_new_tokens", "max_tokens")
        raise RequestError(str(e).replace("SamplingParams.", "").replace("max_new_tokens", "max_tokens"), param)
    if policy is None:
        return asked
    if n != 1:  # (an RL run's endpoint: the request's own values checked above, its policy's taken)
        raise RequestError(f"n={n}: an RL run's endpoint samples one reply a call; send n=1", "n")
    return dataclasses.replace(policy, n=1, max_new_tokens=min(max_tokens, policy.max_new_tokens),
                               stop=stop_list(req.stop) or policy.stop, top_logprobs=asked.top_logprobs)


def longest_token_chars(tok) -> int | None:
    """The most characters of text one token of `tok` stands for: its longest vocabulary entry, special tokens
    included (a byte-level BPE spells each byte of an entry as one character, so a character of text takes at least
    one of them); None where the tokenizer lists no vocabulary."""
    try:
        return max(map(len, tok.get_vocab()), default=None)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def prompt_chars(req: Common) -> tuple[str, int]:
    """(the field, the characters of the request's prompt text that every token of its prompt spells): a
    completion's longest string prompt; a chat's user, system and tool text, each stripped (a template may trim it;
    an assistant turn's text may be dropped, as Qwen3's drops earlier thinking)."""
    if isinstance(req, CompletionRequest):
        texts = [req.prompt] if isinstance(req.prompt, str) else [x for x in req.prompt if isinstance(x, str)]
        return "prompt", max(map(len, texts), default=0)
    total = 0
    for m in req.messages if isinstance(req, ChatRequest) else ():
        if m.role in ("user", "system", "developer", "tool"):
            parts = [m.content] if isinstance(m.content, str) else [p.get("text") for p in m.content or ()]
            total += sum(len(x.strip()) for x in parts if isinstance(x, str))
    return "messages", total


MESSAGE_CHARS = 64
"""What one chat message (or one prompt of a list) costs to render and tokenize, in characters of text: a template
renders an empty message in about the time it tokenizes this many (200,000 empty messages took 12 s)."""


def text_size(value) -> int:
    """The characters of the strings in `value` (a string, or lists and objects holding them), one more for each
    item of a list or object: what rendering it costs, its structure counted too."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return len(value) + sum(text_size(x) for x in value.values() if isinstance(x, (str, list, dict)))
    if isinstance(value, list):
        return len(value) + sum(text_size(x) for x in value if isinstance(x, (str, list, dict)))
    return 0


def render_size(req: Common) -> int:
    """What templating and tokenizing the request's prompts costs, in characters (`MESSAGE_CHARS` for each message
    or prompt of a list, every string of a message counted: tool calls' arguments, its content whatever its role)."""
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return len(p)
        return sum(MESSAGE_CHARS + len(x) for x in p)
    return text_size(req.tools) + sum(MESSAGE_CHARS + text_size(m.content) + text_size(m.model_extra)
                                      for m in req.messages)


def check_counts(req: Common, max_prompts: int, max_messages: int) -> None:
    """Refuses a request of more prompts (prompts times n) or chat messages than the server's limits before any of
    them is tokenized: 100,000 short prompts in an 800 KB body held every other request for minutes."""
    if isinstance(req, CompletionRequest):
        p = req.prompt
        count = 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)
        n = 1 if req.n is None else req.n
        if count > max_prompts:
            raise RequestError(f"the request holds {count:,} prompts, more than this server's limit of "
                               f"{max_prompts:,} a request: send them in several requests (shardrl serve "
                               "--max-prompts raises the limit)", "prompt")
        if count * n > max_prompts and n <= MAX_N:
            raise RequestError(f"the request asks for {count:,} prompts times n={n}: {count * n:,} replies, more "
                               f"than this server's limit of {max_prompts:,} a request: send fewer prompts a "
                               "request (shardrl serve --max-prompts raises the limit)", "prompt")
    elif len(req.messages) > max_messages:
        raise RequestError(f"the request holds {len(req.messages):,} messages, more than this server's limit of "
                           f"{max_messages:,} a request: shorten the conversation (shardrl serve --max-messages "
                           "raises the limit)", "messages")


def check_prompt_chars(req: Common, per_token: int | None, max_model_len: int) -> int:
    """Refuses a prompt whose text alone spells more tokens than the context holds before any of it is tokenized
    (a 20 MB prompt took 25 s to tokenize for its 400), from `per_token` (`longest_token_chars`): a prompt of
    max_model_len tokens spells more than (max_model_len - 1) * per_token characters. Returns its characters."""
    param, chars = prompt_chars(req)
    if per_token and chars > (max_model_len - 1) * per_token:
        raise RequestError(f"this model's context is {max_model_len} tokens and the prompt has {chars:,} characters, "
                           f"more than that many tokens spell (this tokenizer's longest token is {per_token} "
                           "characters): shorten the prompt", param, code="context_length_exceeded")
    return chars


TOKENIZER_OPTIONS = {"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                     "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation"}
"""`apply_chat_template`'s own arguments that a request's chat_template_kwargs must not set: they cut the prompt to
max_length, padded it with pad tokens (a 200 for a reply to another prompt), or returned another type (a 500)."""


def chat_prompt(req: ChatRequest, tok) -> list[int]:
    """The chat request's prompt ids: its messages through the tokenizer's chat template."""
    check_text([m.model_dump(exclude_none=True) for m in req.messages], "messages", "messages")
    for name in ("tools", "chat_template_kwargs"):
        check_text(getattr(req, name), name, name)
    messages = [m.for_template(i) for i, m in enumerate(req.messages)]
    if not messages:
        raise RequestError("messages is empty: send at least one message", "messages")
    if not getattr(tok, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions", "messages")
    tokenizing = sorted(TOKENIZER_OPTIONS.intersection(req.chat_template_kwargs or ()))
    if tokenizing:
        raise RequestError(f"chat_template_kwargs holds {', '.join(tokenizing)}: options of the tokenizer, not of the "
                           "template (the server tokenizes the prompt whole): leave them out", "chat_template_kwargs")
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
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def tool_tokens(req: ChatRequest, ids: list[int], tok) -> int:
    """How many of the chat prompt `ids`' tokens its tools are: the prompt less the one rendered without them."""
    return len(ids) - len(chat_prompt(req.model_copy(update={"tools": None}), tok)) if req.tools else 0


def chat_max_tokens(req: ChatRequest, prompt_len: int, default_max_tokens: int, max_model_len: int) -> int:
    """max_completion_tokens, else max_tokens, else `default_max_tokens` (what is left of the context if less)."""
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return given if given is not None else max(1, min(default_max_tokens, max_model_len - prompt_len))


def completion_prompts(req: CompletionRequest, tok) -> list[list[int]]:
    """The completion request's prompts: a string, token ids, or a list of either."""
    p = req.prompt
    check_text(p, "prompt", "prompt")
    if isinstance(p, str):
        return [tok(p, add_special_tokens=False)["input_ids"]]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) if isinstance(x, list) else tok(x, add_special_tokens=False)["input_ids"] for x in p]


def cut_at_stop_ids(req: Common, outs: list[dict], tok) -> list[dict]:
    """Each reply ended at the first of the request's `stop_token_ids` (generated past it, then cut: the stop
    token stays in token_ids, out of the text, as vLLM's): its log-probs and versions cut alike."""
    ends = set(req.stop_token_ids or ())
    for o in outs if ends else ():
        at = next((i for i, t in enumerate(o["token_ids"]) if t in ends), None)
        if at is None:
            continue
        keep = at + 1
        for key in ("token_ids", "log_probs", "token_versions", "top_ids", "top_log_probs"):
            if key in o:
                o[key] = o[key][:keep]
        text = tok.decode(o["token_ids"][:at], skip_special_tokens=True)
        for x in stop_list(req.stop):  # (a stop string before it cuts the text as before)
            text = text.split(x, 1)[0]
        o["text"], o["finish_reason"], o["stop_reason"] = text, "stop", o["token_ids"][at]
    return outs


def versions(o: dict) -> dict:
    """A choice's policy versions, where the weights may change while it generates (partial rollouts)."""
    return {k: o[k] for k in ("policy_version", "token_versions") if k in o}


def usage(prompts, choices) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c["token_ids"]) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(req: ChatRequest, ids: list[int], outs: list[dict], model_name: str, tok) -> dict:
    """The chat.completion body of the batcher's choices `outs` for the prompt `ids`."""
    choices = []
    for i, o in enumerate(outs):
        message = {"role": "assistant", "content": o["text"]}
        if o.get("tool_calls"):  # (`tool_calls.parse_replies`: the text outside the calls, or null)
            message.update(content=o["content"], tool_calls=o["tool_calls"])
        choice = {"index": i, "message": message,
                  "finish_reason": o["finish_reason"], "stop_reason": o.get("stop_reason"),
                  "token_ids": o["token_ids"], "logprobs": None, **versions(o)}
        if req.logprobs:
            choice["logprobs"] = {"content": token_logprobs(tok, o)}
        choices.append(choice)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "prompt_token_ids": ids, "usage": usage([ids], outs)}


def completion_response(req: CompletionRequest, prompts: list[list[int]], flat: list[dict], n: int,
                        model_name: str, tok) -> dict:
    """The text_completion body of the batcher's choices `flat` (prompt-major, n a prompt)."""
    choices = []
    for outs in [flat[i * n:(i + 1) * n] for i in range(len(prompts))]:
        for o in outs:
            choice = {"index": len(choices), "text": o["text"], "finish_reason": o["finish_reason"],
                      "stop_reason": o.get("stop_reason"),
                      "token_ids": o["token_ids"], "prompt_token_ids": o["prompt_token_ids"], "logprobs": None,
                      **versions(o)}
            if req.logprobs is not None:
                choice["logprobs"] = completion_logprobs(tok, o)
            choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage(prompts, flat)}
