"""The one rank entry (`python -m shardrl.launch`): every trainer's rank ends the same way, by the same table of
exit statuses (an offline trainer's rank once had no disk-full and no peer-stopped branch)."""

from __future__ import annotations

import errno

import pytest

import shardrl.launch.rank as rank
import shardrl.launch.signals as signals


class PeerStopped(RuntimeError):
    """As async_rl's: the other side of the run stopped."""


@pytest.mark.parametrize("trainer", ["train", "sft", "dpo", "rm"])
def test_every_trainer_s_rank_ends_by_one_table(trainer, monkeypatch, capsys):
    for name in ("die_with_launcher", "setup_logging", "catch_stop_signals", "end_of_run_signals"):
        monkeypatch.setattr(rank, name, lambda: None)
    monkeypatch.setenv("RANK", "0")
    # a stop signal an earlier training of this process saw is not this run's (it made every status 143)
    monkeypatch.setattr(signals, "_sigint_seen", True)
    monkeypatch.setattr(signals, "_stop_signal", 15)
    seen = []

    def failing(error):
        def run(config, overrides, name):
            seen.append((config, overrides, name))
            raise error
        return run

    argv = ["--trainer", trainer, "run.yaml", "trainer.total_steps=3"]
    disk_full = OSError(errno.ENOSPC, "disk full: saving the checkpoint of step 3 failed")
    for error, status, line in ((ValueError("data.train_files is empty"), 2, "error: data.train_files is empty"),
                                (disk_full, 1, f"error: {disk_full}"),
                                (PeerStopped("the rollout ranks stopped"), 1, "rank 0: the rollout ranks stopped"),
                                (RuntimeError("Connection closed by peer"), 1, None)):
        monkeypatch.setattr(rank, "run", failing(error))
        assert rank.rank_main(argv) == status, error
        err = capsys.readouterr().err.strip()
        assert err == (line or ""), err
    assert seen[-1] == ("run.yaml", ["trainer.total_steps=3"], trainer)
    monkeypatch.setattr(rank, "run", failing(KeyError("ours")))  # anything else: a traceback, as before
    with pytest.raises(KeyError):
        rank.rank_main(argv)
    monkeypatch.setattr(rank, "run", lambda config, overrides, name: seen.append(name))
    assert rank.rank_main(["--no-config", "x=1"]) == 0 and seen[-1] == "train"  # (no --trainer: train)


def test_a_rank_s_arguments_are_read_or_refused_never_dropped():
    assert rank.rank_args(["--trainer", "sft", "a.yaml", "x=1"]) == ("sft", "a.yaml", ["x=1"])
    assert rank.rank_args(["--no-config", "x=1", "y=2"]) == ("train", None, ["x=1", "y=2"])
    assert rank.rank_args(["x=1"]) == ("train", None, ["x=1"])
    for argv, what in ((["--trainer"], "--trainer needs a trainer's name"),
                       (["--trainer", "x=1"], "--trainer needs a trainer's name"),
                       (["run.yaml", "--trainer", "sft"], "unexpected argument.s. --trainer sft"),
                       (["a.yaml", "b.yaml"], "unexpected argument.s. b.yaml")):
        with pytest.raises(ValueError, match=what):
            rank.rank_args(argv)


@pytest.mark.parametrize("module", ["shardrl.trainer.main", "shardrl.trainer.sft", "shardrl.launch"])
def test_the_cluster_entries_of_every_release_run_their_trainer(module, tmp_path):
    """`torchrun ... -m shardrl.trainer.sft CONFIG` (earlier releases' offline entries) reaches the sft trainer:
    a missing config file is its one error line and status 2, not a silent exit 0."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "missing.yaml"
    args = [sys.executable, "-m", module] + (["--trainer", "sft"] if module == "shardrl.launch" else []) + [str(missing)]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error:" in out.stderr and "missing.yaml" in out.stderr
