"""`shardrl train [CONFIG] [key=value ...] [--nproc-per-node N] [--nnodes N]`, and the per-rank entry
point `python -m shardrl.trainer.main` that torchrun starts (also usable directly on clusters)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def resolve_overrides(config: str | None, overrides: list[str]) -> list[str]:
    """With no config file, the built-in demo's settings come first (the user's overrides win)."""
    if config is not None:
        return list(overrides)
    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

    assets = prepare_demo_assets(Path("outputs") / "demo_assets")
    return demo_overrides(assets.resolve()) + list(overrides)


def run(config: str | None, overrides: list[str]) -> Path:
    """Runs training on this rank (the process group is started from torchrun's environment)."""
    import torch.distributed as dist

    from shardrl.config import load_config
    from shardrl.distributed import init_distributed
    from shardrl.layout import derive_layout
    from shardrl.trainer.rl import RLTrainer, prepare_run_dir, write_summary

    cfg = load_config(config, overrides)
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    owns_group = not dist.is_initialized()  # a test (or a caller) may have started it already
    init_distributed()
    try:
        # the layout as torchrun made it (a cluster may launch us directly, whatever the config says)
        world = dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cfg.trainer.nnodes, cfg.trainer.nproc_per_node = world // per_node, per_node
        derive_layout(cfg, cfg.trainer.nnodes, per_node)
        run_dir = prepare_run_dir(cfg)
        trainer = RLTrainer(cfg, run_dir)
        trainer.fit()
        if dist.get_rank() == 0:
            from shardrl.plot import plot_rewards

            summary = write_summary(run_dir)
            png = plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward_curve.png")
            logging.getLogger("shardrl").info("run folder %s; reward curve %s; %s", run_dir, png, summary)
        return run_dir
    finally:
        if owns_group:
            dist.destroy_process_group()


def train_main(args) -> int:
    """The `shardrl train` subcommand: launches torchrun itself when more than one process is asked for."""
    _setup_logging()
    overrides = resolve_overrides(args.config, list(args.overrides))
    from shardrl.config import load_config

    cfg = load_config(args.config, overrides)  # bad config: a clear error before anything starts
    nproc = args.nproc_per_node or cfg.trainer.nproc_per_node
    nnodes = args.nnodes or cfg.trainer.nnodes
    overrides += [f"trainer.nproc_per_node={nproc}", f"trainer.nnodes={nnodes}"]
    if nnodes > 1 and "RANK" not in os.environ:
        raise ValueError(
            f"a run over {nnodes} nodes needs a rendezvous: on each node start "
            f"`torchrun --nnodes {nnodes} --nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
            "-m shardrl.trainer.main CONFIG key=value ...` (HOST: a node every node reaches)")
    if nproc > 1 and "RANK" not in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run as torchrun

        from shardrl.layout import derive_layout

        derive_layout(cfg, nnodes, nproc)  # batch sizes that do not divide: one clear error, before any process
        argv = [f"--nproc-per-node={nproc}", "--nnodes=1", "--standalone", "-m", "shardrl.trainer.main"]
        argv += ([args.config] if args.config else ["--no-config"]) + overrides
        try:
            torchrun(parse_args(argv))
        except ChildFailedError as e:  # the ranks have said why (a user error: rank 0's `error:` line)
            return next(iter(e.failures.values())).exitcode or 1
        return 0
    run(args.config, overrides)
    return 0


def _rank_main(argv: list[str]) -> int:
    """A rank torchrun started. A user's mistake found here (a `ValueError`: data, model folder, reward
    file) is one `error:` line from rank 0 and exit status 2 on every rank, as in a single process."""
    _setup_logging()
    config = None if argv and argv[0] == "--no-config" else (argv[0] if argv and "=" not in argv[0] else None)
    overrides = [a for a in argv if "=" in a]
    try:
        run(config, overrides)
    except ValueError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
