"""A hostile client of `shardrl serve` (a second reader's findings), through the real `openai` client: a reply of
deeply nested brackets after a call marker is text, not a 500; a streamed Llama 3 call's content joins to the plain
reply's; a streamed call of an RL run's episode past its budget is the plain call's 400, not an error event in a 200
stream; malformed /v1/responses options are 400s naming them, not 500s."""

from __future__ import annotations

import json

import openai
import pytest

from shardrl.rollout.base import SamplingParams
from shardrl.rollout.serving.app import EPISODE_HEADER, ServeOptions, ServerThread, build_app
from shardrl.rollout.serving.batcher import Batcher
from shardrl.rollout.serving.tool_calls import PARSE
from test_serve_tools import TOOLS, ForcedRollout, char_model

DEEP = "[" * 3000  # (json's decoder recurses a bracket: past Python's recursion limit)
REPLIES = {
    "deep": "<tool_call>" + DEEP,
    "llama": ' hi <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "text": "it is 3",
}


def serve(tmp_path, parser: str) -> tuple[ServerThread, openai.OpenAI]:
    tok, model = char_model(tmp_path)
    rollout = ForcedRollout(tok, model, lambda prompt: REPLIES[prompt.split("user: ", 1)[1].split("\n")[0]])
    app = build_app(Batcher(rollout, tok, 8, 8192), "tiny", 8192, 4096, options=ServeOptions(tool_call_parser=parser))
    srv = ServerThread(app)
    return srv, openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    srv, client = serve(tmp_path_factory.mktemp("hermes"), "hermes")
    yield srv, client
    srv.stop()


def ask(client, what: str, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": what}], **kwargs)


@pytest.mark.parametrize("text", ["<tool_call>" + DEEP, "<|python_tag|>" + DEEP, '{"name": ' + DEEP,
                                  "[TOOL_CALLS]" + DEEP, '[TOOL_CALLS]f[ARGS]' + DEEP])
def test_a_call_of_deeply_nested_brackets_is_a_failed_parse_not_an_exception(text):
    for parse in PARSE.values():
        parsed = parse(text)
        assert parsed.calls == [] and parsed.content == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_of_deeply_nested_brackets_is_its_text_not_a_500(hermes, stream):
    """A degenerate reply (thousands of '[' after <tool_call>) stays text, as any call that does not parse: it was
    a 500 (RecursionError in json.loads), streamed an error event, and the agent's episode failed."""
    srv, client = hermes
    if stream:
        chunks = [c.choices[0] for c in ask(client, "deep", tools=TOOLS, stream=True) if c.choices]
        text, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    else:
        choice = ask(client, "deep", tools=TOOLS).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert text == REPLIES["deep"] and finish == "stop"


def test_a_streamed_llama3_calls_content_joins_to_the_plain_replys(tmp_path):
    """llama3_json's content is the text before <|python_tag|> stripped on both sides: the streamed content was cut
    from the text's start by the content's length (' h' for 'hi')."""
    srv, client = serve(tmp_path, "llama3_json")
    try:
        plain = ask(client, "llama", tools=TOOLS).choices[0].message
        chunks = [c.choices[0] for c in ask(client, "llama", tools=TOOLS, stream=True) if c.choices]
        with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "llama"}],
                                            tools=TOOLS) as stream:
            final = stream.get_final_completion().choices[0].message
    finally:
        srv.stop()
    assert plain.content == "hi" and json.loads(plain.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    assert "".join(c.delta.content or "" for c in chunks) == plain.content
    assert final.content == plain.content and final.tool_calls[0].function.arguments == '{"a": 1, "b": 2}'


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_streamed_call_past_its_episodes_budget_is_the_plain_calls_400(hermes, route):
    """An RL run's endpoint refuses a call of an episode with no tokens left (`Routes.episode_budget`): a 400 the
    agent can tell, streamed or not (streamed, it was a 200 whose stream said 'generation failed: RequestError')."""
    srv, client = hermes
    app = srv.app
    app.state.policy = SamplingParams(n=1, temperature=1.0, max_new_tokens=16)
    app.state.episode_budget = 0
    episode = client.with_options(default_headers={EPISODE_HEADER: "e1"})
    try:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                if route == "chat":
                    list(ask(episode, "text", max_tokens=4, stream=stream) if stream else [ask(episode, "text")])
                else:
                    r = episode.responses.create(model="tiny", input="text", max_output_tokens=4, stream=stream)
                    list(r) if stream else None
            assert e.value.code == "episode_budget_spent", stream
            # (in the Responses request's own names)
            want = "max_tokens" if route == "chat" else "max_output_tokens"
            assert e.value.param == want, (stream, e.value.param)
    finally:
        app.state.policy, app.state.episode_budget = None, None
        app.state.records.clear()


@pytest.mark.parametrize("option, value", [("seed", 1.5), ("top_k", "x"), ("stop", 5), ("stop_token_ids", "x"),
                                           ("session_id", 3), ("text", "x"), ("text", {"format": "x"}),
                                           ("reasoning", "x")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_responses_option_is_a_400_naming_it(hermes, option, value, stream):
    srv, client = hermes
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="text", max_output_tokens=4, stream=stream,
                                extra_body={option: value})
    assert e.value.body["param"] == option and e.value.body["type"] == "invalid_request_error"


# ---- a byte-fallback tokenizer's stream (Llama 2's, Mistral's, Gemma's kind) ------------------------------------
def byte_fallback_tokenizer():
    """A SentencePiece-like BPE with byte fallback: characters outside its vocabulary are `<0xNN>` tokens, and its
    decoder (Llama 2's and Mistral's) turns a run of them that is not valid UTF-8 into one U+FFFD a byte, whole."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "▁th", "▁the"]:
        vocab[piece] = len(vocab)
    bpe = models.BPE(vocab=vocab, merges=[("▁", "t"), ("▁t", "h"), ("▁th", "e")], unk_token="<unk>",
                     byte_fallback=True)
    rust = Tokenizer(bpe)
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("chat", [True, False])
def test_a_live_reply_of_an_invalid_byte_run_joins_to_the_plain_text(chat):
    """A reply whose bytes spell 🙂 then a stray continuation byte, handed over as the engine's syncs do: the stream
    sent 🙂 as soon as it was whole, but the whole reply's text is five U+FFFD (the run is not UTF-8), and the rest
    of the reply went out twice. Joined, the chunks are the plain reply's text, for any cut into hand-overs."""
    from shardrl.rollout.serving.schema import ChatRequest, CompletionRequest
    from shardrl.rollout.serving.streaming import ChunkWriter, LiveReply

    tok = byte_fallback_tokenizer()
    byte = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    ids = (tok("the z", add_special_tokens=False)["input_ids"] + [byte[b] for b in "🙂".encode()] + [byte[0x98]]
           + tok("vm é the", add_special_tokens=False)["input_ids"] + [byte[0xE4]])  # (its last character cut)
    text = tok.decode(ids, skip_special_tokens=True)
    assert "🙂" not in text and "\ufffd" * 5 in text
    for cuts in ([3, 7, 8, 12], [2, 4, 5, 6, 7, 8, 9], list(range(1, len(ids) - 1))):
        req = (ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True) if chat
               else CompletionRequest(model="m", prompt="x", stream=True))
        reply = LiveReply(ChunkWriter(req, "m", tok, chat), [1], lambda k: [1])
        sent = []
        for lo, hi in zip([0, *cuts], cuts):
            sent += reply.add(0, ids[lo:hi])
        o = {"token_ids": ids, "text": text, "finish_reason": "length", "stop_reason": None, "prompt_token_ids": [1]}
        events = [json.loads(e[6:]) for e in "".join(sent + reply.end([o], [[1]])).split("\n\n")
                  if e.startswith("data: {")]
        pieces = [e["choices"][0]["delta"].get("content") or "" if chat else e["choices"][0]["text"] for e in events]
        assert "".join(pieces) == text, cuts
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == ids


@pytest.mark.parametrize("kwargs", [{"truncation": True, "max_length": 3}, {"padding": "max_length", "max_length": 40},
                                    {"return_tensors": "pt"}, {"tokenize": False}, {"return_dict": True}])
def test_tokenizer_options_in_chat_template_kwargs_are_a_400(hermes, kwargs):
    """chat_template_kwargs reach the template (vLLM's); the tokenizer's own options passed with them cut the prompt
    to max_length or padded it with pad tokens, and the reply went on from that (a 200), or were a 500."""
    srv, client = hermes
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "text", max_tokens=2, extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == "chat_template_kwargs" and next(iter(kwargs)) in e.value.body["message"]
    assert ask(client, "text", max_tokens=2, extra_body={"chat_template_kwargs": {"flag": 1}}).choices[0]
