"""Checkpoints with torch.distributed.checkpoint (DCP): sharded per rank, loadable at another world size.

Layout of one checkpoint, `root/step_000010/`:
    actor/, critic/, ...    one DCP folder per engine: model and optimizer (sharded state dicts, the
                            optimizer flattened to per-parameter keys), lr_scheduler, global_step
    rng/rank_00000.pt       python, numpy, torch and CUDA RNG states of each rank
    ranks/dp_rank_0.pt      per-rank trainer state under fixed keys the trainer chooses (`rank_extra`:
                            torchtitan's `dp_rank_{r}`), each key written by one rank
    extra.pt                the trainer's global state (dataloader position, step, ...), from rank 0
    trainer_state.json      step, world size and engine names, for people; the trainer that wrote it, its
                            trainer.total_steps and the settings its steps mean under (`record`), read before
                            anything loads (`check_resumable`)
    COMPLETE                written last

Atomicity: everything is written into `root/.tmp_step_000010/`; after a barrier rank 0 writes COMPLETE
and renames the folder to `step_000010` (one rename, atomic within a file system). A save killed part
way leaves a `.tmp_*` folder that loading never looks at and the next save deletes. Old checkpoints
are renamed to `.trash_*` before they are deleted, so a half-deleted one is never taken for complete.
Saving a step that exists renames the old copy aside, the new one in, and only then deletes the old
one; a `.tmp_*` that holds COMPLETE (a save stopped between those renames) is renamed in by `clean_stale`.
A failed write (a full disk) on any rank fails the save on every rank, with the path, and removes the
partial folder. Nothing here locks the folder: one run at a time owns it (the trainer's run-folder lock).

Each engine writes and reads its own folder (`Engine.save` / `Engine.load`, in `shardrl.engine.checkpoint`):
DCP reshards on load, so a checkpoint saved on N ranks loads on M with no conversion step.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardrl.engine.checkpoint import check_settings

if TYPE_CHECKING:
    from shardrl.engine.base import Engine

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


# ---- RNG ----------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- a run's checkpoints ------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    step: int
    path: Path
    extra: dict
    """What the trainer passed to `save` (dataloader state, ...)."""
    record: dict = field(default_factory=dict)
    """Its trainer_state.json: what `save`'s `record` added (the trainer, trainer.total_steps, settings)."""

    def rank_extra(self, key: str) -> Any | None:
        """What some rank saved under `key` in `save(rank_extra={key: ...})`; None when no rank did (saved
        at another layout, or without per-rank state)."""
        file = self.path / "ranks" / f"{key}.pt"
        if not file.is_file():
            return None
        try:
            return torch.load(file, weights_only=False)
        except Exception as e:
            if not _damaged(e):
                raise
            raise ValueError(f"checkpoint {self.path} is marked complete but {file} cannot be read "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); its files may be damaged: "
                             "resume from an earlier one with trainer.resume=<path>") from e


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _damaged(error: BaseException) -> bool:
    """Whether `error`, raised reading a checkpoint, says its files are cut short or corrupt (DCP's
    CheckpointException: whether every rank's own error does), not that something else failed."""
    failures = getattr(error, "failures", None)
    if failures:
        return all(_damaged(inner) for inner, _ in failures.values())
    if isinstance(error, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return True
    if isinstance(error, OSError):  # (a file missing or unreadable; not a full or read-only disk's kind)
        return error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOMEM)
    return isinstance(error, RuntimeError) and any(s in str(error) for s in (
        "PytorchStreamReader", "failed finding central directory", "unexpected EOF", "invalid header",
        "Ran out of input"))


def _fsync(path: Path) -> None:
    """Puts a written file's data, or a folder's entries, on disk (a checkpoint's files before its COMPLETE marker,
    which promises them; DCP syncs its own files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(error: BaseException) -> tuple[int | None, str]:
    """(errno, text) of a failed write; DCP's CheckpointException wraps each rank's own exception."""
    if isinstance(error, CheckpointException):
        inner = [exc for exc, _ in error.failures.values()]
        found = [_describe(exc) for exc in inner] or [(None, "DCP save failed")]
        return next((f for f in found if f[0] is not None), found[0])
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        where = f": {cause.filename}" if cause.filename else ""
        return cause.errno, f"{cause.strerror or cause}{where}"
    return None, f"{type(error).__name__}: {error}"


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Saves `root/step_NNNNNN/` checkpoints atomically, keeps the newest `keep_last`, and resumes from
    the newest complete one. Every method that reads or writes engines must be called on every rank."""

    def __init__(self, root_dir: str | os.PathLike, keep_last: int = 1):
        """`keep_last`: how many complete checkpoints stay on disk; 0 keeps all."""
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last}: use 0 to keep every checkpoint, or N >= 1 to keep the newest N")
        self.root = Path(root_dir)
        self.keep_last = keep_last

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"step_{step:06d}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of the complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = STEP_RE.match(entry.name)
            if m and entry.is_dir() and (entry / COMPLETE).is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1][1] if found else None

    def save(self, step: int, engines: Mapping[str, "Engine"], extra: dict | None = None,
             rank_extra: Mapping[str, Any] | None = None, record: Mapping[str, Any] | None = None) -> Path:
        """Writes `engines` (name -> engine), `extra` (rank 0's) and `rank_extra` (key -> state, each key
        written by one rank: the state only that rank holds) as the checkpoint of `step`; returns its folder.
        `record`: plain values for trainer_state.json (`read_record` gives them back without loading anything)."""
        for key in rank_extra or {}:
            if not re.fullmatch(r"[A-Za-z0-9_\-]+", key):
                raise ValueError(f"rank_extra key {key!r}: use letters, digits, '_' or '-'")
        for name in engines:
            if not re.fullmatch(r"[A-Za-z0-9_\-]+", name) or name in ("rng", "ranks"):
                raise ValueError(f"engine name {name!r}: use letters, digits, '_' or '-' (and not 'rng' or 'ranks')")
        rank = _rank()
        final = self.root / self.step_dir_name(step)
        tmp = self.root / f".tmp_{final.name}"
        error = None
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_stale()
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / "rng").mkdir(parents=True)
                (tmp / "ranks").mkdir()
            except OSError as e:
                error = e
        self._raise_if_any_failed(error, tmp, step)
        try:
            for name, engine in engines.items():
                engine.save(tmp / name)
            written = [tmp / "rng" / f"rank_{rank:05d}.pt"]
            torch.save(rng_state(), written[0])
            for key, value in (rank_extra or {}).items():
                written.append(tmp / "ranks" / f"{key}.pt")
                torch.save(value, written[-1])
            if rank == 0:
                torch.save(dict(extra or {}), tmp / "extra.pt")
                summary = {"step": step, "world_size": _world(), "engines": sorted(engines), "time": time.time(),
                           **dict(record or {})}
                (tmp / "trainer_state.json").write_text(json.dumps(summary, indent=2) + "\n")
                written += [tmp / "extra.pt", tmp / "trainer_state.json"]
            for file in written:
                _fsync(file)
        except (Exception, CheckpointException) as e:  # DCP raises its CheckpointException on every rank
            error = e
        self._raise_if_any_failed(error, tmp, step)  # also the barrier: every rank's files are written
        if rank == 0:
            try:
                for folder in (tmp / "rng", tmp / "ranks", tmp):
                    _fsync(folder)
                _write_file(tmp / COMPLETE, f"{step}\n".encode())
                _fsync(tmp)
            except OSError as e:
                error = e
        self._raise_if_any_failed(error, tmp, step)
        if rank == 0:
            if final.exists():  # saving a step again: the old copy goes only once the new one is in place
                old = final.with_name(f".trash_{final.name}")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(tmp, final)
                _fsync(self.root)
                shutil.rmtree(old)
            else:
                os.rename(tmp, final)
                _fsync(self.root)
            # steps after this one are of the line the run left when it resumed from an earlier checkpoint (as
            # metrics.jsonl's later lines were): resume=auto must continue this one, and the rotation never takes
            # the checkpoint just written for an old one
            later = [p for s, p in self.complete_checkpoints() if s > step]
            if later:
                log.warning("deleting checkpoints after step %d, of the run before it resumed from an earlier one: %s",
                            step, ", ".join(p.name for p in later))
            for stale in later:
                self._delete(stale)
            for _, stale in (self.complete_checkpoints()[:-self.keep_last] if self.keep_last else []):
                self._delete(stale)
            log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _raise_if_any_failed(self, error: BaseException | None, tmp: Path, step: int) -> None:
        """One decision for all ranks: when a write failed on any rank, every rank raises (none waits in a
        collective for a rank that gave up) and rank 0 removes the partial folder."""
        failures = [_describe(error)] if error is not None else []
        if dist.is_initialized() and _world() > 1:
            gathered: list = [None] * _world()
            dist.all_gather_object(gathered, failures)
            failures = [f for per_rank in gathered for f in per_rank]
        if not failures:
            return
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        codes = [code for code, _ in failures if code is not None]
        reasons = "; ".join(dict.fromkeys(text for _, text in failures))
        if any(code in (errno.ENOSPC, errno.EDQUOT) for code in codes):
            raise OSError(errno.ENOSPC, f"disk full: saving the checkpoint of step {step} to {tmp} failed ({reasons}); "
                          f"the partial folder was removed. Free space on the disk of {self.root}, keep fewer "
                          "checkpoints (trainer.keep_last) or set trainer.output_dir to a disk with room") from error
        message = f"saving the checkpoint of step {step} to {tmp} failed: {reasons}; the partial folder was removed"
        if codes:
            raise OSError(codes[0], message) from error
        raise RuntimeError(message) from error

    def _remove_stale(self) -> None:
        """Rank 0: removes what killed saves and deletes left (`.tmp_*`, `.trash_*`) and renames in a `.tmp_*`
        that is complete and whose step folder is missing (a re-save stopped between its two renames)."""
        for stale in sorted(self.root.glob(".tmp_step_*")):
            final = self.root / stale.name[len(".tmp_"):]
            if STEP_RE.match(final.name) and (stale / COMPLETE).is_file() and not final.exists():
                os.rename(stale, final)
                log.warning("finished the interrupted save of %s", final)
            else:
                shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(".trash_*"):
            shutil.rmtree(stale, ignore_errors=True)

    def clean_stale(self) -> None:
        """Tidies the folder before a run uses it (see `_remove_stale`); call on every rank."""
        if _rank() == 0 and self.root.is_dir():
            self._remove_stale()
        _barrier()

    def _delete(self, folder: Path) -> None:
        trash = folder.with_name(f".trash_{folder.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(folder, trash)
        shutil.rmtree(trash)

    def load(self, path: str | os.PathLike, engines: Mapping[str, "Engine"], restore_rng: bool = True) -> Checkpoint:
        """Loads the checkpoint folder `path` into `engines` (name -> engine, at any world size)."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"checkpoint {str(path)!r} not found (trainer.resume takes \"auto\", \"never\" or the "
                             "path of a checkpoint folder such as <run>/checkpoints/step_000010)")
        if not (path / COMPLETE).is_file():
            raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        for name in engines:
            if not (path / name).is_dir():
                saved = sorted(p.name for p in path.iterdir() if (p / ".metadata").is_file())
                raise ValueError(f"checkpoint {path} has no engine {name!r}; it holds {saved}")
        try:
            for name, engine in engines.items():
                engine.load(path / name)
            if restore_rng:
                rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
                if rng_file.is_file():
                    set_rng_state(torch.load(rng_file, weights_only=False))
                else:  # saved on fewer ranks: this rank keeps its own seeding
                    log.warning("checkpoint %s has no RNG state for rank %d (saved at a smaller world size)",
                                path, _rank())
            extra = torch.load(path / "extra.pt", weights_only=False)
        except BaseException as e:  # (DCP's CheckpointException is a BaseException)
            if _damaged(e):  # a file cut short or corrupt: said with what to do
                raise self._unreadable(path, e) from e
            raise  # (a checkpoint of another model, out of memory, a lost peer: as they are)
        m = STEP_RE.match(path.name)
        record = read_record(path)
        step = int(m.group(1)) if m else int(record["step"])
        _barrier()
        return Checkpoint(step=step, path=path, extra=extra, record=record)

    def _unreadable(self, path: Path, error: BaseException) -> ValueError:
        """Why the complete checkpoint `path` could not be read, and the other complete ones to resume from."""
        failures = getattr(error, "failures", None)  # (DCP's CheckpointException: each rank's own error)
        if failures:
            rank, (inner, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
            said = f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())}"
        else:
            said = f"{type(error).__name__}: {' '.join(str(error).split())}"
        said = said if len(said) <= 300 else said[:300] + " ..."
        others = [str(p) for _, p in self.complete_checkpoints() if p.resolve() != path.resolve()]
        fix = (f"resume from an earlier one with trainer.resume=<path> ({', '.join(others[-3:])})" if others
               else "there is no other complete checkpoint here; start afresh in another trainer.output_dir")
        return ValueError(f"checkpoint {path} is marked complete but cannot be read ({said}); its files may be "
                          f"damaged (a disk or copy that cut them short): {fix}")

    def resume_target(self, resume: str) -> Path | None:
        """The checkpoint `trainer.resume` names (the newest complete one for "auto"); None for "never", for "auto"
        with none, and for a path that is no complete checkpoint (`load` says what is wrong with it)."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        return Path(resume) if (Path(resume) / COMPLETE).is_file() else None

    def load_latest(self, engines: Mapping[str, "Engine"], restore_rng: bool = True) -> Checkpoint | None:
        """Loads the newest complete checkpoint; None when there is none (a fresh start)."""
        latest = self.latest()
        if dist.is_initialized() and _world() > 1:  # one decision for all ranks, whatever each one sees
            chosen = [latest]
            dist.broadcast_object_list(chosen, src=0)
            latest = chosen[0]
        if latest is None:
            return None
        return self.load(latest, engines, restore_rng)


# ---- what a checkpoint may be resumed by ---------------------------------------------------------------
def read_record(path: str | os.PathLike) -> dict:
    """A checkpoint's trainer_state.json ({} when it has none or it cannot be read)."""
    try:
        return json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}


def written_by(path: Path, record: Mapping[str, Any]) -> str:
    """The trainer (`shardrl NAME`) that wrote the checkpoint `path`; one written before trainer_state.json named it
    is told by its engines (the RL trainer's `actor`) or by the name an offline trainer kept in extra.pt."""
    if record.get("trainer"):
        return record["trainer"]
    if "actor" in record.get("engines", ()):
        return "train"
    try:
        return torch.load(path / "extra.pt", weights_only=False).get("trainer", "sft")
    except Exception:  # (unreadable: `load` says why, naming the file)
        return "sft"


def check_resumable(path: Path | None, trainer: str, settings: Mapping[str, Any], fresh: str) -> None:
    """Before a run claims its folder (rewriting config.yaml) or loads a model: the checkpoint `path` it will resume
    (None: none) must be of this `trainer` and recorded under these `settings` (key -> value; a key it did not record
    is not checked). Otherwise a ValueError on every rank (rank 0 decides) naming the trainer that wrote it, or each
    changed key with both values, and how to go on; `fresh` says how to start a new run instead. Call on every rank."""
    error = None
    if _rank() == 0 and path is not None:
        settings = json.loads(json.dumps(dict(settings)))  # as the record holds them (a tuple is a list there)
        record = read_record(path)
        made_by = written_by(path, record)
        if not record and (path / "trainer_state.json").exists():  # (none at all: written before there was one)
            error = (f"checkpoint {path} is marked complete but its trainer_state.json cannot be read (cut short or "
                     f"damaged), so what wrote it is unknown: resume from an earlier one with trainer.resume=<path>, "
                     f"or {fresh}")
        elif made_by != trainer:
            error = (f"checkpoint {path} was written by `shardrl {made_by}`, not `shardrl {trainer}`: resume it with "
                     f"`shardrl {made_by}`, or {fresh} (its trainer.export_hf folder as model.path starts from its "
                     "weights)")
        else:
            try:
                check_settings(path, record.get("settings", {}), settings, "settings",
                               "they change what its steps meant, so a resume keeps them: set them back to continue "
                               f"that run, or {fresh}")
            except ValueError as e:
                error = str(e)
    if dist.is_initialized() and _world() > 1:  # one decision for all ranks
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)
