"""What a user gets wrong with environments (`rollout.env`: verifiers; `data.reasoning_gym`) and agent episodes, and
what they then get: a refusal that names the setting, an episode budget kept, the same tasks in every process.
(Found by a hostile reading; each test failed on the code before.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import transformers

pytest.importorskip("verifiers")
pytest.importorskip("reasoning_gym")

from shardrl.testing import save_char_model
from test_verifiers_env import run_environment

ENV = '''
import verifiers as vf
from datasets import Dataset

ROWS = [{"question": q, "answer": a} for q, a in (("1+2=", "3"), ("what is 7*6? ", "x"), ("ab", "ba"))]


def one(completion, **kwargs) -> float:
    return 1.0


def relative(completions, **kwargs) -> list[float]:
    # a group reward function (verifiers' own kind: scores the episodes of one prompt together)
    return [float(i) for i in range(len(completions))]


def nan_reward(completion, **kwargs) -> float:
    return float("nan")


def last_turn_says(completion, **kwargs) -> float:
    # the reward is read from the last model turn only
    texts = [m["content"] for m in completion if m["role"] == "assistant"]
    return float(len(texts))


class ManyTurns(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "tool: 4"}]


def load_environment(kind="plain", max_turns=6):
    dataset = Dataset.from_list(ROWS)
    if kind == "group":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[relative]))
    if kind == "nan":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[nan_reward]))
    if kind == "no_rubric":  # (verifiers' default: a Rubric without reward functions)
        return vf.SingleTurnEnv(dataset=dataset)
    if kind == "metrics_only":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one], weights=[0.0]))
    if kind == "group_without_funcs":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.RubricGroup([vf.Rubric(funcs=[one]), vf.Rubric()]))
    if kind == "no_eval":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one]))
    if kind == "unscored":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one]), score_rollouts=False)
    if kind == "no_question":  # (rows of another shape: verifiers makes each prompt from a 'question')
        rows = Dataset.from_list([{"q": "1+2=", "answer": "3"}])
        return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[one]))
    if kind == "turns":
        return ManyTurns(dataset=dataset, rubric=vf.Rubric(funcs=[last_turn_says]), max_turns=max_turns)
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=Dataset.from_list(ROWS[:2]), rubric=vf.Rubric(funcs=[one]))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("review_env_model")
    tok = save_char_model(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    (folder / "review_env.py").write_text(ENV)
    return tok, model, folder


def run_env(setup, env_args: dict, n: int = 2, max_new_tokens: int = 6, **agent_kwargs):
    tok, model, folder = setup
    spec = f"{folder / 'review_env.py'}:load_environment"
    return run_environment(tok, model, spec, env_args, n, max_new_tokens, **agent_kwargs)[2]


# ---- verifiers environments -------------------------------------------------------------------------
def test_an_environment_with_group_reward_functions_is_refused_when_loaded(setup):
    """verifiers' group reward functions (`def f(completions, ...) -> list[float]`) score a prompt's episodes
    together; shardrl runs each episode on its own, so such a rubric is refused when the environment loads (every
    episode failed with verifiers' own assertion, and the run stopped at its first step)."""
    from shardrl.data.verifiers import load_verifiers_env

    _, _, folder = setup
    with pytest.raises(ValueError, match="group reward functions .* use reward functions of one episode"):
        load_verifiers_env(f"{folder / 'review_env.py'}:load_environment", {"kind": "group"})


@pytest.mark.parametrize("kind, said", [
    ("no_rubric", "rubric has no reward functions"), ("metrics_only", "every reward function's weight is 0"),
    ("group_without_funcs", "rubric has no reward functions"), ("unscored", "score_rollouts=False")])
def test_an_environment_whose_rubric_cannot_reward_is_refused_when_loaded(setup, kind, said):
    """A rubric with no reward functions (`vf.SingleTurnEnv(dataset=...)`: verifiers' default `vf.Rubric()`) failed
    every episode with verifiers' own `AssertionError: Rubric.score_rollout requires at least one individual-level
    reward function`, and the run stopped at its first step; one whose functions all weigh 0 (metrics only), or an
    environment made with `score_rollouts=False`, scored every episode 0 without a word: GRPO learned nothing."""
    from shardrl.data.verifiers import load_verifiers_env

    _, _, folder = setup
    with pytest.raises(ValueError, match=said):
        load_verifiers_env(f"{folder / 'review_env.py'}:load_environment", {"kind": kind})


def test_a_rubric_that_returns_nan_is_said_to_be_the_rubrics(setup):
    """A rubric returning NaN is reported as "the agent returned nan" at shardrl's own
    shardrl/rollout/episodes/verifiers_env.py: there is no agent, and the place is not the user's."""
    out = run_env(setup, {"kind": "nan"}, n=1)
    error = out.errors[0]
    assert error is not None
    assert "rubric" in error and "agent returned" not in error, error
    assert "shardrl/rollout/episodes/verifiers_env.py" not in error, error


def test_a_step_whose_every_environment_episode_failed_says_to_fix_the_environment(setup):
    """When every episode of a step failed (here: a rubric that returns NaN), the run stopped with "Fix the agent
    (rollout.agent.entrypoint; ...)": a run of `rollout.env` has no agent entrypoint; the environment is what to fix."""
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.scoring import Scorer

    batch = run_env(setup, {"kind": "nan"}, n=1).to_batch()
    with pytest.raises(ValueError, match=r"every agent episode of this step failed .* Fix the environment "
                                         r"\(rollout.env") as caught:
        Scorer(RewardManager(), multi_turn=True).score(batch)
    assert "rollout.agent.entrypoint" not in str(caught.value)


def test_an_episode_keeps_to_its_response_budget(setup):
    """The endpoint gives an episode's calls at most what is left of rollout.agent.max_response_tokens (counted
    from its first prompt, as the trajectory is) and refuses a call past it: an environment that keeps calling ends
    in an error (scored failure_reward, counted) instead of a reward for turns its cut trajectory does not hold;
    within the budget, every model turn scored is in the trajectory."""
    # (the tiny model's reply is at times empty, which verifiers ends as an error of its own: those are left out)
    for max_turns, over in ((6, True), (2, False)):
        out = run_env(setup, {"kind": "turns", "max_turns": max_turns}, n=2, max_new_tokens=4,
                      max_response_tokens=12 if over else 64)
        batch = out.to_batch()
        if over:  # (no episode is rewarded: each ran out of its budget, or replied nothing)
            assert (batch["agent_errors"] == 1).all()
            assert any("max_response_tokens" in e for e in out.errors), out.errors
            continue
        ok = [r for r, e in enumerate(out.errors) if e is None]
        assert ok and all("no content" in e for e in out.errors if e is not None), out.errors
        for r in ok:
            mask = out.response_mask[r][out.response_attention_mask[r].bool()].tolist()
            model_turns = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
            # (a reply the template renders back otherwise restarts the trajectory there: a prefix break)
            assert batch["agent_calls"][r] == out.interaction_scores[r] == 2
            assert model_turns == 2 - batch["agent_prefix_breaks"][r]


def test_an_environment_with_val_files_is_refused(setup, tmp_path):
    """`rollout.env` with `data.val_files`: the files' rows have no `verifiers_input`, on which every validation
    episode raised; refused up front."""
    from shardrl.config.load import ConfigError
    from shardrl.config.schema import load_config

    _, _, folder = setup
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": [{"role": "user", "content": "hi"}], "data_source": "openai/gsm8k", '
                   '"reward_model": {"ground_truth": "1"}}\n')
    overrides = [f"model.path={folder}", f"rollout.env={folder / 'review_env.py'}:load_environment",
                 f"data.val_files=[{val}]"]
    with pytest.raises(ConfigError, match="data.val_files=.*and rollout.env: .* drop data.val_files"):
        load_config(None, overrides)


def test_an_environment_run_is_not_warned_about_a_setting_it_never_gave():
    """Every `rollout.env` run with validation off (trainer.val_freq=0, the default) was warned
    "data.reasoning_gym.val_size=0 is never read", a setting the user never gave: `ignored_settings` counted the
    environment's evaluation set (if it has one) as a validation set the user set. With validation on, it still
    keeps trainer.val_freq from being called unused."""
    from shardrl.config.schema import load_config

    assert load_config(None, ["rollout.env=verifiers:gsm8k"]).ignored_settings() == []
    assert load_config(None, ["rollout.env=verifiers:gsm8k", "trainer.val_freq=2"]).ignored_settings() == []


def test_validating_an_environment_without_an_evaluation_set_is_warned(setup, tmp_path, monkeypatch, caplog):
    """`trainer.val_freq=1` with an environment that has no evaluation dataset: the README says "its evaluation set
    validates", but there is none, and the run validated nothing without a word (no val/ metrics, no warning)."""
    import json

    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    folder = setup[2]
    monkeypatch.chdir(tmp_path)
    overrides = resolve_overrides(None, [
        f"model.path={folder}", f"rollout.env={folder / 'review_env.py'}:load_environment",
        "rollout.env_args={kind: no_eval}", "rollout.n=2", "rollout.max_new_tokens=4", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]", "trainer.total_steps=1", "trainer.val_freq=1",
        "trainer.val_before_train=true", "trainer.device=cpu"])
    with caplog.at_level("WARNING", logger="shardrl.trainer.rl"):
        run_dir = run(None, overrides)
    assert not any(k.startswith("val/") for line in open(run_dir / "metrics.jsonl") for k in json.loads(line))
    said = [r.getMessage() for r in caplog.records if "evaluation dataset" in r.getMessage()]
    assert said and "trainer.val_freq=1 and trainer.val_before_train=true" in said[0], [r.getMessage() for r in
                                                                                      caplog.records]


def test_settings_an_environment_run_never_reads_are_warned():
    """`reward.function_path` beside `rollout.env` is never called (the rubric gives every episode its reward, a
    number or a failure), and `rollout.env_args` without `rollout.env` loads nothing: both went without a word."""
    from shardrl.config.schema import load_config

    lines = load_config(None, ["rollout.env=verifiers:gsm8k", "reward.function_path=r.py"]).ignored_settings()
    assert len(lines) == 1 and lines[0].startswith("reward.function_path is set but rollout.env"), lines
    lines = load_config(None, ["rollout.env_args={num_train_examples: 3}"]).ignored_settings()
    assert len(lines) == 1 and lines[0].startswith("rollout.env_args is set but rollout.env is null"), lines


def test_wrong_env_args_are_a_config_error_naming_the_key(setup):
    """`rollout.env_args` with a key the loader does not take (a typo) escapes as a bare TypeError from
    `load_verifiers_env`'s `loader(**env_args)` (verifiers' own load_environment turns it into a RuntimeError for
    `verifiers:ENV_ID`): under `shardrl train` a rank's traceback, as `cli.py` prints one `error:` line only for a
    ValueError; the message names neither rollout.env_args nor the arguments the loader takes."""
    from shardrl.data.verifiers import load_verifiers_env

    _, _, folder = setup
    spec = f"{folder / 'review_env.py'}:load_environment"
    with pytest.raises(ValueError, match="rollout.env_args"):
        load_verifiers_env(spec, {"kindd": "plain"})


def test_an_environment_that_cannot_be_built_says_what_it_lacks_naming_rollout_env(setup):
    """A dataset without a 'prompt' or 'question' column failed with verifiers' bare KeyError('question') from inside
    its constructor; an environment id not installed said nothing of rollout.env."""
    from shardrl.data.verifiers import load_verifiers_env

    _, _, folder = setup
    with pytest.raises(ValueError, match="missing key 'question'; a verifiers dataset needs a 'prompt' column"):
        load_verifiers_env(f"{folder / 'review_env.py'}:load_environment", {"kind": "no_question"})
    with pytest.raises(ValueError, match=r"rollout.env='verifiers:no_such_env_x': Could not import 'no_such_env_x'"):
        load_verifiers_env("verifiers:no_such_env_x")


# ---- reasoning-gym ----------------------------------------------------------------------------------
def test_a_task_setting_that_is_not_a_mapping_is_a_config_error():
    """`data.reasoning_gym.config={leg_counting: 3}` (a user who meant {size: 3}) passes `ReasoningGymConfig.validate`
    (it checks the keys only) and `reasoning_gym_rows` raises a bare `TypeError: 'int' object is not iterable` from
    `dict(cfg.config.get(task) or {})`, outside its try."""
    from shardrl.config.load import ConfigError
    from shardrl.config.schema import load_config
    from shardrl.data.reasoning_gym import reasoning_gym_rows

    overrides = ["data.reasoning_gym.tasks=[leg_counting]", "data.reasoning_gym.config={leg_counting: 3}",
                 "data.reasoning_gym.size=2"]
    try:
        cfg = load_config(None, overrides)
    except ConfigError:
        return
    with pytest.raises(ValueError, match="data.reasoning_gym.config"):
        reasoning_gym_rows(cfg.data.reasoning_gym)


ROWS_SCRIPT = """
import json
from shardrl.config.schema import load_config
from shardrl.data.reasoning_gym import reasoning_gym_rows
cfg = load_config(None, ["data.reasoning_gym.tasks=[isomorphic_strings, ransom_note]", "data.reasoning_gym.size=5"])
rows = reasoning_gym_rows(cfg.data.reasoning_gym)
print(json.dumps([[r["prompt"][-1]["content"], str(r["ground_truth"])] for r in rows]))
"""


def test_generated_tasks_are_the_same_in_every_process():
    """`data.reasoning_gym` generates the rows in each process (each rank, the async rollout side, a resumed run)
    from `seed`, but several of reasoning-gym's generators depend on Python's string hashing (isomorphic_strings,
    ransom_note, polynomial_multiplication: 20 of 20 questions; knight_swap, word_ladder: some): the same config
    gives other questions and answers under another PYTHONHASHSEED, i.e. in every new process, so a resumed run or
    another rank does not see the run's prompt set. (Nothing in shardrl fixes PYTHONHASHSEED.)"""

    def rows(hash_seed):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env["PYTHONHASHSEED"] = hash_seed
        done = subprocess.run([sys.executable, "-c", ROWS_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert rows("1") == rows("2")


# ---- agents -----------------------------------------------------------------------------------------
def test_an_agent_that_forgets_to_return_is_told_so(setup, tmp_path, monkeypatch):
    """An agent that returns nothing (a forgotten `return`) on rows whose data_source no built-in scorer knows
    (an agent's own task): the start skips `check_ground_truths` for agent runs (rl.py: "an agent may score its
    episodes itself"), every episode's None hands the step to the reward function, and the run stops mid-step with
    the reward manager's "no built-in reward function for data_source 'my_task' ... Give a reward function file",
    which never says that the agent returned None (the real mistake)."""
    import json

    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent('''
        async def run(sample, client):
            reply = await client.completions.create(model="policy", prompt=sample["prompt"], max_tokens=2)
            ok = reply.choices[0].text == "1"  # (forgot: return float(ok))
    '''))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "data_source": "my_task"}) + "\n" for a in range(4)))
    monkeypatch.chdir(tmp_path)
    overrides = resolve_overrides(None, [
        f"model.path={setup[2]}", f"rollout.agent.entrypoint={agent}:run", f"data.train_files=[{data}]",
        "rollout.n=2", "rollout.max_new_tokens=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
        "trainer.logger=[jsonl]", "trainer.total_steps=1", "trainer.val_freq=0", "trainer.device=cpu"])
    with pytest.raises(ValueError) as caught:
        run(None, overrides)
    assert "None" in str(caught.value) or "return" in str(caught.value), str(caught.value)
