"""Agent episodes (`rollout.agent.entrypoint`, `shardrl.rollout.episodes.agent`): the user's async function calls the run's
OpenAI-compatible endpoint with the real `openai` client; the trajectories are token-exact (the sampler's
log-probs equal a plain forward of the assembled sequence at the trained positions), the rewards are the agent's,
failures are counted and scored, a rewritten history trains only what follows it, and an RL run trains on it."""

from __future__ import annotations

import json
import sys
import threading
import time
import textwrap

import pytest
import torch
import transformers

from shardrl.rollout import SamplingParams, build_rollout
from shardrl.rollout.episodes.agent import AgentRollout
from shardrl.testing import save_char_model
from test_rollout_hf import recomputed_log_probs

AGENT = '''
import asyncio

RETURNS = {}


async def run(sample, client):
    """Two chat calls: the question, then a follow-up turn that quotes a (made-up) tool answer."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    kind = sample["extra"]["kind"]
    if kind == "raise":
        raise RuntimeError("the tool broke")
    if kind == "slow":
        await asyncio.sleep(30)
    if kind == "bad":
        return "not a number"
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "tool: 4"}]
    if kind == "rewrite":  # the agent drops the first exchange from its history
        messages = [{"role": "user", "content": "again: " + sample["prompt"]}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    reward = float(len(second.choices[0].message.content) % 3)
    RETURNS.setdefault(sample["prompt"], []).append(reward)
    return reward
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent_model")
    tok = save_char_model(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    agent_file = folder / "agent.py"
    agent_file.write_text(AGENT)
    return tok, model, agent_file


def agent_rollout(setup, backend: str = "hf", **kwargs):
    tok, model, agent_file = setup
    inner = build_rollout(backend, model.config, tok, "cpu", torch.float32,
                          **({"block_size": 4} if backend == "fast" else {}))
    inner.load_weights(model.named_parameters())
    return AgentRollout(inner, tok, f"{agent_file}:run", context=512, **kwargs)


def run_episodes(rollout, tok, prompts: list[str], kinds: list[str], n: int = 2):
    enc = tok(prompts, return_tensors="pt", padding=True)
    samples = [{"prompt": p, "data_source": "t", "extra": {"kind": k}} for p, k in zip(prompts, kinds)]
    return rollout.generate(enc["input_ids"], enc["attention_mask"],
                            SamplingParams(n=n, temperature=1.0, max_new_tokens=8, seed=0), samples=samples)


# fast: the endpoint streams (calls join the running batch) and the next call reads the cached K/V of the last
@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_trajectories_are_token_exact_and_rewards_the_agents(setup, backend):
    tok, model, _ = setup
    rollout = agent_rollout(setup, backend)
    prompts = ["1+2=", "what is 7*6? ", "ab"]
    try:
        out = run_episodes(rollout, tok, prompts, ["ok"] * 3, n=3)
    finally:
        rollout.server.stop()
    batch = out.to_batch()
    trained = batch["loss_mask"].bool()
    # the trained tokens are the sampler's: their log-probs are a plain forward's of the assembled sequence
    assert trained.sum() > 20
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)
    # each trajectory: the first prompt, the first reply (trained), the follow-up turn (not), the second reply;
    # except where the chat template could not render the first reply as sampled (a special token sampled within
    # it, which the reply's text leaves out): the trajectory restarts at the second call (a prefix break)
    # A first reply that was only the end-of-turn token (the template renders the turn's end itself) is dropped:
    # that trajectory is the follow-up, then the second reply. (This random model samples <bos> or <unk> in about a
    # quarter of its 6-token replies: how many rows stay whole is chance, at least one nearly always: 1 - 0.26**9)
    whole = [r for r in range(len(out)) if batch["agent_prefix_breaks"][r] == 0]
    assert whole, batch["agent_prefix_breaks"]
    follow_ups = set()
    for r in whole:
        prompt = tok.decode(batch["input_ids"][r][batch["attention_mask"][r].bool()][:out.prompt_mask[r].sum()])
        assert prompt == f"user: {prompts[r // 3]}\nassistant: "
        real = out.response_attention_mask[r].bool()
        mask, ids = out.response_mask[r][real].tolist(), out.response_ids[r][real].tolist()
        runs = [k for i, k in enumerate(mask) if i == 0 or mask[i - 1] != k]
        assert runs in ([1, 0, 1], [0, 1]), mask  # reply, follow-up, reply (or: follow-up, reply)
        follow_ups.add(tok.decode([t for t, m in zip(ids, mask) if m == 0]))
    assert follow_ups == {"\nuser: tool: 4\nassistant: "}, follow_ups
    returns = rollout.entrypoint.__globals__["RETURNS"]
    scores = batch["interaction_score"]
    for i, p in enumerate(prompts):  # (a prompt's episodes finish in any order)
        assert sorted(scores[3 * i:3 * i + 3]) == sorted(returns[p])
    assert batch["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch["agent_calls"].tolist() == [2.0] * 9 and batch["agent_errors"].sum() == 0
    if backend == "fast":
        assert rollout.server.batcher.stats["streams"] >= 1 and rollout.server.batcher.stats["batches"] == 0
        assert rollout.rollout.totals["cached_tokens"] > 0  # blocks of earlier calls (and of the same prompt) read
        assert not rollout.rollout._pool.pins  # each episode's blocks were kept between its calls, then let go
        # the stream's slots (and K/V) for the 9 episodes that can call at once, not the server's 256
        assert rollout.rollout._state.num_slots == 9


def test_failed_episodes_are_counted_scored_and_placed_and_all_failing_stops(setup, caplog):
    """Each failure is logged with its place in the agent's file (where it raised; where it waited when it timed
    out; the function for a bad return); a step whose every episode failed is a ValueError (one `error:` line, exit
    status 2) quoting the first, from the scorer."""
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.scoring import Scorer

    tok, _, agent_file = setup
    rollout = agent_rollout(setup, timeout_s=2.0, failure_reward=-1.0)
    try:
        with caplog.at_level("WARNING", logger="shardrl.rollout.episodes.agent"):
            out = run_episodes(rollout, tok, ["a", "b", "c", "d"], ["ok", "raise", "slow", "bad"], n=1)
        batch = out.to_batch()
        assert batch["agent_errors"].tolist() == [0, 1, 0, 1]
        assert batch["agent_timeouts"].tolist() == [0, 0, 1, 0]
        assert batch["interaction_score"][1:] == [-1.0, -1.0, -1.0]
        assert batch["interaction_score"][0] in (0.0, 1.0, 2.0)
        lines = AGENT.splitlines()  # (line 1 is the empty first line of the string)
        raised = lines.index('        raise RuntimeError("the tool broke")')
        waited = lines.index("        await asyncio.sleep(30)")
        defined = lines.index("async def run(sample, client):")
        assert batch["agent_error"] == [
            None, f"{agent_file}:{raised + 1}: RuntimeError: the tool broke",
            f"{agent_file}:{waited + 1}: timed out after 2 s (rollout.agent.timeout_s)",
            f"{agent_file}:{defined + 1}: the agent returned str, not a number or None"]
        assert [r.getMessage() for r in caplog.records] == [f"agent episode failed at {e}"
                                                            for e in batch["agent_error"][1:]]
        assert "agent_calls" in batch and "num_tool_calls" not in batch and "num_turns" not in batch
        scorer = Scorer(RewardManager(), multi_turn=True)
        scores, metrics = scorer.score(batch)
        assert scores.tolist()[1:] == [-1.0, -1.0, -1.0]
        assert not any(k.startswith("multi_turn/") for k in metrics)  # (an agent calls no tools of ours)
        assert metrics["agent/errors_mean"] == 0.5 and metrics["agent/timeouts_mean"] == 0.25
        failed = run_episodes(rollout, tok, ["a", "b"], ["raise", "raise"], n=1).to_batch()
        with pytest.raises(ValueError, match=r"^every agent episode of this step failed \(2 of them\), so there is "
                           rf"nothing to learn from; the first at {agent_file}:{raised + 1}: RuntimeError: the tool "
                           r"broke\. Fix the agent"):
            scorer.score(failed)
    finally:
        rollout.server.stop()


def test_a_none_among_numbers_is_a_failed_episode(setup, tmp_path):
    """An agent that returns None for one episode and numbers for the others: that episode fails (scored
    failure_reward, counted, placed at the agent's function), the step goes on; None from every episode leaves the
    scores to the reward function (fixed only for failures)."""
    tok, model, _ = setup
    agent = tmp_path / "maybe.py"
    agent.write_text(textwrap.dedent('''
        async def run(sample, client):
            await client.completions.create(model="policy", prompt=sample["prompt"], max_tokens=2)
            return None if sample["extra"]["kind"] == "none" else 0.5
    '''))
    inner = build_rollout("hf", model.config, tok, "cpu", torch.float32)
    inner.load_weights(model.named_parameters())
    rollout = AgentRollout(inner, tok, f"{agent}:run", context=512, failure_reward=-1.0)
    try:
        batch = run_episodes(rollout, tok, ["a", "b", "c"], ["ok", "none", "ok"], n=1).to_batch()
        assert batch["interaction_score"] == [0.5, -1.0, 0.5]
        assert batch["agent_errors"].tolist() == [0, 1, 0]
        assert batch["agent_error"][1] == (f"{agent}:2: the agent returned None where other episodes of this step "
                                           "returned numbers; return a number from every episode (or None from "
                                           "every one: the reward function then scores them)")
        batch = run_episodes(rollout, tok, ["a", "b"], ["none", "none"], n=1).to_batch()
        assert "interaction_score" not in batch and batch["agent_errors"].tolist() == [0, 0]
    finally:
        rollout.server.stop()


def test_a_rewritten_history_trains_only_what_follows_it(setup):
    tok, model, _ = setup
    rollout = agent_rollout(setup)
    try:
        out = run_episodes(rollout, tok, ["1+1=", "xyz"], ["rewrite", "rewrite"], n=1)
    finally:
        rollout.server.stop()
    batch = out.to_batch()
    assert batch["agent_prefix_breaks"].tolist() == [1.0, 1.0]
    for r, p in enumerate(["1+1=", "xyz"]):
        prompt = tok.decode(out.prompt_ids[r][out.prompt_mask[r].bool()])
        assert prompt == f"user: again: {p}\nassistant: "  # the trajectory restarted at the second call
        assert out.response_mask[r].sum() == out.response_attention_mask[r].sum()  # one reply, all trained
    trained = batch["loss_mask"].bool()
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)


def test_bad_entrypoints_are_refused(tmp_path):
    from shardrl.rollout.episodes.agent import load_entrypoint

    (tmp_path / "sync.py").write_text("def run(sample, client):\n    return 1.0\n")
    with pytest.raises(ValueError, match="must be an async function"):
        load_entrypoint(f"{tmp_path / 'sync.py'}:run")
    with pytest.raises(ValueError, match="defines no 'go'"):
        load_entrypoint(f"{tmp_path / 'sync.py'}:go")
    with pytest.raises(ValueError, match="no file"):
        load_entrypoint(f"{tmp_path / 'missing.py'}:run")
    for spec in [str(tmp_path / "sync.py"), f"{tmp_path / 'sync.py'}:", ":run"]:
        with pytest.raises(ValueError, match=r"as path/to/agent.py:function"):
            load_entrypoint(spec)


def test_a_run_with_a_bad_entrypoint_stops_before_building_models(tmp_path, monkeypatch):
    from shardrl.trainer import rl
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    (tmp_path / "sync.py").write_text("def run(sample, client):\n    return 1.0\n")
    built = []
    monkeypatch.setattr(rl.Roles, "build", lambda *a, **k: built.append(a))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="must be an async function"):
        run(None, resolve_overrides(None, [f"rollout.agent.entrypoint={tmp_path}/sync.py:run"]))
    assert not built


def test_an_rl_run_trains_on_agent_episodes(tmp_path, monkeypatch):
    """The demo's task through an agent that asks once by completions and scores the reply itself; training and
    validation log what an agent run counts (agent/*, val/agent/*), and no tool counts (it calls no tools of ours)."""
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent('''
        async def run(sample, client):
            reply = await client.completions.create(model="policy", prompt=sample["prompt"], max_tokens=4)
            return float(reply.choices[0].text.strip()[:1] == str(sample["extra"]["ground_truth"]))
    '''))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+1=", "data_source": "arith", "ground_truth": str(a + 1)})
                           + "\n" for a in range(3)))
    monkeypatch.chdir(tmp_path)
    overrides = resolve_overrides(None, ["trainer.logger=[jsonl]", "trainer.total_steps=3", "trainer.val_freq=0",
                                         "trainer.val_before_train=true", f"rollout.agent.entrypoint={agent}:run"])
    run_dir = run(None, overrides + [f"data.val_files=[{val}]"])  # (after the demo's)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(records) == 4 and records[0]["step"] == 0
    assert {k: v for k, v in records[0].items() if k.startswith("val/agent/")} == {
        "val/agent/errors_mean": 0.0, "val/agent/timeouts_mean": 0.0, "val/agent/prefix_breaks_mean": 0.0,
        "val/agent/calls_mean": 1.0, "val/agent/tool_parse_failures_mean": 0.0}
    assert all(r["agent/calls_mean"] == 1.0 and r["agent/errors_mean"] == 0.0 for r in records[1:])
    assert all("reward/mean" in r and "actor/pg_loss" in r for r in records[1:])
    assert not [k for r in records for k in r if "multi_turn/" in k]


def test_an_agent_run_whose_every_episode_fails_is_one_error_line(tmp_path, monkeypatch, capsys):
    """`shardrl train` with an agent that always raises: one `error:` line naming the first episode's error and its
    place in the agent's file, exit status 2 (no traceback)."""
    from shardrl.cli import main

    agent = tmp_path / "agent.py"
    agent.write_text("async def run(sample, client):\n    x = {}\n    return x['score']\n")
    monkeypatch.chdir(tmp_path)
    status = main(["train", "trainer.logger=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0",
                   "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                   f"rollout.agent.entrypoint={agent}:run"])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: every agent episode of this step failed (8 of them), so there is nothing to learn from; the first "
        f"at {agent}:3: KeyError: 'score'. Fix the agent (rollout.agent.entrypoint; an episode that fails scores "
        "rollout.agent.failure_reward only while others succeed)"]


@pytest.mark.parametrize("body,error,line", [
    ("x = 1\nasync def run(sample, client)\n    return 1.0\n", "SyntaxError: expected ':'", 2),
    ("import os\nimport does_not_exist_xyz\n", "ModuleNotFoundError: No module named 'does_not_exist_xyz'", 2),
    ("\n\nraise RuntimeError('no key')\n", "RuntimeError: no key", 3)])
def test_an_agent_file_that_fails_to_import_is_one_error_line_before_any_model(tmp_path, monkeypatch, capsys,
                                                                              body, error, line):
    """An agent file with a syntax error, a failing import or a raise at import: one `error:` line naming the key,
    the error and its file:line, exit status 2, before any model is built (was: a traceback after the model
    loaded)."""
    from shardrl.cli import main
    from shardrl.trainer import rl

    agent = tmp_path / "agent.py"
    agent.write_text(body)
    monkeypatch.setattr(rl.Roles, "build", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.chdir(tmp_path)
    status = main(["train", "trainer.total_steps=1", f"rollout.agent.entrypoint={agent}:run"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: rollout.agent.entrypoint='{agent}:run': the agent file '{agent}' failed to "
                                f"import: {error}")
    assert errors[0].endswith(f"(at {agent}:{line})")


def test_the_calculator_agent_example_runs_its_tool_loop():
    """examples/agent/calculator_agent.py against a scripted client: a call, the calculator's answer in the next
    prompt, then the answer; rewarded as the tools example (right '####' answer + 0.1 for clean calls)."""
    import asyncio
    import types
    from pathlib import Path

    from shardrl.rollout.episodes.agent import load_entrypoint

    run = load_entrypoint(str(Path(__file__).parent.parent / "examples/agent/calculator_agent.py") + ":run")
    replies = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n', "#### 12"]
    seen = []

    async def create(model, messages, max_tokens, stop):
        seen.append([dict(m) for m in messages])
        choice = types.SimpleNamespace(message=types.SimpleNamespace(content=replies[len(seen) - 1]),
                                       finish_reason="stop")
        return types.SimpleNamespace(choices=[choice])

    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create)))
    sample = {"prompt": [{"role": "user", "content": "Tom has 3 bags of 4."}], "extra": {"ground_truth": "12"}}
    assert asyncio.run(run(sample, client)) == pytest.approx(1.1)
    assert seen[1][-1] == {"role": "user", "content": "<tool_response>\n12\n</tool_response>"}
    assert seen[1][-2]["content"].endswith("</tool_call>")
    sample["extra"]["ground_truth"] = "13"
    seen.clear()
    assert asyncio.run(run(sample, client)) == pytest.approx(0.1)


def test_weights_that_change_during_episodes_are_recorded_per_token(setup):
    """Partial rollouts (asynchronous RL): the server's records carry each token's policy version, and the
    trajectories the version of every token (what a prompt added: the version of the reply after it); each trained
    token's log-prob is the forward of the version that sampled it. The new weights differ in the output head only,
    so the K/V kept across the swap is the same under both."""
    import copy

    tok, model, _ = setup
    new = copy.deepcopy(model)
    new.lm_head.weight.data.mul_(-1.5)
    rollout = agent_rollout(setup)
    calls = [0]

    def hook() -> int:  # (the HF backend calls it at every decode step)
        calls[0] += 1
        if calls[0] == 5:
            rollout.rollout.load_weights([("lm_head.weight", new.lm_head.weight)])
        return int(calls[0] >= 5)

    rollout.weight_hook = hook
    assert rollout.rollout.weight_hook is hook
    seen = []
    assemble = rollout._assemble
    rollout._assemble = lambda *args: (seen.extend(args[-1]), assemble(*args))[1]  # (the episodes' records)
    try:
        out = run_episodes(rollout, tok, ["1+2=", "ab"], ["ok"] * 2, n=2)
    finally:
        rollout.server.stop()
    recorded = [v for calls in seen for call in calls for v in call["token_versions"]]
    assert 0 in recorded and 1 in recorded
    assert all(call["policy_version"] == call["token_versions"][0] for calls in seen for call in calls
               if call["token_ids"])
    batch = out.to_batch()
    versions, real = batch["token_version"], out.response_attention_mask.bool()
    assert torch.equal(versions >= 0, real)
    assert (versions[real] == 1).any()  # (the version-0 replies may have left: a prefix break restarts there)
    trained = batch["loss_mask"].bool()
    width = out.prompt_ids.shape[1]
    want = torch.where(versions == 1, recomputed_log_probs(new, out, 1.0)[:, width:],
                       recomputed_log_probs(model, out, 1.0)[:, width:])
    got = batch["sampled_log_probs"][:, width:]
    torch.testing.assert_close(got[trained[:, width:]], want[trained[:, width:]], atol=1e-4, rtol=0)


def test_what_an_episode_returns_or_raises_is_scored_and_counted(tmp_path):
    """A non-finite return, sys.exit and a CancelledError raised by the agent are episode errors (scored and
    counted, the step goes on); numpy's numbers are rewards; an entrypoint that cannot take (sample, client) is
    refused when the file loads; an agent that blocks the event loop past the timeout is named in the log."""
    import asyncio
    import logging

    import numpy as np

    from shardrl.rollout.episodes.agent import LoopWatch, episode_reward, load_entrypoint

    assert episode_reward(np.float32(0.5)) == (0.5, None) and episode_reward(3) == (3.0, None)
    assert episode_reward(None) == (None, None)
    for bad, said in [(float("nan"), "nan: a reward must be finite"), (float("-inf"), "must be finite"),
                      (True, "returned bool"), ("1", "returned str"), (10**400, "which is no float")]:
        assert episode_reward(bad)[0] is None and said in episode_reward(bad)[1]
    for signature in ["sample", "sample, *, client", "sample, client, extra"]:
        (tmp_path / "a.py").write_text(f"async def run({signature}):\n    return 1.0\n")
        with pytest.raises(ValueError, match=r"cannot be called as run\(sample, client\)"):
            load_entrypoint(f"{tmp_path / 'a.py'}:run")
    for signature in ["sample, client", "sample, client, extra=None", "*args"]:
        (tmp_path / "a.py").write_text(f"async def run({signature}):\n    return 1.0\n")
        load_entrypoint(f"{tmp_path / 'a.py'}:run")
    (tmp_path / "a.py").write_text(textwrap.dedent('''
        import functools

        def with_session(fn):  # a decorator that passes the wrapped function one more argument
            @functools.wraps(fn)
            async def call(sample, client):
                return await fn(sample, client, "session")
            return call

        @with_session
        async def run(sample, client, session):
            return 1.0
    '''))
    load_entrypoint(f"{tmp_path / 'a.py'}:run")
    (tmp_path / "a.py").write_text(textwrap.dedent('''
        import functools

        def logged(fn):  # a generic decorator: its (*args, **kwargs) says nothing of what fn takes
            @functools.wraps(fn)
            async def call(*args, **kwargs):
                return await fn(*args, **kwargs)
            return call

        @logged
        async def run(sample):  # (client forgotten)
            return 1.0
    '''))
    with pytest.raises(ValueError, match=r"cannot be called as run\(sample, client\)"):
        load_entrypoint(f"{tmp_path / 'a.py'}:run")

    class Records(logging.Handler):
        said: list = []

        def emit(self, record):
            Records.said.append(record.getMessage())

    handler = Records()
    logging.getLogger("shardrl.rollout.episodes.agent").addHandler(handler)
    try:
        async def blocked():
            with LoopWatch(asyncio.get_running_loop(), 0.2):
                await asyncio.sleep(0.05)
                time.sleep(0.8)  # (an agent's blocking call)
        asyncio.run(blocked())
    finally:
        logging.getLogger("shardrl.rollout.episodes.agent").removeHandler(handler)
    assert any("blocked the event loop" in m and "timeout_s=0.2" in m for m in Records.said), Records.said


@pytest.mark.skipif(sys.version_info < (3, 11), reason="an agent's own CancelledError is told apart by "
                    "Task.cancelling (Python 3.11+); before, it stops the step")
def test_episodes_that_exit_cancel_or_return_nan_fail_alone(setup, tmp_path):
    tok, model, _ = setup
    agent = tmp_path / "odd.py"
    agent.write_text(textwrap.dedent('''
        import asyncio, sys
        import numpy as np

        async def run(sample, client):
            await client.completions.create(model="policy", prompt=sample["prompt"], max_tokens=2)
            kind = sample["extra"]["kind"]
            if kind == "exit":
                sys.exit(3)
            if kind == "cancel":
                raise asyncio.CancelledError()
            if kind == "timeout":  # (its own: e.g. a tool's wait_for; not the episode's timeout)
                await asyncio.wait_for(asyncio.sleep(5), 0.01)
            if kind == "base":  # (a library's own BaseException subclass)
                class Aborted(BaseException):
                    pass
                raise Aborted("the sandbox gave up")
            return float("nan") if kind == "nan" else np.float32(1.5)
    '''))
    inner = build_rollout("hf", model.config, tok, "cpu", torch.float32)
    inner.load_weights(model.named_parameters())
    rollout = AgentRollout(inner, tok, f"{agent}:run", context=512, failure_reward=-1.0)
    try:
        out = run_episodes(rollout, tok, ["a", "b", "c", "d", "e", "f"],
                           ["exit", "cancel", "nan", "timeout", "base", "ok"], n=1)
    finally:
        rollout.server.stop()
    batch = out.to_batch()
    assert batch["agent_errors"].tolist() == [1, 1, 1, 1, 1, 0]
    assert batch["agent_timeouts"].tolist() == [0] * 6
    assert batch["interaction_score"][:5] == [-1.0] * 5
    assert batch["interaction_score"][5] == 1.5


def test_a_blocking_call_in_a_thread_does_not_hold_the_step_past_its_timeout(setup, tmp_path):
    """An episode whose asyncio.to_thread call outlives the episode's timeout: the episode times out, the step ends
    then (not when the thread's call returns), and the thread is left to finish on its own; a step whose every
    episode times out says the timeout."""
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.scoring import Scorer

    tok, model, _ = setup
    agent = tmp_path / "blocking.py"
    agent.write_text(textwrap.dedent('''
        import asyncio, time

        async def run(sample, client):
            await client.completions.create(model="policy", prompt=sample["prompt"], max_tokens=2)
            if sample["extra"]["kind"] == "hang":
                await asyncio.to_thread(time.sleep, 20)  # (a tool's blocking call that hangs)
            return await asyncio.to_thread(lambda: 1.0)
    '''))
    inner = build_rollout("hf", model.config, tok, "cpu", torch.float32)
    inner.load_weights(model.named_parameters())
    rollout = AgentRollout(inner, tok, f"{agent}:run", context=512, timeout_s=1.5, failure_reward=-1.0)
    try:
        start = time.monotonic()
        out = run_episodes(rollout, tok, ["a", "b"], ["hang", "ok"], n=1)
        took = time.monotonic() - start
        hung = run_episodes(rollout, tok, ["a"], ["hang"], n=1).to_batch()
        with pytest.raises(ValueError, match=r"every agent episode.*the first at .*blocking.py:7: timed out after "
                           r"1.5 s \(rollout.agent.timeout_s\)"):  # (where it waited: the thread's call)
            Scorer(RewardManager(), multi_turn=True).score(hung)
    finally:
        rollout.server.stop()
    assert took < 10, took  # (20 s: the step waited for the thread)
    batch = out.to_batch()
    assert batch["agent_timeouts"].tolist() == [1, 0] and batch["interaction_score"] == [-1.0, 1.0]
    assert sum(t.name == "shardrl-agent-call" for t in threading.enumerate()) == 2  # (still sleeping, daemons)
    assert all(t.daemon for t in threading.enumerate() if t.name == "shardrl-agent-call")


STREAMING_AGENT = '''
import os


async def run(sample, client):
    """One chat call, streamed or not (STREAM): the reply's text, joined from the deltas where streamed."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    if os.environ.get("SHARDRL_TEST_STREAM") == "1":
        chunks = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        text = reply.choices[0].message.content
    return float(len(text))
'''


@pytest.mark.parametrize("backend", ["hf"])
def test_a_streamed_call_records_the_same_trajectory_as_a_plain_one(setup, backend, tmp_path, monkeypatch):
    """The same agent, its call streamed (stream=True) or not, sampling greedily: the same trajectory tokens,
    log-probs and rewards (the streamed reply's text, joined, is the plain reply's)."""
    tok, model, _ = setup
    agent_file = tmp_path / "streaming_agent.py"
    agent_file.write_text(STREAMING_AGENT)
    got = []
    for stream in ("0", "1"):
        monkeypatch.setenv("SHARDRL_TEST_STREAM", stream)
        rollout = agent_rollout((tok, model, agent_file), backend)
        try:
            enc = tok(["1+2=", "ab"], return_tensors="pt", padding=True)
            samples = [{"prompt": p, "data_source": "t", "extra": {}} for p in ("1+2=", "ab")]
            out = rollout.generate(enc["input_ids"], enc["attention_mask"],  # (greedy: the same draws each run)
                                   SamplingParams(n=2, greedy=True, max_new_tokens=8), samples=samples)
        finally:
            rollout.server.stop()
        got.append(out.to_batch())
    plain, streamed = got
    assert plain["loss_mask"].sum() > 4
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(plain[key], streamed[key]), key
    # (concurrent episodes' calls share batches whose makeup depends on timing: the same tokens' log-probs from
    # another batch shape differ in the last bits, ~2e-7)
    torch.testing.assert_close(plain["sampled_log_probs"], streamed["sampled_log_probs"], atol=1e-5, rtol=0)
    assert sorted(plain["interaction_score"]) == sorted(streamed["interaction_score"])
    assert streamed["agent_errors"].sum() == 0
