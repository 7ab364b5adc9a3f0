"""What the OpenAI-compatible server makes of hostile inputs (issue 57): text that is not valid Unicode, bodies too
large to hold, prompts too long to tokenize; the server keeps answering the others."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from shardrl.config.schema import load_config
from shardrl.rollout.serving.app import OFF_LOOP_CHARS
from shardrl.rollout.serving.command import ServeOptions, ServerThread, build_server
from shardrl.testing import save_char_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    save_char_model(folder)
    srv = ServerThread(build_server(load_config(None, [f"model.path={folder}", "rollout.backend=hf"]),
                                    served_name="tiny"))
    yield srv
    srv.stop()


def post(server, path: str, body, timeout: float = 30, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a POST of `body` (bytes, or an iterable of bytes: sent chunked)."""
    request = urllib.request.Request(f"{server.url}/{path}", data=body,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def small_completion(server) -> None:
    status, body = post(server, "completions", json.dumps({"model": "tiny", "prompt": "1+2=", "max_tokens": 2,
                                                           "temperature": 0}).encode())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("route, body, where", [
    ("completions", {"prompt": "\ud800abc"}, "prompt"),
    ("completions", {"prompt": ["fine", "ab\udfffc"]}, "prompt[1]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800abc"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "system", "content": "ok"},
                                       {"role": "user", "content": [{"type": "text", "text": "xy\ud800"}]}]},
     "messages[1].content[0].text"),
])
def test_a_lone_surrogate_gets_a_400_naming_the_character_and_where_it_is(server, route, body, where):
    raw = json.dumps({"model": "tiny", "max_tokens": 2, **body})  # (ensure_ascii: the surrogate as JSON spells it)
    assert "\\ud800" in raw or "\\udfff" in raw
    status, answer = post(server, route, raw.encode())
    assert status == 400, answer
    error = answer["error"]
    char = "U+D800" if "\\ud800" in raw else "U+DFFF"
    position = 0 if where in ("prompt", "messages[0].content") else 2
    assert f"{where} holds an invalid character at position {position}: {char}" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == where.split("[")[0]
    assert "template" not in error["message"] and "TextEncodeInput" not in error["message"]
    small_completion(server)


LIMIT = 100_000


@pytest.fixture(scope="module")
def small_limit_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_limit")
    save_char_model(folder)
    srv = ServerThread(build_server(load_config(None, [f"model.path={folder}", "rollout.backend=hf"]),
                                    served_name="tiny", options=ServeOptions(max_body_bytes=LIMIT)))
    yield srv
    srv.stop()


def test_the_body_limit_defaults_to_8_mib_and_is_checked():
    assert ServeOptions().max_body_bytes == 8 * 2**20
    with pytest.raises(ValueError, match="max_body_bytes=0"):
        ServeOptions(max_body_bytes=0)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_gets_a_413_and_the_server_answers_the_next(small_limit_server, chunked):
    """Refused before it is held whole: at once by its Content-Length, or (chunked: no length) as the bytes pass the
    limit; in OpenAI's error shape."""
    body = json.dumps({"model": "tiny", "prompt": "a" * (50 * LIMIT), "max_tokens": 2}).encode()  # (urllib writes
    # it whole before it reads the answer: the server reads the rest and drops it, or the client got a broken pipe)
    status, answer = post(small_limit_server, "completions",
                          iter([body[i:i + 8192] for i in range(0, len(body), 8192)]) if chunked else body)
    assert status == 413, answer
    assert answer == {"error": {
        "message": f"the request body is larger than this server's limit of {LIMIT:,} bytes: send a smaller one "
                   "(shardrl serve --max-body-mb raises the limit)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    small_completion(small_limit_server)
    status, _ = post(small_limit_server, "completions", json.dumps(  # (under the limit: served)
        {"model": "tiny", "prompt": "b" * (LIMIT // 2), "max_tokens": 1, "temperature": 0}).encode())
    assert status in (200, 400)


@pytest.fixture
def tokenizer_calls(server, monkeypatch) -> list[int]:
    """The length of every text the server's tokenizer is given (its chat template's rendering included)."""
    tok = server.batcher.tokenizer
    calls: list[int] = []
    cls = type(tok)
    call, template = cls.__call__, cls.apply_chat_template

    def counting_call(self, text, *args, **kwargs):
        calls.append(len(text) if isinstance(text, str) else -1)
        return call(self, text, *args, **kwargs)

    def counting_template(self, messages, *args, **kwargs):
        calls.append(sum(len(m.get("content") or "") for m in messages))
        return template(self, messages, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counting_call)
    monkeypatch.setattr(cls, "apply_chat_template", counting_template)
    return calls


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_prompt_whose_characters_exceed_the_context_is_refused_before_it_is_tokenized(server, tokenizer_calls,
                                                                                         route):
    """The char model's tokens spell at most its longest vocabulary entry's characters (its special tokens'), so a
    prompt of more than (context - 1) times that many characters cannot fit: a 400 without tokenizing it."""
    per_token = max(map(len, server.batcher.tokenizer.get_vocab()))
    context = server.batcher.max_model_len
    text = "a" * ((context - 1) * per_token + 1)
    body = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
    status, answer = post(server, route, json.dumps({"model": "tiny", "max_tokens": 2, **body}).encode())
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert (f"this model's context is {context} tokens and the prompt has {len(text):,} characters"
            in answer["error"]["message"])
    assert answer["error"]["param"] == ("prompt" if route == "completions" else "messages")
    assert not any(n >= len(text) for n in tokenizer_calls), tokenizer_calls  # (never tokenized)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """While a long prompt's tokenizing is held (in the tokenizer), a small request is answered: the loop is free."""
    tok = server.batcher.tokenizer
    cls = type(tok)
    call = cls.__call__
    entered, release = threading.Event(), threading.Event()

    def held_call(self, text, *args, **kwargs):
        if isinstance(text, str) and len(text) > OFF_LOOP_CHARS:
            entered.set()
            release.wait(timeout=60)
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", held_call)
    long = json.dumps({"model": "tiny", "prompt": "a" * (OFF_LOOP_CHARS + 10),
                       "max_tokens": server.batcher.max_model_len}).encode()  # (a 400 once tokenized)
    result = {}
    thread = threading.Thread(target=lambda: result.update(long=post(server, "completions", long, timeout=90)))
    thread.start()
    try:
        assert entered.wait(timeout=30), "the long prompt never reached the tokenizer"
        small_completion(server)  # (on the loop: would wait for the release, and time out)
    finally:
        release.set()
        thread.join(timeout=90)
    assert result["long"][0] == 400 and result["long"][1]["error"]["code"] == "context_length_exceeded"


def test_the_prompt_and_message_limits_default_to_1024_and_4096_and_are_checked():
    assert (ServeOptions().max_prompts, ServeOptions().max_messages) == (1024, 4096)
    with pytest.raises(ValueError, match="max_prompts=0"):
        ServeOptions(max_prompts=0)
    with pytest.raises(ValueError, match="max_messages=0"):
        ServeOptions(max_messages=0)


@pytest.mark.parametrize("prompts, n, message", [
    (100_000, 1, "the request holds 100,000 prompts, more than this server's limit of 1,024 a request"),
    (1025, 1, "the request holds 1,025 prompts, more than this server's limit of 1,024 a request"),
    (600, 2, "the request asks for 600 prompts times n=2: 1,200 replies, more than this server's limit of 1,024"),
])
def test_a_completion_of_too_many_prompts_is_refused_before_it_is_tokenized(server, tokenizer_calls, prompts, n,
                                                                           message):
    """100,000 short prompts (an 800 KB body) held every other request for minutes: a 400 naming the limit and
    the flag, not one prompt tokenized; the next request is served."""
    status, answer = post(server, "completions", json.dumps(
        {"model": "tiny", "prompt": ["1+1="] * prompts, "n": n, "max_tokens": 2}).encode(), timeout=20)
    assert status == 400, answer
    assert message in answer["error"]["message"] and "shardrl serve --max-prompts" in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == "prompt"
    assert tokenizer_calls == []  # (refused before any was tokenized)
    status, answer = post(server, "completions", json.dumps(  # (within the limit: served)
        {"model": "tiny", "prompt": ["1+1="] * 3, "n": 2, "max_tokens": 2, "temperature": 0}).encode())
    assert status == 200 and len(answer["choices"]) == 6


def test_a_chat_of_too_many_messages_is_refused_before_it_is_rendered(server, tokenizer_calls):
    """200,000 empty system messages (7 MB; no characters for the context's pre-check) took 12 s to render."""
    messages = [{"role": "system", "content": ""}] * 200_000 + [{"role": "user", "content": "hi"}]
    status, answer = post(server, "chat/completions", json.dumps(
        {"model": "tiny", "messages": messages, "max_tokens": 2}).encode(), timeout=20)
    assert status == 400, answer
    assert answer["error"]["message"] == (
        "the request holds 200,001 messages, more than this server's limit of 4,096 a request: shorten the "
        "conversation (shardrl serve --max-messages raises the limit)")
    assert answer["error"]["param"] == "messages" and tokenizer_calls == []
    small_completion(server)


def call(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": ""}] * (OFF_LOOP_CHARS // 64 + 1) + [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, call(json.dumps({"x": "a" * OFF_LOOP_CHARS})),
     {"role": "user", "content": "and?"}],
], ids=["many messages", "long tool-call arguments"])
def test_a_large_chat_is_rendered_off_the_event_loop(server, monkeypatch, messages):
    """Many empty messages, or a tool call's long arguments (no characters the context's pre-check counts), are
    rendered in a worker thread: while the render is held, a small request is answered."""
    cls = type(server.batcher.tokenizer)
    template = cls.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def held_template(self, msgs, *args, **kwargs):
        if msgs is not None and len(msgs) == len(messages):
            entered.set()
            release.wait(timeout=60)
        return template(self, msgs, *args, **kwargs)

    monkeypatch.setattr(cls, "apply_chat_template", held_template)
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}).encode()
    result = {}
    thread = threading.Thread(target=lambda: result.update(big=post(server, "chat/completions", body, timeout=90)))
    thread.start()
    try:
        assert entered.wait(timeout=30), "the chat never reached the template"
        small_completion(server)  # (on the loop: would wait for the release, and time out)
    finally:
        release.set()
        thread.join(timeout=90)
    assert result["big"][0] in (200, 400), result["big"]


def test_a_token_id_prompt_over_the_context_is_refused_in_tokens(server):
    context = server.batcher.max_model_len
    ids = [5] * (context + 1000)
    status, answer = post(server, "completions", json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2}).encode())
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["message"] == (f"this model's context is {context} tokens and the prompt has "
                                          f"{len(ids):,} tokens: shorten the prompt")
    status, answer = post(server, "completions", json.dumps(
        {"model": "tiny", "prompt": [5] * (context - 2), "max_tokens": 5}).encode())
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    assert f"the prompt has {context - 2:,} tokens and max_tokens asks 5 more" in answer["error"]["message"]


@pytest.mark.parametrize("message, says", [
    ({"role": "user"}, "messages[1].content is missing: a user message needs its text"),
    ({"role": "tool", "tool_call_id": "1", "content": None}, "messages[1].content is missing: a tool message"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[1].content[0].text must be a string"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[1].content[0].text must be a string"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": ["no"]}]},
     "messages[1].content[1].refusal must be a string"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
     "messages[1].content[0] is a part of type 'input_audio', which is not supported by this server"),
])
def test_a_malformed_message_is_a_400_naming_it(server, message, says):
    """Content parts whose text is no string crashed the template's join (a 500); a message without content rendered
    as an empty turn."""
    import openai

    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"}, message],
                                  max_tokens=2)
    assert says in e.value.body["message"] and e.value.body["param"] == "messages"
    c.chat.completions.create(model="tiny", max_tokens=2, messages=[  # (an assistant's turn may be its calls alone)
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "3"}])


@pytest.mark.parametrize("option", [dict(functions=[{"name": "f", "parameters": {}}]), dict(function_call="auto")])
def test_the_deprecated_functions_options_are_a_400_pointing_at_tools(server, option):
    import openai

    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, **option)
    name = next(iter(option))
    assert e.value.body["param"] == name and f"{name} is OpenAI's deprecated form of" in e.value.body["message"]


@pytest.mark.parametrize("route, body, param, place", [
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [None]}, "stop", "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [1]}, "tools", "tools[0]"),
    ("chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages", "messages[0].role"),
    ("responses", {"input": [5]}, "input", "input"),
])
def test_a_body_of_the_wrong_shape_names_the_parameter_as_the_request_spells_it(server, route, body, param, place):
    """pydantic's places name a union's members (`messages.0.content.str`): the param is the request's own name."""
    status, got = post(server, route, json.dumps({"model": "tiny", "max_tokens": 2, **body}).encode())
    assert status == 400 and got["error"]["param"] == param
    assert got["error"]["message"].startswith(f"invalid request: {place}: ")


@pytest.mark.parametrize("route", ["chat/completions", "completions", "responses"])
@pytest.mark.parametrize("option", [dict(include_stop_str_in_output=True), dict(skip_special_tokens=False),
                                    dict(truncate_prompt_tokens=8)])
def test_vllms_text_options_not_applied_are_a_400_naming_them(server, route, option):
    """vLLM's options that change the reply's text or the prompt were ignored: a client asking for the stop string
    kept, or special tokens shown, read a text unlike the one it asked for."""
    prompt = {"chat/completions": {"messages": [{"role": "user", "content": "x"}]}, "completions": {"prompt": "x"},
              "responses": {"input": "x"}}[route]
    limit = {"max_output_tokens" if route == "responses" else "max_tokens": 2}
    status, got = post(server, route, json.dumps({"model": "tiny", **limit, **prompt, **option}).encode())
    name = next(iter(option))
    assert (status, got["error"]["param"]) == (400, name)
    assert "is not supported by this server" in got["error"]["message"]
    defaults = {"include_stop_str_in_output": False, "skip_special_tokens": True, "truncate_prompt_tokens": None}
    plain = {name: defaults[name]}
    status, got = post(server, route, json.dumps({"model": "tiny", **limit, **prompt, **plain}).encode())
    assert status == 200  # (the default asks for nothing)
