"""`shardrl serve` on a byte-level BPE model (GPT-2's and Qwen's kind of tokenizer: an entry spells a space 'Ġ', and
a character of several bytes may be split across tokens), through the real `openai` client: log-prob entries name
each token by its text as vLLM gives it (decoded alone), with its bytes, never by its vocabulary entry; stop strings
match the text the client sees (special tokens left out, across token boundaries), the text ends before the stop
string, streamed too, and `stop_reason` names the string matched (vLLM's)."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from shardrl.config.schema import load_config
from shardrl.rollout.base import Rollout, assemble_output, cut_responses
from shardrl.rollout.serving.app import build_app
from shardrl.rollout.serving.batcher import Batcher
from shardrl.rollout.serving.command import ServerThread, build_server
from shardrl.testing import save_byte_model
from shardrl.tokenizer import stop_token_ids

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
        assert choice.logprobs.text_offset == [len("".join(tokens[:k])) for k in range(len(tokens))]
    assert tokens == [tok.decode([i]) for i in ids]
    lps = [lp for x in chunks for lp in x.logprobs.token_logprobs] if stream else choice.logprobs.token_logprobs
    # (tokens of the same text share an entry: the sampled token's own log-prob is the one given)
    assert [top[t] for t, top in zip(tokens, tops)] == lps
    texts = {tok.decode([i]) for i in range(len(tok))}
    assert all(set(top) <= texts and token in top for token, top in zip(tokens, tops))
    assert any(x.startswith(" ") for top in tops for x in top)


# ---- stop strings ----------------------------------------------------------------------------------------
REPLY = "the cat<|im_start|>sat on the mat, café 世界"  # (then <|im_end|>, the end token)


class ScriptedRollout(Rollout):
    """Replies `REPLY` then the end token whatever the prompt, cut at the request's stop strings by the HF backend's
    own rule (`cut_responses`), its log-probs 0: a reply whose tokens (a special one mid-reply, characters split
    across tokens) are known."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompt_ids, attention_mask, sampling):
        ids = (self.tok.encode(REPLY, add_special_tokens=False) + [self.tok.eos_token_id])[:sampling.max_new_tokens]
        rows = torch.tensor([ids] * prompt_ids.shape[0])
        lengths, texts = cut_responses(self.tok, stop_token_ids(self.tok), rows, sampling.stop)
        responses = [(row[:n], torch.zeros(n)) for row, n in zip(rows, lengths)]
        return assemble_output(prompt_ids, attention_mask, 1, responses, texts, self.tok.pad_token_id)

    def load_weights(self, weights):
        pass

    def release(self):
        pass

    def resume(self):
        pass


@pytest.fixture(scope="module")
def scripted(tok):
    srv = ServerThread(build_app(Batcher(ScriptedRollout(tok), tok, 4, 512), "tiny", 512, 64))
    yield client(srv)
    srv.stop()


SEEN = "the catsat on the mat, café 世界"  # (the reply's text: the special token left out)


@pytest.mark.parametrize("stop, text, reason", [
    (["e c"], "th", "e c"),  # (across two tokens: 'the', ' cat')
    (["zzz", "at o", "mat"], "the cats", "at o"),  # (the first to occur ends it, whichever is listed first)
    (["catsat"], "the ", "catsat"),  # (across the special token, which the text leaves out)
    (["é 世"], "the catsat on the mat, caf", "é 世"),  # (characters split across tokens)
    (["<|im_start|>"], SEEN, None), (["im_end"], SEEN, None),  # (special tokens are no text: the end token ends it)
])
@pytest.mark.parametrize("chat", [True, False])
def test_stop_strings_match_the_text_the_client_sees(scripted, tok, stop, text, reason, chat):
    if chat:
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=40, stop=stop)
        plain = scripted.chat.completions.create(**kwargs).choices[0]
        chunks = [x.choices[0] for x in scripted.chat.completions.create(**kwargs, stream=True) if x.choices]
        got, deltas = plain.message.content, [x.delta.content for x in chunks if x.delta.content is not None]
    else:
        kwargs = dict(model="tiny", prompt="the", max_tokens=40, stop=stop)
        plain = scripted.completions.create(**kwargs).choices[0]
        chunks = [x.choices[0] for x in scripted.completions.create(**kwargs, stream=True)]
        got, deltas = plain.text, [x.text for x in chunks]
    assert (got, plain.finish_reason, plain.model_extra["stop_reason"]) == (text, "stop", reason)
    assert (chunks[-1].finish_reason, chunks[-1].model_extra["stop_reason"]) == ("stop", reason)
    # streamed: the same text, and no delta ever held text past the cut (a piece of the stop string)
    assert "".join(deltas) == text
    assert all(text.startswith("".join(deltas[:k + 1])) for k in range(len(deltas)))
    ids = plain.model_extra["token_ids"]  # (through the token that completed the stop string, as vLLM's)
    if reason is not None:
        assert reason not in tok.decode(ids[:-1], skip_special_tokens=True)
        assert reason in tok.decode(ids, skip_special_tokens=True)


# ---- the Responses API's log-probs -----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_responses_top_logprobs_are_chats_in_the_responses_shape(server, tok, stream):
    """include=["message.output_text.logprobs"] and top_logprobs=k: the output_text part's log-probs are chat's
    entries for the same request (the token's text and bytes, its k alternatives'); streamed, each text delta
    carries its token's entry."""
    c = client(server)
    want = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                     top_logprobs=5).choices[0].logprobs.content
    kwargs = dict(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=16, temperature=0, top_logprobs=5,
                  include=["message.output_text.logprobs"])
    if stream:
        events = list(c.responses.create(**kwargs, stream=True))
        done = [e for e in events if e.type == "response.completed" or e.type == "response.incomplete"][-1]
        got = done.response.output[0].content[0].logprobs
        deltas = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
        assert [(x.token, x.logprob, [(y.token, y.logprob) for y in x.top_logprobs]) for x in deltas] == [
            (x.token, x.logprob, [(y.token, y.logprob) for y in x.top_logprobs]) for x in got]
    else:
        got = c.responses.create(**kwargs).output[0].content[0].logprobs
    assert len(got) == len(want) and all(len(x.top_logprobs) == 5 for x in got)
    assert [x.model_dump() for x in got] == [x.model_dump() for x in want]
    texts = {tok.decode([i]) for i in range(len(tok))}
    assert all(y.token in texts for x in got for y in x.top_logprobs)


# ---- the context a request's tools take ------------------------------------------------------------------
def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool{i}", "description": "the cat sat on the mat " * 4,
                                              "parameters": {"type": "object", "properties": {}}}}
            for i in range(count)]


@pytest.mark.parametrize("stream", [False, True])
def test_the_tools_tokens_count_against_the_context(server, tok, stream):
    """This template renders the tools into the prompt: a request that fits without them and not with them is an
    OpenAI-shaped 400 naming max_tokens and saying how many tokens the tools took; tools that alone overflow the
    context are a 400 naming tools."""
    c = client(server)
    with_tools = tok.apply_chat_template(MESSAGES, tools=tools(2), add_generation_prompt=True)["input_ids"]
    bare = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    tools_take = len(with_tools) - len(bare)
    assert tools_take > 100 and len(with_tools) < 512  # (the context of `save_byte_model`'s)
    max_tokens = 512 - len(bare) - 10
    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens, stream=stream)  # (fits)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens, tools=tools(2),
                                  stream=stream)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["message"] == (
        f"this model's context is 512 tokens; the prompt has {len(with_tools)} tokens, {tools_take} of them the 2 "
        f"tools' (the chat template renders them into the prompt) and max_tokens asks {max_tokens} more: shorten "
        "the prompt or lower max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools(8), stream=stream)
    assert e.value.body["param"] == "tools" and "of them the 8 tools'" in e.value.body["message"]
