"""Streamed replies of `shardrl serve` (issue 59): `stream=true` through the real `openai` client gives vLLM's chunks
(the role first, per-token deltas with token ids and log-probs, the finish_reason and stop_reason on a choice's last
chunk, a usage chunk where asked), joined equal to the non-streamed reply; a client that closes mid-stream frees its
slot; text is detokenized incrementally without a broken character mid-stream; `stop_reason` as vLLM's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from shardrl.config.schema import load_config
from shardrl.rollout.serving.command import ServerProcess, ServerThread, build_engine, build_server
from shardrl.rollout.serving.streaming import IncrementalText, event, text_deltas
from shardrl.testing import save_char_model
from test_serve import wait_for

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module", params=["fast", "hf", "fast_process"])
def server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"model_{request.param}")
    save_char_model(folder)
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={request.param.split('_')[0]}"])
    if request.param == "fast_process":
        srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=8))
    else:
        srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=8))
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_a_streamed_chat_reply_joins_to_the_plain_one(server):
    c = client(server)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True)
    plain = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    body, last = chunks[1:-1], chunks[-1]
    assert len({x.id for x in chunks}) == 1 and all(x.object == "chat.completion.chunk" for x in chunks)
    want = plain.choices[0]
    assert "".join(x.choices[0].delta.content for x in body) == want.message.content
    assert [t for x in body for t in x.choices[0].model_extra["token_ids"]] == want.model_extra["token_ids"]
    assert len(body) == len(want.model_extra["token_ids"])  # (one chunk a token)
    assert [lp.logprob for x in body for lp in x.choices[0].logprobs.content] == pytest.approx(
        [lp.logprob for lp in want.logprobs.content], abs=1e-6)
    assert [x.choices[0].finish_reason for x in body] == [None] * (len(body) - 1) + [want.finish_reason]
    assert last.choices == [] and last.usage == plain.usage  # (the usage chunk, alone, last)
    assert all(x.usage is None for x in chunks[:-1])


def test_streamed_completions_join_per_choice_and_end_at_a_stop_string(server):
    c = client(server)
    kwargs = dict(model="tiny", prompt=["1+2=", "hello world "], max_tokens=10, temperature=0, logprobs=0)
    plain = c.completions.create(**kwargs)
    chunks = list(c.completions.create(**kwargs, stream=True))
    for want in plain.choices:
        mine = [x.choices[0] for x in chunks if x.choices[0].index == want.index]
        assert "".join(x.text for x in mine) == want.text
        assert [t for x in mine for t in x.model_extra["token_ids"]] == want.model_extra["token_ids"]
        assert [lp for x in mine for lp in x.logprobs.token_logprobs] == pytest.approx(
            want.logprobs.token_logprobs, abs=1e-6)
        assert [x.finish_reason for x in mine][-1] == want.finish_reason
        assert mine[0].model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
    # a stop string: the reply ends before it, stop_reason names it (streamed and not)
    text = plain.choices[0].text
    at = next(i for i in range(1, len(text)) if text[i] not in text[:i])  # (the first new character: a stop)
    stop = text[at]
    cut = c.completions.create(model="tiny", prompt="1+2=", max_tokens=10, temperature=0, stop=[stop, "\x00"])
    assert cut.choices[0].text == text[:at] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    streamed = list(c.completions.create(model="tiny", prompt="1+2=", max_tokens=10, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(x.choices[0].text for x in streamed) == text[:at]
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].model_extra[
        "stop_reason"] == stop


def test_stop_reason_is_the_stop_token_id_or_null(server):
    c = client(server)
    plain = c.completions.create(model="tiny", prompt="1+2=", max_tokens=8, temperature=0)
    ids = plain.choices[0].model_extra["token_ids"]
    assert plain.choices[0].model_extra["stop_reason"] is None  # (its limit, or the end token: null, as vLLM's)
    at = ids[2]
    cut = c.completions.create(model="tiny", prompt="1+2=", max_tokens=8, temperature=0, extra_body={
        "stop_token_ids": [at]})
    assert cut.choices[0].model_extra["stop_reason"] == at and cut.choices[0].finish_reason == "stop"


# (not hf: its reply is one generate call and nothing is sent until it returns, so whether the server has seen the
# client leave before the call ends is a race; on CI it ended first, or the client's leaving was never seen)
@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)
def test_a_client_that_closes_mid_stream_frees_its_slot(server, monkeypatch):
    """A streamed request whose client reads the role chunk, then closes: its rows end (counted as cancelled), and
    the next request is answered (was: the rows ran on to their 3,000 tokens)."""
    batcher = server.batcher
    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)  # (the fast cache sized, for its state)
    state = getattr(batcher.rollout, "_state", None)
    if state is not None:
        monkeypatch.setattr(state, "eos", torch.tensor([-1]))  # no row ends before its limit
        asked = dict(max_tokens=3000, temperature=0)
    else:  # (hf: a batch, ended at its next step once its client left; this reply runs long)
        asked = dict(max_tokens=20000, temperature=0.001, seed=1)
    before = dict(batcher.stats)
    stream = c.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **asked)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    # (its rows decoding: in the running stream, or the hf batch generating)
    wait_for(lambda: (batcher.current is not None and batcher.current.rows) or batcher.rollout.abort is not None,
             "its generation started")
    stream.close()
    wait_for(lambda: batcher.stats["cancelled"] > before["cancelled"], "the request cancelled")
    res = c.with_options(timeout=30).completions.create(model="tiny", prompt="b", max_tokens=2)
    assert res.choices[0].model_extra["token_ids"]


def test_stream_options_without_stream_is_a_400(server):
    body = json.dumps({"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{server.url}/completions", data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["param"] == "stream_options"


@pytest.mark.parametrize("route, body", [
    ("completions", {"prompt": "a", "max_tokens": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
    ("responses", {"input": "a", "max_output_tokens": 2})])
def test_a_stream_flag_that_is_not_a_json_boolean_is_a_400(server, route, body):
    """"stream": "yes" (or 1) is a 400 naming stream, as OpenAI's API answers it (was read as true)."""
    for value in ("yes", 1):
        request = urllib.request.Request(f"{server.url}/{route}", headers={"content-type": "application/json"},
                                         data=json.dumps({"model": "tiny", **body, "stream": value}).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "stream", (route, value)


def test_a_zero_max_completion_tokens_is_a_400_naming_that_field(server):
    request = urllib.request.Request(f"{server.url}/chat/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                                                      "max_completion_tokens": 0}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["param"] == "max_completion_tokens", error
    assert error["message"] == "max_completion_tokens=0 must be >= 1"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE whose vocabulary holds no multi-byte character whole: each is split across tokens."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world, hello there"] * 4, vocab_size=262, min_frequency=1, show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_text_is_detokenized_incrementally_without_broken_characters(byte_tokenizer):
    tok = byte_tokenizer
    text = "hello 世界 é 🙂 there"
    ids = tok(text)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids)  # (decoded a token at a time: broken characters)
    decoder = IncrementalText(tok)
    pieces = [decoder.add(t) for t in ids]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == text
    assert "" in pieces  # (held back while a character was incomplete)
    deltas = text_deltas(tok, ids, text[:9])  # (a final text cut short, as a stop string cuts it)
    assert len(deltas) == len(ids) and "".join(deltas) == text[:9]


@pytest.mark.parametrize("chat", [True, False])
def test_the_templated_chunks_are_the_dicts_chunks(byte_tokenizer, chat):
    """A streamed choice's middle chunks are written from a template (`ChunkWriter.middle_template`): parsed, each is
    the chunk the dict path makes, for texts with quotes, braces, backslashes, characters split across tokens."""
    import json

    from shardrl.rollout.serving.schema import ChatRequest, CompletionRequest
    from shardrl.rollout.serving.streaming import ChunkWriter

    tok = byte_tokenizer
    text = 'he said "{x}" \\ 世界 [0] é 🙂 there'
    ids = tok(text)["input_ids"]
    o = {"token_ids": ids, "text": text, "finish_reason": "length", "stop_reason": None, "prompt_token_ids": [1, 2]}
    req = (ChatRequest(model="m{[0]}", messages=[{"role": "user", "content": "x"}], stream=True,
                       stream_options={"include_usage": True}) if chat
           else CompletionRequest(model="m{[0]}", prompt="x", stream=True))
    writer = ChunkWriter(req, "m{[0]}", tok, chat)
    fast = writer.choice(0, o)
    assert sum(isinstance(c, str) for c in fast) >= len(ids) - 2  # (all but the first (completions) and last)
    writer.middle_template = lambda index: None  # (the dict path only)
    assert [json.loads(c) if isinstance(c, str) else c for c in fast] == writer.choice(0, o)


# ---- replies streamed as their tokens are made (`LiveReply`) -------------------------------------------------
def _writer(tok, chat: bool, **more):
    from shardrl.rollout.serving.schema import ChatRequest, CompletionRequest
    from shardrl.rollout.serving.streaming import ChunkWriter

    req = (ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                       stream_options={"include_usage": True}, **more) if chat
           else CompletionRequest(model="m", prompt=["x", "y"], stream=True, stream_options={"include_usage": True},
                                  **more))
    return ChunkWriter(req, "m", tok, chat)


def _events(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def _per_choice(events: list[dict]) -> dict:
    """A stream's events per choice: its role chunks, its text and token ids joined, its last chunk less its own
    text and ids (finish_reason, stop_reason, versions), its prompt ids; and the usage chunk."""
    out = {"usage": [e["usage"] for e in events if not e["choices"]]}
    for e in events:
        if not e["choices"]:
            continue
        choice = dict(e["choices"][0])
        c = out.setdefault(choice["index"], {"roles": 0, "text": "", "ids": [], "prompt": None})
        delta = choice.pop("delta", {})
        c["roles"] += "role" in delta
        c["text"] += delta.get("content", "") + choice.pop("text", "")
        c["ids"] += choice.pop("token_ids", [])
        c["prompt"] = c["prompt"] or choice.pop("prompt_token_ids", None)
        c["last"] = choice
    return out


@pytest.mark.parametrize("chat", [True, False])
def test_a_reply_sent_as_its_tokens_come_is_the_whole_replys_stream(byte_tokenizer, chat):
    """Its tokens handed over in parts (as the engine's syncs do), then the answer: each hand-over is one chunk a
    choice (its tokens' ids, their text joined), and per choice the events say what those of the same reply sent whole
    say (a token a chunk): the role, the text, the token ids, the last chunk's finish and stop reasons, the usage."""
    from shardrl.rollout.serving.streaming import LiveReply, chat_events, completion_events

    tok = byte_tokenizer
    texts = ['he said "{x}" \\ 世界 é 🙂 there', "hello world, hello there 世界"]
    outs = [{"token_ids": tok(t)["input_ids"], "text": t, "finish_reason": "length", "stop_reason": None,
             "prompt_token_ids": [5 + k, 6]} for k, t in enumerate(texts)]
    prompts = [o["prompt_token_ids"] for o in outs]
    parts = ((0, 3), (3, 4), (4, 11), (11, 12))  # (a part of one token, parts splitting a character)
    for count in (1, 2):
        writer = _writer(tok, chat, **({"n": count} if chat else {}))
        reply = LiveReply(writer, [9, 9], lambda k: prompts[k])
        sent = []
        for lo, hi in parts:
            for k in range(count):
                got = _events("".join(reply.add(k, outs[k]["token_ids"][lo:hi])))
                assert [e["choices"][0]["token_ids"] for e in got if "role" not in e["choices"][0].get("delta", {})] \
                    == [outs[k]["token_ids"][lo:hi]]  # (one chunk, the hand-over's tokens)
                sent += got
        sent += _events("".join(reply.end(outs[:count], [[9, 9]] if chat else prompts[:count])))
        whole = _events("".join(chat_events(writer, [9, 9], outs[:count]) if chat
                                else completion_events(writer, prompts[:count], outs[:count])))
        if chat:
            whole = _events(event(writer.role(0, [9, 9]))) + whole  # (the first role chunk: sent before, by the app)
            sent = _events(event(writer.role(0, [9, 9]))) + sent
        assert _per_choice(sent) == _per_choice(whole)
        assert _per_choice(sent)[count - 1]["text"] == texts[count - 1]
        assert len({e["id"] for e in sent}) == 1


def test_text_a_stop_string_cuts_is_never_sent(byte_tokenizer):
    """With stop strings, the text's last (longest stop - 1) characters wait: the row stops at the sync where "world"
    is whole, and "wor" (made at an earlier sync) was never sent; joined, the chunks are the cut reply."""
    from shardrl.rollout.serving.streaming import LiveReply

    tok = byte_tokenizer
    ids = tok("hello world, hello there")["input_ids"]
    decoded = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    before = next(i for i, d in enumerate(decoded) if "wor" in d and "world" not in d)  # (sent before the stop)
    whole = next(i for i, d in enumerate(decoded) if "world" in d)
    writer = _writer(tok, False, stop=["world", "zz"])
    reply = LiveReply(writer, [], lambda k: [1])
    sent = "".join(reply.add(0, ids[:before]))
    text = "".join(e["choices"][0]["text"] for e in _events(sent))
    assert "hello ".startswith(text) and "w" not in text
    o = {"token_ids": ids[:whole], "text": "hello ", "finish_reason": "stop", "stop_reason": "world",
         "prompt_token_ids": [1]}
    events = _events(sent + "".join(reply.end([o], [[1]])))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "hello "
    assert [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]] == o["token_ids"]


def test_tokens_from_a_stop_token_id_on_are_never_sent(byte_tokenizer):
    """A reply generated past one of its stop_token_ids is cut after it: no token from it on goes out before the
    answer, and the chunks are the cut reply's."""
    from shardrl.rollout.serving.streaming import LiveReply

    tok = byte_tokenizer
    ids = tok("hello world, hello there")["input_ids"]
    at = 4
    writer = _writer(tok, True, stop_token_ids=[ids[at]])
    reply = LiveReply(writer, [1], None)
    sent = "".join(reply.add(0, ids[:3]) + reply.add(0, ids[3:8]))
    assert [t for e in _events(sent) for t in e["choices"][0]["token_ids"]] == ids[:at]
    o = {"token_ids": ids[:at + 1], "text": tok.decode(ids[:at]), "finish_reason": "stop", "stop_reason": ids[at]}
    events = _events(sent + "".join(reply.end([o], [[1]])))
    assert [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]] == ids[:at + 1]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == o["text"]


def _http_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """The body of a streamed POST as the server wrote it: its HTTP chunks (one per write of the reply)."""
    import socket
    import urllib.parse

    where = urllib.parse.urlparse(url)
    data = json.dumps(body).encode()
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(f"POST {where.path}/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if not size:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2:]


@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)
@pytest.mark.parametrize("chat", [True, False])
def test_a_streamed_reply_goes_out_while_its_rows_decode(server, monkeypatch, chat):
    """On the fast backend's stream, a reply's tokens go out at the syncs that hand them over (every 16 decode steps
    by default), not all at its end: a 64-token reply comes in several writes, and the joined chunks are the
    non-streamed reply (text and token ids; two completions, one chat choice)."""
    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)  # (the fast cache sized, for its state)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))  # every row runs to its limit
    monkeypatch.setattr(server.batcher, "stop_ids", set())  # (and is not cut at an end token after)
    if chat:
        path, body = "chat/completions", dict(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
        plain = c.chat.completions.create(**body)
        want = {0: (plain.choices[0].message.content, plain.choices[0].model_extra["token_ids"])}
    else:
        path, body = "completions", dict(model="tiny", prompt=["1+2=", "hello "], max_tokens=64, temperature=0)
        plain = c.completions.create(**body)
        want = {x.index: (x.text, x.model_extra["token_ids"]) for x in plain.choices}
    writes = _http_chunks(server.url, path, dict(body, stream=True))
    events = _events(b"".join(writes).decode())
    assert len(writes) >= 3 + chat  # (the role chunk, a write a sync that handed tokens over, the end)
    for k, (text, ids) in want.items():
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == k]
        assert "".join(x["delta"].get("content", "") if chat else x["text"] for x in mine) == text
        assert [t for x in mine for t in x.get("token_ids", [])] == ids
        assert len(ids) == 64 and [x["finish_reason"] for x in mine][-1] == "length"


@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)
def test_a_stream_interval_hands_tokens_over_in_larger_chunks(server, monkeypatch):
    """`Batcher.stream_interval` (`shardrl serve --stream-interval`): a streamed row's tokens go out once at least
    that many have come since its last chunk, so a 64-token reply comes in fewer chunks than at every sync (16
    tokens), each but the last of at least 32 tokens, and joined they are still the plain reply."""
    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)  # (the fast cache sized, for its state)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))  # every row runs to its limit
    monkeypatch.setattr(server.batcher, "stop_ids", set())
    body = dict(model="tiny", prompt=["1+2=", "hello "], max_tokens=64, temperature=0)
    plain = c.completions.create(**body)
    sizes = {}
    for every in (1, 32):
        monkeypatch.setattr(server.batcher, "stream_interval", every)
        events = _events(b"".join(_http_chunks(server.url, "completions", dict(body, stream=True))).decode())
        for x in plain.choices:
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == x.index]
            assert "".join(m["text"] for m in mine) == x.text
            assert [t for m in mine for t in m["token_ids"]] == x.model_extra["token_ids"]
            sizes[every, x.index] = [len(m["token_ids"]) for m in mine]
    for k in (0, 1):
        assert len(sizes[32, k]) < len(sizes[1, k]), sizes
        assert all(n >= 32 for n in sizes[32, k][:-1]) and max(sizes[1, k]) <= 17, sizes


def test_a_stream_interval_hands_a_rows_held_tokens_over_at_its_end_token():
    """With `stream_interval`, a row that makes an end token (decoding past it: the device not told) hands over the
    tokens it held before it at that sync, also where the end token is the sync's first: they waited for the answer,
    which comes only when the row reaches its limit."""
    from types import SimpleNamespace

    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.serving.batcher import _Stream

    handed = []
    loop = SimpleNamespace(call_soon_threadsafe=lambda _, calls: handed.append([(k, t) for _, k, t in calls]))
    for first in (False, True):
        handed.clear()
        stream = _Stream(SimpleNamespace(stop_ids={2}, stream_interval=4), loop, SamplingParams(), 64, 0.1)
        stream.rows[0] = (object(), 0, [1])
        stream.streamed.add(0)
        stream.progress([(0, [5, 6])])  # (fewer than 4: held)
        assert handed == []
        stream.progress([(0, [2, 7, 8] if first else [9, 2, 7])])
        assert handed == [[(0, [5, 6] if first else [5, 6, 9])]], first
        stream.progress([(0, [7, 7, 7, 7])])  # (nothing after the end token)
        assert len(handed) == 1 and 0 not in stream.unsent


@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)
def test_no_token_after_an_end_token_goes_out(server, monkeypatch):
    """A row that decodes past its end of turn (the device not told of it) is cut there in the answer: the tokens
    after it were never handed over, and the streamed chat reply joins to the plain one."""
    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))
    body = dict(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    plain = c.chat.completions.create(**body)
    ids = plain.choices[0].model_extra["token_ids"]
    assert len(ids) < 64 and ids[-1] in server.batcher.stop_ids  # (the reply ends at its end token)
    events = _events(b"".join(_http_chunks(server.url, "chat/completions", dict(body, stream=True))).decode())
    mine = [e["choices"][0] for e in events if e["choices"]]
    assert [t for x in mine for t in x.get("token_ids", [])] == ids
    assert "".join(x["delta"].get("content") or "" for x in mine) == plain.choices[0].message.content


@pytest.mark.parametrize("server", ["fast"], indirect=True)
def test_a_client_leaving_mid_stream_leaves_no_task_waiting(server, monkeypatch):
    """A streamed reply's generator waits on the next hand-over or the answer; a client that leaves while it waits
    cancels it, and nothing of it stays pending: not its request's task, nor a waiter (once: one `Event.wait` task a
    stream, destroyed pending later)."""
    import asyncio
    import gc
    import time

    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))
    monkeypatch.setattr(server.batcher, "stop_ids", set())
    before = dict(server.batcher.stats)
    _leave_mid_stream(server, 3000)  # (tokens of several hand-overs read: the generator waits again)
    wait_for(lambda: server.batcher.stats["cancelled"] > before["cancelled"], "the request cancelled")
    time.sleep(0.3)

    def waiting() -> list[str]:
        names = []
        for t in gc.get_objects():
            try:
                name = t.get_coro().__qualname__ if isinstance(t, asyncio.Task) and not t.done() else ""
                if any(s in name for s in ("Event.wait", "Routes.submit", "Routes.streamed")):
                    names.append(name)
            except ReferenceError:  # (a weak proxy whose object is gone)
                pass
        return names
    assert waiting() == []


@pytest.mark.parametrize("server", ["fast"], indirect=True)
def test_a_stream_failing_after_tokens_went_out_ends_the_reply_with_an_error(server, monkeypatch):
    """A stream that fails retries its unanswered requests in batches, but not one whose client has some of its
    tokens already (a new reply would not continue them): that reply ends with an error event and [DONE]."""
    from shardrl.rollout.serving import batcher as batcher_module

    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))
    monkeypatch.setattr(server.batcher, "stop_ids", set())
    progress, calls = batcher_module._Stream.progress, []

    def failing(self, parts):
        progress(self, parts)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a failing stream")
    monkeypatch.setattr(batcher_module._Stream, "progress", failing)
    writes = _http_chunks(server.url, "completions", dict(model="tiny", prompt="1+2=", max_tokens=64,
                                                            temperature=1.0, stream=True))
    text = b"".join(writes).decode()
    events = _events(text)
    assert any(e.get("choices") and e["choices"][0]["token_ids"] for e in events)  # (some went out)
    assert events[-1].get("error") and text.endswith("data: [DONE]\n\n")
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)


@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)
def test_replies_of_rows_of_different_ages_stream_their_own_tokens(server, monkeypatch):
    """Requests joining the stream while earlier ones decode: each sync hands over each row's own new tokens (its
    window, whatever the other rows' ages); each streamed reply joins to its plain one."""
    import threading
    import time

    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))
    monkeypatch.setattr(server.batcher, "stop_ids", set())
    prompts = ["1+2=", "hello ", "abc", "x"]
    plain = {p: c.completions.create(model="tiny", prompt=p, max_tokens=96 - 16 * i, temperature=0).choices[0]
             for i, p in enumerate(prompts)}
    got = {}

    def streamed(i, p):
        time.sleep(0.05 * i)  # (joining a stream whose earlier rows are older)
        got[p] = _events(b"".join(_http_chunks(server.url, "completions", dict(
            model="tiny", prompt=p, max_tokens=96 - 16 * i, temperature=0, stream=True))).decode())

    threads = [threading.Thread(target=streamed, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, want in plain.items():
        mine = [e["choices"][0] for e in got[p] if e["choices"]]
        assert [t for x in mine for t in x["token_ids"]] == want.model_extra["token_ids"]
        assert "".join(x["text"] for x in mine) == want.text


def _runs_to_its_limit(server, monkeypatch) -> openai.OpenAI:
    c = client(server)
    c.completions.create(model="tiny", prompt="a", max_tokens=1)  # (the fast cache sized, for its state)
    monkeypatch.setattr(server.batcher.rollout._state, "eos", torch.tensor([-1]))  # every row runs to its limit
    monkeypatch.setattr(server.batcher, "stop_ids", set())
    return c


@pytest.mark.parametrize("server", ["fast"], indirect=True)
def test_an_rl_endpoints_stop_string_is_held_back_too(server, monkeypatch):
    """An RL run's endpoint samples with its policy's stop strings where the request names none (`sampling_of`), and
    the reply is cut at them; the streamed reply holds text back by those too (it held back by the request's only:
    the part of the stop string made before the sync that found it went out)."""
    from shardrl.rollout.base import SamplingParams

    c = _runs_to_its_limit(server, monkeypatch)
    body = dict(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    text = c.chat.completions.create(**body).choices[0].message.content
    stop = text[20:]  # (longer than a sync's 16 tokens: the stop string spans a sync)
    at = text.find(stop)
    assert len(stop) > 20 and at > 0
    server.app.state.policy = SamplingParams(n=1, temperature=1.0, greedy=True, seed=None, max_new_tokens=64,
                                             stop=[stop])
    try:
        plain = c.chat.completions.create(**body).choices[0]
        chunks = list(c.chat.completions.create(**body, stream=True))
    finally:
        server.app.state.policy = None
    assert plain.message.content == text[:at] and plain.finish_reason == "stop"
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == plain.message.content


@pytest.mark.parametrize("server", ["fast"], indirect=True)
def test_a_stream_forgets_a_request_whose_client_left(server, monkeypatch):
    """A stream runs for as long as requests keep coming: a request whose client left mid-stream leaves nothing of
    it in the stream once its rows end (its `outs` and `left` entries stayed: one a client that ever left)."""
    import threading

    c = _runs_to_its_limit(server, monkeypatch)
    batcher = server.batcher

    def keep():  # (keeps the stream running while the other request comes and goes; the server stops it)
        try:
            c.with_options(timeout=300).completions.create(model="tiny", prompt="keep", max_tokens=3000,
                                                           temperature=0)
        except openai.APIError:
            pass

    threading.Thread(target=keep, daemon=True).start()
    wait_for(lambda: batcher.current is not None and batcher.current.rows, "the stream running")
    stream, cancelled = batcher.current, batcher.stats["cancelled"]
    _leave_mid_stream(server, 2000)
    wait_for(lambda: batcher.stats["cancelled"] > cancelled, "the request cancelled")
    wait_for(lambda: len(stream.rows) == 1, "its row retired")  # (the keeper's row alone decodes)
    assert batcher.current is stream
    assert len(stream.outs) == 1 and len(stream.left) == 1, (stream.outs.keys(), stream.left)


def _leave_mid_stream(server, max_tokens: int) -> None:
    """A streamed chat request of `max_tokens` whose client reads 20 tokens' chunks (a hand-over or two), then
    closes its connection."""
    import socket
    import urllib.parse

    where = urllib.parse.urlparse(server.url)
    body = json.dumps(dict(model="tiny", messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True)).encode()
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(f"POST {where.path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"token_ids") < 20:
            got += sock.recv(65536)


def _asgi_post(app, path: str, body: dict) -> list[dict]:
    """The ASGI messages `app` sends for one POST of `body` to `path`, its client staying connected."""
    import asyncio

    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent, asked = [], []

    async def receive():
        asked.append(1)
        if len(asked) == 1:
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)  # (the client stays)

    async def send(message):
        sent.append(message)

    async def main():
        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(main())
    return sent


class _StandIn:
    """A batcher that answers "hi" at once, recording what the response had sent when each request came."""

    def __init__(self, tok, sent: list):
        self.tokenizer, self.sent, self.seen, self.stopped = tok, sent, [], False

    async def start(self):
        pass

    async def stop(self):
        pass

    def submit(self, prompts, sampling, alive=None, session=None, on_tokens=None):
        self.seen.append([m["type"] for m in self.sent])

        async def outputs():  # (as an in-process `Batcher`'s: a stopping server refuses once this runs)
            if self.stopped:
                from shardrl.rollout.serving.batcher import Stopped

                raise Stopped("the server is stopping: it takes no more requests")
            return [dict(token_ids=[104, 105], text="hi", finish_reason="stop", stop_reason=None,
                         prompt_token_ids=prompts[0], log_probs=[-0.5, -0.5]) for _ in range(sampling.n)]
        return outputs()


def test_a_streamed_request_reaches_the_batcher_before_its_response_begins(byte_tokenizer):
    """A streamed request is handed to the batcher from its own route, before its response begins: the response
    runs in a task of its own that starts after every request of a burst is parsed, so 256 streamed requests at once
    reached the engine 0.3 s after plain ones would have (bench/serve.py's stand-in: `started_after_s`)."""
    from shardrl.rollout.serving.app import build_app

    sent = []
    stand_in = _StandIn(byte_tokenizer, sent)
    body = dict(model="m", stream=True, max_tokens=4, prompt="hey")  # (chat: the same path)
    sent += _asgi_post(build_app(stand_in, "m", 64, 8), "/v1/completions", body)
    assert stand_in.seen == [[]], (stand_in.seen, sent)  # (before the response's start)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert text.endswith("data: [DONE]\n\n") and "".join(e["choices"][0]["text"] for e in _events(text)) == "hi"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stopping_server_refuses_a_request_503_streamed_or_not(byte_tokenizer, stream):
    """A request that comes while the server stops is refused 503 `server_stopping` before anything is sent, a
    streamed one too (an in-process batcher raised only once the stream's 200 was out)."""
    from shardrl.rollout.serving.app import build_app

    stand_in = _StandIn(byte_tokenizer, [])
    stand_in.stopped = True
    sent = _asgi_post(build_app(stand_in, "m", 64, 8), "/v1/completions",
                      dict(model="m", stream=stream, max_tokens=4, prompt="hey"))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503, sent
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["code"] == "server_stopping"
    assert stand_in.seen == []  # (refused before the batcher)
