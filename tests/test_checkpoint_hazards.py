"""A hostile review of checkpointing: each test names a way a save or a resume could lose or change the run.

- the kept-checkpoints limit counts the checkpoint just written as the newest, also when it is of an earlier step
  than some already there (a run resumed from an earlier checkpoint by path, into its own folder);
- a checkpoint's files are on disk (fsync) before its COMPLETE marker is;
- a damaged per-rank file or trainer_state.json is a clear error naming the checkpoint, never another trainer;
- saving an engine whose optimizer has not stepped yet (its first steps skipped for a non-finite gradient norm)
  does not change the run: its next step equals that of a run that saved nothing, and so does a resumed run's;
- PPO with a critic (GAE) and an adaptive KL controller resumes as the run that was not stopped (the critic's unread
  lm_head had no AdamW state in the checkpoint, which the resumed optimizer expected: a resume was refused).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardrl.trainer.checkpoint as ckpt
from shardrl.trainer.checkpoint import CheckpointManager, check_resumable


# ---- the kept-checkpoints limit ------------------------------------------------------------------------
@pytest.mark.parametrize("keep_last", [1, 2])
def test_saving_an_earlier_step_keeps_the_checkpoint_just_saved_and_resume_auto_finds_it(tmp_path, keep_last):
    manager = CheckpointManager(tmp_path, keep_last=keep_last)
    for step in (2, 4, 6):
        manager.save(step, {}, extra={"step": step})
    # a run resumed from step 2 by path (trainer.resume=<run>/checkpoints/step_000002) saves its step 3
    manager.save(3, {}, extra={"step": 3})
    steps = [s for s, _ in manager.complete_checkpoints()]
    assert 3 in steps, f"the checkpoint just saved was deleted by the keep_last={keep_last} rotation: {steps}"
    # a crash now: resume=auto must continue this line (metrics.jsonl was cut back to step 2 when it resumed)
    assert manager.latest() == tmp_path / "step_000003", steps


# ---- durability ------------------------------------------------------------------------------------------
def test_every_file_of_a_checkpoint_is_synced_before_its_complete_marker(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", recording_fsync)
    manager = CheckpointManager(tmp_path, keep_last=1)
    final = manager.save(1, {}, extra={"step": 1}, rank_extra={"dp_rank_0": {"x": 1}}, record={"trainer": "train"})
    marker = synced.index(str(tmp_path / ".tmp_step_000001" / "COMPLETE"))
    before = {os.path.relpath(p, tmp_path / ".tmp_step_000001") for p in synced[:marker]}
    files = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file() and p.name != "COMPLETE"}
    assert files <= before, f"written but not synced before COMPLETE: {sorted(files - before)}"


# ---- damaged files: one clear line -------------------------------------------------------------------------
def test_a_damaged_per_rank_file_is_a_clear_error_naming_the_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    path = manager.save(1, {}, extra={"step": 1}, rank_extra={"dp_rank_0": {"shuffle": list(range(100))}})
    os.truncate(path / "ranks" / "dp_rank_0.pt", 10)
    loaded = manager.load(path, {})
    with pytest.raises(ValueError) as info:
        loaded.rank_extra("dp_rank_0")
    assert str(path) in str(info.value) and "dp_rank_0.pt" in str(info.value)


def test_a_damaged_trainer_state_json_is_not_taken_for_another_trainers_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    path = manager.save(1, {}, extra={"step": 1}, record={"trainer": "train", "settings": {"algorithm.gamma": 1.0}})
    (path / "actor").mkdir()  # (an RL checkpoint's engine folder)
    (path / "trainer_state.json").write_text('{"step": 1, "wor')  # cut short
    with pytest.raises(ValueError) as info:
        check_resumable(path, "train", {"algorithm.gamma": 0.5}, "start afresh")
    msg = str(info.value)
    assert "shardrl sft" not in msg, msg  # it was written by `shardrl train`
    assert "trainer_state.json" in msg and str(path) in msg, msg


# ---- an optimizer that has not stepped yet --------------------------------------------------------------
NUM_SEQS, MAX_LEN = 4, 12


def _pg_loss(outputs, mb, num_tokens, num_seqs, scale: float = 1.0):
    from shardrl.algos.aggregate import agg_loss

    loss = agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens, num_global_seqs=num_seqs)
    return loss * scale, {}


def _nan_loss(outputs, mb, num_tokens, num_seqs):
    return _pg_loss(outputs, mb, num_tokens, num_seqs, scale=float("nan"))


def _engine():
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import TINY_MODELS

    torch.manual_seed(0)
    return build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                        EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=4),
                        OptimConfig(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=1.0))


def _batch(seed: int):
    from shardrl.testing import TINY_MODELS, random_batch

    return random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS["qwen2"]["vocab_size"], seed=seed)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.export_weights()}


def skipped_first_step_run(root: str) -> dict:
    """World 1: step 1 is skipped (a NaN gradient); then (a) no save, (b) a save, (c) a resume of that save; each
    then takes step 2."""
    out = {}
    for mode in ("plain", "saved"):
        engine = _engine()
        assert engine.train_batch(_batch(1), _nan_loss)["skipped_step"] == 1.0
        if mode == "saved":
            CheckpointManager(root).save(1, {"actor": engine}, extra={"step": 1})
        engine.train_batch(_batch(2), _pg_loss)
        out[mode] = _weights(engine)
    engine = _engine()
    CheckpointManager(root).load_latest({"actor": engine})
    engine.train_batch(_batch(2), _pg_loss)
    out["resumed"] = _weights(engine)
    return out


@pytest.mark.multiproc
def test_saving_before_the_first_optimizer_step_does_not_change_the_next_step(tmp_path):
    from shardrl.testing import run_distributed

    out = run_distributed(skipped_first_step_run, 1, str(tmp_path / "run"))
    for mode in ("saved", "resumed"):
        worst = max((out[mode][k] - w).abs().max().item() for k, w in out["plain"].items())
        assert worst <= 1e-7, f"{mode}: step 2 differs from the run that saved nothing by {worst:.3g}"


# ---- the RL trainer: a critic and an adaptive KL controller resume too --------------------------------------
def _rl_run(overrides: list[str]) -> list[dict]:
    from shardrl.launch.rank import run

    import torch.distributed as dist

    run_dir = run(None, overrides)
    if dist.is_initialized() and dist.get_rank() != 0:  # (rank 0 may still be writing its last line: its result is read)
        return []
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.multiproc
def test_ppo_with_a_critic_and_adaptive_kl_resumes_like_the_uninterrupted_run(tmp_path):
    import shutil

    from shardrl.testing import run_distributed, small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=5)
    args = ["trainer.logger=[jsonl]", "trainer.total_steps=3", "trainer.save_freq=1", "trainer.keep_last=0",
            "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "critic.optim.lr=1e-3",
            "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.05", "algorithm.kl_target=0.001",
            "actor.optim.warmup_steps=3", "critic.optim.warmup_steps=3"]
    full = run_distributed(_rl_run, 1, small_demo_run(assets, tmp_path / "full", *args))
    other = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_000001", other / "checkpoints" / "step_000001")
    resumed = run_distributed(_rl_run, 1, small_demo_run(assets, other, "trainer.resume=auto", *args))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    keys = [k for k in full[1] if k.startswith(("critic/", "actor/", "reward/", "kl/")) and "timing" not in k]
    assert any(k.startswith("critic/") for k in keys) and any("kl" in k for k in keys), keys
    for got, want in zip(resumed[1:], full[1:]):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)
