"""`shardrl serve` on a byte-level BPE model (GPT-2's and Qwen's kind of tokenizer: an entry spells a space 'Ġ', and
a character of several bytes may be split across tokens), through the real `openai` client: log-prob entries name
each token by its text as vLLM gives it (decoded alone), with its bytes, never by its vocabulary entry."""

from __future__ import annotations

import openai
import pytest
import transformers

from shardrl.config.schema import load_config
from shardrl.rollout.serving.command import ServerThread, build_server
from shardrl.testing import save_byte_model

MESSAGES = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_model")
    save_byte_model(folder)
    return folder


@pytest.fixture(scope="module")
def tok(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["fast", "hf"])
def server(request, folder):
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={request.param}"])
    srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=4))
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def check_entries(tok, token_ids: list[int], entries: list[tuple[str, list[int]]], tops: list[list]) -> None:
    """Each sampled token's (text, bytes) is its decoding alone and its own bytes (joined: the reply's); each
    alternative's text is some token's decoding, its bytes that text's where it is whole."""
    texts = {tok.decode([i]) for i in range(len(tok))}
    assert [t for t, _ in entries] == [tok.decode([i]) for i in token_ids]
    assert bytes(b for _, raw in entries for b in raw).decode("utf-8", "replace") == tok.decode(token_ids)
    for text, raw in [*entries, *(x for top in tops for x in top)]:
        assert text in texts
        if "\ufffd" not in text:
            assert bytes(raw) == text.encode()
        else:  # (a piece of a character: its own bytes, not the replacement character's)
            assert raw and bytes(raw) != "\ufffd".encode() and max(raw) >= 0x80
    named = [text for top in tops for text, _ in top]
    assert any(x.startswith(" ") for x in named) and any("\ufffd" in x for x in named)  # (both kinds were checked)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_tokens_are_their_text_with_bytes(server, tok, stream):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=3, logprobs=True,
                  top_logprobs=20)
    if stream:
        chunks = [x.choices[0] for x in client(server).chat.completions.create(**kwargs, stream=True) if x.choices]
        ids = [t for x in chunks for t in x.model_extra.get("token_ids") or ()]
        content = [e for x in chunks if x.logprobs for e in x.logprobs.content]
    else:
        choice = client(server).chat.completions.create(**kwargs).choices[0]
        ids, content = choice.model_extra["token_ids"], choice.logprobs.content
    check_entries(tok, ids, [(e.token, e.bytes) for e in content],
                  [[(x.token, x.bytes) for x in e.top_logprobs] for e in content])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprob_tokens_are_their_text(server, tok, stream):
    kwargs = dict(model="tiny", prompt="the cat sat on the mat", max_tokens=24, temperature=1.0, seed=3,
                  logprobs=20)
    if stream:
        chunks = [x.choices[0] for x in client(server).completions.create(**kwargs, stream=True) if x.choices]
        ids = [t for x in chunks for t in x.model_extra["token_ids"]]
        tokens = [t for x in chunks for t in x.logprobs.tokens]
        tops = [d for x in chunks for d in x.logprobs.top_logprobs]
    else:
        choice = client(server).completions.create(**kwargs).choices[0]
        ids, tokens, tops = choice.model_extra["token_ids"], choice.logprobs.tokens, choice.logprobs.top_logprobs
    assert tokens == [tok.decode([i]) for i in ids]
    texts = {tok.decode([i]) for i in range(len(tok))}
    assert all(set(top) <= texts and token in top for token, top in zip(tokens, tops))
    assert any(x.startswith(" ") for top in tops for x in top)
