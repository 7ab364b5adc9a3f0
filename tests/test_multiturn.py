"""Multi-turn rollouts with tools: token layout and loss mask, malformed calls, timeouts, turn and token limits,
the sampler's log-probs against the engine's on a multi-turn sequence, the advantage convention on the gaps of
a multi-turn mask, and the built-in tools."""

from __future__ import annotations

import asyncio
import copy
import string
import threading
import time

import pytest
import torch
import transformers

from shardrl.algos.advantages import compute_grpo, compute_reinforce_plus_plus, scores_to_token_rewards
from shardrl.config.schema import ConfigError, load_config
from shardrl.engine.model import PolicyModel, build_causal_lm
from shardrl.rollout import SamplingParams, build_rollout
from shardrl.rollout.base import Rollout, assemble_output, cut_at_stop
from shardrl.rollout.episodes.multiturn import (CHATML_TOOL_TURN, BuiltinToolsInteraction, Interaction, MultiTurnRollout,
                                       load_interaction, score_with_interaction)
from shardrl.testing import TINY_MODELS
from shardrl.tokenizer import build_char_tokenizer
from shardrl.tools import (CalculatorTool, PythonTool, Tool, ToolCall, check_arguments, evaluate_arithmetic, parse_tool_call,
                           run_python, run_tool_calls)

ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
TEMPLATE = "|{output}|"  # the tool turn of these tests: one char each side of the answer
CALL = '<tool_call>{{"name":"{name}","arguments":{{"expression":"{expr}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


class ScriptedRollout(Rollout):
    """Answers round k with `script[k]`: one text per live conversation (in order); EOS where a text ends in
    "$". Records every round's contexts and sampling, and gives token i of a round the log-prob -(i+1)/100."""

    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.rounds = tok, script, []

    def generate(self, prompt_ids, attention_mask, sampling):
        k = len(self.rounds)
        self.rounds.append(([row[m.bool()].tolist() for row, m in zip(prompt_ids, attention_mask)], sampling))
        responses, texts = [], []
        for text in self.script[k]:
            eos = text.endswith("$")
            ids = self.tok.encode(text.rstrip("$"), add_special_tokens=False) + ([self.tok.eos_token_id] if eos else [])
            ids = ids[: sampling.max_new_tokens]
            responses.append((torch.tensor(ids), -torch.arange(1, len(ids) + 1, dtype=torch.float32) / 100))
            texts.append(cut_at_stop(self.tok.decode(ids, skip_special_tokens=True), sampling.stop))
        return assemble_output(prompt_ids, attention_mask, 1, responses, texts, self.tok.pad_token_id)

    def load_weights(self, weights):
        pass

    def release(self):
        pass

    def resume(self):
        pass


class Recorder(Interaction):
    """Calculator tool; records each sample's calls in its state; rewards 1 when the final text is the truth."""

    def __init__(self, tools=None):
        self.tools = tools if tools is not None else [CalculatorTool()]

    def start(self, sample):
        return {"truth": (sample["extra"] or {}).get("ground_truth"), "calls": []}

    def step(self, state, call):
        state["calls"].append(call.arguments)
        return super().step(state, call)

    def reward(self, state, response_text):
        return float(response_text.strip() == state["truth"])


def encode(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def loop(tok, script, interaction=None, **kwargs) -> tuple[MultiTurnRollout, ScriptedRollout]:
    inner = ScriptedRollout(tok, script)
    kwargs = {"tool_turn_template": TEMPLATE, **kwargs}
    return MultiTurnRollout(inner, tok, interaction or Recorder(), **kwargs), inner


# ---------------------------------------------------------------- token layout and loss mask

def test_two_tool_calls_token_layout_and_loss_mask(tok):
    t1, t2 = CALL.format(name="calculator", expr="3*4"), CALL.format(name="calculator", expr="2+12")
    script = [[t1, "7$"],  # conversation 0 calls; conversation 1 answers at once
              [t2],  # only conversation 0 is live
              ["14$"]]
    mt, inner = loop(tok, script)
    prompts = ["q 2+3*4", "q 3+4"]
    ids, mask = encode(tok, prompts)
    samples = [{"data_source": "x", "extra": {"ground_truth": "14"}}, {"data_source": "x", "extra": {"ground_truth": "8"}}]
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200, seed=3), samples=samples)

    eos = tok.eos_token_id
    tool1, tool2 = ids_of(tok, "|12|"), ids_of(tok, "|14|")
    m1, m2, m3 = ids_of(tok, t1), ids_of(tok, t2), ids_of(tok, "14") + [eos]
    expected_ids = m1 + tool1 + m2 + tool2 + m3
    expected_model = [1] * len(m1) + [0] * len(tool1) + [1] * len(m2) + [0] * len(tool2) + [1] * len(m3)
    lp = lambda n: [-(i + 1) / 100 for i in range(n)]
    expected_logp = lp(len(m1)) + [0.0] * len(tool1) + lp(len(m2)) + [0.0] * len(tool2) + lp(len(m3))
    width = len(expected_ids)
    assert out.response_ids.shape == (2, width)
    assert out.response_ids[0].tolist() == expected_ids
    assert out.response_mask[0].tolist() == expected_model
    assert out.response_attention_mask[0].tolist() == [1] * width
    torch.testing.assert_close(out.sampled_log_probs[0], torch.tensor(expected_logp))
    # conversation 1: one model turn "7<eos>", then padding
    assert out.response_ids[1, :2].tolist() == ids_of(tok, "7") + [eos]
    assert out.response_mask[1].tolist() == [1, 1] + [0] * (width - 2)
    assert out.response_attention_mask[1].tolist() == [1, 1] + [0] * (width - 2)
    assert (out.response_ids[1, 2:] == tok.pad_token_id).all()
    # each round's context is the previous context plus the exact ids appended (no re-tokenization)
    p0 = ids_of(tok, prompts[0])
    assert inner.rounds[1][0] == [p0 + m1 + tool1]
    assert inner.rounds[2][0] == [p0 + m1 + tool1 + m2 + tool2]
    assert inner.rounds[0][1].stop == ["</tool_call>"] and inner.rounds[0][1].n == 1
    assert out.num_turns == [3, 1] and out.num_tool_calls == [2, 0] and out.num_tool_errors == [0, 0]
    assert out.response_text == ["14", "7"]
    assert out.interaction_scores == [1.0, 0.0]

    batch = out.to_batch()
    P = ids.shape[1]
    assert batch["loss_mask"][0].tolist() == [0] * P + expected_model
    assert batch["attention_mask"][0].tolist() == mask[0].tolist() + [1] * width  # tool tokens are attended
    assert batch["input_ids"][0, P:].tolist() == expected_ids
    assert batch["interaction_score"] == [1.0, 0.0]
    scores, metrics = score_with_interaction(batch, lambda b: pytest.fail("the interaction gives the rewards"))
    assert scores.tolist() == [1.0, 0.0] and metrics["multi_turn/num_turns_mean"] == 2.0


def test_n_samples_are_prompt_major_and_get_their_own_state(tok):
    call = CALL.format(name="calculator", expr="1+1")
    mt, inner = loop(tok, [[call, "5$", "6$", call], ["a$", "b$"]])
    ids, mask = encode(tok, ["p0", "p1"])
    out = mt.generate(ids, mask, SamplingParams(n=2, max_new_tokens=100),
                      samples=[{"extra": {"ground_truth": "a"}}, {"extra": {"ground_truth": "b"}}])
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.response_text == ["a", "5", "6", "b"]
    assert out.interaction_scores == [1.0, 0.0, 0.0, 1.0]  # per-sample state: rows 0 and 3 differ in truth
    assert inner.rounds[1][0][1][:2] == ids_of(tok, "p1")


# ---------------------------------------------------------------- malformed calls, timeouts, limits

@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": calc</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('{"name":"calculator"}</tool_call>', "no <tool_call> before </tool_call>"),
    ('<tool_call>{"name":"search","arguments":{}}</tool_call>', "no tool named 'search'"),
    ('<tool_call>{"name":"calculator","arguments":{}}</tool_call>', "missing required argument"),
    ('<tool_call>{"name":"calculator","arguments":{"expression":"x+1"}}</tool_call>', "only numbers"),
])
def test_a_malformed_call_gets_an_error_message_as_the_answer(tok, text, error):
    interaction = Recorder()
    mt, inner = loop(tok, [[text], ["ok$"]], interaction, max_tool_output_chars=10_000)
    ids, mask = encode(tok, ["q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    answer = inner.rounds[1][0][0][len(ids_of(tok, "q") + ids_of(tok, text)):]
    assert tok.decode(answer).startswith("|error: ") and error in tok.decode(answer)
    assert out.num_tool_calls == [1] and out.num_tool_errors == [1] and out.response_text == ["ok"]


def test_parse_tool_call_is_lenient_where_it_costs_nothing():
    call = parse_tool_call('think <tool_call>\n```json\n{"name": "f", "parameters": "{\\"a\\": 1}"}\n```\n</tool_call>')
    assert call.error is None and call.name == "f" and call.arguments == {"a": 1}
    last = parse_tool_call('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"}</tool_call>')
    assert last.name == "b"
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').error == '"arguments" must be a JSON object'


class Sleepy(Tool):
    name, parameters = "sleepy", {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]}

    def call(self, args):
        time.sleep(args["s"])
        return "slept"


class AsyncSleepy(Sleepy):
    name = "async_sleepy"

    async def acall(self, args):
        await asyncio.sleep(args["s"])
        return "slept async"


def test_tools_run_concurrently_and_time_out():
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(8)
    sleepy, slow_async = Sleepy(), AsyncSleepy()
    jobs = [lambda: sleepy.call({"s": 0.4}), lambda: sleepy.call({"s": 0.4}), lambda: slow_async.acall({"s": 0.4}),
            lambda: sleepy.call({"s": 3.0}), lambda: slow_async.acall({"s": 3.0}), lambda: 1 / 0]
    t0 = time.perf_counter()
    answers = run_tool_calls(jobs, timeout_s=1.0, pool=pool)
    took = time.perf_counter() - t0
    assert answers[:3] == ["slept", "slept", "slept async"]
    assert answers[3] == answers[4] == "error: the tool timed out after 1 s"
    assert answers[5] == "error: ZeroDivisionError: division by zero"
    assert took < 2.0  # concurrent: three 0.4 s calls and two cut at 1 s, not 7 s in a row


HUNG_TOOL_SCRIPT = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from shardrl.tools import DaemonThreadPool, run_tool_calls
pool = DaemonThreadPool(2)
forever = threading.Event()
answers = run_tool_calls([lambda: forever.wait() or 'never', lambda: 'quick'], timeout_s=0.3, pool=pool)
print(answers, flush=True)
pool.shutdown()
"""


def test_a_tool_that_never_returns_does_not_keep_the_process_from_exiting(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import shardrl

    root = str(Path(shardrl.__file__).parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", HUNG_TOOL_SCRIPT, root], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # this test's own process group only
        proc.wait()
        pytest.fail("the process did not exit: a hung tool's worker thread was joined at exit")
    assert proc.returncode == 0
    assert out.strip() == "['error: the tool timed out after 0.3 s', 'quick']"


def test_a_timed_out_tool_answers_with_an_error_turn(tok):
    call = '<tool_call>{"name":"sleepy","arguments":{"s":2}}</tool_call>'
    mt, inner = loop(tok, [[call], ["done$"]], Recorder([Sleepy()]), tool_timeout_s=0.2)
    ids, mask = encode(tok, ["q"])
    t0 = time.perf_counter()
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    assert time.perf_counter() - t0 < 1.5
    answer = inner.rounds[1][0][0][len(ids_of(tok, "q") + ids_of(tok, call)):]
    assert tok.decode(answer) == "|error: the tool timed out after 0.2 s|"
    assert out.num_tool_errors == [1]


def test_turn_limit_ends_the_conversation_without_running_its_last_call(tok):
    call = CALL.format(name="calculator", expr="1+1")
    interaction = Recorder()
    mt, inner = loop(tok, [[call], [call], [call]], interaction, max_turns=2)
    ids, mask = encode(tok, ["q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    assert len(inner.rounds) == 2 and out.num_turns == [2] and out.num_tool_calls == [1]
    m, tool = ids_of(tok, call), ids_of(tok, "|2|")
    assert out.response_ids[0].tolist() == m + tool + m
    assert out.response_mask[0].tolist() == [1] * len(m) + [0] * len(tool) + [1] * len(m)


def test_token_budget_cuts_the_turn_and_drops_a_tool_turn_that_does_not_fit(tok):
    call = CALL.format(name="calculator", expr="1+1")
    m = ids_of(tok, call)
    # budget: the call, then room for less than its 3-token answer
    mt, inner = loop(tok, [[call], ["abcdef$"]], max_response_tokens=len(m) + 2)
    ids, mask = encode(tok, ["q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    assert inner.rounds[0][1].max_new_tokens == len(m) + 2 and len(inner.rounds) == 1
    assert out.response_ids[0].tolist() == m and out.num_tool_calls == [1]
    # per-turn limit: rollout.max_new_tokens caps each turn; a turn cut there ends the conversation
    mt, inner = loop(tok, [[call]], max_response_tokens=500)
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=10))
    assert out.response_ids[0].tolist() == m[:10] and out.num_tool_calls == [0] and len(inner.rounds) == 1


# ---------------------------------------------------------------- a real tiny model: sampler vs engine log-probs

def tiny_model(tok, seed=0):
    kw = dict(TINY_MODELS["qwen2"], vocab_size=len(tok), pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    return build_causal_lm(cfg, None, "cpu", torch.float32, seed=seed).eval()


class Echo(Interaction):
    tools = []

    def step(self, state, call):
        return "ab"


@pytest.mark.parametrize("backend,overlap,compact", [("hf", False, False), ("fast", False, False),
                                                     ("fast", True, False), ("fast", False, True), ("fast", True, True)])
def test_sampler_log_probs_equal_the_engines_on_multi_turn_sequences(backend, overlap, compact):
    # a 3-letter alphabet: a random model writes ">" (the call's end marker here) often, so conversations have
    # several model turns with tool turns between them (its calls are never JSON: the answers are error messages,
    # cut to 2 characters; the other characters are <unk> tokens, ids like any other)
    tok = build_char_tokenizer("ab>")
    model = tiny_model(tok, seed=4)
    # compact: the fast engine moves rows to narrower slot prefixes (8 slots: 4, 2, 1; a host sync every 2
    # steps, so that rows end at different syncs), and with overlapped tools rows that come back from a tool
    # join a compacted batch, widening it again
    fast_kwargs = {"min_width": 1, "sync_every": 2} if compact else {}
    if backend == "fast":  # blocks of 4 positions: a next turn reads its conversation's earlier turns from the cache
        fast_kwargs.update(block_size=4, max_seq_len=128)
    inner = build_rollout(backend, model.config, tok, "cpu", torch.float32, **fast_kwargs)
    inner.load_weights(model.named_parameters())
    mt = MultiTurnRollout(inner, tok, Echo(), max_turns=4, max_response_tokens=90, call_start="", call_end=">",
                          tool_turn_template="b{output}b", max_tool_output_chars=2, overlap_tools=overlap)
    ids, mask = encode(tok, ["ab", "ba>ab"])
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=11)
    out = mt.generate(ids, mask, sampling)
    if backend == "fast" and not overlap:  # (with overlapped tools, whether rows must move depends on tool timing)
        assert (inner.last_stats["compactions"] > 0) is compact
    if backend == "fast":
        assert inner.totals["cached_tokens"] > 40
    batch = out.to_batch()
    loss_mask = batch["loss_mask"].bool()
    tool_tokens = batch["attention_mask"].bool() & ~loss_mask
    tool_tokens[:, : ids.shape[1]] = False
    assert max(out.num_turns) >= 3 and tool_tokens.sum() >= 8 and loss_mask.sum() >= 12  # really multi-turn
    assert out.num_tool_errors == out.num_tool_calls
    lm = copy.deepcopy(model)
    lm.config.use_cache = False
    with torch.no_grad():  # packed (padding removed), chunked: what the training engine runs
        engine_lp = PolicyModel(lm, chunk_size=7).eval()(batch["input_ids"], batch["attention_mask"],
                                                        remove_padding=True, temperature=1.0)["log_probs"]
    got = batch["sampled_log_probs"]
    torch.testing.assert_close(got[loss_mask], engine_lp[loss_mask], atol=1e-5, rtol=0)
    assert (got[~loss_mask] == 0).all() and (got[loss_mask] < 0).all()
    # every tool turn is exactly the template around the cut answer, after a model turn that ended in a call
    P, tool_turn = ids.shape[1], len(ids_of(tok, "ber...(truncated)b"))  # the answer "error: ..." cut to 2 characters
    for r in range(len(out.num_turns)):
        row = batch["input_ids"][r, P:][batch["attention_mask"][r, P:].bool()].tolist()
        model = batch["loss_mask"][r, P:][batch["attention_mask"][r, P:].bool()].tolist()
        tool_runs = "".join("m" if m else "t" for m in model).split("m")
        assert all(len(run) in (0, tool_turn) for run in tool_runs), (r, model)
        assert sum(len(run) == tool_turn for run in tool_runs) == out.num_tool_calls[r] <= 3
        assert out.num_turns[r] <= 4 and len(row) <= 90


class Gate(Interaction):
    """The first call waits (up to 3 s) until another conversation makes its second call: only possible when
    tools run while the other conversations go on generating."""
    tools = []

    def __init__(self):
        self.lock, self.second_call, self.first, self.released = threading.Lock(), threading.Event(), None, None

    def start(self, sample):
        return {"calls": 0}

    def parse_call(self, text):  # every turn that ends in ">" is a valid call
        return ToolCall(name="gate", text=text)

    def step(self, state, call):
        state["calls"] += 1
        with self.lock:
            first, self.first = self.first is None, self.first or state
        if state["calls"] >= 2 and state is not self.first:
            self.second_call.set()
        if first:
            self.released = self.second_call.wait(3.0)
        return "ab"


@pytest.mark.parametrize("overlap", [True, False])
def test_overlapped_tools_run_while_other_conversations_decode(overlap):
    tok = build_char_tokenizer("ab>")
    model = tiny_model(tok, seed=4)
    inner = build_rollout("fast", model.config, tok, "cpu", torch.float32)
    inner.load_weights(model.named_parameters())
    gate = Gate()
    mt = MultiTurnRollout(inner, tok, gate, max_turns=4, max_response_tokens=60, call_start="", call_end=">",
                          tool_turn_template="b{output}b", max_tool_output_chars=2, overlap_tools=overlap)
    ids, mask = encode(tok, ["ab", "ba>ab"])
    out = mt.generate(ids, mask, SamplingParams(n=8, temperature=1.0, max_new_tokens=12, seed=11))
    assert sum(c >= 2 for c in out.num_tool_calls) >= 2  # several conversations called twice
    # rounds: every first-round call waits for the round's slowest, so no second call can come in time
    assert gate.released is overlap


def test_the_config_turns_overlap_on():
    tok = build_char_tokenizer("ab>")
    inner = build_rollout("fast", tiny_model(tok).config, tok, "cpu", torch.float32)
    cfg = load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                             "rollout.multi_turn.overlap_tools=true", "rollout.backend=fast"])
    assert MultiTurnRollout.from_config(inner, tok, cfg.rollout.multi_turn).overlap_tools
    assert not MultiTurnRollout.from_config(inner, tok, load_config(None, []).rollout.multi_turn).overlap_tools


def test_overlapped_tools_need_a_streaming_backend():
    tok = build_char_tokenizer("ab>")
    inner = build_rollout("hf", tiny_model(tok).config, tok, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"overlap_tools needs a backend .*\(rollout.backend=fast\)"):
        MultiTurnRollout(inner, tok, Echo(), overlap_tools=True)


# ---------------------------------------------------------------- advantages on the gaps of a multi-turn mask

def test_reinforce_plus_plus_carries_the_return_over_tool_turns():
    # model, model, tool, tool, model, model(last), padding: the outcome reaches the first turn, discounted by
    # the model tokens after it only; the tool tokens get 0
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    rewards = scores_to_token_rewards(torch.tensor([2.0], dtype=torch.float64), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 2.0, 0]]
    _, ret = compute_reinforce_plus_plus(rewards, mask, gamma=0.5, whiten=False)
    assert ret.tolist() == [[2 * 0.5**3, 2 * 0.5**2, 0.0, 0.0, 2 * 0.5, 2.0, 0.0]]
    adv, _ = compute_grpo(torch.tensor([1.0, 0.0]), torch.cat([mask, mask]), torch.tensor([0, 0]))
    assert (adv[:, 2:4] == 0).all() and (adv[0, [0, 1, 4, 5]] > 0).all()


# ---------------------------------------------------------------- built-in tools, interactions, config

def test_calculator_is_safe_arithmetic():
    calc = CalculatorTool()
    assert calc.call({"expression": "(12 + 5) * 3 / 2"}) == "25.5"
    assert calc.call({"expression": "7 // 2 + 2 ** 10 - 10 % 4"}) == "1025"
    assert calc.call({"expression": "0.1 + 0.2"}) == "0.3"
    assert evaluate_arithmetic("-(3)") == -3
    for bad, why in [("__import__('os').system('x')", "only numbers"), ("9 ** 9 ** 9", "too large"),
                     ("1 / 0", "division by zero"), ("abs(-1)", "only numbers"), ("1 +", "not an arithmetic")]:
        assert calc.call({"expression": bad}).startswith("error:") and why in calc.call({"expression": bad})
    assert check_arguments(calc.parameters, {"expression": 3}) == "argument 'expression' must be of type string, got int"
    assert calc.schema()["function"]["name"] == "calculator"


def test_python_tool_limits_time_memory_and_environment():
    assert run_python("print(6 * 7)") == "42\n"
    out = run_python("import os; print(os.getcwd()); print(sorted(os.environ)); open('f.txt', 'w').write('x')")
    cwd, env = out.splitlines()[:2]
    assert "shardrl_py_" in cwd and env == "['HOME', 'LANG', 'PATH', 'TMPDIR']"  # no trainer secrets leak in
    t0 = time.perf_counter()
    assert run_python("while True: pass", timeout_s=0.5) == "error: the code ran longer than 0.5 s and was stopped"
    assert time.perf_counter() - t0 < 3
    assert "MemoryError" in run_python("x = bytearray(2**30)", memory_mb=256)
    assert "ValueError: 3" in run_python("raise ValueError(3)")
    assert PythonTool(max_output_chars=20).call({"code": "print('a' * 100)"}).endswith("[output cut]")


def test_interaction_files_load_like_reward_files(tmp_path):
    path = tmp_path / "inter.py"
    path.write_text("from shardrl.rollout.episodes.multiturn import Interaction\n"
                    "from shardrl.tools import CalculatorTool\n"
                    "class Calc(Interaction):\n    tools = [CalculatorTool()]\n")
    interaction = load_interaction(str(path), "Calc")
    assert [t.name for t in interaction.tools] == ["calculator"]
    with pytest.raises(ValueError, match="is shardrl.s base class Interaction"):
        load_interaction(str(path))
    with pytest.raises(ValueError, match="interaction file not found"):
        load_interaction(str(tmp_path / "missing.py"))
    assert [t.name for t in BuiltinToolsInteraction(["python", "calculator"]).tools] == ["python", "calculator"]


def test_without_an_interaction_reward_the_reward_function_scores(tok):
    mt, _ = loop(tok, [["3$"]], BuiltinToolsInteraction(["calculator"]))
    ids, mask = encode(tok, ["q"])
    batch = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=20)).to_batch()
    assert "interaction_score" not in batch
    scores, metrics = score_with_interaction(batch, lambda b: (torch.tensor([0.5]), {"reward/x": 1.0}))
    assert scores.tolist() == [0.5] and metrics["reward/x"] == 1.0 and metrics["multi_turn/num_turns_mean"] == 1.0


def test_config_checks():
    cfg = load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"])
    assert cfg.rollout.multi_turn.max_turns == 4 and not load_config().rollout.multi_turn.enable
    assert cfg.rollout.multi_turn.tool_turn_template == CHATML_TOOL_TURN  # the config's default is the loop's
    for override, match in [("rollout.multi_turn.tools=[search]", "unknown built-in tool"),
                            ("rollout.multi_turn.max_turns=-1", "must be >= 0"),
                            ("rollout.multi_turn.tool_timeout_s=0", "must be > 0"),
                            ("rollout.multi_turn.tool_turn_template=x", "placeholder")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="need tools"):
        load_config(None, ["rollout.multi_turn.enable=true"])


# ---------------------------------------------------------------- the trainer, end to end

def _train_multi_turn(overrides):
    import json

    from shardrl.launch.rank import run

    run_dir = run(None, overrides)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.multiproc
def test_the_trainer_runs_multi_turn_rollouts(tmp_path):
    from shardrl.testing import run_distributed, small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=5)
    # the demo model writes digits: "1" ends a call here, so some conversations call (malformed: no JSON) and go
    # on. Two processes at sp=2 (sp rank 0 generates, the batch is broadcast, Ulysses splits the holed rows),
    # token-budget micro-batches, REINFORCE++ (its returns step over the tool turns)
    sp2 = [f"actor.engine.{k}" for k in ("ulysses_sequence_parallel_size=2", "use_dynamic_bsz=true",
                                         "max_token_len_per_gpu=32", "param_dtype=float32")]
    records = run_distributed(_train_multi_turn, 2, small_demo_run(
        assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=2", "actor.entropy_coeff=0.01",
        "algorithm.adv_estimator=reinforce_plus_plus", *sp2,
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.call_start=\"\"",
        "rollout.multi_turn.call_end=\"1\"", "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tool_output_chars=4",
        "rollout.multi_turn.max_response_tokens=40", "rollout.multi_turn.tool_turn_template=\" {output} \"",
        "trainer.val_freq=2", "trainer.export_hf=true"))
    assert [r["step"] for r in records] == [1, 2]
    # validation reports the tool use of its greedy conversations (the numbers: tests/test_trainer_outputs.py)
    val = records[-1]
    assert 0 <= val["val/multi_turn/clean_call_rate"] <= val["val/multi_turn/tool_call_rate"] <= 1
    assert "val/multi_turn/tool_call_rate" not in records[0]
    # the trained actor as a Hugging Face folder: loads, same names as the start, trained weights

    start = transformers.AutoModelForCausalLM.from_pretrained(assets / "model").state_dict()
    end = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model").state_dict()
    assert start.keys() == end.keys() and transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "hf_model")
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert len(moved) > len(start) // 2, moved
    # (a few: 2 and 1 of 16 conversations with these seeds)
    assert all(r["multi_turn/num_tool_calls_mean"] > 0 and r["multi_turn/num_turns_mean"] > 1 for r in records)
    # the actor's recomputation of the model's tokens, with the tool turns in their context, is the sampler's
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 and r["actor/grad_norm"] > 0 for r in records)
    # a conversation is cut at its response budget (40 tokens), not at one turn's max_new_tokens
    assert all((r["response/clip_frac"] > 0) == (r["response/length_max"] >= 40) for r in records), records


def test_the_layout_bounds_a_multi_turn_sequence_by_its_response_budget():
    from shardrl.plan.layout import derive_layout

    base = ["rollout.max_new_tokens=32", "data.max_prompt_length=64", "actor.engine.use_dynamic_bsz=true",
            "actor.engine.max_token_len_per_gpu=200"]
    assert derive_layout(load_config(None, base), 1, 1).max_seq_len == 96
    multi = base + ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                    "rollout.multi_turn.max_response_tokens=128"]
    assert derive_layout(load_config(None, multi), 1, 1).max_seq_len == 192
    with pytest.raises(ValueError, match="max_response_tokens 256"):  # a 320-token sequence fits no micro-batch
        derive_layout(load_config(None, [*multi, "rollout.multi_turn.max_response_tokens=256"]), 1, 1)


def test_an_interaction_may_parse_its_own_call_format(tok):
    class Pythonic(Recorder):
        def parse_call(self, text):  # e.g. "calculator(1+2)</tool_call>"
            name, _, rest = text.partition("(")
            return ToolCall(name=name, arguments={"expression": rest.split(")")[0]})

    mt, inner = loop(tok, [["calculator(1+2)</tool_call>"], ["3$"]], Pythonic())
    ids, mask = encode(tok, ["q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    assert tok.decode(inner.rounds[1][0][0]).endswith("</tool_call>|3|") and out.num_tool_errors == [0]


def test_a_call_followed_by_the_end_of_turn_token_is_a_call_and_the_turn_is_closed_once(tok):
    # some tokenizers make the call's end marker a special token, which stop strings do not see: the model
    # writes the call, then its end-of-turn token; the tool turn must not close the turn a second time
    call = CALL.format(name="calculator", expr="3*4")
    template = "<eos>\n|{output}|"
    mt, inner = loop(tok, [[call + "$", call], ["a$", "b$"]], tool_turn_template=template)
    ids, mask = encode(tok, ["q", "q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200))
    eos = tok.eos_token_id
    m = ids_of(tok, call)
    assert out.num_tool_calls == [1, 1]
    assert out.response_ids[0].tolist() == m + [eos] + ids_of(tok, "\n|12|") + ids_of(tok, "a") + [eos]
    assert out.response_ids[1].tolist() == m + [eos] + ids_of(tok, "\n|12|") + ids_of(tok, "b") + [eos]
    assert out.response_mask[0].tolist() == [1] * (len(m) + 1) + [0] * 5 + [1, 1]
    assert out.response_mask[1].tolist() == [1] * len(m) + [0] * 6 + [1, 1]  # here the template's <eos> is a tool token


def test_a_tool_class_without_call_or_acall_is_refused_when_defined():
    with pytest.raises(TypeError, match="tool class Mute defines neither call"):
        class Mute(Tool):
            name = "mute"


def test_overlong_shaping_of_a_conversation_counts_against_its_budget_not_the_turn_limit():
    from shardrl.batch import Batch
    from shardrl.config.schema import OverlongBufferConfig
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.scoring import Scorer

    # two conversations of 600 and 400 response tokens (model and tool tokens), a prompt of 4; budget 640
    prompt, width = 4, 640
    attention = torch.zeros(2, prompt + width, dtype=torch.long)
    attention[:, :prompt] = 1
    attention[0, prompt:prompt + 600] = 1
    attention[1, prompt:prompt + 400] = 1
    model_mask = torch.zeros(2, width, dtype=torch.long)
    model_mask[0, :500] = 1  # the model's own tokens of the first: 500, already past a 256-token turn limit
    model_mask[1, :300] = 1
    batch = Batch({"input_ids": torch.zeros(2, prompt + width, dtype=torch.long), "attention_mask": attention,
                   "response_mask": model_mask, "num_turns": torch.tensor([3.0, 2.0]),
                   "num_tool_calls": torch.tensor([2.0, 1.0]), "num_tool_errors": torch.tensor([0.0, 0.0])},
                  {"data_source": ["x", "x"], "response_text": ["a", "b"], "extra": [{}, {}]})
    scorer = Scorer(RewardManager(lambda data_source, solution_str, ground_truth, extra_info=None: 1.0),
                    multi_turn=True, overlong=OverlongBufferConfig(enable=True, len=64), length_limit=640)
    scores, metrics = scorer.score(batch)
    # 600 tokens, 24 into the last 64 before 640: -24/64; 400: no penalty; never below -penalty_factor
    assert scores.tolist() == pytest.approx([1.0 - 24 / 64, 1.0])
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-24 / 128)


# ---------------------------------------------------------------- several calls a turn, verl's tool config

def test_several_calls_in_one_turn_are_answered_in_one_tool_turn(tok):
    t1, t2 = CALL.format(name="calculator", expr="3*4"), CALL.format(name="calculator", expr="2+1")
    script = [[f"{t1} and {t2} and {t1}$"], ["15$"]]  # three calls, the turn ended by its end of turn
    mt, inner = loop(tok, script, max_calls_per_turn=2, tool_answer_separator="/", reward_text="conversation")
    ids, mask = encode(tok, ["q"])
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=400),
                      samples=[{"data_source": "x", "extra": {"ground_truth": "15"}}])
    assert inner.rounds[0][1].stop == []  # the turn is not stopped at its first call's end
    eos = tok.eos_token_id
    first = ids_of(tok, f"{t1} and {t2} and {t1}") + [eos]
    assert out.response_ids[0].tolist() == first + ids_of(tok, "|12/3|") + ids_of(tok, "15") + [eos]  # 2 of 3 run
    assert out.num_tool_calls == [2] and out.num_turns == [2]
    # the reward reads the whole conversation, as verl's does
    assert out.response_text == [f"{t1} and {t2} and {t1}|12/3|15"] and out.interaction_scores == [0.0]


GSM8K_TOOL_CONFIG = "tests/data/verl/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"


def test_verls_gsm8k_tool_config_runs_verls_tool(tok):
    """verl's own gsm8k tool (from verl's tool config, verbatim): created per conversation with the row's
    extra_info.tools_kwargs, it answers as verl's does and keeps verl's tool rewards."""
    from shardrl.rollout.episodes.interactions import VerlToolsInteraction
    from shardrl.tools.verl_tools import load_tool_config

    interaction = VerlToolsInteraction(load_tool_config(GSM8K_TOOL_CONFIG))
    assert [s["function"]["name"] for s in interaction.schemas()] == ["calc_gsm8k_reward"]
    call = '<tool_call>{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{}"}}}}</tool_call>'
    script = [[call.format("71"), call.format("72")], [call.format("72"), call.format("71")], ["#### 72$", "#### 7$"]]
    mt, _ = loop(tok, script, interaction=interaction)
    ids, mask = encode(tok, ["q one", "q two"])
    row = {"data_source": "openai/gsm8k", "extra": {"extra_info": {
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}}
    out = mt.generate(ids, mask, SamplingParams(n=1, max_new_tokens=200), samples=[row, row])
    tool_turns = [tok.decode([t for t, m, a in zip(out.response_ids[r], out.response_mask[r],
                                                   out.response_attention_mask[r]) if a and not m]) for r in (0, 1)]
    assert tool_turns == ["|Current parsed answer='71' reward=0.0||Current parsed answer='72' reward=1.0|",
                          "|Current parsed answer='72' reward=1.0||Current parsed answer='71' reward=0.0|"]
    assert out.interaction_scores is None  # the reward function scores the conversation
    state = interaction.start(row)  # verl's tool rewards: a submission that does not beat the last costs 0.05
    for answer in ("72", "71", "72"):
        asyncio.run(interaction.step(state, ToolCall(name="calc_gsm8k_reward", arguments={"answer": answer})))
    assert state.tool_rewards == [0.0, -0.05, 0.0]


def test_tool_schemas_reach_the_chat_template(tmp_path):
    import json as json_module

    from shardrl.data.prompts import load_prompt_dataset
    from shardrl.rollout.episodes.interactions import prompt_tool_schemas

    tok = build_char_tokenizer(ALPHABET)
    tok.chat_template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json_module.dumps({"prompt": [{"role": "user", "content": "q"}], "data_source": "x"}) + "\n")
    verl_cfg = load_config(None, ["rollout.multi_turn.enable=true",
                                  f"rollout.multi_turn.tool_config_path={GSM8K_TOOL_CONFIG}"]).rollout.multi_turn
    builtin_cfg = load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"])
    shown = load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                               "rollout.multi_turn.tools_in_chat_template=true"]).rollout.multi_turn
    assert prompt_tool_schemas(builtin_cfg.rollout.multi_turn) is None  # off by default for built-in tools
    for cfg, names in ((verl_cfg, "calc_gsm8k_reward"), (shown, "calculator")):
        dataset = load_prompt_dataset([str(rows)], tok, tools=prompt_tool_schemas(cfg))
        assert dataset[0]["prompt_text"] == f"TOOLS {names}\nq\n"
