"""Tool calls in chat replies (`shardrl.rollout.serving.tool_calls`): each family's parser (Hermes/Qwen, Llama 3 JSON,
Mistral) on calls, text before them, several calls and malformed ones; the parser told from the chat template;
`tool_calls`, `content` and finish_reason "tool_calls" through the real `openai` client, streamed too; tool_choice's
refusals; and an agent episode whose replies are tool calls, its trajectory still the sampled tokens exactly."""

from __future__ import annotations

import json
import string

import pytest
import torch
import transformers

from shardrl.rollout.base import Rollout, SamplingParams, assemble_output
from shardrl.rollout.serving.tool_calls import (detect_parser, parse_hermes, parse_llama3_json, parse_mistral,
                                                reply_text)
from shardrl.tokenizer import build_char_tokenizer

openai = pytest.importorskip("openai")

ALPHABET = string.digits + string.ascii_lowercase + " +-*=?.,:()#\n" + '<>{}"_/[]|;'
# a Hermes-like template of the character tokenizer: an assistant turn's calls rendered as the model writes them
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


# ---- the parsers ---------------------------------------------------------------------------------------
def test_hermes_reads_calls_text_before_them_and_leaves_malformed_ones_text():
    one = parse_hermes('let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert one.content == "let me add." and one.calls == [("add", '{"a": 1, "b": 2}')] and not one.failed
    two = parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                       '<tool_call>{"name": "g", "arguments": "{\\"x\\": [1]}"}</tool_call>')
    assert two.content is None and two.calls == [("f", "{}"), ("g", '{"x": [1]}')]
    unclosed = parse_hermes('<tool_call>{"name": "f", "arguments": {"q": "ü"}}')  # (cut at its stop token)
    assert unclosed.calls == [("f", '{"q": "ü"}')]
    bad = 'x <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> <tool_call>{"name": "g"}</tool_call>'
    for text in (bad, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>[1]</tool_call>'):
        r = parse_hermes(text)  # (one bad call of several: the whole reply stays text, as vLLM's)
        assert (r.content, r.calls, r.failed) == (text, [], True)
    prose = parse_hermes("the answer is {3}")
    assert (prose.content, prose.calls, prose.failed, prose.attempted) == ("the answer is {3}", [], False, False)
    assert parse_hermes("").content is None


QWEN25_ASSISTANT = (  # (Qwen2.5-Instruct's chat template, its assistant turn)
    "{%- for message in messages %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}")


@pytest.mark.parametrize("sampled", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "ü"}}\n</tool_call>',
    'sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", '
    '"arguments": {"x": [1, 2]}}\n</tool_call>'])
def test_a_qwen_reply_read_and_sent_back_renders_as_it_was_sampled(sampled):
    """A Qwen2.5 reply's calls, read and sent back as OpenAI's message (arguments a JSON string), render through
    Qwen's template token for token as sampled: the agent's trajectory goes on (no prefix break)."""
    from shardrl.rollout.serving.schema import Message

    tok = build_char_tokenizer(ALPHABET)
    parsed = parse_hermes(sampled)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate(parsed.calls)]
    message = Message(role="assistant", content=parsed.content, tool_calls=calls).for_template()
    rendered = tok.apply_chat_template([message], chat_template=QWEN25_ASSISTANT, tokenize=False)
    assert rendered == f"<|im_start|>assistant\n{sampled}<|im_end|>\n"


def test_llama3_json_reads_one_or_more_calls_with_or_without_the_python_tag():
    r = parse_llama3_json('{"name": "add", "parameters": {"a": 1}}')
    assert r.content is None and r.calls == [("add", '{"a": 1}')]
    r = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": "x"}}')
    assert r.calls == [("f", "{}"), ("g", '{"b": "x"}')]
    r = parse_llama3_json('thinking <|python_tag|>{"name": "f", "parameters": {}}')
    assert r.content == "thinking" and r.calls == [("f", "{}")]
    for text in ('{"name": "f", "parameters": {"a": 1}', '<|python_tag|>print(1)',
                 '{"name": "f", "parameters": {}} and more'):
        r = parse_llama3_json(text)
        assert (r.content, r.calls, r.failed) == (text, [], True)
    for text in ('{"answer": 3}', "3 {\"name\"", "plain"):  # (no marker, no call's shape: no attempt)
        r = parse_llama3_json(text)
        assert (r.content, r.calls, r.attempted) == (text, [], False)


def test_mistral_reads_a_call_list_and_the_args_form():
    r = parse_mistral('ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert r.content == "ok" and r.calls == [("f", '{"a": 1}'), ("g", "{}")]
    r = parse_mistral('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert r.content is None and r.calls == [("f", '{"a": 1}'), ("g", "{}")]
    for text in ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', '[TOOL_CALLS]f[ARGS]{"a": }',
                 '[TOOL_CALLS][{"name": "f"}, 3]'):
        r = parse_mistral(text)
        assert (r.content, r.calls, r.failed) == (text, [], True)
    assert not parse_mistral("[1, 2]").attempted


def test_the_parser_is_told_from_the_chat_template():
    class Tok:
        def __init__(self, template):
            self.chat_template = template

    assert detect_parser(Tok("{{- '<tool_call>\\n{\"name\": \"' }}")) == "hermes"  # (Qwen2.5's, Qwen3's)
    assert detect_parser(Tok("{{- '[TOOL_CALLS] [' }}")) == "mistral"
    assert detect_parser(Tok("{{- '<|python_tag|>' + tool_call.name }}<|eot_id|>")) == "llama3_json"
    assert detect_parser(Tok('{"name": function name, "parameters": ...}<|eot_id|>')) == "llama3_json"  # 3.2's
    assert detect_parser(Tok({"default": "x", "tool_use": "<tool_call>"})) == "hermes"
    assert detect_parser(Tok("{{ m.content }}")) == "hermes"  # (no family's markers: Hermes, the common one)
    assert detect_parser(Tok(None)) == "hermes"


def test_markers_held_as_special_tokens_are_read_from_the_token_ids():
    """Mistral's [TOOL_CALLS] (Llama's <|python_tag|>) is a special token: the reply's text leaves it out, the
    parser reads it back from the ids."""
    tok = build_char_tokenizer(ALPHABET)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tok.encode('hi [TOOL_CALLS][{"name": "f", "arguments": {}}]', add_special_tokens=False)
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    o = {"token_ids": ids, "text": tok.decode(ids, skip_special_tokens=True)}
    assert "[TOOL_CALLS]" not in o["text"]
    text = reply_text(tok, o, "mistral")
    assert text == 'hi [TOOL_CALLS][{"name": "f", "arguments": {}}]'
    assert parse_mistral(text).calls == [("f", "{}")]
    assert reply_text(tok, o, "hermes") == o["text"]


# ---- through the server --------------------------------------------------------------------------------
def char_model(folder, seed: int = 0):
    """A tiny random Qwen2 with the character tokenizer over `ALPHABET` and the Hermes-like `TEMPLATE`."""
    tok = build_char_tokenizer(ALPHABET)
    tok.chat_template = TEMPLATE
    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return tok, model


class ForcedRollout(Rollout):
    """Replies `reply(prompt_text)` (then EOS) whatever the model would sample, with the model's own log-probs of
    those tokens (log softmax(logits / T) of a plain forward): a policy forced to call tools, whose trajectories
    can still be checked against a forward."""

    def __init__(self, tok, model, reply):
        self.tok, self.model, self.reply, self.calls = tok, model, reply, []

    @torch.no_grad()
    def generate(self, prompt_ids, attention_mask, sampling):
        responses, texts = [], []
        for row, mask in zip(prompt_ids, attention_mask):
            prompt = row[mask.bool()].tolist()
            text = self.reply(self.tok.decode(prompt))
            self.calls.append((self.tok.decode(prompt), text))
            ids = self.tok.encode(text, add_special_tokens=False)[:sampling.max_new_tokens - 1] + [
                self.tok.eos_token_id]
            full = torch.tensor([prompt + ids])
            logits = self.model(full).logits[0, len(prompt) - 1:-1].float() / sampling.temperature
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
            responses.append((torch.tensor(ids), logp))
            texts.append(self.tok.decode(ids, skip_special_tokens=True))
        return assemble_output(prompt_ids, attention_mask, 1, responses, texts, self.tok.pad_token_id)

    def load_weights(self, weights):
        pass

    def release(self):
        pass

    def resume(self):
        pass


@pytest.fixture
def server(tmp_path):
    from shardrl.rollout.serving.app import ServeOptions, ServerThread, build_app
    from shardrl.rollout.serving.batcher import Batcher

    tok, model = char_model(tmp_path)
    replies = {"call": CALL, "two": "ok: " + CALL + CALL.replace('"a": 1', '"a": 5'),
               "bad": '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "text": "it is 3"}

    def reply(prompt: str) -> str:
        return replies[prompt.split("user: ", 1)[1].split("\n")[0]]

    rollout = ForcedRollout(tok, model, reply)
    app = build_app(Batcher(rollout, tok, 8, 512), "tiny", 512, 256, options=ServeOptions(tool_call_parser="auto"))
    srv = ServerThread(app)
    yield srv, openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0), tok
    srv.stop()


def ask(client, what: str, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": what}], **kwargs)


def test_tool_calls_reach_the_openai_client_and_the_tokens_stay_the_sampled_ones(server):
    srv, client, tok = server
    r = ask(client, "call", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    raw = r.model_dump()["choices"][0]
    assert raw["token_ids"] == tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]  # (as sampled)

    two = ask(client, "two", tools=TOOLS).choices[0]
    assert two.message.content == "ok:" and [c.function.arguments for c in two.message.tool_calls] == [
        '{"a": 1, "b": 2}', '{"a": 5, "b": 2}']
    assert len({c.id for c in two.message.tool_calls}) == 2
    first = ask(client, "two", tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.arguments for c in first] == ['{"a": 1, "b": 2}']  # (one call at most, as OpenAI's)

    bad = ask(client, "bad", tools=TOOLS).choices[0]  # (malformed: text, as sampled)
    assert bad.finish_reason == "stop" and bad.message.tool_calls is None
    assert bad.message.content == '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    text = ask(client, "text", tools=TOOLS).choices[0]
    assert (text.finish_reason, text.message.content, text.message.tool_calls) == ("stop", "it is 3", None)
    for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):  # (no tools, or "none": the text as it is)
        plain = ask(client, "call", **kwargs).choices[0]
        assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == ("stop", CALL, None)


def test_a_tool_call_sent_back_renders_through_the_template(server):
    """The assistant's call (arguments a JSON string, as OpenAI's) and the tool's answer sent back: the template
    renders the call as the model wrote it (its arguments an object, not a quoted string)."""
    srv, client, tok = server
    first = ask(client, "call", tools=TOOLS)
    messages = [{"role": "user", "content": "text"}, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "3"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    prompt = tok.decode(second.model_dump()["prompt_token_ids"])
    assert prompt == f"user: text\nassistant: {CALL}\ntool: 3\nassistant: "


@pytest.mark.parametrize("choice, says", [
    ("required", "tool_choice=required is not supported"),
    ({"type": "function", "function": {"name": "add"}}, "tool_choice=a named function"),
    ("sometimes", "must be \"auto\", \"none\""),
])
def test_tool_choices_not_built_are_refused(server, choice, says):
    srv, client, tok = server
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "call", tools=TOOLS, tool_choice=choice)
    assert says in e.value.body["message"] and e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "call", tool_choice="required")
    assert "needs tools" in e.value.body["message"]


# ---- an agent episode of tool calls --------------------------------------------------------------------
async def tool_agent(sample, client):
    """Calls the model with tools; runs the call it gets (`add`) and sends the answer back for a final reply."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    if not message.tool_calls:
        return 0.0
    call = message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return float(second.choices[0].message.content == "3")


def test_an_agents_tool_calls_train_on_the_sampled_tokens_and_bad_ones_are_counted(tmp_path):
    """An agent episode whose first reply is a tool call (read into `tool_calls` for the agent), then a tool turn,
    then a text reply: the trajectory is the sampled call's tokens (trained), the tool turn the template renders
    (not), the last reply (trained), and the sampler's log-probs equal a plain forward's at every trained position;
    a reply that looked like a call but did not parse is counted (`agent_tool_parse_failures`)."""
    from shardrl.rollout.episodes.agent import AgentRollout
    from test_rollout_hf import recomputed_log_probs

    tok, model = char_model(tmp_path)

    def reply(prompt: str) -> str:
        if "tool: " in prompt:
            return "3"
        return CALL if "call" in prompt else '<tool_call>{"name": "add", "arguments": {"a": 1}'  # (cut short)

    rollout = AgentRollout(ForcedRollout(tok, model, reply), tok, tool_agent, context=512)
    enc = tok(["call", "bad"], return_tensors="pt", padding=True)
    samples = [{"prompt": p, "data_source": "t", "extra": {}} for p in ("call", "bad")]
    try:
        out = rollout.generate(enc["input_ids"], enc["attention_mask"],
                               SamplingParams(n=2, temperature=1.0, max_new_tokens=128, seed=0), samples=samples)
    finally:
        rollout.server.stop()
    batch = out.to_batch()
    assert batch["interaction_score"] == [1.0, 1.0, 0.0, 0.0]
    assert batch["agent_tool_parse_failures"].tolist() == [0, 0, 1, 1]
    assert batch["agent_calls"].tolist() == [2, 2, 1, 1] and batch["agent_prefix_breaks"].tolist() == [0] * 4
    for r in range(4):
        real = out.response_attention_mask[r].bool()
        ids, mask = out.response_ids[r][real].tolist(), out.response_mask[r][real].tolist()
        trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        if r < 2:  # the call as sampled (its EOS dropped: the template ends the turn with a newline), the tool turn
            assert tok.decode(ids, skip_special_tokens=False) == f"{CALL}\ntool: 3\nassistant: 3<eos>"
            assert trained == f"{CALL}3<eos>"
        else:
            assert trained == '<tool_call>{"name": "add", "arguments": {"a": 1}<eos>'
    trained = batch["loss_mask"].bool()
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)


def test_streamed_tool_calls_are_vllms_chunks_and_accumulate_to_the_plain_reply(server):
    """stream=true: the content's tokens, then a chunk per call (index, id, type, name, arguments), then
    finish_reason "tool_calls"; the chunks' token ids and log-probs are the reply's, and the openai client's stream
    helper accumulates them into the plain reply's message."""
    srv, client, tok = server
    plain = ask(client, "two", tools=TOOLS, logprobs=True).model_dump()["choices"][0]
    chunks = [c.model_dump() for c in ask(client, "two", tools=TOOLS, logprobs=True, stream=True)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "ok:"
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert [(c["index"], c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "function", "add", '{"a": 1, "b": 2}'), (1, "function", "add", '{"a": 5, "b": 2}')]
    assert all(c["id"].startswith("call_") for c in calls)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    extra = [c["choices"][0] for c in chunks]
    assert [t for c in extra for t in c.get("token_ids") or ()] == plain["token_ids"]
    streamed_lp = [x["logprob"] for c in extra if c["logprobs"] for x in c["logprobs"]["content"]]
    assert streamed_lp == pytest.approx([x["logprob"] for x in plain["logprobs"]["content"]])
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "two"}],
                                        tools=TOOLS) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "ok:"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("add", '{"a": 1, "b": 2}'), ("add", '{"a": 5, "b": 2}')]
    bad = [c.choices[0] for c in ask(client, "bad", tools=TOOLS, stream=True)]  # (no calls: text, as before)
    assert "".join(c.delta.content or "" for c in bad) == '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert bad[-1].finish_reason == "stop" and not any(c.delta.tool_calls for c in bad)


@pytest.mark.parametrize("tools, says", [
    ({"type": "function", "function": {"name": "add"}}, "tools: Input should be a valid list"),  # (not a list)
    ([{"type": "function"}], "tools[0].function is missing: send the function as an object"),
    ([{"type": "function", "function": "add"}], "tools[0].function is a string: send the function as an object"),
    ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name is missing: each function"),
    ([*TOOLS, {"type": "function", "function": {"name": 3}}], "tools[1].function.name is a number 3: each"),
    ([{"type": "function", "function": {"name": " "}}], "tools[0].function.name is a string ' ': each"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[0].function.parameters is a string: send the function's parameters as a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters is an array"),
    ([{"type": "function", "function": {"name": "f", "description": {"a": 1}}}],
     "tools[0].function.description must be a string"),
    ([{"type": "retrieval"}], "tools[0].type='retrieval': this server renders function tools only"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tools_are_a_400_naming_tools(server, tools, says, stream):
    srv, client, tok = server
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "call", tools=tools, stream=stream)
    assert says in e.value.body["message"] and e.value.body["param"] == "tools"
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("value", ["false", 0, 1, [], {}])
def test_parallel_tool_calls_of_a_wrong_type_is_a_400_naming_it(server, value):
    srv, client, tok = server
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "two", tools=TOOLS, parallel_tool_calls=value)
    assert e.value.body["param"] == "parallel_tool_calls" and "boolean" in e.value.body["message"]
    tools = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="two", parallel_tool_calls=value, tools=tools)
    assert e.value.body["param"] == "parallel_tool_calls"


def test_parallel_tool_calls_false_gives_one_call_at_most_streamed_and_in_responses(server):
    srv, client, tok = server
    chunks = [c.choices[0] for c in ask(client, "two", tools=TOOLS, parallel_tool_calls=False, stream=True)]
    calls = [call for c in chunks for call in c.delta.tool_calls or ()]
    assert [(c.index, c.function.arguments) for c in calls] == [(0, '{"a": 1, "b": 2}')]
    assert chunks[-1].finish_reason == "tool_calls"
    assert len(ask(client, "two", tools=TOOLS, parallel_tool_calls=True).choices[0].message.tool_calls) == 2
    tools = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(model="tiny", input="two", tools=tools, parallel_tool_calls=False)
    assert [x.type for x in r.output] == ["message", "function_call"] and r.parallel_tool_calls is False
    events = list(client.responses.create(model="tiny", input="two", tools=tools, parallel_tool_calls=False,
                                          stream=True))
    assert [e.type for e in events].count("response.function_call_arguments.done") == 1


@pytest.mark.parametrize("tool, says", [
    ({"type": "function"}, "tools[0].name is missing"),
    ({"type": "function", "name": "add", "parameters": "x"}, "tools[0].parameters is a string"),
])
def test_malformed_responses_tools_are_a_400_naming_tools(server, tool, says):
    srv, client, tok = server
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="call", tools=[tool])
    assert says in e.value.body["message"] and e.value.body["param"] == "tools"
