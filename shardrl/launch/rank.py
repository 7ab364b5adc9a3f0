"""One rank of a run, for every trainer: `run` builds the trainer a registry name gives (`config.registry`) on
this rank's share of the world and fits it; `rank_main` is what torchrun starts (`python -m shardrl.launch`), with
one exit status per way a run ends:

    0    done
    2    the user's mistake (a `ValueError`: config, data, model folder, reward file): one `error:` line, rank 0's
    1    the machine's storage refused a write (`STORAGE_EXIT`), a peer rank died, or the other side of an async
         run stopped (`PeerStopped`)
    130  Ctrl-C (143: SIGTERM), after one line from rank 0 saying how far the run got
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from shardrl.launch.signals import (STORAGE_EXIT, RunInterrupted, catch_stop_signals, die_with_launcher,
                                    end_of_run_signals, forget_earlier_runs_signals, interrupted_exit,
                                    interrupted_line, is_storage_error, peer_gone, reset_stop_signal,
                                    was_interrupted)



def resume_note(trainer) -> str:
    """What a stopped run leaves to resume from: its newest complete checkpoint, or that there is none."""
    found = trainer.checkpoints.complete_checkpoints()
    if found:
        return f"trainer.resume=auto continues from its checkpoint of step {found[-1][0]}"
    save = trainer.cfg.trainer.save_freq
    why = "trainer.save_freq=0" if save <= 0 else f"none due yet at trainer.save_freq={save}"
    return f"no checkpoint was saved ({why}): these steps cannot be resumed"

def setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def trainer_class(name: str):
    """The `trainer.base.Trainer` class of the registry's row `name` (`config.registry.TRAINERS`)."""
    from shardrl.config.registry import TRAINERS

    if name not in TRAINERS:
        raise ValueError(f"no trainer named {name!r}; the trainers: {', '.join(TRAINERS)}")
    module, attr = TRAINERS[name].entry.split(":")
    return getattr(importlib.import_module(module), attr)


def run(config: str | None, overrides: list[str], trainer: str = "train") -> Path | None:
    """Runs trainer `trainer` (a `config.registry` name) on this rank (the process group is started from
    torchrun's environment); the run folder, or None on a rank that only generates (async_rl.rollout_ranks)."""
    import torch.distributed as dist

    from shardrl.config.hub import resolve_hub_paths
    from shardrl.config.schema import load_config
    from shardrl.distributed import init_distributed
    from shardrl.trainer.logger import check_sinks_installed

    forget_earlier_runs_signals()
    cls = trainer_class(trainer)
    cfg = load_config(config, overrides, cls=cls.config_cls)
    resolve_hub_paths(cfg)  # (ranks torchrun started directly; `shardrl train` hands them local folders already)
    check_sinks_installed(cfg.trainer.logger)  # before the model loads
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    owns_group = not dist.is_initialized()  # a test (or a caller) may have started it already
    init_distributed()
    try:
        with cls.placement(cfg, owns_group) as place:
            if place is None:  # this rank only generated (async_rl.rollout_ranks): its run is done
                return None
            return _fit(cls, cfg, place)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _fit(cls, cfg, place) -> Path:
    """The plan, the run folder, the trainer and its fit; rank 0 writes the summary (and curve), also when a stop
    signal ends the run early."""
    import torch.distributed as dist

    from shardrl.trainer.run_folder import prepare_run_dir, release_run_dir

    # the layout as torchrun made it (a cluster may launch us directly, whatever the config says); the training
    # ranks of a disaggregated run are laid out as one node of their own
    world = dist.get_world_size()
    per_node = world if place.one_node else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = cls.build_plan(cfg, world // per_node, per_node)
    run_dir = prepare_run_dir(cfg)  # chosen and checked writable; the trainer creates and locks it
    failed = True
    try:
        trainer = cls(cfg, run_dir, plan=plan, **place.trainer_args)
        rank0 = dist.get_rank() == 0
        try:
            trainer.fit()
        except BaseException as e:  # Ctrl-C: rank 0 still writes the summary of the steps done
            if not was_interrupted(e):
                raise
            raise RunInterrupted(f"{trainer.write_results()}; {resume_note(trainer)}" if rank0 else "") from None
        if rank0:
            logging.getLogger("shardrl").info("run folder %s; %s", run_dir, trainer.write_results())
        if dist.get_world_size() > 1:  # every rank returns once the run folder is whole (rank 0's last lines in)
            dist.barrier()
        failed = False
    finally:  # a run that failed before writing anything leaves no folder behind
        release_run_dir(run_dir, failed)
    return run_dir


def rank_args(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(trainer, config file or None, overrides) of a rank's arguments, `[--trainer NAME] [CONFIG | --no-config]
    key=value ...`; anything else is refused (a ValueError), never dropped."""
    usage = "a rank takes [--trainer NAME] [CONFIG | --no-config] key=value ..."
    trainer, rest = "train", list(argv)
    if rest[:1] == ["--trainer"]:
        if len(rest) < 2 or rest[1].startswith("-") or "=" in rest[1]:
            raise ValueError(f"--trainer needs a trainer's name; {usage}")
        trainer, rest = rest[1], rest[2:]
    config = None
    if rest[:1] == ["--no-config"]:
        rest = rest[1:]
    elif rest and "=" not in rest[0]:
        config, rest = rest[0], rest[1:]
    stray = [a for a in rest if "=" not in a]
    if stray:
        raise ValueError(f"unexpected argument(s) {' '.join(stray)}: {usage}")
    return trainer, config, rest


def rank_main(argv: list[str]) -> int:
    """A rank torchrun started: `[--trainer NAME] [CONFIG | --no-config] key=value ...`. A user's mistake found
    here is one `error:` line from rank 0 and exit status 2 on every rank, as in a single process."""
    die_with_launcher()
    setup_logging()
    rank0 = int(os.environ.get("RANK", 0)) == 0
    reset_stop_signal()  # (a process that ran a stopped training before, as launch_main does)
    catch_stop_signals()
    try:
        trainer, config, overrides = rank_args(argv)
        run(config, overrides, trainer)
    except BaseException as e:
        return _exit_status(e, rank0)
    finally:
        try:
            end_of_run_signals()
        except KeyboardInterrupt:  # (a SIGTERM landing just before it: the run is over, it only exits)
            pass
    return 0


def _exit_status(e: BaseException, rank0: bool) -> int:
    """The exit status of a rank whose run raised `e` (the table of the module's docstring); `e` again when it is
    none of those."""
    if was_interrupted(e):  # Ctrl-C: one line from rank 0; the others stop quietly, whatever they were in
        if rank0:
            print(interrupted_line(e), file=sys.stderr)
        return interrupted_exit()
    if isinstance(e, ValueError):
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if is_storage_error(e):
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return STORAGE_EXIT
    if type(e).__name__ == "PeerStopped":  # async_rl: the other side stopped and its ranks say why
        print(f"rank {os.environ.get('RANK', 0)}: {e}", file=sys.stderr)
        return 1
    if peer_gone(e):  # another rank died mid-collective: the launcher names it in one line
        return 1
    raise e
