"""reasoning-gym tasks as a prompt source and reward (`data.reasoning_gym`): the rows are the generator's questions,
the reward its task's own `score_answer` on the answer read by `answer_format`; and the built-in example
(`shardrl train --example reasoning_gym`) learns on the CPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

from shardrl.config.load import ConfigError
from shardrl.config.schema import load_config
from shardrl.rewards.manager import RewardManager, check_ground_truths

LEGS = "{leg_counting: {min_animals: 1, max_animals: 1, max_instances: 1}}"


def _config(*overrides):
    return load_config(None, ["data.reasoning_gym.tasks=[leg_counting]", f"data.reasoning_gym.config={LEGS}",
                              "data.reasoning_gym.size=12", "data.max_prompt_length=1024", *overrides])


def _datasets(*overrides):
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.datasets import load_datasets
    from shardrl.trainer.reasoning_gym_example import ALPHABET

    return load_datasets(_config(*overrides), build_char_tokenizer(ALPHABET))


def test_rows_are_the_generators_questions_and_val_draws_other_ones():
    import reasoning_gym

    train, val = _datasets("data.reasoning_gym.val_size=5")
    expected = list(reasoning_gym.create_dataset("leg_counting", size=12, seed=0, min_animals=1, max_animals=1,
                                                 max_instances=1))
    assert len(train) == 12 and len(val) == 5
    first = train[0]
    assert first["data_source"] == "reasoning_gym/leg_counting"
    assert first["prompt"][0]["role"] == "system" and "<answer>" in first["prompt"][0]["content"]  # its own prompt
    assert first["prompt"][1] == {"role": "user", "content": expected[0]["question"]}
    assert [item["extra"]["ground_truth"] for item in train.items] == [e["answer"] for e in expected]
    # validation questions are those of indices 12.. (seed + size): not the training ones
    assert val[0]["extra"]["extra_info"]["reasoning_gym_entry"]["metadata"]["source_index"] == 0
    assert val[0]["prompt"][1]["content"] == reasoning_gym.create_dataset(
        "leg_counting", size=1, seed=12, min_animals=1, max_animals=1, max_instances=1)[0]["question"]
    check_ground_truths(train)  # (a built-in scorer scores them)


def test_the_reward_is_the_tasks_own_score_on_the_answer_tag_or_the_whole_reply():
    train, _ = _datasets()
    item = train[0]
    truth = item["extra"]["ground_truth"]
    replies = [f"I think <answer>{truth}</answer>", f"<answer>1</answer> <answer> {truth} </answer><|im_end|>",
               truth, f"<answer>1{truth}</answer>", "<answer></answer>"]
    scores, metrics = RewardManager().score([{"data_source": item["data_source"], "response_text": r,
                                              "extra": item["extra"]} for r in replies])
    # the last tag counts; no tag: no answer; "1<truth>" contains the truth: leg_counting's partial credit
    assert scores.tolist() == [1.0, 1.0, 0.0, pytest.approx(len(truth) / (len(truth) + 1)), 0.0]
    assert metrics["reward/num_errors"] == 0
    train, _ = _datasets("data.reasoning_gym.answer_format=whole", "data.reasoning_gym.system_prompt=null")
    item = train[0]
    assert [m["role"] for m in item["prompt"]] == ["user"]
    scores, _ = RewardManager().score([{"data_source": item["data_source"], "response_text": r,
                                        "extra": item["extra"]} for r in (f" {truth}\n", f"<answer>{truth}</answer>")])
    assert scores.tolist() == [1.0, pytest.approx(len(truth) / (len(truth) + 17))]


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="data.reasoning_gym.tasks both give the training prompts"):
        _config("data.train_files=[a.jsonl]")
    with pytest.raises(ConfigError, match=r"tasks=.*: names \['leg_counting'\] more than once"):
        _config("data.reasoning_gym.tasks=[leg_counting, basic_arithmetic, leg_counting]")
    with pytest.raises(ConfigError, match=r"names \['count_bits'\]"):
        _config("data.reasoning_gym.config={count_bits: {}}")
    with pytest.raises(ValueError, match="'leg_countin' is no reasoning-gym dataset; did you mean 'leg_counting'"):
        _datasets("data.reasoning_gym.tasks=[leg_countin]", "data.reasoning_gym.config={}")
    with pytest.raises(ValueError, match="reasoning-gym refuses it"):
        _datasets("data.reasoning_gym.config={leg_counting: {min_animals: 3, max_animals: 1}}")
    assert "data.reasoning_gym.val_size=4 is never read" in " ".join(
        _config("data.reasoning_gym.val_size=4", "trainer.val_freq=0").ignored_settings())


def test_a_misspelled_system_prompt_name_is_refused_not_sent_as_the_message():
    """`system_prompt=deepseekzero` (reasoning-gym's prompt is DeepSeekZero) was taken as the text of the system
    message: every question went out after a system message reading "deepseekzero", asking for no <answer> tags, and
    answer_tag scored 0 all run long. A one-word value close to a prompt's name is refused naming it; other text is
    the message, as before."""
    for typo, name in (("deepseekzero", "DeepSeekZero"), ("Default", "default"), ("chain-of-draft", "chain_of_draft")):
        with pytest.raises(ValueError, match=f"system_prompt={typo!r}.*did you mean {name!r}"):
            _datasets(f"data.reasoning_gym.system_prompt={typo}")
    train, _ = _datasets("data.reasoning_gym.system_prompt='Answer in <answer> tags.'")
    assert train[0]["prompt"][0] == {"role": "system", "content": "Answer in <answer> tags."}


def test_the_reasoning_gym_example_learns(tmp_path, monkeypatch):
    """`shardrl train --example reasoning_gym`, shortened to 30 steps: the tiny model starts near a guess's reward
    (its warm-up saw each question's answer a few times) and GRPO on reasoning-gym's own score raises the mean
    reward of the last 10 steps over that of the first 10 by a margin (a reward stuck at 0, or one that ignores the
    answer, cannot)."""
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    monkeypatch.chdir(tmp_path)
    run_dir = run(None, resolve_overrides(None, ["trainer.logger=[jsonl]", "trainer.total_steps=30",
                                                 "trainer.val_freq=0", "trainer.val_before_train=false",
                                                 "trainer.export_hf=false"], example="reasoning_gym"))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.3, rewards
    assert last > first + 0.1, rewards


def test_an_answer_the_tasks_scorer_cannot_read_scores_zero():
    """Some of reasoning-gym's scorers raise on an answer they cannot parse (prime_factorization's `int(...)` on
    "two times three"): each such reply was a reward function error, and a step whose every reply was unreadable (a
    policy early in training) stopped the run with "Fix the reward function", a function the user did not write.
    A reply in a format the scorer rejects is a wrong answer: 0. An entry the scorer cannot score even with its own
    answer is still an error."""
    train, _ = _datasets("data.reasoning_gym.tasks=[prime_factorization]", "data.reasoning_gym.config={}")
    item = train[0]
    truth = item["extra"]["ground_truth"]
    replies = ["<answer>two times three</answer>", "<answer>x</answer>", f"<answer>{truth}</answer>"]
    scores, metrics = RewardManager().score([{"data_source": item["data_source"], "response_text": r,
                                              "extra": item["extra"]} for r in replies])
    assert scores.tolist() == [0.0, 0.0, 1.0]
    assert metrics["reward/num_errors"] == 0
    broken = {**item["extra"], "extra_info": {**item["extra"]["extra_info"], "reasoning_gym_entry": {
        **item["extra"]["extra_info"]["reasoning_gym_entry"], "answer": "not a number"}}}
    with pytest.raises(ValueError, match="failed on all 3 samples.*'not a number'"):
        RewardManager().score([{"data_source": item["data_source"], "response_text": r, "extra": broken}
                               for r in replies])
