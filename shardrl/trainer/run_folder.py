"""The run folder's life: chosen and checked writable at start (nothing created), then created, locked and
given its config.yaml by rank 0 once the run can start (`claim_run_dir`, after the cheap checks of data,
reward file and tokenizer), held for the whole run, released at exit (`release_run_dir`).

The lock is an `fcntl.flock` on `run.lock` inside the folder, held by rank 0's open file. The OS drops it
when that process ends however it ends (an exception, Ctrl-C, SIGKILL), so a crashed run never blocks the
next one; a second run into a folder that a live run holds refuses at start, naming the folder and the
holder (pid, host, start time and command, which the holder wrote into the file).

A run that ends in this process (done, stopped by Ctrl-C or SIGTERM, or failed with an error) deletes `run.lock`
as it lets go, so a finished run's folder holds only its records. Only a process killed outright (SIGKILL, the
OOM killer, a lost node) leaves the file: it locks nothing then (the OS dropped the flock), names the run that was
killed, and the next run into the folder takes it over. Whether a folder is in use is the flock, never the file's
being there (a pid is no test across hosts).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from shardrl.trainer.checkpoint import CheckpointManager
from shardrl.config.schema import Config, save_config
from shardrl.metrics import read_metrics

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _from_rank_0(value):
    """Rank 0's `value` on every rank (one decision for the whole job)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def has_complete_checkpoint(run_dir: Path) -> bool:
    return CheckpointManager(run_dir / "checkpoints").latest() is not None


def choose_run_dir(cfg: Config) -> Path:
    """trainer.output_dir; or with resume=auto the newest run of this experiment that holds a complete
    checkpoint; else a new `./outputs/<experiment>/<timestamp>`. Rank 0 chooses for every rank; nothing is
    created here (see `claim_run_dir`)."""
    run_dir = None
    if _rank() == 0:
        if cfg.trainer.output_dir:
            run_dir = Path(cfg.trainer.output_dir)
        else:
            base = Path("outputs") / cfg.trainer.experiment_name
            candidates = sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []
            resumable = [p for p in candidates if has_complete_checkpoint(p)]
            if cfg.trainer.resume == "auto" and resumable:
                run_dir = resumable[-1]
            else:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                run_dir, n = base / stamp, 1
                while run_dir.exists():  # two runs started within a second
                    run_dir, n = base / f"{stamp}-{n}", n + 1
    return Path(_from_rank_0(str(run_dir)))


def _probe_write(folder: Path) -> None:
    """Raises OSError when this process cannot create files in `folder`."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "permission denied", str(folder))
    with tempfile.TemporaryFile(dir=folder):  # what os.access misses (some network file systems, ACLs)
        pass


def check_writable(run_dir: Path) -> None:
    """Raises ValueError, naming the folder, when `run_dir` (or, not there yet, the folder it would be made
    in) cannot be written; cheap, so it runs before anything is loaded."""
    error = None
    if _rank() == 0:
        target = run_dir
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            error = f"trainer.output_dir={str(run_dir)!r}: {target} is a file, not a folder"
        else:
            try:
                _probe_write(target)
            except OSError as e:
                what = (f"cannot write to the run folder {run_dir}" if target == run_dir else
                        f"cannot create the run folder {run_dir}: {target} is not writable")
                error = (f"{what} ({e.strerror or e}); set trainer.output_dir to a folder this user can write, "
                         "or fix its permissions")
    error = _from_rank_0(error)
    if error:
        raise ValueError(error)


def read_lock_owner(run_dir: Path) -> str:
    """Who holds (or last held) the folder's lock, as its lock file says."""
    try:
        info = json.loads((run_dir / LOCK_FILE).read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["start_time"]))
        return f"pid {info['pid']} on host {info['host']}, started {started} ({info.get('command', '?')})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name into the lock file"


class _Claim:
    def __init__(self, run_dir: Path, handle, created: bool):
        self.run_dir, self.handle, self.created = run_dir, handle, created


_claims: dict[str, _Claim] = {}  # the folders this process holds, by resolved path


def _lock(run_dir: Path):
    """Opens and locks `run_dir/run.lock` (rank 0); raises ValueError when another process holds it."""
    while True:
        handle = open(run_dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(handle, run_dir / LOCK_FILE):
                break
        except BlockingIOError:
            handle.close()
            raise ValueError(f"the run folder {run_dir} is in use by another run: {read_lock_owner(run_dir)}. Two "
                             "runs writing one folder corrupt each other's checkpoints and metrics; wait for it to "
                             "end, stop it, or set trainer.output_dir to another folder") from None
        except BaseException:
            handle.close()
            raise
        # the holder ended between our open and our flock and deleted the file we locked (`release_run_dir`): a
        # lock on it guards nothing, as a third run would lock a new run.lock; lock the file that is there now
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start_time": time.time(),
                             "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:500]}))
    handle.flush()
    return handle


def _same_file(handle, path: Path) -> bool:
    """Whether the open `handle` is the file at `path` now (not one deleted since it was opened)."""
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def claim_run_dir(cfg: Config, run_dir: Path) -> None:
    """Call on every rank once the run can start: rank 0 creates the folder, locks it for this process's
    life and writes config.yaml. A folder another live run holds is a ValueError on every rank.
    `cfg.trainer.output_dir` becomes the folder's absolute path (config.yaml and the loggers record where the run
    wrote, also when it was chosen here: `./outputs/<experiment_name>/<timestamp>`)."""
    cfg.trainer.output_dir = str(run_dir.absolute())
    error = None
    if _rank() == 0:
        key = str(run_dir.resolve())
        try:
            if key not in _claims:
                created = not run_dir.exists()
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    _claims[key] = _Claim(run_dir, _lock(run_dir), created)
                except BaseException:
                    if created:
                        shutil.rmtree(run_dir, ignore_errors=True)
                    raise
                if cfg.trainer.resume == "auto" and not has_complete_checkpoint(run_dir):
                    keep_earlier_records(run_dir)
            save_config(cfg, str(run_dir / CONFIG_FILE))
        except ValueError as e:
            error = str(e)
        except OSError as e:
            error = f"cannot create the run folder {run_dir}: {e.strerror or e}; set trainer.output_dir to a writable folder"
    error = _from_rank_0(error)
    if error:
        raise ValueError(error)


def release_run_dir(run_dir: Path, failed: bool = False) -> None:
    """Unlocks the folder and deletes its run.lock (rank 0; a no-op where this process holds none). With `failed`,
    a folder that this run created and that holds nothing but its config and lock (the run stopped before its first
    step wrote anything) is removed, so a run that never started leaves nothing behind."""
    claim = _claims.pop(str(run_dir.resolve()), None)
    if claim is None:
        return
    try:
        leftover = ({p.name for p in run_dir.iterdir() if _holds_something(p)} - {LOCK_FILE, CONFIG_FILE}
                    if run_dir.is_dir() else set())
        if failed and claim.created and not leftover:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif _same_file(claim.handle, run_dir / LOCK_FILE):  # deleted while still locked: see `_lock`
            try:
                (run_dir / LOCK_FILE).unlink()
            except OSError as e:  # (a stale file locks nothing: not worth hiding the error the run may end on)
                log.warning("could not delete %s: %s", run_dir / LOCK_FILE, e.strerror or e)
    finally:
        claim.handle.close()  # closing the file drops the flock


RUN_RECORDS = ("metrics.jsonl", "summary.json", "generations.jsonl", "checkpoints", "hf_model", "lora_adapter",
               "tensorboard")
"""What a run leaves in its folder: a folder holding any of these holds a run."""
RUN_COMPANIONS = (CONFIG_FILE, "*_curve.png")
"""What goes with a run's records (not a run by itself: config.yaml is written before the first step, a curve can be
drawn from any metrics): moved with them by `keep_earlier_records`."""


def _holds_something(path: Path) -> bool:
    """A file with bytes in it, or a folder with anything in it (an empty metrics.jsonl, as a logger opens it
    before the first step, is no record)."""
    return path.stat().st_size > 0 if path.is_file() else path.is_dir() and any(path.iterdir())


def held_run_records(run_dir: Path) -> list[str]:
    """The records of an earlier run in `run_dir` (an empty file or checkpoints folder does not count)."""
    return [name for name in RUN_RECORDS if _holds_something(run_dir / name)]


def _locked_by_another(run_dir: Path) -> bool:
    """Whether a live run holds the folder's lock (then `claim_run_dir` refuses, naming it)."""
    if str(run_dir.resolve()) in _claims or not (run_dir / LOCK_FILE).is_file():
        return False
    with open(run_dir / LOCK_FILE) as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return False


def keep_earlier_records(run_dir: Path) -> Path | None:
    """A run that `trainer.resume=auto` starts afresh in a folder whose run left records but no complete checkpoint
    to continue from (it saved none, or was stopped before its first save: a requeued job): those records are moved
    into `earlier_<time>/` in the folder, not overwritten. Returns that folder, or None when there was nothing."""
    held = held_run_records(run_dir)
    if not held:
        return None
    aside = run_dir / time.strftime("earlier_%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    aside.mkdir()
    companions = [p.name for pattern in RUN_COMPANIONS for p in run_dir.glob(pattern) if p.is_file()]
    for name in held + companions:
        (run_dir / name).rename(aside / name)
    log.warning("the run folder %s held a run (%s) with no complete checkpoint to continue from: trainer.resume=auto "
                "starts afresh, and that run's records are kept in %s", run_dir, ", ".join(held), aside)
    return aside


def check_fresh(cfg: Config, run_dir: Path) -> None:
    """A fresh run (`trainer.resume=never`) refuses a folder that holds another run: it would delete that run's
    metrics and summary, and its checkpoint rotation would count the old run's checkpoints as its own. (`auto`
    continues that run, or where it left no complete checkpoint keeps its records aside: `keep_earlier_records`.)"""
    error = None
    if _rank() == 0 and cfg.trainer.resume == "never" and run_dir.is_dir() and not _locked_by_another(run_dir):
        held = held_run_records(run_dir)
        if held:
            error = (f"the run folder {run_dir} holds another run ({', '.join(held)}), and trainer.resume=never "
                     "starts a fresh one, which would overwrite it: "
                     + ("set trainer.resume=auto to continue that run, " if has_complete_checkpoint(run_dir) else "")
                     + "set trainer.output_dir to another folder, or move that run away first")
    error = _from_rank_0(error)
    if error:
        raise ValueError(error)


def check_same_model(cfg: Config, run_dir: Path) -> None:
    """`trainer.resume=auto` continues the run in `run_dir` only with the model that run trained (its config.yaml's
    model.path): resuming another model's checkpoint would load its weights under this run's name, and the
    folder's config.yaml would then name a model the weights never came from."""
    error = None
    if _rank() == 0 and cfg.trainer.resume == "auto" and has_complete_checkpoint(run_dir):
        before, now = _saved_model_path(run_dir), getattr(cfg.model, "path", None)  # (unreadable: no comparison)
        # (both folders there and not one: a relative path saved from elsewhere that finds nothing here is no proof)
        if (before and now and Path(before).is_dir() and Path(now).is_dir()
                and Path(before).resolve() != Path(now).resolve()):
            error = (f"trainer.resume=auto would continue the run in {run_dir}, which trained model.path={before!r}, "
                     f"with model.path={now!r}: set trainer.output_dir (or trainer.experiment_name) for a new run "
                     f"of this model, or resume that run with its own model.path (if it is the same model moved, "
                     f"edit model.path in {run_dir / CONFIG_FILE})")
    resume = cfg.trainer.resume
    if _rank() == 0 and resume not in ("auto", "never") and (Path(resume).parent.parent / CONFIG_FILE).is_file():
        before = _saved_model_path(Path(resume).parent.parent)
        now = getattr(cfg.model, "path", None)
        if (before and now and Path(before).is_dir() and Path(now).is_dir()
                and Path(before).resolve() != Path(now).resolve()):
            log.warning("trainer.resume=%s is a checkpoint of a run of model.path=%r; this run names "
                        "model.path=%r, whose weights it does not start from (a warm start from that run: the "
                        "reference model and config.yaml are this run's)", resume, before, now)
    error = _from_rank_0(error)
    if error:
        raise ValueError(error)


def _saved_model_path(run_dir: Path) -> str | None:
    """model.path of the run in `run_dir` (its config.yaml), or None where it cannot be read."""
    import yaml

    try:
        return ((yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}).get("model") or {}).get("path")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None


def prepare_run_dir(cfg: Config) -> Path:
    """The run folder (`run_folder.choose_run_dir`), the same on every rank, checked writable (and, for a fresh
    run, free of another run) before anything loads. Nothing is created here: the trainer claims the folder once
    its cheap checks pass."""
    run_dir = choose_run_dir(cfg)
    check_writable(run_dir)
    check_fresh(cfg, run_dir)
    check_same_model(cfg, run_dir)
    return run_dir


def summarize(records: list[dict]) -> dict:
    """Steps done; the mean train reward of the first and last `first_last_window` steps (`_first_last`) and the
    last validation reward, or for a run without rewards (sft, dpo, rm) its loss likewise (`plot.OFFLINE_LOSSES`);
    {} if no step."""
    if not records:
        return {}
    from shardrl.trainer.plot import OFFLINE_LOSSES

    summary = {"steps": records[-1]["step"]}
    rewards = [r["reward/mean"] for r in records if r.get("reward/mean") is not None]
    if rewards:
        summary.update(_first_last("reward", rewards))
        val = [r["val/reward_mean"] for r in records if r.get("val/reward_mean") is not None]
        if val:
            summary["val_last"] = val[-1]
        return summary
    for key in OFFLINE_LOSSES:
        losses = [r[key] for r in records if r.get(key) is not None]
        if losses:
            summary.update(_first_last("loss", losses))
            val = [r["val/loss"] for r in records if r.get("val/loss") is not None]
            if val:
                summary["val_loss_last"] = val[-1]
            break
    return summary


def _first_last(name: str, values: list[float]) -> dict:
    """The mean of the first and of the last few values (a quarter of them, 1 to 5: less noisy than one step's),
    and how many that is (`first_last_window`)."""
    k = max(1, min(5, len(values) // 4))
    return {f"{name}_first": sum(values[:k]) / k, f"{name}_last": sum(values[-k:]) / k, "first_last_window": k}


def write_summary(run_dir: Path, records: list[dict] | None = None) -> dict:
    """`summary.json` of `records` (the trainer's in-memory log; None reads the folder's metrics.jsonl)."""
    if records is None:
        path = run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
    summary = summarize(records)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_results(run_dir: Path, records: list[dict], total_steps: int) -> str:
    """summary.json and the curve (reward_curve.png, or loss_curve.png for a run without rewards:
    `plot.choose_curves`) of the steps logged (rank 0's in-memory records, so any logger will do); a sentence saying
    what was written."""
    summary = write_summary(run_dir, records)
    if not records:
        return f"0 of {total_steps} steps; {run_dir / 'summary.json'} is empty and there is no curve"
    done = f"{summary['steps']} of {total_steps} steps; summary {run_dir / 'summary.json'}"
    from shardrl.trainer.plot import choose_curves, plot_rewards

    metrics = run_dir / "metrics.jsonl"
    try:
        what = choose_curves(records, metrics)[0]
    except ValueError:  # (steps that logged neither a reward nor a loss: nothing to draw)
        return done
    png = plot_rewards(metrics, run_dir / f"{what}_curve.png", records)
    return f"{done}, {what} curve {png}"
