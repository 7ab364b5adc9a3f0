"""The run folder: a second run into a folder a live run holds refuses, naming the folder and the holder
(and the holder's files stay untouched); a read-only output folder is an error before anything loads; a run
that fails before it starts leaves no folder behind; resume=auto picks the newest run that holds a complete
checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from shardrl.cli import main as cli_main
from shardrl.trainer.checkpoint import COMPLETE
from shardrl.config.schema import load_config
from shardrl.trainer.demo import demo_overrides, prepare_demo_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)


def small(assets: Path, *extra: str) -> list[str]:
    return demo_overrides(assets) + ["trainer.logger=[jsonl]", "trainer.val_freq=0", "trainer.total_steps=1",
                                     "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", *extra]


# a run that holds its folder (the lock taken as a real run takes it), until killed
HOLDER = """
import sys
from pathlib import Path
from shardrl.config.schema import load_config
from shardrl.trainer.run_folder import claim_run_dir
claim_run_dir(load_config(None, sys.argv[2:]), Path(sys.argv[1]))
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_second_run_into_a_held_folder_refuses_and_names_the_holder(assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), *small(assets)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding", "the holding process did not take the folder"
        # the first run's files, which a second run would delete or truncate
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
        (run_dir / "checkpoints" / ".tmp_step_000002" / "actor").mkdir(parents=True)
        assert cli_main(["train", *small(assets, f"trainer.output_dir={run_dir}")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the run folder ") and str(run_dir) in err and "in use by another run" in err
        assert f"pid {holder.pid} on host {socket.gethostname()}, started 20" in err
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'
        assert (run_dir / "checkpoints" / ".tmp_step_000002" / "actor").is_dir()
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "run.lock"]
    finally:
        holder.kill()  # SIGKILL: the OS drops the lock; nothing is left to release it by hand
        holder.wait()
    from shardrl.trainer.run_folder import claim_run_dir, read_lock_owner, release_run_dir

    cfg = load_config(None, small(assets))
    claim_run_dir(cfg, run_dir)  # the killed holder's lock is gone with it
    try:
        assert read_lock_owner(run_dir).startswith(f"pid {os.getpid()} on host ")
    finally:
        release_run_dir(run_dir)


def test_a_read_only_output_folder_is_an_error_before_anything_loads(assets, tmp_path, capsys, monkeypatch):
    import shardrl.trainer.run_folder as run_folder

    parent, existing = tmp_path / "read_only", tmp_path / "read_only_run"
    parent.mkdir()
    existing.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits: refuse as a read-only mount would
        real = run_folder._probe_write

        def read_only(folder):
            if Path(folder) in (parent, existing):
                raise PermissionError(13, "Permission denied", str(folder))
            real(folder)

        monkeypatch.setattr(run_folder, "_probe_write", read_only)
    os.chmod(parent, 0o555)
    os.chmod(existing, 0o555)
    try:
        # model.path names no folder: an error about it would mean the model came first
        for out, says in ((parent / "run", f"cannot create the run folder {parent / 'run'}: {parent} is not writable"),
                          (existing, f"cannot write to the run folder {existing}")):
            assert cli_main(["train", *small(assets, f"trainer.output_dir={out}", "model.path=/no/such/model")]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: {says} (") and "trainer.output_dir" in err, err
            assert "/no/such/model" not in err
    finally:
        os.chmod(parent, 0o755)
        os.chmod(existing, 0o755)
    assert list(parent.iterdir()) == [] and list(existing.iterdir()) == []


def test_a_run_that_fails_before_it_starts_leaves_no_run_folder(assets, tmp_path, monkeypatch):
    import transformers

    from shardrl.launch.rank import run

    missing = tmp_path / "missing.jsonl"
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"question": "x"}\n')
    no_weights = tmp_path / "no_weights"  # fails later, when the model loads
    transformers.AutoConfig.from_pretrained(assets / "model").save_pretrained(no_weights)
    cases = {"missing": ([f"data.train_files=[{missing}]"], "missing.jsonl"),
             "bad_rows": ([f"data.train_files=[{bad_rows}]"], "no row has the columns"),
             "no_weights": ([f"model.path={no_weights}", f"model.tokenizer_path={assets / 'model'}"], "no weights")}
    for name, (extra, says) in cases.items():
        out = tmp_path / "runs" / name
        with pytest.raises((ValueError, FileNotFoundError), match=says):
            run(None, small(assets, f"trainer.output_dir={out}", *extra))
        assert not out.exists(), name
    # the default folder, ./outputs/<experiment>/<timestamp>, is not made either
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run(None, small(assets, "trainer.experiment_name=exp", f"data.train_files=[{missing}]"))
    assert not (tmp_path / "outputs" / "exp").exists() or list((tmp_path / "outputs" / "exp").iterdir()) == []
    # a folder that was there before the failed run stays, untouched
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run(None, small(assets, f"trainer.output_dir={kept}", f"data.train_files=[{missing}]"))
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


def _complete_checkpoint(run_dir: Path, step: int) -> None:
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / COMPLETE).write_text(f"{step}\n")


def test_resume_auto_picks_the_newest_run_with_a_complete_checkpoint(tmp_path, monkeypatch):
    from shardrl.trainer.run_folder import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "outputs" / "exp"
    _complete_checkpoint(base / "20260101-000000", 2)
    _complete_checkpoint(base / "20260102-000000", 2)
    (base / "20260103-000000" / "checkpoints" / ".tmp_step_000004" / "actor").mkdir(parents=True)  # killed mid-save
    (base / "20260104-000000" / "checkpoints" / "step_000006").mkdir(parents=True)  # no COMPLETE marker
    (base / "20260105-000000" / "checkpoints").mkdir(parents=True)  # killed before any save
    (base / "20260106-000000").mkdir()  # failed at start
    before = sorted(str(p) for p in base.rglob("*"))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        auto = prepare_run_dir(load_config(None, ["trainer.experiment_name=exp", "trainer.resume=auto"]))
        fresh = prepare_run_dir(load_config(None, ["trainer.experiment_name=exp", "trainer.resume=never"]))
        other = prepare_run_dir(load_config(None, ["trainer.experiment_name=other", "trainer.resume=auto"]))
    finally:
        if owns_group:
            dist.destroy_process_group()
    assert auto == Path("outputs/exp/20260102-000000")
    assert fresh.parent == Path("outputs/exp") and fresh.name[:2] == "20" and not fresh.exists()
    assert other.parent == Path("outputs/other") and not other.exists()
    assert sorted(str(p) for p in base.rglob("*")) == before  # choosing creates nothing


def test_a_fresh_run_refuses_a_folder_that_holds_another_run(assets, tmp_path, capsys):
    run_dir = tmp_path / "mix"
    first = small(assets, f"trainer.output_dir={run_dir}", "trainer.total_steps=3", "trainer.save_freq=1")
    assert cli_main(["train", *first]) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "run.lock"}
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # a fresh run with another config into the same folder: refused, nothing of the first run touched
    second = small(assets, f"trainer.output_dir={run_dir}", "trainer.save_freq=1", "actor.optim.lr=1e-3")
    assert cli_main(["train", *second]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the run folder {run_dir} holds another run (metrics.jsonl, summary.json")
    assert "trainer.resume=auto" in err and "trainer.output_dir" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "run.lock"} == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == steps
    # resume=auto continues it; a fresh run into an empty folder, or one with only an empty checkpoints folder, runs
    assert cli_main(["train", *first, "trainer.total_steps=4", "trainer.resume=auto"]) == 0
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    # resuming past total_steps: said, not "0 of 2 steps" with exit 0
    capsys.readouterr()
    assert cli_main(["train", *first, "trainer.total_steps=2", "trainer.resume=auto"]) == 2
    assert "is at step 4, past trainer.total_steps=2: there is nothing to train" in capsys.readouterr().err
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert cli_main(["train", *small(assets, f"trainer.output_dir={tmp_path / 'empty'}")]) == 0


def test_a_run_that_stopped_in_its_first_step_leaves_no_folder_and_blocks_no_rerun(assets, tmp_path):
    """The loggers open metrics.jsonl before the first step: a run that fails in that step leaves it empty, which
    is no record of a run (the folder goes, as for a run that failed earlier), and a folder holding only empty
    records is free for a fresh run."""
    from shardrl.trainer.run_folder import check_fresh, claim_run_dir, held_run_records, release_run_dir

    cfg = load_config(None, small(assets))
    run_dir = tmp_path / "run"
    claim_run_dir(cfg, run_dir)
    (run_dir / "metrics.jsonl").touch()
    (run_dir / "checkpoints").mkdir()
    release_run_dir(run_dir, failed=True)
    assert not run_dir.exists()

    kept = tmp_path / "kept"  # (made by the user before: kept, and free)
    kept.mkdir()
    (kept / "metrics.jsonl").touch()
    assert held_run_records(kept) == []
    check_fresh(cfg, kept)
    (kept / "metrics.jsonl").write_text('{"step": 1}\n')
    assert held_run_records(kept) == ["metrics.jsonl"]
    with pytest.raises(ValueError, match="holds another run") as e:
        check_fresh(cfg, kept)
    assert "resume=auto" not in str(e.value)  # (no checkpoint: nothing to continue)
    # resume=auto with no checkpoint to continue from (a requeued job stopped before its first save) starts afresh,
    # that run's records kept aside in the folder, not overwritten
    auto = load_config(None, small(assets, "trainer.resume=auto"))
    check_fresh(auto, kept)
    (kept / "config.yaml").write_text("# the earlier run's\n")  # (its config and curve go with its records)
    (kept / "reward_curve.png").write_bytes(b"png")
    claim_run_dir(auto, kept)
    release_run_dir(kept)
    aside = [p for p in kept.iterdir() if p.name.startswith("earlier_")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (aside[0] / "config.yaml").read_text() == "# the earlier run's\n"
    assert (aside[0] / "reward_curve.png").read_bytes() == b"png" and not (kept / "reward_curve.png").exists()
    assert (kept / "config.yaml").read_text() != "# the earlier run's\n"  # (this run's own)
    assert held_run_records(kept) == []
    (kept / "lora_adapter").mkdir()  # (a LoRA run's product is a run's record too)
    (kept / "lora_adapter" / "adapter_config.json").write_text("{}")
    assert held_run_records(kept) == ["lora_adapter"]
    shutil.rmtree(kept / "lora_adapter")
    (kept / "metrics.jsonl").write_text('{"step": 1}\n')
    (kept / "checkpoints" / "step_000001").mkdir(parents=True)
    (kept / "checkpoints" / "step_000001" / "COMPLETE").write_text("1\n")
    check_fresh(auto, kept)  # (it continues that run)
    # ... with the model it trained: another model.path is refused (it would load that run's weights as this model)
    from shardrl.trainer.run_folder import check_same_model

    (tmp_path / "other_model").mkdir()
    (kept / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'other_model'}\n")
    with pytest.raises(ValueError, match=r"trained model.path=.*other_model.*, with model.path=.*: set "
                                         r"trainer.output_dir"):
        check_same_model(auto, kept)
    check_same_model(cfg, kept)  # (resume=never: nothing is continued)
    (kept / "config.yaml").write_text("model:\n  path: models/moved\n")  # (relative, found nowhere here: no proof)
    check_same_model(auto, kept)
    (kept / "config.yaml").write_text(f"model:\n  path: {auto.model.path}\n")
    check_same_model(auto, kept)
    with pytest.raises(ValueError, match="set trainer.resume=auto to continue that run"):
        check_fresh(cfg, kept)


def test_a_finished_run_leaves_no_lock_and_records_its_folder_and_summary_window(assets, tmp_path, monkeypatch):
    """A run that ends deletes its run.lock (the flock is what guards the folder; the file would only say a finished
    run still held it); config.yaml names the folder the run chose (was `output_dir: null`); summary.json says over
    how many steps its first and last means are taken."""
    import yaml

    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", *small(assets, "trainer.total_steps=2")]) == 0
    [run_dir] = (tmp_path / "outputs" / "demo").iterdir()
    assert not (run_dir / "run.lock").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["output_dir"] == str(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [r["reward/mean"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert summary["first_last_window"] == 1  # (2 steps: a quarter of them, at least 1)
    assert summary["reward_first"] == pytest.approx(rewards[0]) and summary["reward_last"] == pytest.approx(rewards[1])


def test_a_run_that_ends_as_another_starts_hands_over_the_lock_file_it_deletes(assets, tmp_path, monkeypatch):
    """A run that ends deletes run.lock; a second run that opened the file just before, and locks it just after,
    holds a lock on a deleted file, which guards nothing: it locks the file that is there now instead, so a third
    run is refused."""
    import builtins

    from shardrl.trainer import run_folder

    cfg = load_config(None, small(assets))
    run_dir = tmp_path / "run"
    run_folder.claim_run_dir(cfg, run_dir)
    opened = []

    def open_as_the_holder_ends(path, mode="r"):
        handle = builtins.open(path, mode)
        if not opened:
            run_folder.release_run_dir(run_dir)  # the first run ends between the second's open and flock
        opened.append(handle)
        return handle

    monkeypatch.setattr(run_folder, "open", open_as_the_holder_ends, raising=False)
    handle = run_folder._lock(run_dir)
    monkeypatch.undo()
    try:
        assert len(opened) == 2 and os.fstat(handle.fileno()).st_ino == os.stat(run_dir / "run.lock").st_ino
        with pytest.raises(ValueError, match="is in use by another run"):
            run_folder._lock(run_dir).close()
    finally:
        handle.close()
