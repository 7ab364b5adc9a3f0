"""What a checkpoint folder holds through saves that repeat, fail or were cut short (one process, no
engines: the files and renames of CheckpointManager, not DCP): keep_last=0 keeps every checkpoint; a
re-saved step keeps its old copy until the new one is in place; a full disk says so, names the path and
leaves no partial folder; what crashes left (`.tmp_*`, `.trash_*`) is cleaned up."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import shardrl.trainer.checkpoint as ckpt
from shardrl.trainer.checkpoint import CheckpointManager


def saved_value(folder) -> int:
    return torch.load(folder / "extra.pt", weights_only=False)["v"]


def test_keep_last_0_keeps_every_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2, 3, 4):
        manager.save(step, {}, extra={"v": step})
    assert [s for s, _ in manager.complete_checkpoints()] == [1, 2, 3, 4]
    two = CheckpointManager(tmp_path / "two", keep_last=2)
    for step in (1, 2, 3):
        two.save(step, {}, extra={"v": step})
    assert [s for s, _ in two.complete_checkpoints()] == [2, 3]
    with pytest.raises(ValueError, match="keep_last=-1"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_resaving_a_step_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, {}, extra={"v": 1})
    final = tmp_path / "step_000001"
    seen = []  # at every deletion: the value a reader would load from step_000001 then
    rmtree = ckpt.shutil.rmtree

    def watching_rmtree(path, *args, **kwargs):
        seen.append(saved_value(final) if (final / "COMPLETE").is_file() else None)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", watching_rmtree)
    manager.save(1, {}, extra={"v": 2})
    assert seen and seen[-1] == 2 and None not in seen  # never a moment without a complete step_000001
    assert saved_value(final) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_a_resave_cut_between_its_renames_is_finished_on_restart(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, {}, extra={"v": 1})
    rename = os.rename
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old copy moved aside, new one not yet in: the process dies here
            raise KeyboardInterrupt
        return rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        manager.save(1, {}, extra={"v": 2})
    monkeypatch.setattr(ckpt.os, "rename", rename)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_000001", ".trash_step_000001"]
    # the old copy was not deleted: it sits aside, complete; the new one is complete in .tmp_
    assert saved_value(tmp_path / ".trash_step_000001") == 1
    restarted = CheckpointManager(tmp_path, keep_last=2)
    restarted.clean_stale()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert saved_value(restarted.latest()) == 2


def test_stale_tmp_and_trash_folders_are_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, {}, extra={"v": 1})
    (tmp_path / ".tmp_step_000003" / "actor").mkdir(parents=True)  # a killed save: no COMPLETE
    (tmp_path / ".trash_step_000000" / "actor").mkdir(parents=True)  # a delete cut short
    (tmp_path / ".trash_step_000000" / "actor" / "x.distcp").write_bytes(b"0" * 10)
    assert manager.latest() == tmp_path / "step_000001"  # neither is ever taken for a checkpoint
    manager.clean_stale()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    (tmp_path / ".trash_step_000001").mkdir()
    manager.save(2, {}, extra={"v": 2})  # a save cleans up as well
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]


def test_disk_full_during_a_save_names_the_path_and_removes_the_partial_folder(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, {}, extra={"v": 1})
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("extra.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        manager.save(2, {}, extra={"v": 2})
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert msg.count("disk full") == 1 and str(tmp_path / ".tmp_step_000002") in msg
    assert "No space left on device" in msg and "partial folder was removed" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # no .tmp_ left, the old one kept
    assert saved_value(manager.latest()) == 1
    # the COMPLETE marker, the last write, failing is the same
    monkeypatch.setattr(ckpt.torch, "save", real_save)

    def full_at_marker(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "_write_file", full_at_marker)
    with pytest.raises(OSError, match="disk full: saving the checkpoint of step 3"):
        manager.save(3, {}, extra={"v": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
