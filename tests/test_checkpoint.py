"""DCP checkpoints: a run saved at world 2 resumes at world 1, at world 4 and under HSDP with the losses of
the run that never stopped; a save killed part way leaves the previous checkpoint the one that loads;
a checkpoint of another model is refused with the keys that differ.

Every step trains on its own global batch (seed = step), cut into per-rank shares, so the losses do not
depend on the layout; a warm-up schedule makes the LR differ at every step, so a schedule that was not
restored shows.
"""

from __future__ import annotations

import os
import shutil
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import shardrl.trainer.checkpoint as ckpt
from shardrl.trainer.checkpoint import CheckpointManager
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.testing import TINY_MODELS, random_batch, run_distributed

pytestmark = pytest.mark.multiproc

NUM_SEQS, MAX_LEN = 8, 20
VOCAB = TINY_MODELS["qwen2"]["vocab_size"]
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=1.0, warmup_steps=5)
ATOL = 2e-6  # layouts sum in other orders; parameters move by ~1e-3 a step


def pg_loss(outputs, mb, num_tokens, num_seqs):
    from shardrl.algos.aggregate import agg_loss

    loss = agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens, num_global_seqs=num_seqs)
    return loss, {}


def make_engine(kind: str = "qwen2", tiny: dict | None = None, **engine_kwargs):
    engine_kwargs = dict(dict(param_dtype="float32", micro_batch_size_per_gpu=2), **engine_kwargs)
    return build_engine(ModelConfig(tiny=tiny or TINY_MODELS[kind]), EngineConfig(**engine_kwargs), OptimConfig(**OPTIM))


def train_step(engine, step: int) -> dict:
    batch = random_batch(NUM_SEQS, MAX_LEN, VOCAB, seed=step).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    m = engine.train_batch(batch, pg_loss)
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": m["lr"]}


def cpu_weights(engine) -> dict[str, torch.Tensor]:
    # at world 1 an exported tensor can be the parameter itself: copy it
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.export_weights()}


def draw_rng() -> tuple:
    return torch.rand(3), random.random(), float(np.random.rand())


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# ---- workers --------------------------------------------------------------------------------------
def uninterrupted_run(root: str, other_root: str):
    """World 2: steps 1-4, saving after 1, 2 and 3 (keep_last=2); also a llama checkpoint elsewhere."""
    rank = torch.distributed.get_rank()
    seed_everything(1000 + rank)
    manager = CheckpointManager(root, keep_last=2)
    engine = make_engine()
    out = {"metrics": {}}
    for step in (1, 2, 3, 4):
        out["metrics"][step] = train_step(engine, step)
        if step <= 3:
            manager.save(step, {"actor": engine}, extra={"loader": {"epoch": 0, "position": 8 * step}, "step": step},
                         rank_extra={f"rank_{rank}": {"rank": rank, "step": step}})
        if step == 2:
            out["rng_after_save_2"] = draw_rng()
            out["weights_2"] = cpu_weights(engine)
    out["weights_4"] = cpu_weights(engine)
    out["folders"] = sorted(os.listdir(root))
    llama = make_engine("llama")
    CheckpointManager(other_root).save(1, {"actor": llama})
    return out


RESUME_LAYOUTS = {
    1: {"full": dict(micro_batch_size_per_gpu=8)},
    4: {"full": dict(micro_batch_size_per_gpu=1), "hsdp": dict(micro_batch_size_per_gpu=2, fsdp_size=2)},
}


def resume_run(root: str, layouts: dict):
    """Loads step 2 into each layout and trains steps 3-4."""
    manager = CheckpointManager(root, keep_last=2)
    out = {}
    for name, kwargs in layouts.items():
        seed_everything(7)  # whatever the RNG was, loading puts back the saved state
        engine = make_engine(**kwargs)
        loaded = manager.load(Path(root) / "step_000002", {"actor": engine})
        res = {"step": loaded.step, "extra": loaded.extra, "rng": draw_rng(),
               "rank_extra": [loaded.rank_extra(f"rank_{r}") for r in (0, 1, 2)],
               "global_step": engine.global_step,
               "weights_2": cpu_weights(engine), "metrics": {s: train_step(engine, s) for s in (3, 4)}}
        res["weights_4"] = cpu_weights(engine)
        if name == "hsdp":  # saved from HSDP (shards replicated over "ddp"), loaded at world 1 below
            CheckpointManager(Path(root).parent / "from_hsdp").save(4, {"actor": engine})
        out[name] = res
    return out


def mismatch_run(root: str, other_root: str):
    """World 1: the newest checkpoint, and errors for checkpoints of other models."""
    out = {}
    manager = CheckpointManager(root, keep_last=2)
    engine = make_engine()
    latest = manager.load_latest({"actor": engine})
    out["latest_step"], out["latest_global_step"] = latest.step, engine.global_step
    errors = {}
    try:
        CheckpointManager(other_root).load_latest({"actor": make_engine()})  # llama into qwen2
    except ValueError as e:
        errors["llama_into_qwen2"] = str(e)
    try:
        manager.load_latest({"actor": make_engine(tiny=dict(TINY_MODELS["qwen2"], vocab_size=VOCAB + 2))})
    except ValueError as e:
        errors["other_vocab"] = str(e)
    try:
        manager.load_latest({"critic": engine})
    except ValueError as e:
        errors["no_such_engine"] = str(e)
    damaged = Path(root).parent / "damaged"  # (the newest checkpoint's weights cut short, as a full disk leaves them)
    shutil.copytree(root, damaged)
    for shard in (damaged / "step_000003" / "actor").glob("*.distcp"):
        os.truncate(shard, 100)
    try:
        CheckpointManager(damaged).load_latest({"actor": make_engine()})
    except ValueError as e:
        errors["damaged"] = str(e)
    out["errors"] = errors
    engine = make_engine()
    CheckpointManager(Path(root).parent / "from_hsdp").load_latest({"actor": engine})
    out["from_hsdp_weights"] = cpu_weights(engine)
    return out


def save_then_hang(root: str, ready_file: str):
    """World 1, in its own process: a complete save of step 1, then a save of step 2 that stops for good
    after the engine's DCP files are written and before the checkpoint is complete."""
    from shardrl.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    manager = CheckpointManager(root, keep_last=3)
    engine = make_engine()
    train_step(engine, 1)
    manager.save(1, {"actor": engine}, extra={"step": 1})
    torch.save(cpu_weights(engine), Path(root) / "weights_1.pt")
    train_step(engine, 2)

    def hang():
        Path(ready_file).touch()
        time.sleep(600)

    ckpt.rng_state = hang
    manager.save(2, {"actor": engine}, extra={"step": 2})


def load_after_kill(root: str):
    manager = CheckpointManager(root, keep_last=3)
    engine = make_engine()
    loaded = manager.load_latest({"actor": engine})
    out = {"step": loaded.step, "extra": loaded.extra, "weights": cpu_weights(engine)}
    train_step(engine, 2)
    manager.save(2, {"actor": engine}, extra={"step": 2})  # the next save clears the killed one's folder
    out["folders"] = sorted(os.listdir(root))
    return out


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("ckpt_llama")


@pytest.fixture(scope="module")
def saved(roots):
    return run_distributed(uninterrupted_run, 2, str(roots[0]), str(roots[1]))


@pytest.fixture(scope="module")
def resumed(saved, roots):
    return {world: run_distributed(resume_run, world, str(roots[0]), layouts)
            for world, layouts in RESUME_LAYOUTS.items()}


@pytest.fixture(scope="module")
def mismatch(resumed, roots):
    return run_distributed(mismatch_run, 1, str(roots[0]), str(roots[1]))


# ---- tests ----------------------------------------------------------------------------------------
def test_keeps_last_k_complete_checkpoints(saved, roots):
    assert saved["folders"] == ["step_000002", "step_000003"]
    for folder in saved["folders"]:
        files = {p.name for p in (roots[0] / folder).iterdir()}
        assert {"actor", "rng", "extra.pt", "trainer_state.json", "COMPLETE"} <= files
        assert sorted(p.name for p in (roots[0] / folder / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
        assert sorted(p.name for p in (roots[0] / folder / "ranks").iterdir()) == ["rank_0.pt", "rank_1.pt"]
        assert any(p.suffix == ".distcp" for p in (roots[0] / folder / "actor").iterdir())


@pytest.mark.parametrize("world,layout", [(1, "full"), (4, "full"), (4, "hsdp")])
def test_resume_at_other_world_sizes_continues_the_same_run(saved, resumed, world, layout):
    res = resumed[world][layout]
    assert res["step"] == 2 and res["global_step"] == 2
    assert res["extra"] == {"loader": {"epoch": 0, "position": 16}, "step": 2}
    assert res["rank_extra"] == [{"rank": 0, "step": 2}, {"rank": 1, "step": 2}, None]  # what each rank saved under its key
    for name, w in saved["weights_2"].items():
        assert torch.equal(res["weights_2"][name], w), name  # loading is exact
    for step in (3, 4):
        got, want = res["metrics"][step], saved["metrics"][step]
        assert got["lr"] == want["lr"]  # the schedule resumed (warm-up: it differs every step)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert saved["metrics"][3]["lr"] != saved["metrics"][4]["lr"]
    for name, w in saved["weights_4"].items():
        diff = (res["weights_4"][name] - w).abs().max().item()
        assert diff <= ATOL, f"{name}: {diff:.3g}"


def test_resume_restores_rank_rng(saved, resumed):
    got, want = resumed[1]["full"]["rng"], saved["rng_after_save_2"]
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_hsdp_checkpoint_loads_at_world_1(resumed, mismatch):
    for name, w in resumed[4]["hsdp"]["weights_4"].items():
        assert torch.equal(mismatch["from_hsdp_weights"][name], w), name


def test_load_latest_picks_newest_complete(mismatch):
    assert mismatch["latest_step"] == 3 and mismatch["latest_global_step"] == 3


def test_checkpoint_of_other_model_is_a_clear_error(mismatch):
    msg = mismatch["errors"]["llama_into_qwen2"]
    assert "does not match this model" in msg and "missing from the checkpoint" in msg
    assert "model.lm.model.layers.0.self_attn.q_proj.bias" in msg and "step_000001" in msg
    msg = mismatch["errors"]["other_vocab"]
    assert "of another shape" in msg and "embed_tokens.weight: checkpoint (101, 32), model (103, 32)" in msg
    assert "has no engine 'critic'" in mismatch["errors"]["no_such_engine"]
    msg = mismatch["errors"]["damaged"]  # (a file cut short: named, with the checkpoint before it to resume from)
    assert msg.startswith("checkpoint ") and "step_000003 is marked complete but cannot be read" in msg, msg
    assert "trainer.resume=<path>" in msg and "step_000002" in msg and "(rank 0: EOFError: Ran out of input)" in msg
    # only a file's damage is said so: out of memory or a lost peer is raised as it is (not "resume an earlier one")
    from torch.distributed.checkpoint.api import CheckpointException

    assert ckpt._damaged(EOFError("Ran out of input")) and ckpt._damaged(FileNotFoundError(2, "gone"))
    assert not ckpt._damaged(RuntimeError("CUDA out of memory")) and not ckpt._damaged(OSError(28, "disk full"))
    assert ckpt._damaged(CheckpointException("load", {0: (EOFError(), None), 1: (EOFError(), None)}))
    assert not ckpt._damaged(CheckpointException("load", {0: (EOFError(), None),
                                                          1: (RuntimeError("Connection closed by peer"), None)}))


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    root, ready = tmp_path / "run", tmp_path / "ready"
    proc = mp.get_context("spawn").Process(target=save_then_hang, args=(str(root), str(ready)))
    proc.start()
    try:
        deadline = time.time() + 300
        while not ready.exists():
            assert proc.is_alive() and time.time() < deadline, "the saving process ended before hanging"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    partial = root / ".tmp_step_000002"
    assert (partial / "actor" / ".metadata").is_file() and not (partial / "COMPLETE").exists()
    manager = CheckpointManager(root)
    assert manager.latest() == root / "step_000001"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        manager.load(partial, {})

    res = run_distributed(load_after_kill, 1, str(root))
    assert res["step"] == 1 and res["extra"] == {"step": 1}
    want = torch.load(root / "weights_1.pt")
    for name, w in want.items():
        assert torch.equal(res["weights"][name], w), name
    assert res["folders"] == ["step_000001", "step_000002", "weights_1.pt"]


# ---- CUDA: FSDP1 ------------------------------------------------------------------------------------
def gpu_fsdp1_run(root: str, phase: str):
    manager = CheckpointManager(root, keep_last=1)
    if phase == "save":
        engine = make_engine(strategy="fsdp")
        metrics = {s: train_step(engine, s) for s in (1, 2)}
        manager.save(2, {"actor": engine})
        metrics.update({s: train_step(engine, s) for s in (3, 4)})
        return metrics
    engine = make_engine(strategy=phase)  # FSDP1's checkpoint loads into FSDP1 and into FSDP2
    manager.load_latest({"actor": engine})
    return {s: train_step(engine, s) for s in (3, 4)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fsdp1_checkpoint_resumes(tmp_path):
    world = min(2, torch.cuda.device_count())
    saved = run_distributed(gpu_fsdp1_run, world, str(tmp_path), "save")
    for strategy in ("fsdp", "fsdp2"):
        for other_world in sorted({1, world}):
            got = run_distributed(gpu_fsdp1_run, other_world, str(tmp_path), strategy)
            for step in (3, 4):
                assert got[step]["lr"] == saved[step]["lr"]
                assert got[step]["loss"] == pytest.approx(saved[step]["loss"], rel=1e-4), (strategy, other_world, step)
