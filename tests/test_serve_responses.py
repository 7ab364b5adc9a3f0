"""OpenAI's Responses API on `shardrl serve` (issue 59 item 3): `client.responses.create` through the real `openai`
client answers exactly the chat request it means (the same prompt ids, reply tokens and log-probs), streamed as the
Responses API's typed events whose deltas join to the plain reply; input items (earlier output, function calls and
their outputs) render as chat's messages; what it cannot honour (stored responses, built-in tools, images) is a
400 naming the field; and in the agent trainer a Responses call records the trajectory a chat call does."""

from __future__ import annotations

import re
import textwrap

import openai
import pytest
import torch
import transformers

from shardrl.config.schema import load_config
from shardrl.rollout import SamplingParams
from shardrl.rollout.serving.command import ServerThread, build_server
from shardrl.testing import save_char_model

LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module", params=["fast", "hf"])
def server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"model_{request.param}")
    save_char_model(folder)
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={request.param}"])
    srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=8))
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("max_tokens", [1, 40])
def test_a_response_is_the_chat_reply_of_the_same_conversation(server, max_tokens):
    c = client(server)
    got = c.responses.create(model="tiny", instructions="be brief", input="hello there", temperature=0,
                             max_output_tokens=max_tokens, include=LOGPROBS)
    want = c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hello there"}],
                                     max_tokens=max_tokens, temperature=0, logprobs=True)
    item, choice = got.output[0], want.choices[0]
    assert got.object == "response" and got.id.startswith("resp_") and got.store is False
    assert item.type == "message" and item.role == "assistant"
    assert got.output_text == choice.message.content and item.content[0].text == choice.message.content
    assert got.model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
    assert got.model_extra["token_ids"] == choice.model_extra["token_ids"]
    assert [x.logprob for x in item.content[0].logprobs] == pytest.approx(
        [x.logprob for x in choice.logprobs.content], abs=1e-6)
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    cut = choice.finish_reason == "length"
    assert got.status == item.status == ("incomplete" if cut else "completed")
    assert (got.incomplete_details.reason if cut else got.incomplete_details) == ("max_output_tokens" if cut else None)
    assert cut == (max_tokens == 1)  # (this model's greedy reply here is 'u' and its end: cut at 1 token only)


def test_a_streamed_response_is_the_responses_events_joining_to_the_plain_one(server):
    c = client(server)
    kwargs = dict(model="tiny", input="1+2=", max_output_tokens=12, temperature=0, include=LOGPROBS)
    plain = c.responses.create(**kwargs)
    events = list(c.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        f"response.{plain.status}"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in deltas) == plain.output_text
    assert [lp.logprob for e in deltas for lp in e.logprobs] == pytest.approx(
        [x.logprob for x in plain.output[0].content[0].logprobs], abs=1e-6)
    done = events[-1].response
    assert done.id == events[0].response.id and done.output_text == plain.output_text
    assert done.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert events[-2].item.content[0].text == plain.output_text


def test_input_items_render_as_the_chat_messages_they_mean(server):
    """An earlier response's output message, a function call and its output, and content parts: the prompt is
    the chat template's of the matching chat messages (a call joins the assistant turn before it)."""
    c = client(server)
    first = c.responses.create(model="tiny", input="what is 2+2?", max_output_tokens=4, temperature=0)
    items = [{"role": "user", "content": "what is 2+2?"}, *[x.model_dump(exclude_none=True) for x in first.output],
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
             {"type": "function_call_output", "call_id": "c1", "output": "4"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "so? "},
                                                            {"type": "input_text", "text": "say it"}]}]
    got = c.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0)
    want = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": first.output_text, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"}, {"role": "user", "content": "so? say it"}])
    assert got.model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
    assert got.output_text == want.choices[0].message.content
    tok = server.app.state.batcher.tokenizer
    assert tok.decode(got.model_extra["prompt_token_ids"]) == (
        f"user: what is 2+2?\nassistant: {first.output_text}\ntool: 4\nuser: so? say it\nassistant: ")


@pytest.mark.parametrize("kwargs,param,said", [
    (dict(previous_response_id="resp_1"), "previous_response_id", "this server stores no responses: send the whole "
                                                                   "conversation as input"),
    (dict(background=True), "background", "answers in the foreground only"),
    (dict(tools=[{"type": "web_search"}]), "tools", "tools[0] is a 'web_search' tool, which this server does not run"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]), "input",
     "input[0].content[0] is a part of type 'input_image'"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input", "this server stores no items"),
    (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), "input", "an item of type 'reasoning'"),
    (dict(text={"format": {"type": "json_object"}}), "text", "free text only"),
    (dict(truncation="auto"), "truncation", "does not drop input"),
    (dict(top_logprobs=2), "top_logprobs", "send include=['message.output_text.logprobs'] with it"),
    (dict(model="gpt-5"), "model", "the model 'gpt-5' does not exist"),
    # (the chat path's refusals, in the Responses request's names)
    (dict(max_output_tokens=0), "max_output_tokens", "max_output_tokens=0 must be >= 1"),
    (dict(max_output_tokens=10**6), "max_output_tokens",
     "the prompt has 20 tokens and max_output_tokens asks 1000000 more: shorten the prompt or lower "
     "max_output_tokens"),
    (dict(input=[]), "input", "input is empty"),
    (dict(input="hi " * 60_000), "input",
     "this model's context is 32768 tokens and the prompt has 179,999 characters"),
    (dict(input="hi", instructions="x " * 90_000), "input", "this model's context is 32768 tokens and the prompt"),
    # (chat's options that are not applied, refused as chat refuses them: they were ignored)
    (dict(extra_body={"n": 2}), "n", "a response is one reply"),
    (dict(extra_body={"logit_bias": {"1": 5}}), "logit_bias", "is not supported by this server; leave it out"),
    (dict(extra_body={"frequency_penalty": 1.0}), "frequency_penalty", "is not supported by this server"),
    # (chat's names for the Responses API's own: max_tokens was ignored, the reply's length left at the default)
    (dict(extra_body={"max_tokens": 3}), "max_tokens", "the Responses API's name for it is max_output_tokens"),
    (dict(extra_body={"messages": [{"role": "user", "content": "x"}]}), "messages", "takes the conversation as input"),
    # (input items missing what they are rendered from: they rendered as empty turns and nameless calls)
    (dict(input=[{"role": "user"}]), "input", "input[0].content is missing: a message item needs its text"),
    (dict(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]), "input",
     "input[0].name is missing: a function_call item needs its call_id, name and arguments"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]), "input",
     "input[0].arguments is {'a': 1}: a function_call item needs"),
    (dict(input=[{"type": "function_call_output", "output": "3"}]), "input",
     "input[0].call_id is missing: a function_call_output item needs the call_id of its call"),
    (dict(input=[{"type": "function_call_output", "call_id": "c"}]), "input", "input[0].output is missing"),
    (dict(input=[{"role": "user", "content": "hi"}] * 5000), "input",
     "the request holds 5,000 input items, more than this server's limit of 4,096 a request: shorten the "
     "conversation (shardrl serve --max-messages raises the limit)"),
])
def test_what_a_response_cannot_honour_is_a_400_naming_the_field(server, kwargs, param, said):
    c = client(server)
    kwargs = {"model": "tiny", "input": "hi", **kwargs}
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as e:
            c.responses.create(**kwargs, stream=stream)
        assert e.value.status_code == (404 if param == "model" else 400)
        assert e.value.body["param"] == param and said in e.value.body["message"], e.value.body
        if param not in ("max_tokens", "messages"):  # (chat's names, where they were not sent)
            assert not re.search(r"(?<!-)\b(max_tokens|messages)\b", e.value.body["message"])


def test_a_plain_server_answers_store_true_without_storing(server):
    got = client(server).responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    assert got.store is False and got.status in ("completed", "incomplete")


RESPONSES_AGENT = '''
import os


async def run(sample, client):
    """Two turns through the Responses API (streamed or not: STREAM), or the same two turns by chat (API=chat)."""
    stream = os.environ.get("SHARDRL_TEST_STREAM") == "1"
    if os.environ.get("SHARDRL_TEST_API") == "chat":
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": sample["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        return float(len(second.choices[0].message.content))
    items = [{"role": "user", "content": sample["prompt"]}]
    first = await ask(client, items, 6, stream)
    items += [x.model_dump(exclude_none=True) for x in first.output] + [{"role": "user", "content": "more"}]
    second = await ask(client, items, 5, stream)
    return float(len(second.output_text))


async def ask(client, items, max_tokens, stream):
    kwargs = dict(model="policy", instructions="be brief", input=items, max_output_tokens=max_tokens)
    if not stream:
        return await client.responses.create(**kwargs)
    events = await client.responses.create(**kwargs, stream=True)
    return [e async for e in events][-1].response
'''


def test_a_responses_agent_records_the_trajectory_a_chat_agent_does(tmp_path, monkeypatch):
    """The same two-turn agent through the Responses API (plain and streamed) and through chat, sampling greedily:
    the same trajectory tokens, trained mask, log-probs and rewards; the trained log-probs are a plain forward's."""
    from test_agent import agent_rollout
    from test_rollout_hf import recomputed_log_probs

    tok = save_char_model(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    agent_file = tmp_path / "responses_agent.py"
    agent_file.write_text(textwrap.dedent(RESPONSES_AGENT))
    got = []
    for api, stream in (("chat", "0"), ("responses", "0"), ("responses", "1")):
        monkeypatch.setenv("SHARDRL_TEST_API", api)
        monkeypatch.setenv("SHARDRL_TEST_STREAM", stream)
        rollout = agent_rollout((tok, model, agent_file))
        try:
            enc = tok(["1+2=", "ab"], return_tensors="pt", padding=True)
            samples = [{"prompt": p, "data_source": "t", "extra": {}} for p in ("1+2=", "ab")]
            out = rollout.generate(enc["input_ids"], enc["attention_mask"],
                                   SamplingParams(n=2, greedy=True, max_new_tokens=8), samples=samples)
        finally:
            rollout.server.stop()
        got.append((out, out.to_batch()))
    (chat_out, chat), *others = got
    assert chat["loss_mask"].sum() > 8 and chat["agent_calls"].tolist() == [2.0] * 4
    assert chat["agent_errors"].sum() == 0
    for out, batch in others:  # (log-probs: to float noise, as concurrent episodes batch by timing)
        for key in ("input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(chat[key], batch[key]), key
        torch.testing.assert_close(chat["sampled_log_probs"], batch["sampled_log_probs"], atol=1e-5, rtol=0)
        assert sorted(chat["interaction_score"]) == sorted(batch["interaction_score"])
        assert batch["agent_errors"].sum() == 0 and batch["agent_calls"].tolist() == [2.0] * 4
    trained = chat["loss_mask"].bool()
    torch.testing.assert_close(chat["sampled_log_probs"][trained],
                               recomputed_log_probs(model, chat_out, 1.0)[trained], atol=1e-4, rtol=0)


# ---- function tools (the tools branch's parser; a policy forced to call them: test_serve_tools) -----------
RESPONSE_TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


@pytest.fixture
def tool_server(tmp_path):
    """test_serve_tools' server: a tiny model whose replies are scripted by the prompt's user turn."""
    from shardrl.rollout.serving.app import ServeOptions, ServerThread, build_app
    from shardrl.rollout.serving.batcher import Batcher
    from test_serve_tools import CALL, ForcedRollout, char_model

    tok, model = char_model(tmp_path)
    replies = {"call": CALL, "two": "ok: " + CALL + CALL.replace('"a": 1', '"a": 5'), "text": "it is 3"}
    rollout = ForcedRollout(tok, model, lambda prompt: replies[prompt.split("user: ", 1)[1].split("\n")[0]])
    srv = ServerThread(build_app(Batcher(rollout, tok, 8, 512), "tiny", 512, 256,
                                 options=ServeOptions(tool_call_parser="auto")))
    yield srv, tok
    srv.stop()


def test_function_calls_are_output_items_and_go_back_as_input_items(tool_server):
    """A reply of tool calls: its text before them a message, then a function_call item a call (call_id, name,
    arguments as a JSON string), streamed as the Responses API's function-call events; sent back with their outputs,
    they render as chat's tool calls and tool messages. The reply's tokens stay the sampled ones."""
    from test_serve_tools import CALL

    srv, tok = tool_server
    c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
    r = c.responses.create(model="tiny", input="two", tools=RESPONSE_TOOLS)
    assert [x.type for x in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "ok:" and r.status == "completed"  # (less trailing space, as chat)
    assert [(x.name, x.arguments) for x in r.output[1:]] == [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 5, "b": 2}')]
    assert all(x.call_id.startswith("call_") for x in r.output[1:])
    want = tok.encode("ok: " + CALL + CALL.replace('"a": 1', '"a": 5'), add_special_tokens=False)
    assert r.model_extra["token_ids"] == want + [tok.eos_token_id]
    only = c.responses.create(model="tiny", input="call", tools=RESPONSE_TOOLS, parallel_tool_calls=False)
    assert [x.type for x in only.output] == ["function_call"]
    assert c.responses.create(model="tiny", input="call", tools=RESPONSE_TOOLS, tool_choice="none").output_text == CALL
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="call", tools=RESPONSE_TOOLS,
                           tool_choice={"type": "function", "name": "add"})
    assert e.value.body["param"] == "tool_choice" and "not supported" in e.value.body["message"]

    events = list(c.responses.create(model="tiny", input="two", tools=RESPONSE_TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and kinds.count("response.function_call_arguments.done") == 2
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [
        x.arguments for x in r.output[1:]]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "ok:"
    assert [x.type for x in events[-1].response.output] == ["message", "function_call", "function_call"]

    first = c.responses.create(model="tiny", input="call", tools=RESPONSE_TOOLS)
    call = first.output[0]
    items = [{"role": "user", "content": "text"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    second = c.responses.create(model="tiny", input=items, tools=RESPONSE_TOOLS)
    assert tok.decode(second.model_extra["prompt_token_ids"]) == f"user: text\nassistant: {CALL}\ntool: 3\nassistant: "


def test_a_responses_stop_string_is_applied_as_chats(server):
    """stop and stop_token_ids (vLLM's extensions) reach the chat path the response is sampled on."""
    c = client(server)
    sampled = dict(max_output_tokens=12, temperature=1.0, extra_body={"seed": 4})
    plain = c.responses.create(model="tiny", input="hello there", **sampled)
    text = plain.output_text
    at = next(i for i in range(1, len(text)) if text[i] not in text[:i])  # (a character first seen there)
    cut = c.responses.create(model="tiny", input="hello there", max_output_tokens=12, temperature=1.0,
                             extra_body={"seed": 4, "stop": [text[at]]})
    want = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                     max_tokens=12, temperature=1.0, seed=4, stop=[text[at]]).choices[0]
    assert cut.output_text == want.message.content == text[:at] and cut.status == "completed"
