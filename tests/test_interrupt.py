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

from shardrl.testing import interrupt_after_first_step, small_demo_run, run_distributed
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
    code = interrupt_after_first_step(
        ["train", *small_demo_run(assets, run_dir, "trainer.total_steps=1000", "trainer.logger=[jsonl]", *extra),
         "--nproc-per-node", str(nproc)], run_dir, tmp_path / "stderr.txt")
    metrics = run_dir / "metrics.jsonl"
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 130, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line.lower()]
    steps = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert lines == [f"interrupted (Ctrl-C) after {steps} of 1000 steps; summary {run_dir / 'summary.json'}, "
                     f"reward curve {run_dir / 'reward_curve.png'}; no checkpoint was saved (trainer.save_freq=0): "
                     "these steps cannot be resumed"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "death signal" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps >= 1 and 0.0 <= summary["reward_last"] <= 1.0
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert not (run_dir / "run.lock").exists()  # a stopped run lets go of its folder as a finished one does


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_to_the_launcher_stops_the_run_as_ctrl_c_does_with_status_143(assets, tmp_path, nproc):
    """SIGTERM (a scheduler's, `timeout`'s, `kill`'s) to the process the user started: the run stops where it is
    and writes its summary and curve, says so in one line, and exits 128 + SIGTERM (was: 143 with no summary in one
    process, 130 with no line and no summary from the launcher)."""
    run_dir = tmp_path / "run"
    code = interrupt_after_first_step(
        ["train", *small_demo_run(assets, run_dir, "trainer.total_steps=1000", "trainer.logger=[jsonl]"),
         "--nproc-per-node", str(nproc)], run_dir, tmp_path / "stderr.txt", sigterm=True)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 143, err[-3000:]
    steps = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    lines = [line for line in err.splitlines() if "stopped by" in line]
    assert lines == [f"stopped by SIGTERM after {steps} of 1000 steps; summary {run_dir / 'summary.json'}, "
                     f"reward curve {run_dir / 'reward_curve.png'}; no checkpoint was saved (trainer.save_freq=0): "
                     "these steps cannot be resumed"], err[-3000:]
    assert "Traceback" not in err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps >= 1


def train_and_list(overrides: list[str]) -> list[str]:
    from shardrl.launch.rank import run

    return sorted(p.name for p in run(None, overrides).iterdir())


def test_console_logger_alone_trains_and_writes_summary_and_curve(assets, tmp_path):
    files = run_distributed(train_and_list, 1, small_demo_run(assets, tmp_path / "console", "trainer.total_steps=2",
                                                     "trainer.logger=[console]"))
    assert "metrics.jsonl" not in files and {"summary.json", "reward_curve.png"} <= set(files)
    summary = json.loads((tmp_path / "console" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["reward_first"] <= 1.0


def train_and_record_steps(overrides: list[str]) -> list[int]:
    """The steps of the trainer's records (what summary.json and the reward curve are made from) after a run."""
    from shardrl.trainer import rl
    from shardrl.launch.rank import run

    seen, fit = [], rl.RLTrainer.fit

    def recording_fit(self):
        try:
            return fit(self)
        finally:
            seen.append([r["step"] for r in self.records])
    rl.RLTrainer.fit = recording_fit
    try:
        run(None, overrides)
    finally:
        rl.RLTrainer.fit = fit
    return seen[0]


def test_a_resumed_run_with_the_console_logger_alone_summarises_the_whole_run(assets, tmp_path):
    first = small_demo_run(assets, tmp_path / "console", "trainer.total_steps=2", "trainer.save_freq=1",
                           "trainer.logger=[console]")
    assert run_distributed(train_and_record_steps, 1, first) == [1, 2]
    # the steps before the resume count too, not only the 2 after it
    assert run_distributed(train_and_record_steps, 1, first + ["trainer.total_steps=4", "trainer.resume=auto"]) == \
        [1, 2, 3, 4]
    assert not (tmp_path / "console" / "metrics.jsonl").exists()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"  # a zombie has exited


def _start_two_ranks(assets, tmp_path):
    """`shardrl train` on 2 processes in a session of its own, once its first step is logged: (launcher, ranks)."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    stderr = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shardrl.cli", "train",
                             *small_demo_run(assets, run_dir, "trainer.total_steps=100000", "trainer.logger=[jsonl]"),
                             "--nproc-per-node", "2"], stdout=subprocess.DEVNULL, stderr=stderr,
                            start_new_session=True, env=env)
    stderr.close()
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert time.time() < deadline, "no step within 300 s"
        time.sleep(0.05)
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    return proc, ranks


def _end(proc, pids) -> None:
    """Ends what a test started, by PID only."""
    for pid in [proc.pid, *pids]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_the_ranks_exit_when_their_launcher_is_killed(assets, tmp_path):
    proc, ranks = _start_two_ranks(assets, tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group: torchrun put each rank in its own
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while any(_alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.1)
        assert not [r for r in ranks if _alive(r)], "ranks trained on after their launcher was killed"
    finally:
        _end(proc, ranks)


def test_a_killed_rank_is_one_line_and_its_signal_in_the_exit_status(assets, tmp_path):
    proc, ranks = _start_two_ranks(assets, tmp_path)
    try:
        os.kill(max(ranks), signal.SIGKILL)  # what the kernel's OOM killer does
        code = proc.wait(timeout=120)
    finally:
        _end(proc, ranks)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + signal.SIGKILL, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith(("error", "rank ", "[rank"))]
    assert len(errors) == 1 and errors[0].startswith("error: rank ") and " was killed by SIGKILL (out of memory?" \
        in errors[0], err[-3000:]
    assert "Traceback" not in err and "Connection" not in err


def test_a_finalizer_interrupted_by_ctrl_c_prints_nothing_in_the_launcher(monkeypatch, capsys):
    """torchrun raises its SignalException in the launcher's main thread, which may be running a weakref finalizer
    (the rendezvous keep-alive thread's) just then: Python would print "Exception ignored" and a traceback after the
    one Ctrl-C line. The launcher's hook drops exactly those; another finalizer's error is still printed."""
    import gc
    import sys
    import weakref

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from shardrl.launch.torchrun import quiet_interrupted_finalizers

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    quiet_interrupted_finalizers()
    quiet_interrupted_finalizers()  # (idempotent)

    class Holder:
        pass

    def raising(error):
        raise error

    for error in (SignalException("Process 1 got signal: 2", sigval=2), KeyboardInterrupt(), ValueError("real")):
        holder = Holder()
        weakref.finalize(holder, raising, error)
        del holder
        gc.collect()
    err = capsys.readouterr().err
    assert "ValueError: real" in err and err.count("Traceback") == 1
    assert "SignalException" not in err and "KeyboardInterrupt" not in err


def test_a_stop_signal_landing_in_a_handled_exception_stops_the_run_half_a_second_later():
    """SIGTERM arriving while a library's own exception is being handled (caught and gone after): not lost (the run
    would go on and the launcher's SIGTERM was its only one); it comes again and stops the run."""
    import os
    import signal
    import time

    from shardrl.launch import signals as m

    previous = m.catch_stop_signals()
    m.reset_stop_signal()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                raise KeyError("a library's own")
            except KeyError:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            while time.monotonic() - started < 5:
                time.sleep(0.01)
    finally:
        m.restore_signals(previous)
    assert 0.4 < time.monotonic() - started < 2 and m.interrupted_exit() == 143


def test_an_earlier_runs_stop_signal_does_not_make_an_in_process_runs_error_an_interruption(assets, tmp_path,
                                                                                            monkeypatch):
    """A stop signal seen before (an earlier training of this process, here the state the test above leaves) made
    the next in-process `run`'s own ValueError read as Ctrl-C: `RunInterrupted`, a KeyboardInterrupt, reached the
    caller (a pytest worker took it for the user's Ctrl-C and stopped: the CI run of session 43). The run's own error
    comes out, and a pending second signal of the earlier run is not sent."""
    import signal
    import time

    from shardrl.launch import signals as m
    from shardrl.launch.rank import run
    from shardrl.trainer.rl import RLTrainer

    def fit(self):
        raise ValueError("this run's own mistake")

    monkeypatch.setattr(RLTrainer, "fit", fit)  # (an error inside the fit, where a stop signal is told apart)
    previous = m.catch_stop_signals()
    try:  # what a stop signal landing in a handled exception leaves: seen, and a second one pending
        try:
            raise KeyError("a library's own")
        except KeyError:
            m._on_stop_signal(signal.SIGTERM, None)
    finally:
        m.restore_signals(previous)
    assert m.was_interrupted(ValueError()) and m._again is not None
    with pytest.raises(ValueError, match="this run's own mistake"):
        run(None, small_demo_run(assets, tmp_path / "run", "trainer.device=cpu"))
    assert not m.was_interrupted(ValueError()) and m._again is None
    time.sleep(0.6)  # (the cancelled second signal would have landed here)
