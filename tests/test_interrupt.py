"""`shardrl train` stopped by Ctrl-C on 1 and 2 processes: one line, exit status 130, and summary.json and
the reward curve of the steps done; and a run whose only logger is the console still writes both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrl.testing import small_demo_run, run_distributed
from shardrl.trainer.demo import prepare_demo_assets

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)




# the last case: 1 training rank + 1 rollout rank generating a step ahead (shardrl.trainer.async_rl)
@pytest.mark.parametrize("nproc,extra", [(1, ()), (2, ()), (2, ("async_rl.rollout_ranks=1", "async_rl.max_staleness=1",
                                                           "algorithm.rollout_is=true"))])
def test_ctrl_c_is_one_line_status_130_and_still_writes_the_summary(assets, tmp_path, nproc, extra):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    with open(tmp_path / "stderr.txt", "w") as stderr:
        # a session of its own, so the SIGINT below reaches what a terminal's Ctrl-C would: the launcher's group
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardrl.cli", "train",
             *small_demo_run(assets, run_dir, "trainer.total_steps=1000", "trainer.logger=[jsonl]", *extra),
             "--nproc-per-node", str(nproc)],
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=env)
        try:
            metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
            while not (metrics.is_file() and metrics.read_text().strip()):
                assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
                assert time.time() < deadline, "no step within 300 s"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 130, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line.lower()]
    steps = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert lines == [f"interrupted (Ctrl-C) after {steps} of 1000 steps; summary {run_dir / 'summary.json'}, "
                     f"reward curve {run_dir / 'reward_curve.png'}"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "death signal" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps >= 1 and 0.0 <= summary["reward_last"] <= 1.0
    assert (run_dir / "reward_curve.png").stat().st_size > 1000


def train_and_list(overrides: list[str]) -> list[str]:
    from shardrl.trainer.main import run

    return sorted(p.name for p in run(None, overrides).iterdir())


def test_console_logger_alone_trains_and_writes_summary_and_curve(assets, tmp_path):
    files = run_distributed(train_and_list, 1, small_demo_run(assets, tmp_path / "console", "trainer.total_steps=2",
                                                     "trainer.logger=[console]"))
    assert "metrics.jsonl" not in files and {"summary.json", "reward_curve.png"} <= set(files)
    summary = json.loads((tmp_path / "console" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["reward_first"] <= 1.0
