"""`shardrl serve`: the OpenAI-compatible endpoint, exercised with the real `openai` client over loopback (CPU, a
tiny saved model): completions and chat with the sampler's token ids and log-probs equal to the rollout's own
`generate` on the same prompts, concurrent clients batched together, bad requests answered with 4xx JSON errors,
and a client that went away dropped before its batch."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch

from shardrl.config.schema import load_config
from shardrl.rollout import SamplingParams
from shardrl.rollout.serving.command import ServerProcess, ServerThread as Server, build_engine, build_server
from shardrl.testing import save_char_model

PROMPTS = ["1+2=", "hello world ", "what is 7*6? "]


# fast: continuous batching (requests join the running generate_stream); fast_batches and hf: one batch at a time;
# fast_process: as fast, the HTTP front end in two processes of its own (`shardrl serve`'s default is one); fast
# admits before it launches the decode steps (overlap off), fast_process after (on: the default)
@pytest.fixture(scope="module", params=["fast", "fast_batches", "hf", "fast_process"])
def server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"model_{request.param}")
    save_char_model(folder)
    backend = request.param.split("_")[0]
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={backend}"])
    stream = {"fast": True, "fast_batches": False, "hf": None, "fast_process": True}[request.param]
    if request.param == "fast_process":
        srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=8, stream=stream), front_ends=2)
    else:
        srv = Server(build_server(cfg, served_name="tiny", max_batch=8, stream=stream))
        srv.batcher.overlap = request.param != "fast"
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def post(server, path: str, body: bytes, timeout: float):
    request = urllib.request.Request(f"{server.url}/{path}", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def direct(server, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """The rollout's own greedy generate on the same prompt ids (the server idle meanwhile)."""
    b = server.batcher
    pad = b.tokenizer.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    b.pause()  # (a stream's idle wait holds the rollout: it ends first)
    try:
        out = b.rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=max_tokens))
    finally:
        b.unpause()
    rows = []
    for j in range(len(prompts)):
        n = int(out.response_mask[j].sum())
        rows.append(dict(token_ids=out.response_ids[j, :n].tolist(), log_probs=out.sampled_log_probs[j, :n].tolist(),
                         text=out.response_text[j]))
    return rows


def test_models_lists_the_served_model(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_the_server_shortens_the_thread_switch_interval_while_it_runs(tmp_path):
    """The generation thread needs the interpreter lock back after every CUDA call it waited on: while a batcher
    runs, other threads hold it at most SWITCH_INTERVAL_S at a time (bench/RESULTS.md: a served decode step on an
    H200 at 5.4 ms at 0.5 ms, 2.96 ms at 0.05 ms, direct calls' 3.06 ms); stopping puts the interpreter's own
    setting back."""
    import sys

    from shardrl.rollout.serving.server import SWITCH_INTERVAL_S

    save_char_model(tmp_path)
    original = sys.getswitchinterval()  # (another test's server may be running: its own setting, put back here)
    sys.setswitchinterval(0.004)
    try:
        srv = Server(build_server(load_config(None, [f"model.path={tmp_path}", "rollout.backend=hf"]),
                                  served_name="t"))
        try:
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        finally:
            srv.stop()
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(original)


def test_completions_carry_the_samplers_tokens_and_log_probs(server):
    tok = server.batcher.tokenizer
    res = client(server).completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=0)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    want = direct(server, ids, 12)
    assert len(res.choices) == len(PROMPTS)
    for choice, w, p in zip(res.choices, want, ids):
        extra = choice.model_extra
        assert extra["token_ids"] == w["token_ids"] and extra["prompt_token_ids"] == p
        assert choice.text == w["text"]
        assert choice.logprobs.token_logprobs == pytest.approx(w["log_probs"], abs=1e-6)
        assert choice.finish_reason == ("length" if len(w["token_ids"]) == 12 else "stop")
    assert res.usage.prompt_tokens == sum(map(len, ids))
    assert res.usage.completion_tokens == sum(len(w["token_ids"]) for w in want)


def hold(batcher, monkeypatch) -> threading.Event:
    """Holds the batcher's next generate call until the returned event is set (requests queue meanwhile); its
    `started` event is set once the held call began."""
    release = threading.Event()
    release.started = threading.Event()
    wait_for(lambda: batcher.current is None, "the last stream drained")  # (else the next request joins it)
    name = "_stream_generate" if batcher.streaming() else "_generate"
    generate = getattr(batcher, name)
    monkeypatch.setattr(batcher, name, lambda items: (release.started.set(), release.wait(30), generate(items))[2])
    return release


def queued(batcher) -> int:
    """Requests waiting behind a held call: in the queue, joined to the held stream, or waiting for it to drain."""
    joined = len(batcher.current.items) - 1 if batcher.current is not None else 0
    return batcher.queue.qsize() + joined + len(batcher.later) + len(batcher.held)


def calls(batcher) -> int:
    """Generate calls so far: batches, or streams."""
    return batcher.stats["batches"] + batcher.stats["streams"]


def wait_for(condition, what: str, timeout_s: float = 30):
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("seed", [None, 3])
def test_a_shorter_max_tokens_in_the_same_batch_is_a_prefix_of_a_longer_one(server, monkeypatch, seed):
    """Two requests that wait together share one generate call (batches: of the longer length, the shorter cut at
    its own max_tokens; a stream: they join the held one, each row with its own limit): the shorter one ends at its
    max_tokens (finish_reason length) and is the longer one's prefix. Greedy requests with a seed (as lm-eval sends
    them) too: greedy draws nothing, so the seed does not keep them in calls of their own."""
    release = hold(server.batcher, monkeypatch)
    busy = threading.Thread(target=lambda: client(server).completions.create(model="tiny", prompt="x", max_tokens=2,
                                                                             temperature=0))
    busy.start()
    assert release.started.wait(30)
    got = {}

    def ask(n):  # (with a seed: one greedy by temperature 0, the other by a temperature below 1e-5)
        greedy = dict(temperature=1e-6) if seed is not None and n == 4 else dict(temperature=0)
        got[n] = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=n, seed=seed,
                                                   **greedy)

    asks = [threading.Thread(target=ask, args=(n,)) for n in (10, 4)]
    for t in asks:
        t.start()
    wait_for(lambda: queued(server.batcher) == 2, "both requests queued")
    before = calls(server.batcher)
    release.set()
    for t in [busy, *asks]:
        t.join()
    # the held one, then both together; or all three in the held stream
    assert calls(server.batcher) - before == (1 if server.batcher.streaming() else 2)
    long, short = got[10].choices[0], got[4].choices[0]
    assert len(long.model_extra["token_ids"]) > 4, "the long answer ended early: no cut to check"
    assert short.model_extra["token_ids"] == long.model_extra["token_ids"][:4]
    assert short.finish_reason == "length" and short.logprobs is None
    assert got[4].usage.completion_tokens == 4


def test_chat_applies_the_chat_template_and_returns_token_ids(server):
    tok = server.batcher.tokenizer
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    res = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert res.model_extra["prompt_token_ids"] == prompt
    (want,) = direct(server, [prompt], 10)
    choice = res.choices[0]
    assert choice.model_extra["token_ids"] == want["token_ids"]
    assert choice.message.role == "assistant" and choice.message.content == want["text"]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want["log_probs"], abs=1e-6)


def test_concurrent_clients_are_batched_and_each_gets_its_own_answer(server):
    tok = server.batcher.tokenizer
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(2)]

    async def all_at_once():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts])

    before = dict(server.batcher.stats)
    results = asyncio.run(all_at_once())
    stats = server.batcher.stats
    assert stats["requests"] - before["requests"] == len(prompts)
    assert calls(server.batcher) - before["batches"] - before["streams"] < len(prompts)  # some shared a call
    for p, res in zip(prompts, results):
        (want,) = direct(server, [tok(p, add_special_tokens=False)["input_ids"]], 8)
        assert res.choices[0].model_extra["token_ids"] == want["token_ids"], p


def test_bad_requests_get_4xx_json_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "does not exist" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"content": "no role"}], max_tokens=2)
    assert "role" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="stream_options"):  # (stream=true streams: test_serve_stream)
        c.completions.create(model="tiny", prompt="x", max_tokens=2, stream_options={"include_usage": True})
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, "chat/completions", b"{not json", timeout=10)
    assert e.value.code == 400 and "is not valid JSON (at character 1" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, "completions", b"", timeout=10)
    assert e.value.code == 400 and "the body is missing" in json.loads(e.value.read())["error"]["message"]
    for body, kind in [(b"[1, 2]", "list"), (b'"x"', "str"), (b"null", "null")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, "completions", body, timeout=10)
        assert e.value.code == 400
        assert f"the body must be a JSON object, not {kind}" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:  # (JSON sent as a form, as curl -d does without -H)
        request = urllib.request.Request(f"{server.url}/completions", data=b'{"model": "tiny", "prompt": "x"}',
                                         headers={"content-type": "application/x-www-form-urlencoded"})
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400 and "Content-Type: application/json" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:  # (a GET where only POST is served: 405 and its Allow)
        urllib.request.urlopen(f"{server.url}/completions", timeout=10)
    assert e.value.code == 405 and "POST" in e.value.headers["allow"]
    assert "GET /v1/completions" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=2.0)
    assert e.value.body["param"] == "top_p"
    for option in [dict(logit_bias={"5": -100}), dict(presence_penalty=0.5), dict(frequency_penalty=1.0),
                   dict(best_of=3), dict(echo=True), dict(suffix="end")]:  # (sampling they would change)
        with pytest.raises(openai.BadRequestError, match="is not supported by this server") as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2, **option)
        assert e.value.body["param"] == next(iter(option))
    for option in [dict(repetition_penalty=1.2), dict(min_p=0.1), dict(min_tokens=3), dict(ignore_eos=True),
                   dict(guided_json={"type": "object"}), dict(guided_choice=["a", "b"]), dict(allowed_token_ids=[3]),
                   dict(bad_words=["x"]), dict(use_beam_search=True)]:
        with pytest.raises(openai.BadRequestError, match="is not supported by this server") as e:  # (vLLM's)
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=option)
        assert e.value.body["param"] == next(iter(option))
    c.completions.create(model="tiny", prompt="x", max_tokens=2,  # (their defaults: taken)
                         extra_body=dict(repetition_penalty=1.0, min_p=0.0, min_tokens=0, ignore_eos=False,
                                         stop_token_ids=[], use_beam_search=False))
    # (alternatives up to 20: tests/test_serve_top_logprobs.py)
    one = c.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=1).choices[0].logprobs
    assert len(one.token_logprobs) == len(one.tokens) == len(one.top_logprobs) >= 1
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                              logprobs=True, top_logprobs=0)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  response_format={"type": "json_object"})
    c.completions.create(model="tiny", prompt="x", max_tokens=2, presence_penalty=0, logit_bias={}, best_of=1,
                         extra_body={"top_k": -1})  # (the values clients send by default: taken)
    for option, message in [(dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),  # (vLLM's and the trainer's bounds)
                            (dict(top_p=-0.5), "top_p=-0.5 must be in (0, 1]"),
                            (dict(temperature=-1.0), "temperature=-1.0 must be 0 (greedy) or in [1e-5, 1e4]"),
                            (dict(extra_body={"top_k": -2}), "top_k=-2 must be in [0, 2**31) (0 = off)")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2, **option)
        assert e.value.status_code == 400 and message in e.value.body["message"], e.value.body
        assert e.value.body["param"] == message.split("=")[0] and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt must be a string, a list of strings, a list of token"):
        c.completions.create(model="tiny", prompt=[True, False], max_tokens=2)  # (a bool is no token id)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.models.retrieve("gpt-9")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{server.url}/no/such/route", timeout=10)
    assert e.value.code == 404 and "/v1/no/such/route" in json.loads(e.value.read())["error"]["message"]
    short = c.completions.create(model="tiny", prompt="y" * (server.batcher.max_model_len - 4))  # (default: 16)
    assert 1 <= len(short.choices[0].model_extra["token_ids"]) <= 4  # (what is left of the context)


def test_numbers_out_of_range_and_asks_the_server_cannot_honour_get_400s(server):
    """A temperature too small to divide by is greedy, one too large, a seed past 64 bits and values of the wrong
    JSON type are 400s (were 500s or coerced); a top_k past the vocabulary is off; image parts, a forced tool choice,
    audio and reasoning effort are refused; tool-call arguments sent as OpenAI's JSON string reach the template as an
    object; vLLM's continue_final_message and chat_template_kwargs are applied."""
    c = client(server)
    greedy = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=1)
    for tiny in (1e-300, 5e-324, 1e-6):
        res = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=tiny, logprobs=1)
        assert res.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]
        assert res.choices[0].logprobs.token_logprobs == pytest.approx(greedy.choices[0].logprobs.token_logprobs)
    for option, param in [(dict(temperature=1e300), "temperature"), (dict(seed=10**23), "seed"),
                          (dict(max_tokens="3"), "max_tokens"), (dict(n=True), "n"),
                          (dict(temperature="0.5"), "temperature"), (dict(logprobs=True), "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2, **option})
        assert e.value.body["param"] == param, e.value.body
    seeded = dict(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=5)
    assert (c.completions.create(**seeded, extra_body={"top_k": 10**23}).choices[0].model_extra["token_ids"]
            == c.completions.create(**seeded).choices[0].model_extra["token_ids"])
    user = {"role": "user", "content": "x"}
    image = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for messages, option, param in [
            ([image], {}, "messages"), ([user], dict(tools=tools, tool_choice="required"), "tool_choice"),
            ([user], dict(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
            ([user], dict(modalities=["text", "audio"]), "modalities"), ([user], dict(reasoning_effort="high"),
                                                                         "reasoning_effort")]:
        with pytest.raises(openai.BadRequestError, match="not supported by this server") as e:
            c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **option)
        assert e.value.body["param"] == param
    c.chat.completions.create(model="tiny", messages=[user], max_tokens=2, tools=tools, tool_choice="auto",
                              modalities=["text"], parallel_tool_calls=False)
    tok = server.batcher.tokenizer
    template = "{% for m in messages %}{{ m['role'] }}:{{ m.tool_calls[0].function.arguments.x if m.tool_calls " \
               "else m['content'] }}:{% endfor %}{{ flag }}"
    called = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": "yz"}'}}]}]
    res = c.chat.completions.create(model="tiny", messages=called, max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"chat_template": template, "flag": "ok"}})
    assert tok.decode(res.model_extra["prompt_token_ids"]) == "user:x:assistant:yz:ok"
    res = c.chat.completions.create(model="tiny", messages=[user, {"role": "assistant", "content": "ab"}],
                                    max_tokens=2, extra_body={"continue_final_message": True,
                                                              "add_generation_prompt": False})
    assert tok.decode(res.model_extra["prompt_token_ids"]) == "user: x\nassistant: ab"
    res = c.chat.completions.create(model="tiny", messages=[user], max_tokens=2,  # (the kwargs win, as vLLM's)
                                    extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert tok.decode(res.model_extra["prompt_token_ids"]) == "user: x\n"
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}  # (an assistant's refusal)
    res = c.chat.completions.create(model="tiny", messages=[user, refused, user], max_tokens=2)
    assert "assistant: no\n" in tok.decode(res.model_extra["prompt_token_ids"])
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt=false"):
        c.chat.completions.create(model="tiny", messages=[user, {"role": "assistant", "content": "ab"}],
                                  max_tokens=2, extra_body={"continue_final_message": True})


@pytest.mark.parametrize("server", ["hf"], indirect=True)
def test_a_plain_server_keeps_no_records_of_an_agents_calls(server):
    """Only an RL run's endpoint (a policy set) keeps each episode's calls for its trainer: a plain server answered
    with the episode header keeps nothing (was: every such request's choices, for good)."""
    c = client(server).with_options(default_headers={"x-shardrl-episode": "e1"})
    c.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert server.app.state.records == {}


def test_a_client_that_went_away_is_dropped_before_its_batch(server, monkeypatch):
    """While a request generates (held until the second client is gone), a second client gives up (timeout) and
    disconnects: its request is not generated (counted as dropped; a stream took it in and ended it: cancelled)
    and the server answers the next one."""
    batcher = server.batcher
    release = hold(batcher, monkeypatch)
    busy = threading.Thread(target=lambda: client(server).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0))
    before = dict(batcher.stats)
    busy.start()
    assert release.started.wait(30)
    with pytest.raises(TimeoutError):
        post(server, "completions", json.dumps({"model": "tiny", "prompt": "gone", "max_tokens": 50}).encode(),
             timeout=0.3)
    wait_for(lambda: queued(batcher) == 1, "the abandoned request queued")
    time.sleep(0.2)  # (the server reads the closed connection)
    release.set()
    busy.join()
    res = client(server).completions.create(model="tiny", prompt="a", max_tokens=2, temperature=0)
    assert res.choices[0].model_extra["token_ids"]
    stats = batcher.stats
    assert stats["dropped"] + stats["cancelled"] - before["dropped"] - before["cancelled"] == 1
    assert stats["requests"] - before["requests"] == 2  # the held one and the last one


def test_more_bad_requests_and_the_forms_clients_send(server):
    """Ids outside the vocabulary and too many samples are refused before they reach a batch; nulls, content
    parts, a content-less assistant turn and lists of id lists are taken."""
    c = client(server)
    for prompt in ([10**6], [-1, 5]):
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            c.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=100000"):
        c.completions.create(model="tiny", prompt="a", max_tokens=2, n=100000)
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|context"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 40000}])
    body = json.dumps({"model": "tiny", "prompt": [[5, 6], [7]], "max_tokens": None, "temperature": None,
                       "n": 2}).encode()
    res = post(server, "completions", body, timeout=60)
    assert [ch["prompt_token_ids"] for ch in res["choices"]] == [[5, 6], [5, 6], [7], [7]]
    assert all(1 <= len(ch["token_ids"]) <= 16 for ch in res["choices"])
    messages = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2="}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    res = c.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    tok = server.batcher.tokenizer
    want = tok.apply_chat_template([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": ""},
                                    {"role": "user", "content": "again"}], add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert res.model_extra["prompt_token_ids"] == want


def test_a_failing_request_fails_alone(server, monkeypatch):
    """A generate call that fails for one request's rows: the others batched (or streamed) with it are answered,
    the failing one gets a JSON 500."""
    batcher = server.batcher
    streaming = batcher.streaming()
    release = hold(batcher, monkeypatch)
    generate = batcher._generate

    def fragile(items):
        if any(item.prompts[0][:1] == [9] for item in items):
            raise RuntimeError("row 9 broke the kernel")
        return generate(items)

    if streaming:  # the stream fails; its requests are retried one at a time in batches, where 9 fails again
        def fragile_stream(stream):
            release.started.set()
            release.wait(30)
            if any(item.prompts[0][:1] == [9] for item in stream.items):
                raise RuntimeError("a stream with row 9 broke")
            raise AssertionError("row 9 joined the stream")

        monkeypatch.setattr(batcher, "_stream_generate", fragile_stream)
        monkeypatch.setattr(batcher, "_generate", fragile)

    busy = threading.Thread(target=lambda: client(server).completions.create(model="tiny", prompt="x", max_tokens=2))
    busy.start()
    assert release.started.wait(30)
    if not streaming:
        monkeypatch.setattr(batcher, "_generate", lambda items: (release.wait(30), fragile(items))[1])
    got = {}

    def ask(prompt):
        try:
            got[prompt[0]] = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=3)
        except openai.InternalServerError as e:
            got[prompt[0]] = e

    asks = [threading.Thread(target=ask, args=([p, 5],)) for p in (8, 9, 10)]
    for t in asks:
        t.start()
    wait_for(lambda: queued(batcher) == 3, "three requests queued")
    release.set()
    for t in [busy, *asks]:
        t.join()
    assert isinstance(got[9], openai.InternalServerError) and "row 9 broke the kernel" in got[9].body["message"]
    assert got[9].body["type"] == "server_error"
    assert got[8].choices[0].model_extra["token_ids"] and got[10].choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("server", ["fast", "fast_process"], indirect=True)  # (a batch runs to its end: the client is checked first)
def test_a_client_that_leaves_while_it_generates_ends_its_rows(server, monkeypatch):
    """Streaming: a request whose client gives up while its rows decode ends at the engine's next host sync, its
    slot free (counted as cancelled; nothing answered); the server answers the next request."""
    from shardrl.rollout.serving import batcher as server_module

    batcher = server.batcher
    assert batcher.streaming()
    made = {}
    finished = server_module._Stream.finished

    def recording(self, row, tokens, log_probs):
        if row in self.gone:
            made[row] = len(tokens)
        return finished(self, row, tokens, log_probs)

    monkeypatch.setattr(server_module._Stream, "finished", recording)
    wait_for(lambda: batcher.current is None, "the last stream drained")
    client(server).completions.create(model="tiny", prompt="a", max_tokens=1)  # (the cache sized, for the state)
    monkeypatch.setattr(batcher.rollout._state, "eos", torch.tensor([-1]))  # no row ends before its limit
    before = dict(batcher.stats)
    body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 3000, "temperature": 0}).encode()
    with pytest.raises(TimeoutError):
        post(server, "completions", body, timeout=0.5)
    wait_for(lambda: batcher.stats["cancelled"] > before["cancelled"], "the request cancelled")
    wait_for(lambda: made, "its row ended")
    assert 1 <= max(made.values()) < 3000
    res = client(server).completions.create(model="tiny", prompt="b", max_tokens=2)
    assert res.choices[0].model_extra["token_ids"]
    assert batcher.stats["requests"] - before["requests"] == 1


@pytest.mark.parametrize("server", ["hf", "fast"], indirect=True)
def test_a_batch_whose_every_client_left_ends_at_its_next_step(server):
    """A batch (hf; fast: a seeded request, generated alone, not streamed) whose only client gave up: it ends at its
    next step or sync (`Rollout.abort`), counted as cancelled, and the next request is answered in seconds (was: after
    the 20,000 tokens nobody would read)."""
    batcher = server.batcher
    before = dict(batcher.stats)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 20000, "temperature": 0.001,
                       "seed": 1}).encode()
    with pytest.raises(TimeoutError):
        post(server, "completions", body, timeout=1)
    started = time.monotonic()
    res = client(server).with_options(timeout=30).completions.create(model="tiny", prompt="b", max_tokens=2,
                                                                     temperature=0)
    assert res.choices[0].model_extra["token_ids"] and time.monotonic() - started < 15
    wait_for(lambda: batcher.stats["cancelled"] > before["cancelled"], "the abandoned request counted")


@pytest.mark.parametrize("server", ["fast"], indirect=True)  # (batches take every waiting request in turn)
def test_a_request_with_other_settings_is_not_starved_by_a_busy_stream(server):
    """Streaming: requests at one temperature keep a stream busy; one at another temperature, waiting with them when
    the stream started, is answered while they go on (the stream closes to new rows and drains first)."""
    b = server.batcher
    assert b.streaming()
    stop, got = threading.Event(), {}

    def pump():
        c = client(server)
        while not stop.is_set():
            c.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=1.0)

    wait_for(lambda: b.current is None, "the last stream drained")
    b.pause()  # (everything below waits together)
    pumps = [threading.Thread(target=pump) for _ in range(3)]
    odd = threading.Thread(target=lambda: got.update(odd=client(server).completions.create(
        model="tiny", prompt="b", max_tokens=3, temperature=0.5)))
    try:
        for t in pumps:
            t.start()
        wait_for(lambda: queued(b) >= 3, "the pumps' first requests queued")
        odd.start()
        wait_for(lambda: queued(b) >= 4, "the odd request queued")
        b.unpause()
        odd.join(20)
        assert not odd.is_alive(), "the request at another temperature starved"
        assert got["odd"].choices[0].model_extra["token_ids"]
    finally:
        b.unpause()
        stop.set()
        for t in pumps:
            t.join(30)


def test_seeded_requests_are_reproducible(server):
    """A request with a seed is generated in a generate call of its own (not joined to a running stream, whose
    noise depends on when rows arrive, nor to another seeded request, whose rows would take the seed's first draws):
    the same request gives the same tokens, alone or with copies of it arriving together."""
    c = client(server)
    first, second = (c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7)
                     for _ in range(2))
    alone = first.choices[0].model_extra["token_ids"]
    assert second.choices[0].model_extra["token_ids"] == alone

    async def together() -> list:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0) as ac:
            return await asyncio.gather(*[ac.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12,
                                                                temperature=1.0, seed=7) for _ in range(4)])

    assert [r.choices[0].model_extra["token_ids"] for r in asyncio.run(together())] == [alone] * 4
    # a prompt's samples do not depend on the request's other prompts (each prompt a call of its own, as vLLM's)
    many = c.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=12, temperature=1.0, seed=7,
                                n=2)
    pair = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7, n=2)
    assert ([ch.model_extra["token_ids"] for ch in many.choices[2:]]
            == [ch.model_extra["token_ids"] for ch in pair.choices])


def test_stop_token_ids_end_a_reply_at_the_first_of_them(server):
    """vLLM's `stop_token_ids`: the reply ends at the first of them (kept in token_ids, out of the text), its
    log-probs and the usage cut alike, finish_reason stop; an id outside the vocabulary is refused."""
    c = client(server)
    full = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=0)
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) >= 4, "too short a reply to cut"
    first = ids.index(ids[2])  # (where the reply ends: the first place that id is made)
    absent = next(t for t in range(3, 100) if t not in ids)
    res = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=0,
                               extra_body={"stop_token_ids": [absent, ids[2]]})
    cut = res.choices[0]
    assert cut.model_extra["token_ids"] == ids[:first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[:first + 1]
    assert cut.text == server.batcher.tokenizer.decode(ids[:first], skip_special_tokens=True)
    assert res.usage.completion_tokens == first + 1
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                     temperature=0, extra_body={"stop_token_ids": [ids[2]]})
    assert ids[2] not in chat.choices[0].model_extra["token_ids"][:-1]
    with pytest.raises(openai.BadRequestError, match="stop token id 99999999 is outside") as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"stop_token_ids": [99999999]})
    assert e.value.body["param"] == "stop_token_ids"


@pytest.mark.parametrize("server", ["fast", "fast_batches"], indirect=True)  # (hf keeps no cache across calls)
def test_a_session_id_pins_the_conversation(server):
    """`session_id` (and an RL run's episode header): the fast backend keeps the conversation's cached blocks for the
    session's next request (`FastRollout.pin_session`; what it keeps: tests/test_prefix_cache.py)."""
    b = server.batcher
    pinned = []
    pin = b.rollout.pin_session
    b.rollout.pin_session = lambda session, tokens: (pinned.append((session, list(tokens))), pin(session, tokens))[1]
    try:
        res = client(server).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                                extra_body={"session_id": "conv-1"})
    finally:
        del b.rollout.pin_session
    choice = res.choices[0].model_extra
    assert pinned == [("conv-1", choice["prompt_token_ids"] + choice["token_ids"])]
    assert "conv-1" in b.rollout._pool.pins


def test_every_waiting_client_is_checked_for_having_left_while_answered_ones_leave_the_list():
    """A running stream checks at most 32 clients a tick, in turn; with 256 waiting, the 32 oldest answered each
    tick and 32 new ones arriving, every request is checked before it is answered (a cursor into the shrinking list
    skipped half of them, and checking new ones first would spend every check on them), and no request twice while
    another that arrived with it waits unchecked."""
    from shardrl.rollout.serving.server import ALIVE_CHECKS, due_for_check

    class Item:
        pass

    waiting, last_check, checks, answered = [Item() for _ in range(256)], {}, {}, []
    for tick in range(64):
        due, last_check = due_for_check(waiting, last_check, float(tick))
        assert len(due) == ALIVE_CHECKS == len(set(map(id, due)))
        assert sorted(last_check) == sorted(map(id, waiting))  # nothing kept for requests that left the list
        for item in due:
            checks[id(item)] = checks.get(id(item), 0) + 1
        answered += waiting[:32]
        waiting = waiting[32:] + [Item() for _ in range(32)]
    assert all(checks.get(id(item), 0) >= 1 for item in answered)
    assert max(checks.values()) == 1  # each checked once in its 8 ticks: 256 waiting, 32 checks a tick


def test_clients_still_waiting_are_checked_again_while_new_ones_keep_coming():
    """256 waiting, all checked once in 8 ticks; then 32 arrive a tick and none is answered: the first 256 are each
    checked a second time in the next 8 ticks (new requests do not take every check)."""
    from shardrl.rollout.serving.server import due_for_check

    class Item:
        pass

    first, last_check, checks = [Item() for _ in range(256)], {}, {}
    waiting = list(first)
    for tick in range(16):
        due, last_check = due_for_check(waiting, last_check, float(tick))
        for item in due:
            checks[id(item)] = checks.get(id(item), 0) + 1
        if tick >= 7:
            waiting += [Item() for _ in range(32)]
    assert [checks.get(id(item), 0) for item in first] == [2] * 256


def test_a_front_end_process_stops_when_its_engine_goes(tmp_path):
    """`shardrl serve`'s front end in its own process: when the engine closes its side (its process ended), the
    front end stops and frees its port instead of answering errors forever."""
    save_char_model(tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.backend=fast"])
    srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=4), front_ends=2)
    try:
        assert client(srv).models.list().data[0].id == "tiny"
        srv.engine.close()
        for process in srv.processes:
            process.join(timeout=30)
            assert process.exitcode is not None
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{srv.url}/models", timeout=5)
    finally:
        srv.stop()


def test_front_ends_share_the_port_and_all_serve(tmp_path):
    """Several front-end processes, each on a socket of its own bound by the engine's process to one port: requests
    on many connections reach the engine through every front end, each answered as one front end answers it; a
    port already served is refused with an error that names it; a stopped server leaves no thread or open file of
    its own behind."""
    save_char_model(tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.backend=fast"])
    engine = build_engine(cfg, served_name="tiny", max_batch=8)
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    ServerProcess(*engine, front_ends=2).stop()  # (once before, so the count below sees only what a server leaks)
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    srv = ServerProcess(*engine, front_ends=3)
    try:
        assert len(srv.pids) == 3 and len(srv.engine.conns) == 3

        async def many() -> list:
            async def one(i: int):  # (a client of its own: a connection of its own)
                async with openai.AsyncOpenAI(base_url=srv.url, api_key="unused", max_retries=0) as c:
                    return await c.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=3,
                                                      temperature=0)
            return await asyncio.gather(*[one(i) for i in range(48)])

        answers = asyncio.run(many())
        assert all(len(a.choices[0].token_ids) == 3 for a in answers)
        assert sum(srv.engine.served) == 48
        print("requests per front end", srv.engine.served)
        assert all(n > 0 for n in srv.engine.served), srv.engine.served  # (each front end took some)
        for i in range(3):  # greedy: the same prompt, the same tokens, whichever front end served it
            assert len({tuple(a.choices[0].token_ids) for a in answers[i::3]}) == 1
        port = int(srv.url.rsplit(":", 1)[1].split("/")[0])
        for n in (1, 2):  # (two: sockets that share a port with SO_REUSEPORT must not join this server's)
            with pytest.raises(RuntimeError, match=f"cannot serve on 127.0.0.1:{port}.*--port"):
                ServerProcess(*engine, port=port, front_ends=n)
    finally:
        srv.stop()
    time.sleep(0.5)  # (threads that were told to end)
    assert threading.active_count() <= threads and len(os.listdir("/proc/self/fd")) <= fds
    with pytest.raises(ValueError, match="at least one front-end"):
        ServerProcess(*engine, front_ends=0)


def test_requests_arriving_as_streams_end_are_all_answered(tmp_path):
    """The stream's loop wakes on a request's arrival (no poll); a request that arrives just as its stream ends goes
    to the next stream. Here streams end after 0.2 ms idle, and whenever a request of the other temperature comes,
    while 16 clients (two temperatures) send 20 requests each with no pause: every request is answered with its own
    rows (an echo rollout: each row's tokens are its prompt's last token)."""
    from shardrl.rollout.serving.server import Batcher
    from shardrl.testing import save_char_model

    tok = save_char_model(tmp_path)

    class EchoRollout:
        stop_ids = [tok.eos_token_id]
        streams = 0

        def generate(self, ids, mask, sampling, max_new_tokens=None):  # (per-row limits: a stream can serve it)
            raise AssertionError("every request here joins a stream")

        def generate_stream(self, prompts, limits, sampling, feed, need_seq, num_slots, overlap=False):
            EchoRollout.streams += 1
            row = 0
            while new := feed.take(block=True):
                for prompt, limit in new:
                    feed.finished(row, [int(prompt[-1])] * limit, torch.zeros(limit))
                    row += 1

    async def run() -> list:
        batcher = Batcher(EchoRollout(), tok, max_batch=8, max_model_len=64, idle_s=0.0002)
        await batcher.start()

        async def client(c: int) -> list:
            got = []
            for r in range(20):
                sampling = SamplingParams(temperature=(1.0, 0.7)[c % 2], max_new_tokens=1 + r % 3, seed=None)
                ids = [5 + (c * 20 + r) % 40]
                outs = await asyncio.wait_for(batcher.submit([[3, *ids]], sampling), timeout=10)
                got.append((ids[0], r, outs[0]["token_ids"]))
            return got

        try:
            return await asyncio.gather(*[client(c) for c in range(16)])
        finally:
            await batcher.stop()

    answers = [a for got in asyncio.run(run()) for a in got]
    assert len(answers) == 320
    assert all(tokens == [last] * (1 + r % 3) for last, r, tokens in answers)
    assert EchoRollout.streams > 20  # (the streams did end and restart under the clients)


@pytest.mark.parametrize("backend, front_end", [("hf", "process"), ("hf", "thread"), ("fast", "process")])
def test_a_server_stopped_with_requests_in_flight_answers_them_503_and_ends_soon(tmp_path, backend, front_end):
    """A long request generating (greedy, 20,000 tokens: minutes here) and another waiting behind it (other
    settings) when the server stops: both clients get a 503 `server_stopping` within seconds, and the generation
    ends (hf: its batch at the next step) instead of the front end waiting for it (was: 30 s, then the connections
    cut without a response; a thread front end waited for the clients to give up)."""
    save_char_model(tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", f"rollout.backend={backend}"])
    if front_end == "process":
        srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=8, stream=backend == "fast"))
    else:
        srv = Server(build_server(cfg, served_name="tiny", max_batch=8, stream=backend == "fast"))
    batcher, answers = srv.batcher, {}

    def ask(name: str, **options) -> None:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 20000, **options}).encode()
        try:
            answers[name] = post(srv, "completions", body, timeout=60)
        except urllib.error.HTTPError as e:
            answers[name] = (e.code, json.loads(e.read())["error"])
        except Exception as e:  # noqa: BLE001 (a cut connection: what the test is against)
            answers[name] = e

    clients = [threading.Thread(target=ask, args=("long",), kwargs=dict(temperature=0))]
    clients[0].start()
    wait_for(lambda: not batcher.idle.is_set(), "the long request generating")
    clients.append(threading.Thread(target=ask, args=("behind",), kwargs=dict(temperature=0.5, max_tokens=3)))
    clients[1].start()
    time.sleep(0.5)  # (it waits for the long one: other settings)
    started = time.monotonic()
    srv.stop()
    for c in clients:
        c.join(timeout=30)
    took = time.monotonic() - started
    assert answers.get("long", (None, {}))[0] == 503 and answers.get("behind", (None, {}))[0] == 503, answers
    assert answers["long"][1]["code"] == "server_stopping" and "stopped" in answers["long"][1]["message"]
    assert took < 15, took
    assert batcher.idle.wait(10), "the generation kept running after the server stopped"


@pytest.mark.parametrize("waiting", [False, True])
def test_stopping_the_batcher_ends_its_stream_and_answers_every_request(tmp_path, waiting):
    """`Batcher.stop` while a stream decodes long requests (and, `waiting`, another waits for it to drain): the
    stream ends at its next sync (its rows cancelled, no wait for more: the generation thread returns at once, not
    after 10,000 tokens or its idle wait), every request gets an error, and one submitted after gets an error at
    once. A batcher started again waits for the last generation of its stop to end (never two at once on one
    rollout). An engine service whose batcher fails to start raises and leaves no thread running."""
    from shardrl.rollout.serving.frontend import EngineService
    from shardrl.rollout.serving.server import Batcher

    tok = save_char_model(tmp_path)
    ended = threading.Event()

    class SlowRollout:  # (a token a row every 5 ms; rows of clients that left end at the next step, as FastRollout's)
        stop_ids = [tok.eos_token_id]

        def generate(self, ids, mask, sampling, max_new_tokens=None):
            raise AssertionError("every request here joins a stream")

        def generate_stream(self, prompts, limits, sampling, feed, need_seq, num_slots, overlap=False):
            rows, added = {}, 0  # row -> [tokens made, limit]
            while True:
                for prompt, limit in feed.take(block=not rows):
                    rows[added], added = [0, limit], added + 1
                if not rows:
                    break
                for row in feed.cancelled():
                    rows[row][1] = rows[row][0]
                time.sleep(0.005)
                for row in list(rows):
                    rows[row][0] += 1
                    if rows[row][0] >= rows[row][1]:
                        made = rows.pop(row)[0]
                        feed.finished(row, [5] * made, torch.zeros(made))
            ended.set()

    def plain(**kwargs) -> SamplingParams:
        return SamplingParams(seed=None, **kwargs)

    async def run() -> tuple[list, float]:
        batcher = Batcher(SlowRollout(), tok, max_batch=8, max_model_len=20000, idle_s=30)
        await batcher.start()
        asks = [asyncio.ensure_future(batcher.submit([[3, 4]], plain(max_new_tokens=10000))) for _ in range(3)]
        await asyncio.sleep(0.2)  # (the stream decodes them)
        if waiting:  # (another temperature: it waits for the stream to drain)
            asks.append(asyncio.ensure_future(batcher.submit([[3]], plain(temperature=0.5, max_new_tokens=2))))
            await asyncio.sleep(0.05)
        assert batcher.current is not None and not ended.is_set()
        started = time.monotonic()
        await batcher.stop()
        answers = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), timeout=5)
        assert await asyncio.to_thread(ended.wait, 2), "the stream kept generating after stop"
        with pytest.raises(RuntimeError, match="takes no more requests"):
            await asyncio.wait_for(batcher.submit([[3]], plain(max_new_tokens=2)), timeout=5)
        return answers, time.monotonic() - started

    answers, took = asyncio.run(run())
    assert len(answers) == 3 + waiting
    assert all(isinstance(a, RuntimeError) and "stopped before this request was answered" in str(a)
               for a in answers), answers
    assert took < 2

    running, peak = [0], [0]

    class SlowBatches:  # (one generate call takes 0.5 s: a batch stop cannot end early)
        stop_ids = [tok.eos_token_id]

        def generate(self, ids, mask, sampling):
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            time.sleep(0.5)
            running[0] -= 1
            return SimpleNamespace(response_mask=torch.ones(len(ids), 2, dtype=torch.long),
                                   response_ids=torch.full((len(ids), 2), 5), sampled_log_probs=torch.zeros(len(ids), 2),
                                   response_text=["x"] * len(ids), token_version=None)

    async def restart() -> list:
        batcher = Batcher(SlowBatches(), tok, max_batch=8, max_model_len=64)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit([[3]], plain(max_new_tokens=2)))
        await asyncio.sleep(0.1)
        await batcher.stop()
        await batcher.start()  # (the first call still runs)
        try:
            return [await asyncio.gather(first, return_exceptions=True),
                    await batcher.submit([[3]], plain(max_new_tokens=2))]
        finally:
            await batcher.stop()

    first, second = asyncio.run(restart())
    assert isinstance(first[0], RuntimeError) and second[0]["token_ids"] == [5, 5]
    assert peak[0] == 1, "two generate calls ran at once on one rollout"

    class Failing(Batcher):
        async def start(self):
            raise OSError("no device")

    def loops() -> set:  # (another test's server may have one running: only a new one counts)
        return {t for t in threading.enumerate() if t.name == "shardrl-engine-loop"}

    before = loops()
    with pytest.raises(OSError, match="no device"):
        EngineService(Failing(SlowRollout(), tok))
    wait_for(lambda: loops() <= before, "the failed engine's loop thread ended", timeout_s=5)


def test_shardrl_serve_says_what_is_wrong_in_one_line(tmp_path, capsys):
    """A model folder with a broken config.json or without weights, a port already served, and --front-ends out of
    range: one line each, before the model loads where it can be checked first."""
    import shutil
    import socket

    from shardrl.cli import main as cli_main

    good = tmp_path / "good"
    save_char_model(good)
    broken, bare = tmp_path / "broken", tmp_path / "bare"
    shutil.copytree(good, broken)
    (broken / "config.json").write_text("{not json")
    shutil.copytree(good, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    capsys.readouterr()  # (the model's writing)
    for folder, says in [(broken, "its config.json cannot be read"), (bare, "has a config.json but no weights")]:
        assert cli_main(["serve", f"model.path={folder}", "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["serve", f"model.path={tmp_path / 'no_such_folder'}", "--port", str(port)]) == 1
        assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err  # (before the model: none here)
    with pytest.raises(SystemExit, match="at least one front-end"):
        cli_main(["serve", f"model.path={good}", "--front-ends", "0"])
    for option, says in [(["--port", "99999"], "a port is 0 to 65535, got 99999"),
                         (["--max-batch", "0"], "must be >= 1, got 0")]:
        with pytest.raises(SystemExit):  # (argparse's usage error: exit status 2, one line)
            cli_main(["serve", f"model.path={good}", *option])
        assert says in capsys.readouterr().err


def test_shardrl_serve_gives_a_request_without_max_tokens_its_own_default_not_the_training_configs(tmp_path,
                                                                                                   monkeypatch):
    """Agent frameworks mostly send no max_tokens: `shardrl serve` gives them --default-max-tokens (2048), not
    rollout.max_new_tokens (a training default of 32, which cut their replies and tool calls)."""
    from shardrl.cli import SERVE_DEFAULT_MAX_TOKENS, main as cli_main
    from shardrl.rollout.serving import command
    from shardrl.rollout.serving.batcher import STREAM_SEQ

    save_char_model(tmp_path / "model")
    cfg = load_config(None, [f"model.path={tmp_path / 'model'}", "rollout.backend=hf"])
    assert build_engine(cfg, max_batch=2)[3] == cfg.rollout.max_new_tokens == 32  # (the library's default: as before)
    assert build_engine(cfg, max_batch=2, default_max_tokens=77)[3] == 77
    seen = []

    def fake_engine(cfg, *args, **kwargs):
        seen.append(kwargs["default_max_tokens"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(command, "build_engine", fake_engine)
    for option, expected in [([], SERVE_DEFAULT_MAX_TOKENS), (["--default-max-tokens", "300"], 300)]:
        with pytest.raises(RuntimeError, match="stop here"):
            cli_main(["serve", f"model.path={tmp_path / 'model'}", "--port", "0", *option])
        assert seen.pop() == expected
    assert SERVE_DEFAULT_MAX_TOKENS == 2048 and 2 * SERVE_DEFAULT_MAX_TOKENS <= STREAM_SEQ  # (no slot given up)


@pytest.mark.parametrize("front_end", ["thread", "process"])
def test_ctrl_c_stops_shardrl_serve_quietly(tmp_path, front_end):
    """Ctrl-C on `shardrl serve` (its process group, as a terminal sends it): exit status 0 and no traceback (uvicorn
    raises the Ctrl-C again after its graceful stop; a thread front end let it out as a KeyboardInterrupt)."""
    import signal
    import subprocess
    import sys

    save_char_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "shardrl.cli", "serve", f"model.path={tmp_path / 'model'}",
                             "--port", "0", "--front-end", front_end], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        line = ""
        while not line.startswith("serving "):  # (the model loaded; uvicorn's access lines may come first)
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(2)  # (a thread front end starts its uvicorn after that line)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def test_a_front_end_that_stopped_answers_a_new_request_503_not_500():
    """A request reaching a front end between its stop and the closing of its sockets: `Stopped` (503), not an
    OSError on the engine's closed connection (500)."""
    from shardrl.rollout.serving.frontend import RemoteBatcher
    from shardrl.rollout.serving.server import Stopped

    remote = RemoteBatcher(("127.0.0.1", 1), b"key", tokenizer=None)
    remote.stopped = True
    with pytest.raises(Stopped, match="takes no more requests"):
        asyncio.run(remote.submit([[3]], SamplingParams(max_new_tokens=2)))


class EchoEngine:
    """What `EngineService` needs of a Batcher: each prompt answered reversed (`outputs`), after `delay_s`."""

    async def start(self):
        pass

    async def stop(self):
        pass

    def delay_s(self, prompt) -> float:
        return 0.0

    def outputs(self, prompts) -> list[dict]:
        return [dict(token_ids=p[::-1]) for p in prompts]

    async def submit(self, prompts, sampling, alive=None, session=None):
        await asyncio.sleep(self.delay_s(prompts[0]))
        return self.outputs(prompts)


def through_engine_service(batcher, body):
    """The result of `body(remote, engine)` (a coroutine function), run from a `RemoteBatcher` connected to an
    `EngineService` over `batcher`."""
    from shardrl.rollout.serving.frontend import EngineService, RemoteBatcher

    engine = EngineService(batcher)
    try:
        async def front_end():
            remote = RemoteBatcher(engine.address, engine.authkey, tokenizer=None)
            await remote.start()
            try:
                return await body(remote, engine)
            finally:
                await remote.stop()

        return asyncio.run(front_end())
    finally:
        engine.close()


def test_the_engine_connection_sends_small_messages_at_once():
    """Both ends of a front end's connection to the engine have Nagle's algorithm off (TCP_NODELAY): with many
    requests in flight on the one connection, a message written while the last waits for its acknowledgement was
    held up to Linux's 40 ms delayed ACK (bench/serve.py's `hops`: 44 ms median a request on the way up, 9 without);
    and a request still goes there and back."""
    import socket

    def nodelay_is_on(conn) -> int:
        sock = socket.socket(fileno=conn.fileno())
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            sock.detach()

    async def body(remote, engine):
        answer = await remote.submit([[3, 4, 5]], SamplingParams(max_new_tokens=2))
        return answer, nodelay_is_on(remote.conn), [nodelay_is_on(conn) for conn in engine.conns]

    answer, front, engine_ends = through_engine_service(EchoEngine(), body)
    assert answer == [dict(token_ids=[5, 4, 3])]
    assert front and len(engine_ends) == 1 and all(engine_ends)


def test_the_serve_bench_runs_on_its_gpu_stand_in(tmp_path):
    """bench/serve.py on `--backend sim` (bench/sim_rollout.py: the fast rollout's timing, no model), as a machine
    without a GPU runs it: the real batcher, front-end process and clients; every request answered, each leg of a
    request timed (`hops`), the direct calls made the same number of rows."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "serve.jsonl"
    proc = subprocess.run([sys.executable, "bench/serve.py", "--backend", "sim", "--clients", "6", "--requests", "2",
                           "--prompt-len", "16", "--max-tokens", "24", "--client", "raw", "--in-process",
                           "--warm-ups", "0", "--sim", "step_ms=1,admit_host_ms=1", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["backend"] == "SimRollout" and rec["requests"] == 12 and rec["ratio"] > 0
    assert rec["sim"] == dict(step_ms=1.0, admit_host_ms=1.0)
    assert rec["in_process_stats"]["requests"] == 12 and rec["served_profile"]["decode_steps"] > 0
    hops = rec["arrivals"]["hops"]
    assert rec["arrivals"]["traced"] == 12 and sorted(hops) == ["wave_0", "wave_1"]
    assert all(len(hops[w][leg]) == 3 for w in hops for leg in ("up", "front_end", "link", "engine", "down"))


def test_a_generation_raising_stop_iteration_fails_its_request_not_the_batcher(tmp_path):
    """A backend whose generate raises StopIteration (a `next()` on an empty iterator, as an aborted R3 call once
    did): the request fails with an error and the batcher serves the next one (StopIteration cannot cross into the
    awaiting coroutine: the request hung, and every request after it)."""
    from shardrl.rollout.serving.server import Batcher

    tok = save_char_model(tmp_path)
    calls = []

    class Broken:
        def generate(self, ids, mask, sampling):
            calls.append(1)
            if len(calls) == 1:
                next(iter([]))
            return SimpleNamespace(response_mask=torch.ones(len(ids), 1, dtype=torch.long),
                                   response_ids=torch.full((len(ids), 1), 5),
                                   sampled_log_probs=torch.zeros(len(ids), 1), response_text=["x"] * len(ids),
                                   token_version=None)

    async def run():
        batcher = Batcher(Broken(), tok, 4, 64)
        await batcher.start()
        try:
            with pytest.raises(RuntimeError, match="StopIteration"):
                await asyncio.wait_for(batcher.submit([[3, 4]], SamplingParams(max_new_tokens=1)), 10)
            return await asyncio.wait_for(batcher.submit([[3, 4]], SamplingParams(max_new_tokens=1)), 10)
        finally:
            await batcher.stop()

    assert asyncio.run(run())[0]["token_ids"] == [5]


def test_the_engine_connection_sends_a_turns_messages_as_one_list():
    """What one turn of the event loop puts in an `Outbox` crosses as one list (16 at most: the first of a burst
    does not wait for the rest), in order; a list that cannot be sent fails its requests, not the others."""
    from shardrl.rollout.serving.frontend import Outbox

    class Conn:
        def __init__(self):
            self.sent, self.broken = [], False

        def send(self, batch):
            if self.broken:
                raise OSError("gone")
            self.sent.append(list(batch))

    async def turns():
        conn, failed = Conn(), []
        box = Outbox(conn, asyncio.get_running_loop(), failed=lambda batch, e: failed.append((batch, str(e))))
        for i in range(40):  # (one turn)
            box.put(i)
        await asyncio.sleep(0)
        box.put("alone")
        await asyncio.sleep(0)
        conn.broken = True
        box.put("lost")
        await asyncio.sleep(0)
        return conn.sent, failed

    sent, failed = asyncio.run(turns())
    assert sent == [list(range(16)), list(range(16, 32)), list(range(32, 40)), ["alone"]]
    assert failed == [(["lost"], "gone")]

    class OutOfOrder(EchoEngine):
        def delay_s(self, prompt) -> float:
            return 0.01 * (prompt[0] % 3)

    async def body(remote, engine):
        answers = await asyncio.wait_for(asyncio.gather(*[
            remote.submit([[i, i + 1]], SamplingParams(max_new_tokens=2)) for i in range(50)]), 30)
        remote.outbox.conn = broken = Conn()  # (a send that fails: that request fails, with a message)
        broken.broken = True
        with pytest.raises(RuntimeError, match="could not reach the engine"):
            await asyncio.wait_for(remote.submit([[1]], SamplingParams(max_new_tokens=2)), 5)
        assert not remote.waiting
        return answers, list(engine.served)

    answers, served = through_engine_service(OutOfOrder(), body)
    assert answers == [[dict(token_ids=[i + 1, i])] for i in range(50)]
    assert served == [50]


def test_an_answer_that_cannot_be_sent_fails_its_request_alone():
    """An answer the engine cannot pickle, sent in one list with others: the others are answered, its request gets
    an error (it does not wait for ever); and a request the front end cannot pickle fails alone too."""

    class Odd(EchoEngine):
        def outputs(self, prompts) -> list[dict]:
            return [dict(token_ids=prompts[0], bad=(lambda: 0) if prompts[0][0] == 3 else None)]

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("not picklable")

    async def body(remote, engine):
        async def one(i):
            try:
                return (await remote.submit([[i]], SamplingParams(max_new_tokens=2)))[0]["token_ids"]
            except RuntimeError as e:
                return str(e)

        answers = await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(8)]), 30)
        sent = [remote.submit([[10 + i]], SamplingParams(max_new_tokens=2), session=Unpicklable() if i == 1 else None)
                for i in range(4)]
        return answers, await asyncio.wait_for(asyncio.gather(*sent, return_exceptions=True), 30)

    answers, results = through_engine_service(Odd(), body)
    assert [a for i, a in enumerate(answers) if i != 3] == [[i] for i in range(8) if i != 3]
    assert "the answer could not be sent" in answers[3]
    assert [r[0]["token_ids"] for i, r in enumerate(results) if i != 1] == [[10], [12], [13]]
    assert isinstance(results[1], RuntimeError) and "could not reach the engine" in str(results[1])
