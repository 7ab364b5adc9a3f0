"""What a resume does with a changed setting, for every trainer: a raised trainer.total_steps gives the LR schedule
of a fresh run of the new length from the restored step (one line says so); a setting that changes what the earlier
steps meant is refused naming the key and both values; a checkpoint another trainer wrote is refused naming it. A
refused resume leaves the folder's config.yaml as it was."""

from __future__ import annotations

import json
import logging
import math

import pytest
import yaml

from shardrl.cli import main
from shardrl.testing import save_char_model, small_demo_run
from shardrl.trainer.demo import prepare_demo_assets

pytestmark = pytest.mark.multiproc

LR, WARMUP, MIN_RATIO = 1e-3, 1, 0.1
SCHEDULE = ["optim.lr_schedule=cosine", f"optim.warmup_steps={WARMUP}", f"optim.min_lr_ratio={MIN_RATIO}"]


def fresh_lr(step: int, total: int) -> float:
    """The LR logged at `step` (1-based) by a fresh run of `total` steps: linear warm-up, then cosine decay to
    min_lr_ratio, written out from the formula (not `engine.optim`'s code)."""
    done = step - 1  # optimizer steps before this one
    if done < WARMUP:
        return LR * (done + 1) / WARMUP
    progress = min(1.0, (done - WARMUP) / (total - WARMUP))
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    save_char_model(folder, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return folder


def offline_args(tmp_path, model_dir, run_dir) -> list[str]:
    pairs = tmp_path / "rows.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a), "chosen": str(2 * a),
                                         "rejected": f"{2 * a}{a}"}) + "\n" for a in range(5)))
    return [f"model.path={model_dir}", f"data.train_files=[{pairs}]", "data.batch_size=2",
            "engine.param_dtype=float32", f"optim.lr={LR}", "trainer.logger=[jsonl]", f"trainer.output_dir={run_dir}",
            "trainer.device=cpu", "trainer.save_freq=1"]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_sft_resumed_with_more_steps_follows_the_longer_schedule(tmp_path, model_dir, caplog):
    """Was: 1e-3, 1e-3, then 1e-4 (the 2-step schedule's end, restored with the optimizer), then the 5-step
    schedule's values."""
    run_dir = tmp_path / "run"
    args = offline_args(tmp_path, model_dir, run_dir) + SCHEDULE
    assert main(["sft", *args, "trainer.total_steps=2"]) == 0
    with caplog.at_level(logging.INFO, logger="shardrl"):
        assert main(["sft", *args, "trainer.total_steps=5", "trainer.resume=auto"]) == 0
    got = {r["step"]: r["sft/lr"] for r in records(run_dir)}
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        assert got[step] == pytest.approx(fresh_lr(step, 5), rel=1e-6), (step, got)
    said = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert len(said) == 1 and "2 to 5" in said[0] and "step 2" in said[0], said
    # this run's optim.lr too (was: the checkpoint's base LR, the new one ignored)
    assert main(["sft", *args, "trainer.total_steps=6", "trainer.resume=auto", f"optim.lr={LR / 2}"]) == 0
    assert records(run_dir)[-1]["sft/lr"] == pytest.approx(fresh_lr(6, 6) / 2, rel=1e-6)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=0)


def rl_args(assets, run_dir, *extra) -> list[str]:
    return small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", "actor.ppo_mini_batch_size=4",
                          "rollout.max_new_tokens=2", "trainer.save_freq=1", f"actor.optim.lr={LR}",
                          *[f"actor.{s}" for s in SCHEDULE], *extra)


def test_rl_resumed_with_more_steps_follows_the_longer_schedule(tmp_path, assets, caplog):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(assets, run_dir, "trainer.total_steps=2")]) == 0
    with caplog.at_level(logging.INFO, logger="shardrl"):
        assert main(["train", *rl_args(assets, run_dir, "trainer.total_steps=4", "trainer.resume=auto")]) == 0
    got = {r["step"]: r["actor/lr"] for r in records(run_dir)}
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):  # one optimizer step a training step: the actor's schedule is 4 long
        assert got[step] == pytest.approx(fresh_lr(step, 4), rel=1e-6), (step, got)
    said = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert len(said) == 1 and "2 to 4" in said[0], said


def saved_config(run_dir) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_a_changed_dpo_loss_is_refused_on_resume(tmp_path, model_dir, capsys):
    """Was: the ipo run resumed the sigmoid run's checkpoint and rewrote config.yaml to ipo."""
    run_dir = tmp_path / "run"
    args = offline_args(tmp_path, model_dir, run_dir)
    assert main(["dpo", *args, "trainer.total_steps=1"]) == 0
    capsys.readouterr()
    assert main(["dpo", *args, "trainer.total_steps=2", "trainer.resume=auto", "dpo.loss_type=ipo",
                 "dpo.beta=0.2"]) == 2
    err = capsys.readouterr().err
    assert "dpo.loss_type='sigmoid' in the checkpoint, 'ipo' here" in err, err
    assert "dpo.beta=0.1 in the checkpoint, 0.2 here" in err, err
    assert "set them back" in err and "trainer.output_dir" in err, err
    assert saved_config(run_dir)["dpo"]["loss_type"] == "sigmoid"  # the folder's config still says what ran
    assert [r["step"] for r in records(run_dir)] == [1]


def test_a_dpo_setting_its_loss_never_reads_may_change_on_resume(tmp_path, model_dir, caplog):
    """Was: a sigmoid run resumed with another dpo.simpo_gamma (SimPO's margin, read by simpo only) was refused."""
    run_dir = tmp_path / "run"
    args = offline_args(tmp_path, model_dir, run_dir)
    assert main(["dpo", *args, "trainer.total_steps=1"]) == 0
    with caplog.at_level(logging.WARNING, logger="shardrl"):
        assert main(["dpo", *args, "trainer.total_steps=2", "trainer.resume=auto", "dpo.simpo_gamma=2.0"]) == 0
    assert any("dpo.simpo_gamma=2.0 is never read" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in records(run_dir)] == [1, 2]


def test_a_changed_rm_loss_is_refused_on_resume(tmp_path, model_dir, capsys):
    run_dir = tmp_path / "run"
    args = offline_args(tmp_path, model_dir, run_dir)
    assert main(["rm", *args, "trainer.total_steps=1"]) == 0
    capsys.readouterr()
    assert main(["rm", *args, "trainer.total_steps=2", "trainer.resume=auto",
                 "rm.center_rewards_coefficient=0.01"]) == 2
    err = capsys.readouterr().err
    assert "rm.center_rewards_coefficient=0.0 in the checkpoint, 0.01 here" in err, err
    assert saved_config(run_dir)["rm"]["center_rewards_coefficient"] == 0.0


def test_a_changed_rl_estimator_is_refused_on_resume(tmp_path, assets, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(assets, run_dir, "trainer.total_steps=1")]) == 0
    capsys.readouterr()
    assert main(["train", *rl_args(assets, run_dir, "trainer.total_steps=2", "trainer.resume=auto",
                                   "algorithm.adv_estimator=rloo", "actor.loss_agg_mode=seq-mean-token-mean")]) == 2
    err = capsys.readouterr().err
    assert "algorithm.adv_estimator='grpo' in the checkpoint, 'rloo' here" in err, err
    assert "actor.loss_agg_mode='token-mean' in the checkpoint, 'seq-mean-token-mean' here" in err, err
    assert "critic" not in err, err  # (grpo has no critic: was "critic.loss_agg_mode=... in the checkpoint" too)
    assert saved_config(run_dir)["algorithm"]["adv_estimator"] == "grpo"
    # a setting outside the table (the sampling temperature) is no reason to refuse
    assert main(["train", *rl_args(assets, run_dir, "trainer.total_steps=2", "trainer.resume=auto",
                                   "rollout.temperature=0.9")]) == 0


def test_another_trainers_checkpoint_is_refused_naming_it(tmp_path, model_dir, assets, capsys):
    """Was: `shardrl rm` on a dpo run's folder reported tensors missing from the checkpoint (the score head), and
    `shardrl train` on an sft checkpoint that it has no engine 'actor'."""
    run_dir = tmp_path / "run"
    args = offline_args(tmp_path, model_dir, run_dir)
    assert main(["dpo", *args, "trainer.total_steps=1"]) == 0
    before = (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["rm", *args, "trainer.total_steps=2", "trainer.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "was written by `shardrl dpo`" in err and "resume it with `shardrl dpo`" in err, err
    assert "trainer.output_dir" in err and "missing" not in err, err
    assert (run_dir / "config.yaml").read_text() == before  # still the dpo run's
    checkpoint = run_dir / "checkpoints" / "step_000001"
    assert main(["train", *rl_args(assets, tmp_path / "rl", "trainer.total_steps=2",
                                   f"trainer.resume={checkpoint}")]) == 2
    err = capsys.readouterr().err
    assert "was written by `shardrl dpo`" in err and "resume it with `shardrl dpo`" in err, err


def test_the_writer_of_a_checkpoint_from_before_it_was_recorded(tmp_path):
    """A checkpoint whose trainer_state.json does not name its trainer: the RL trainer's engines say `train`, an
    offline trainer's name kept in extra.pt says which (sft when it has none)."""
    import torch

    from shardrl.trainer.checkpoint import written_by

    torch.save({"step": 1, "trainer": "dpo"}, tmp_path / "extra.pt")
    assert written_by(tmp_path, {"step": 1, "engines": ["model"]}) == "dpo"
    assert written_by(tmp_path, {"step": 1, "engines": ["actor", "critic"]}) == "train"
    torch.save({"step": 1}, tmp_path / "extra.pt")
    assert written_by(tmp_path, {"step": 1, "engines": ["model"]}) == "sft"
    assert written_by(tmp_path, {"trainer": "rm", "engines": ["model"]}) == "rm"
