"""Tool calls in chat replies: with `tools=` given, a reply's calls are read out of its text into OpenAI's
`tool_calls` by a parser of the model family's format (vLLM's names, `shardrl serve --tool-call-parser`):

    hermes       Hermes, Qwen2.5, Qwen3:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3.x:               [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    mistral      Mistral:                 text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                          (or, newer tokenizers: [TOOL_CALLS]name[ARGS]{...})

`auto` tells the family from the chat template (the markers it renders a call with); a template that names none of
them gets hermes. A reply whose calls parse answers `content` (the text before the first call less trailing
whitespace, or null), `tool_calls` (`id`, `type: "function"`, `function.name`, `function.arguments` as a JSON
string) and `finish_reason: "tool_calls"`; one that does not stays text, as vLLM's parsers leave it (all or nothing:
one bad call of several leaves the whole reply text). Parsing changes what the client sees, never the choice's `token_ids` and
log-probs: an RL run trains on the sampled tokens whatever the parser made of them.

A reply is an attempted call (`ParsedReply.attempted`) when it holds its family's call marker (hermes' `<tool_call>`,
mistral's `[TOOL_CALLS]`, llama3's `<|python_tag|>`) or, for llama3_json (whose calls need no marker), when its text
starts with `{` and names a `"name"`; an attempted call that does not parse is a parse failure (the agent trainer
counts them: `agent/tool_parse_failures_mean`). Plain prose is neither."""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string

from shardrl.rollout.serving.schema import RequestError

PARSERS = ("hermes", "llama3_json", "mistral")
"""The tool-call formats this server reads (vLLM's parser names)."""
PARSER_CHOICES = ("auto", *PARSERS)

MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",),
           "mistral": ("[TOOL_CALLS]", "[ARGS]")}
"""Each format's marker tokens: a tokenizer may hold them as special tokens, which a reply's text leaves out."""
NOT_JSON = (ValueError, RecursionError)
"""What decoding a call's text as JSON raises where it is none: json's ValueError, and RecursionError for a degenerate
reply of thousands of nested brackets (json recurses a bracket; it was a 500). Either way the reply stays text."""


@dataclasses.dataclass
class ParsedReply:
    """What a parser read from a reply: its calls (name, arguments as a JSON string), the text outside them
    (`content`: None when there is none), and whether the reply looked like a call (see the module docstring)."""
    content: str | None
    calls: list[tuple[str, str]]
    attempted: bool

    @property
    def failed(self) -> bool:
        return self.attempted and not self.calls


def detect_parser(tok) -> str:
    """The parser the tokenizer's chat template asks for (its call markers), else hermes."""
    template = getattr(tok, "chat_template", None) or ""
    if isinstance(template, dict):  # (named templates: all of them read)
        template = "\n".join(map(str, template.values()))
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def resolve_parser(name: str, tok) -> str:
    if name not in PARSER_CHOICES:
        raise ValueError(f"tool_call_parser={name!r} must be one of {', '.join(PARSER_CHOICES)} (vLLM's names; "
                         "auto: told from the chat template)")
    return detect_parser(tok) if name == "auto" else name


def _arguments(call) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one decoded call object, or None when it is no call: a dict with a
    string `name` and `arguments` (llama's `parameters`) that are an object, or a JSON string of one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


def _content(text: str) -> str | None:
    return text if text else None


def parse_hermes(text: str) -> ParsedReply:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedReply(_content(text), [], False)
    calls = []  # (the last block may be unclosed: a reply cut at its stop token, as vLLM's regex allows)
    for closed, unclosed in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
        body = re.sub(r"^```(?:json)?\s*|\s*```$", "", (closed or unclosed).strip())
        try:
            call = _arguments(json.loads(body))
        except NOT_JSON:
            call = None
        if call is None:
            return ParsedReply(_content(text), [], True)
        calls.append(call)
    # (the text before the calls less its trailing whitespace: Qwen's templates render content, a newline, then
    # each call, so the reply renders back as it was sampled and the agent's trajectory goes on unbroken)
    return ParsedReply(_content(text[:start].rstrip()), calls, True)


def _json_objects(text: str, separator: str) -> list | None:
    """The JSON values of `text`, one after another with `separator` (and whitespace) between them; None when
    anything else is there."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            value, at = decoder.raw_decode(text, at)
        except NOT_JSON:
            return None
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest) + len(separator)


def parse_llama3_json(text: str) -> ParsedReply:
    tag = text.find("<|python_tag|>")
    before, body = (text[:tag], text[tag + len("<|python_tag|>"):]) if tag >= 0 else ("", text)
    attempted = tag >= 0 or (body.lstrip().startswith("{") and '"name"' in body)
    if not attempted:
        return ParsedReply(_content(text), [], False)
    values = _json_objects(body, ";")
    calls = [_arguments(v) for v in values or ()]
    if not values or None in calls:
        return ParsedReply(_content(text), [], True)
    return ParsedReply(_content(before.strip()), calls, True)


def parse_mistral(text: str) -> ParsedReply:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedReply(_content(text), [], False)
    calls = []
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        if "[ARGS]" in part:  # (v11+ tokenizers: name[ARGS]{arguments})
            name, _, args = part.partition("[ARGS]")
            values = _json_objects(args, ",")
            call = _arguments({"name": name.strip(), "arguments": values[0]}) if values and len(values) == 1 \
                else None
            found = [call]
        else:
            values = _json_objects(part, ",")
            listed = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
            found = [_arguments(v) for v in listed] if listed else [None]
        if None in found:
            return ParsedReply(_content(text), [], True)
        calls += found
    return ParsedReply(_content(text[:start].rstrip()), calls, True)


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def call_id(parser: str) -> str:
    """A call's id: OpenAI's `call_<hex>`; Mistral's templates demand 9 letters or digits."""
    if parser == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def reply_text(tok, o: dict, parser: str) -> str:
    """The text the parser reads: the reply's, with its format's markers kept where the tokenizer holds them as
    special tokens (which the reply's text leaves out, e.g. Llama's <|python_tag|>, Mistral's [TOOL_CALLS])."""
    special = set(getattr(tok, "all_special_ids", ()) or ()) | {
        i for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)}
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    markers = {vocab[m]: m for m in MARKERS[parser] if vocab.get(m) in special}
    ids = o["token_ids"]
    if not markers or not any(t in markers for t in ids):
        return o["text"]
    pieces, run = [], []
    for t in ids:
        if t in markers:
            pieces += [tok.decode(run, skip_special_tokens=True), markers[t]]
            run = []
        else:
            run.append(t)
    return "".join(pieces + [tok.decode(run, skip_special_tokens=True)])


# ---- requests ------------------------------------------------------------------------------------------
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}


def check_function(function: dict, where: str) -> None:
    """Refuses (400 naming tools) a function tool the template could not render as the model expects: no name (a
    string), a description that is no string, parameters that are no JSON Schema object."""
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "missing" if name is None else f"{JSON_TYPES.get(type(name), type(name).__name__)} {name!r}"
        raise RequestError(f"{where}.name is {got}: each function tool needs its name, a non-empty string", "tools")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise RequestError(f"{where}.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        got = JSON_TYPES.get(type(parameters), type(parameters).__name__)
        raise RequestError(f"{where}.parameters is {got}: send the function's parameters as a JSON Schema object, "
                           'e.g. {"type": "object", "properties": {...}}', "tools")


def check_tools(req) -> str | dict:
    """Refuses malformed chat `tools` (400 naming tools: a tool that is no function tool, or whose function is
    malformed, `check_function`) before anything is rendered; returns the checked `tool_choice` (`tool_choice_of`).
    (`parallel_tool_calls` is a strict boolean of the request's schema.)"""
    for i, tool in enumerate(req.tools or ()):
        kind = tool.get("type", "function")
        if kind != "function":
            raise RequestError(f"tools[{i}].type={kind!r}: this server renders function tools only: send "
                               '{"type": "function", "function": {"name": ..., "parameters": {...}}}', "tools")
        if not isinstance(tool.get("function"), dict):
            got = "missing" if tool.get("function") is None else JSON_TYPES.get(type(tool["function"]), "no object")
            raise RequestError(f"tools[{i}].function is {got}: send the function as an object: "
                               '{"type": "function", "function": {"name": ..., "parameters": {...}}}', "tools")
        check_function(tool["function"], f"tools[{i}].function")
    return tool_choice_of(req)


def tool_choice_of(req) -> str | dict:
    """The request's checked `tool_choice`: "auto" (the default with tools), "none" (no parsing: the reply's text as
    it is; the tools are still rendered into the prompt, as vLLM's default), or refused (400): "required" and a named
    function are not built (they need a constrained reply), nor a tool_choice without tools."""
    choice = getattr(req, "tool_choice", None)
    choice = "auto" if choice is None else choice
    if choice in ("auto", "none"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        what = "required" if choice == "required" else f"a named function ({json.dumps(choice)[:80]})"
        if not req.tools:
            raise RequestError(f"tool_choice={what} needs tools: send the tools it chooses from", "tool_choice")
        raise RequestError(f"tool_choice={what} is not supported by this server (it would constrain the reply); "
                           "send tool_choice \"auto\" (the model decides) or \"none\"", "tool_choice")
    raise RequestError(f"tool_choice={choice!r} must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def parse_replies(req, outs: list[dict], parser: str, tok) -> list[dict]:
    """Each choice's tool calls read (with `tools` given and tool_choice not "none"): a choice whose calls parse
    gains `tool_calls` (OpenAI's shape; its first alone with parallel_tool_calls=false), `content` and finish_reason
    "tool_calls"; one that looked like a call but did not parse is marked `tool_parse_failed` (its reply stays
    text). Token ids and log-probs untouched."""
    if not req.tools or tool_choice_of(req) == "none":
        return outs
    for o in outs:
        parsed = PARSE[parser](reply_text(tok, o, parser))
        if parsed.failed:
            o["tool_parse_failed"] = True
        if not parsed.calls:
            continue
        if req.parallel_tool_calls is False:  # (OpenAI's: one call at most)
            parsed.calls = parsed.calls[:1]
        o["content"] = parsed.content
        o["tool_calls"] = [{"id": call_id(parser), "type": "function",
                            "function": {"name": name, "arguments": args}} for name, args in parsed.calls]
        o["finish_reason"] = "tool_calls"
    return outs
