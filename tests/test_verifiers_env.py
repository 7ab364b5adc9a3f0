"""A verifiers environment as the episodes (`rollout.env`): its dataset is the prompts, its own loop (a
`vf.SingleTurnEnv`, a `vf.MultiTurnEnv` whose environment answers between turns) calls the policy through the run's
endpoint, the trajectory is token-exact (the sampler's log-probs equal a plain forward's at the trained positions),
and the episode's reward is the rubric's."""

from __future__ import annotations

import json
import textwrap
from collections import Counter

import pytest
import torch
import transformers

pytest.importorskip("verifiers")

from shardrl.rollout import SamplingParams, build_rollout
from shardrl.rollout.episodes.agent import AgentRollout
from shardrl.testing import save_char_model
from test_rollout_hf import recomputed_log_probs

ENV = '''
import verifiers as vf
from datasets import Dataset

SCORED = []  # (question, the last reply the rubric read, its reward)


def last_reply_length(completion, answer, prompt, **kwargs) -> float:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    reward = float(len(text) % 3) + (0.5 if answer == "x" else 0.0)
    SCORED.append((prompt[-1]["content"], text, reward))
    return reward


class TwoTurns(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "tool: 4"}]


def load_environment(kind="single"):
    rows = [{"question": q, "answer": a} for q, a in (("1+2=", "3"), ("what is 7*6? ", "x"), ("ab", "ba"))]
    dataset, rubric = Dataset.from_list(rows), vf.Rubric(funcs=[last_reply_length])
    if kind == "single":
        env = vf.SingleTurnEnv(dataset=dataset, eval_dataset=Dataset.from_list(rows[:2]), rubric=rubric)
    else:
        env = TwoTurns(dataset=dataset, rubric=rubric, max_turns=2)
    env.scored = SCORED  # (for the test to read)
    return env
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("env_model")
    tok = save_char_model(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    (folder / "my_env.py").write_text(ENV)
    return tok, model, folder


def run_environment(tok, model, spec: str, env_args: dict, n: int = 2, max_new_tokens: int = 6, **agent_kwargs):
    """(the environment, its rows, the AgentRollout's output) of `n` episodes of each row of the environment
    `spec` run on the HF rollout of `model` (`agent_kwargs`: AgentRollout's)."""
    from shardrl.data.verifiers import environment_rows, load_verifiers_env
    from shardrl.rollout.episodes.verifiers_env import environment_episode

    env = load_verifiers_env(spec, env_args)
    rows = environment_rows(env, spec)
    inner = build_rollout("hf", model.config, tok, "cpu", torch.float32)
    inner.load_weights(model.named_parameters())
    rollout = AgentRollout(inner, tok, environment_episode(env), context=512, **agent_kwargs)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True)
    samples = [{"prompt": r["prompt"], "data_source": r["data_source"],
                "extra": {"verifiers_input": r["verifiers_input"]}} for r in rows]
    try:
        out = rollout.generate(enc["input_ids"], enc["attention_mask"],
                               SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=0),
                               samples=samples)
    finally:
        rollout.server.stop()
    return env, rows, out


def run_env(setup, kind: str, n: int = 2):
    tok, model, folder = setup
    env, rows, out = run_environment(tok, model, f"{folder / 'my_env.py'}:load_environment", {"kind": kind}, n)
    assert [r["data_source"] for r in rows] == ["verifiers/my_env"] * 3
    return tok, model, out, env.scored, [r["prompt"][-1]["content"] for r in rows]


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_an_environments_rollouts_are_token_exact_and_scored_by_its_rubric(setup, kind):
    tok, model, out, scored, questions = run_env(setup, kind, n=3)
    batch = out.to_batch()
    trained = batch["loss_mask"].bool()
    assert trained.sum() > 10
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)
    # a reply that is only the end of the turn (this random model's, now and then) is verifiers' own
    # EmptyModelResponseError: that rollout ends with an error, a failed episode scored rollout.agent.failure_reward
    ok = batch["agent_errors"] == 0
    assert ok.sum() >= 5, batch["agent_errors"]
    assert (batch["agent_calls"][ok] == (1.0 if kind == "single" else 2.0)).all()
    # each trajectory: the environment's prompt, then its turns (multi: the environment's answer between them)
    whole = [r for r in range(len(out)) if batch["agent_prefix_breaks"][r] == 0 and ok[r]]
    assert whole
    for r in whole:
        prompt = tok.decode(batch["input_ids"][r][batch["attention_mask"][r].bool()][:out.prompt_mask[r].sum()])
        assert prompt == f"user: {questions[r // 3]}\nassistant: "
        real = out.response_attention_mask[r].bool()
        mask, ids = out.response_mask[r][real].tolist(), out.response_ids[r][real].tolist()
        untrained = tok.decode([t for t, m in zip(ids, mask) if m == 0])
        if kind == "multi":
            assert "\nuser: tool: 4\nassistant: " in untrained, untrained
        else:
            assert set(mask) == {1}
    # the reward of each episode is what the rubric returned for it, on the reply the endpoint gave
    scores = torch.tensor(batch["interaction_score"], dtype=torch.float32)
    # (the rubric also scores a rollout that failed in its second turn: its reward is not the episode's)
    assert int(ok.sum()) <= len(scored) <= len(out)
    assert (scores[~ok] == 0.0).all()
    for i, q in enumerate(questions):
        rubric = Counter(reward for question, _, reward in scored if question == q)
        episodes = Counter(scores[3 * i:3 * i + 3][ok[3 * i:3 * i + 3]].tolist())
        assert episodes <= rubric, (episodes, rubric)
        if ok[3 * i:3 * i + 3].all() and len(scored) == len(out):
            assert episodes == rubric
        assert all(reward == len(text) % 3 + (0.5 if q.startswith("what") else 0.0)
                   for question, text, reward in scored if question == q)
    scored.clear()


def test_an_rl_run_trains_on_an_environment(setup, tmp_path, monkeypatch):
    """`shardrl train rollout.env=my_env.py:load_environment model.path=...`: the environment's dataset is the
    prompts, its evaluation set the validation, its rubric the reward."""
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    _, _, folder = setup
    monkeypatch.chdir(tmp_path)
    overrides = resolve_overrides(None, [
        f"model.path={folder}", f"rollout.env={folder / 'my_env.py'}:load_environment", "rollout.n=2",
        "rollout.max_new_tokens=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
        "trainer.logger=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=2", "trainer.device=cpu"])
    run_dir = run(None, overrides)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    # (an episode whose reply is empty is verifiers' EmptyModelResponseError: failed, counted)
    assert all(r["agent/calls_mean"] == 1.0 and r["agent/errors_mean"] < 1.0 for r in records)
    assert "val/reward_mean" in records[-1] and "actor/pg_loss" in records[-1]


def test_an_environment_with_prompt_files_or_an_agent_is_refused(tmp_path):
    from shardrl.config.load import ConfigError
    from shardrl.config.schema import load_config

    with pytest.raises(ConfigError, match="rollout.env both give the training prompts"):
        load_config(None, ["rollout.env=verifiers:gsm8k", "data.train_files=[a.jsonl]"])
    with pytest.raises(ConfigError, match="rollout.agent.entrypoint both run the episodes"):
        load_config(None, ["rollout.env=verifiers:gsm8k", "rollout.agent.entrypoint=a.py:run"])
    with pytest.raises(ConfigError, match="must be 'verifiers:ENV_ID'"):
        load_config(None, ["rollout.env=gsm8k"])
    env = tmp_path / "env.py"
    env.write_text(textwrap.dedent('''
        def load_environment():
            return "not an environment"
    '''))
    from shardrl.data.verifiers import load_verifiers_env

    with pytest.raises(ValueError, match="gave a str, not a verifiers Environment"):
        load_verifiers_env(f"{env}:load_environment")
