"""Alternatives to each sampled token from `shardrl serve` (issue 59): chat's `top_logprobs` (with `logprobs=true`)
and completions' `logprobs` up to 20, as vLLM's OpenAI server gives them, streamed and not, through the real `openai`
client, checked against a plain forward of the tiny model (the top k of log softmax(logits / temperature): the
distribution the sampled tokens' log-probs are reported in); asking for them changes nothing that is sampled; values
out of range are OpenAI-shaped 400s naming the parameter."""

from __future__ import annotations

import openai
import pytest
import torch

from shardrl.config.schema import load_config
from shardrl.rollout.serving.command import ServerProcess, ServerThread, build_engine, build_server
from shardrl.testing import save_char_model

TEMPERATURE, K = 0.7, 5
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    save_char_model(folder)
    return folder


@pytest.fixture(scope="module")
def reference(folder):
    """(prompt ids, reply ids) -> (the reply's positions' k likeliest token names, their log-probs), by a plain
    forward of the model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)

    def top(prompt: list[int], reply: list[int], temperature: float = TEMPERATURE):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1].float()  # (R, V)
        values, ids = (logits / temperature).log_softmax(-1).topk(K, -1)
        return [tok.convert_ids_to_tokens(row) for row in ids.tolist()], values.tolist()

    return top


@pytest.fixture(scope="module", params=["fast", "hf", "fast_process"])
def server(request, folder):
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={request.param.split('_')[0]}"])
    if request.param == "fast_process":  # (what crosses from the engine to the front ends)
        srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=4))
    else:
        srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=4))
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def chat(c, stream: bool, **kwargs):
    """The reply's (prompt ids, token ids, logprobs.content entries), streamed or not."""
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=TEMPERATURE, seed=4,
                  extra_body={"top_k": 4}) | kwargs
    if not stream:
        res = c.chat.completions.create(**kwargs)
        choice = res.choices[0]
        return res.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], choice.logprobs.content
    chunks = list(c.chat.completions.create(**kwargs, stream=True))
    body = [x.choices[0] for x in chunks[1:]]
    return (chunks[0].model_extra["prompt_token_ids"], [t for x in body for t in x.model_extra["token_ids"]],
            [lp for x in body for lp in x.logprobs.content])


def completion(c, stream: bool, **kwargs):
    """The reply's (prompt ids, token ids, tokens, token_logprobs, top_logprobs), streamed or not."""
    kwargs = dict(model="tiny", prompt="1+2=", max_tokens=10, temperature=TEMPERATURE, seed=4,
                  extra_body={"top_k": 4}) | kwargs
    if not stream:
        choice = c.completions.create(**kwargs).choices[0]
        lp = choice.logprobs
        return (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], lp.tokens,
                lp.token_logprobs, lp.top_logprobs)
    body = [x.choices[0] for x in c.completions.create(**kwargs, stream=True)]
    return (body[0].model_extra["prompt_token_ids"], [t for x in body for t in x.model_extra["token_ids"]],
            [t for x in body for t in x.logprobs.tokens], [v for x in body for v in x.logprobs.token_logprobs],
            [d for x in body for d in x.logprobs.top_logprobs])


# seeded: a generate call of its own; greedy (at temperature 1, as its log-probs): the fast backend's continuous batch
@pytest.mark.parametrize("temperature", [TEMPERATURE, 0.0], ids=["seeded", "greedy"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat_top_logprobs_are_the_forwards_likeliest_tokens(server, reference, stream, temperature):
    c = client(server)
    prompt, ids, content = chat(c, stream, logprobs=True, top_logprobs=K, temperature=temperature)
    # (without them: the same tokens, the same log-probs)
    _, same_ids, plain = chat(c, stream, logprobs=True, temperature=temperature)
    assert same_ids == ids and [x.logprob for x in plain] == [x.logprob for x in content]
    assert all(x.top_logprobs == [] for x in plain)
    names, values = reference(prompt, ids, temperature or 1.0)
    assert len(content) == len(ids) == len(names) >= 1
    among = 0
    for entry, want_names, want in zip(content, names, values):
        assert [x.token for x in entry.top_logprobs] == want_names  # (the k likeliest, best first)
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(want, abs=1e-4)
        mine = [x.logprob for x in entry.top_logprobs if x.token == entry.token]
        assert mine in ([], [entry.logprob])  # (the sampled token's entry: its own log-prob, exactly)
        among += len(mine)
    assert among >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_completion_logprobs_are_the_sampled_token_then_the_likeliest(server, reference, stream):
    c = client(server)
    prompt, ids, tokens, token_logprobs, top = completion(c, stream, logprobs=K)
    _, same_ids, _, same_logprobs, just_sampled = completion(c, stream, logprobs=0)
    assert same_ids == ids and same_logprobs == token_logprobs
    assert just_sampled == [{t: lp} for t, lp in zip(tokens, token_logprobs)]  # (logprobs=0: the sampled alone)
    names, values = reference(prompt, ids)
    assert len(top) == len(ids) == len(names) >= 1
    for step, token, logprob, want_names, want in zip(top, tokens, token_logprobs, names, values):
        assert list(step)[0] == token and step[token] == logprob  # (the sampled token first, as vLLM's)
        assert len(step) == K + (token not in want_names)  # (k + 1 where it is not among the likeliest)
        assert [step[name] for name in want_names] == pytest.approx(want, abs=1e-4)


def test_out_of_range_alternatives_are_refused_naming_the_parameter(server):
    c = client(server)
    for k in (21, -1):
        with pytest.raises(openai.BadRequestError, match=rf"top_logprobs={k} must be in \[0, 20\]") as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=k)
        assert e.value.status_code == 400 and e.value.body["param"] == "top_logprobs"
        assert e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match=rf"logprobs={k} must be in \[0, 20\]") as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=k)
        assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="top_logprobs=3 needs logprobs=true") as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs=1 is not supported") as e:  # (vLLM's)
        c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    most = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=20)
    counts = [len(x.top_logprobs) for x in most.choices[0].logprobs.content]  # (1 or 2 tokens: EOS may be sampled)
    assert counts and set(counts) == {20}
