"""The trainer's start-up checks and its stop on a reward that never works: data, reward file and
vocabulary are checked before any model loads; a reward function that fails on every sample of a step
stops the run with one `error:` line and exit status 2, decided on the count over all dp ranks."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from shardrl.cli import main as cli_main
from shardrl.rewards.manager import RewardManager
from shardrl.testing import small_demo_run, run_distributed
from shardrl.trainer.demo import prepare_demo_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=2)


def small(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", "trainer.total_steps=1", *extra)


def test_cheap_checks_come_before_any_model_loads(assets, tmp_path, monkeypatch):
    import transformers

    import shardrl.trainer.roles as roles
    from shardrl.launch.rank import run

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(roles, "build_engine", no_model)
    base = small(assets, tmp_path / "run")
    empty_prompt = tmp_path / "rows.jsonl"
    empty_prompt.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "", "ground_truth": "0"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl: row 2: the 'prompt' string is empty"):
        run(None, base + [f"data.train_files=[{empty_prompt}]"])
    bad_val = tmp_path / "val.jsonl"
    bad_val.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"val.jsonl: line 2 is not UTF-8 text"):
        run(None, base + [f"data.val_files=[{bad_val}]"])
    broken = tmp_path / "broken_reward.py"
    broken.write_text("import not_a_module_xyz\n")
    with pytest.raises(ValueError, match="broken_reward.py' failed to import: ModuleNotFoundError"):
        run(None, base + [f"reward.function_path={broken}"])
    two_args = tmp_path / "two_args.py"
    two_args.write_text("def compute_score(solution_str, truth):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"compute_score\(solution_str, truth\) \(compute_score in .*\) cannot be "
                                         r"called with a reward function's arguments"):
        run(None, base + [f"reward.function_path={two_args}"])
    # a model whose vocabulary is smaller than the tokenizer's (53 characters and specials)
    small_vocab = tmp_path / "small_vocab"
    config = transformers.AutoConfig.from_pretrained(assets / "model")
    config.vocab_size = 40
    config.save_pretrained(small_vocab)
    with pytest.raises(ValueError, match=r"model.path='.*small_vocab' has a vocabulary of 40 tokens, smaller than the "
                                         r"tokenizer's 53 \(from '.*model'\): ids >= 40 have no embedding\. Use the "
                                         r"tokenizer made for this model \(model.tokenizer_path\), or grow the "
                                         r"model's embeddings to match: model.resize_token_embeddings\(53\)"):
        run(None, base + [f"model.path={small_vocab}", f"model.tokenizer_path={assets / 'model'}"])
    with pytest.raises(AssertionError, match="a model was loaded"):  # good inputs reach the model
        run(None, base)


def test_a_critic_or_reward_model_path_is_named_by_its_own_key(assets, tmp_path, monkeypatch):
    """critic.model_path and reward.model_path are checked before any model loads, and their errors name their own
    key (was: "model.path=... is not a folder", the policy's key, for the critic's or the reward model's folder)."""
    import transformers

    import shardrl.trainer.roles as roles
    from shardrl.launch.rank import run

    monkeypatch.setattr(roles, "build_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    base = small(assets, tmp_path / "run")
    with pytest.raises(ValueError, match=r"^critic\.model_path='/nonexistent' is not a folder"):
        run(None, base + ["algorithm.adv_estimator=gae", "critic.model_path=/nonexistent"])
    with pytest.raises(ValueError, match=r"^reward\.model_path='/nonexistent' is not a folder"):
        run(None, base + ["reward.model_path=/nonexistent"])
    small_vocab = tmp_path / "small_vocab"
    config = transformers.AutoConfig.from_pretrained(assets / "model")
    config.vocab_size = 40
    config.save_pretrained(small_vocab)
    with pytest.raises(ValueError, match=r"^critic\.model_path='.*small_vocab' has a vocabulary of 40 tokens, smaller "
                                         r"than the tokenizer's 53 .*model.resize_token_embeddings\(53\)"):
        run(None, base + ["algorithm.adv_estimator=gae", f"critic.model_path={small_vocab}"])


def test_a_reward_that_fails_on_every_sample_stops_the_run(assets, tmp_path, capsys):
    reward = tmp_path / "returns_none.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return None  # forgot the return value\n")
    assert cli_main(["train", *small(assets, tmp_path / "run", f"reward.function_path={reward}")]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err.split("error: ")[1]
    assert ("error: the reward function failed on all 16 samples of this step, so there is nothing to learn from; "
            "the first failure (data_source='arith') TypeError: reward function returned NoneType None, not a "
            "number") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def _score_on_two_ranks(cases):
    """The trainer's scorer on each rank's share, for each case of (failing responses on rank 0, on rank 1)."""
    import torch.distributed as dist

    from shardrl.trainer.scoring import Scorer

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str == "ok" else None

    rank = dist.get_rank()
    out = []
    for responses in cases:
        scorer = Scorer(RewardManager(fn), dp_group=dist.group.WORLD)
        texts = responses[rank]
        batch = {"data_source": ["x"] * len(texts), "response_text": texts, "extra": [{}] * len(texts)}
        try:
            scores, metrics = scorer.score(batch)
            out.append(("ok", scores.tolist(), metrics["reward/num_errors"]))
        except ValueError as e:
            out.append(("error", str(e)))
    return out


@pytest.mark.multiproc
def test_all_samples_failing_is_decided_over_all_ranks():
    cases = [
        (["bad", "bad"], ["ok", "bad"]),  # rank 0 fails on all of its samples, rank 1 does not: train on
        (["bad", "bad"], ["bad", "bad"]),  # every sample of every rank fails: every rank stops
    ]
    results = run_distributed(_score_on_two_ranks, 2, cases)  # rank 0's view; rank 1 must agree to finish
    assert results[0] == ("ok", [0.0, 0.0], 2)
    assert results[1][0] == "error" and "failed on all 4 samples of this step" in results[1][1]
    assert "TypeError: reward function returned NoneType None" in results[1][1]


def test_rows_without_a_ground_truth_for_a_built_in_scorer_are_an_error_at_load(assets, tmp_path):
    from shardrl.launch.rank import run

    rows = tmp_path / "answers.jsonl"
    rows.write_text('{"prompt": "1+2=", "data_source": "arith", "answer": "3"}\n'
                    '{"prompt": "2+2=", "data_source": "arith", "answer": "4"}\n')
    base = small(assets, tmp_path / "run")
    with pytest.raises(ValueError, match=r"answers.jsonl: 2 of 2 rows have no ground truth, and their data_source "
                                         r"'arith' is scored by a built-in scorer .* the fields \['answer', "
                                         r"'data_source', 'prompt'\]"):
        run(None, base + [f"data.train_files=[{rows}]"])
    with pytest.raises(ValueError, match=r"answers.jsonl: 2 of 2 rows have no ground truth"):  # validation rows too
        run(None, base + [f"data.val_files=[{rows}]"])
    # one row of a data_source no built-in scores, among good ones: refused at load (it failed the step that drew it)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(f'{{"prompt": "{a}+1=", "data_source": "arith", "ground_truth": "{a + 1}"}}\n'
                             for a in range(6)) + '{"prompt": "x", "data_source": "gsm8k_strict", "ground_truth": "1"}\n')
    with pytest.raises(ValueError, match=r"mixed.jsonl: no built-in reward function scores the data_source of 1 of 7 "
                                         r"rows: 'gsm8k_strict' \(1 rows\); known: .*reward.function_path"):
        run(None, base + [f"data.train_files=[{mixed}]"])
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_sequences_past_the_models_context_are_refused_at_load(assets, tmp_path, capsys):
    """A prompt plus rollout.max_new_tokens (RL), or a conversation (SFT), longer than the model's context: refused
    at load, naming the config key that says the context (was: an index error mid-step for absolute positions,
    positions the model never learned for rotary ones)."""
    import json

    import transformers

    from shardrl.testing import save_char_model
    from shardrl.launch.rank import run

    base = small(assets, tmp_path / "run")
    with pytest.raises(ValueError, match=r"the longest prompt \(\d+ tokens\) plus rollout.max_new_tokens=70 is \d+ "
                                         r"tokens, past the context of model.path=.*\(64 positions: "
                                         r"max_position_embeddings=64 in its config.json\): lower "
                                         r"rollout.max_new_tokens"):
        run(None, base + ["rollout.max_new_tokens=70"])
    assert not (tmp_path / "run").exists()
    model = tmp_path / "short"
    save_char_model(model, max_position_embeddings=8)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a)}) + "\n" for a in range(4)))
    capsys.readouterr()
    assert cli_main(["sft", f"model.path={model}", f"data.train_files=[{rows}]", "data.batch_size=2",
                     f"trainer.output_dir={tmp_path / 'sft'}", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "the longest sequence of the data is" in err and "max_position_embeddings=8" in err, err
    assert "lower data.max_length=1024" in err and not (tmp_path / "sft").exists()
    # a rotary model scaled past its trained length (YaRN x4 over 8 positions): 32 fit
    from shardrl.models.config import check_context, context_length

    config = transformers.Qwen2Config(max_position_embeddings=8, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    assert context_length(config) == (32, "max_position_embeddings=8, rope scaling x4 of 8")
    check_context(config, 32, "x", "y", "z")
    with pytest.raises(ValueError, match=r"33 tokens, past the context of y \(32 positions"):
        check_context(config, 33, "x", "y", "z")
