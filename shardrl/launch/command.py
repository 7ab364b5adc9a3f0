"""`shardrl train|sft|dpo|rm [CONFIG] [key=value ...] [--nproc-per-node N] [--nnodes N]`: one process runs the
trainer itself; more start torchrun here (`torchrun.spawn_ranks`), each rank `rank.rank_main`."""

from __future__ import annotations

import os
import sys
import threading

from shardrl.launch.rank import run, setup_logging, trainer_class
from shardrl.launch.signals import (catch_stop_signals, interrupted_exit, interrupted_line, reset_stop_signal,
                                    restore_signals, was_interrupted)


def launch_main(trainer: str, args) -> int:
    """The command of trainer `trainer` (a `config.registry` name): a bad config or a layout that cannot work is
    one error before any process starts; Ctrl-C is one line and 130."""
    from shardrl.config.hub import resolve_hub_paths
    from shardrl.config.schema import load_config
    from shardrl.launch.overrides import resolve_overrides, verl_overrides
    from shardrl.trainer.logger import check_sinks_installed

    setup_logging()
    cls = trainer_class(trainer)
    overrides = list(args.overrides)
    if getattr(args, "verl", False) and getattr(args, "example", None):
        raise ValueError("--verl translates a verl command line; --example runs a built-in example: use one of them")
    if getattr(args, "verl", False):
        overrides = verl_overrides(args.config, overrides, getattr(args, "config_path", None),
                                   getattr(args, "config_name", None), trainer)
    elif cls.demo_without_config:
        overrides = resolve_overrides(args.config, overrides, example=getattr(args, "example", None))
    cfg = load_config(args.config, overrides, cls=cls.config_cls)  # bad config: a clear error before anything starts
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.trainer.nproc_per_node
    nnodes = args.nnodes if getattr(args, "nnodes", None) is not None else cfg.trainer.nnodes
    for flag, value in (("--nproc-per-node", nproc), ("--nnodes", nnodes)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1 (processes per node / nodes)")
    check_sinks_installed(cfg.trainer.logger)  # a missing tensorboard/wandb: said now, not after the model loads
    # hub ids: local folders of the hub's cache, downloaded here once before any rank starts; the ranks get the folders
    overrides += resolve_hub_paths(cfg)
    overrides += [f"trainer.nproc_per_node={nproc}", f"trainer.nnodes={nnodes}"]
    if nnodes > 1 and "RANK" not in os.environ:
        raise ValueError(
            f"a run over {nnodes} nodes needs a rendezvous: on each node start "
            f"`torchrun --nnodes {nnodes} --nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
            f"-m shardrl.launch --trainer {trainer} CONFIG key=value ...` (HOST: a node every node reaches)")
    if nproc > 1 and "RANK" not in os.environ:
        from shardrl.launch.torchrun import spawn_ranks, warn_oversubscribed

        warn_oversubscribed(nproc, cfg.trainer.device)
        cls.check_launch(cfg, nnodes, nproc)  # batch sizes that do not divide: one clear error, before any process
        return spawn_ranks(nproc, trainer, args.config, overrides)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    reset_stop_signal()
    previous = catch_stop_signals() if main_thread else {}
    try:
        run(args.config, overrides, trainer)
    except BaseException as e:
        if not was_interrupted(e):
            raise
        print(interrupted_line(e), file=sys.stderr)
        return interrupted_exit()
    finally:
        restore_signals(previous)
    return 0
