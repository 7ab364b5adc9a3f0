"""`shardrl train [CONFIG] [key=value ...] [--nproc-per-node N] [--nnodes N]`, and the per-rank entry
point `python -m shardrl.trainer.main` that torchrun starts (also usable directly on clusters)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
from pathlib import Path

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd program
STORAGE_EXIT = 1
# the machine's storage refused a write (disk full, quota, read-only): the message names the path, a
# traceback adds nothing
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def is_storage_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS
_sigint_seen = False
_stop_signal: int | None = None  # the signal that stopped the run (SIGINT or SIGTERM)
_run_over = True  # no run catching stop signals (`catch_stop_signals` to `restore_signals`/`end_of_run_signals`)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Ctrl-C, and what schedulers, `timeout` and `kill` send: both stop the run where it is, with its summary."""


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C or SIGTERM (torchrun forwards either to every rank): stop where we are, once. Later ones are ignored
    so they cannot cut the summary short; one landing while an exception already unwinds (a collective a stopped
    peer left) lets that exception stop the run instead of replacing it mid-clean-up; if that exception was only a
    library's own, caught and gone, the signal comes again half a second later and stops the run then."""
    global _sigint_seen, _stop_signal
    _sigint_seen, _stop_signal = True, signum
    if sys.exc_info()[1] is not None:
        again = threading.Timer(0.5, _signal_again, (signum,))
        again.daemon = True
        again.start()
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _signal_again(signum: int) -> None:
    if not _run_over:  # (a run that ended meanwhile only exits: nothing to stop)
        os.kill(os.getpid(), signum)


def catch_stop_signals() -> dict:
    """`_on_sigint` for SIGINT and SIGTERM (from the main thread); returns the handlers before, for
    `restore_signals`."""
    global _run_over
    _run_over = False
    return {sig: signal.signal(sig, _on_sigint) for sig in STOP_SIGNALS}


def reset_stop_signal() -> None:
    """No stop signal seen yet (a caller's process may run more than one training, from any thread)."""
    global _sigint_seen, _stop_signal
    _sigint_seen, _stop_signal = False, None


def end_of_run_signals() -> None:
    """A rank whose run is over only exits: SIGTERM (the launcher stopping it, say after a peer died) ends it at once
    again; `_on_sigint` would raise KeyboardInterrupt in an exit finalizer and print its traceback."""
    global _run_over
    _run_over = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def restore_signals(previous: dict) -> None:
    global _run_over
    _run_over = True
    for sig, handler in previous.items():
        if handler is not None:  # (None: one set outside Python, which cannot be put back)
            signal.signal(sig, handler)


def interrupted_exit() -> int:
    """128 + the signal that stopped the run, as a shell reports a program it stopped (Ctrl-C: 130, SIGTERM: 143)."""
    return 128 + int(_stop_signal or signal.SIGINT)


def launcher_interrupted_exit(e: BaseException) -> int:
    """The launcher's status when torchrun stopped on a signal (its SignalException carries it) or Ctrl-C."""
    sig = getattr(e, "sigval", None)
    return 128 + int(sig) if sig is not None else INTERRUPTED_EXIT


def _was_interrupted(e: BaseException) -> bool:
    return _sigint_seen or isinstance(e, KeyboardInterrupt)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; on rank 0 the message says how far the run got and what it wrote."""


def write_results(run_dir: Path, records: list[dict], total_steps: int) -> str:
    """summary.json and reward_curve.png of the steps logged (rank 0's in-memory records, so any logger will
    do); a sentence saying what was written."""
    from shardrl.trainer.run_folder import write_summary

    summary = write_summary(run_dir, records)
    if not records:
        return f"0 of {total_steps} steps; {run_dir / 'summary.json'} is empty and there is no reward curve"
    from shardrl.trainer.plot import plot_rewards

    png = plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", records)
    return f"{summary['steps']} of {total_steps} steps; summary {run_dir / 'summary.json'}, reward curve {png}"


RUN_SOURCE_KEYS = ("model.path", "model.tiny", "model.tokenizer_path", "data.train_files", "data.val_files")
"""Override keys (and their sub-keys) that name a model or data: with any of them and no config file, a run is the
user's own and starts from the plain defaults, not the demo's."""


def resolve_overrides(config: str | None, overrides: list[str], make_demo_assets: bool = True) -> list[str]:
    """The overrides a run applies: with no config file and no override naming a model or data
    (`RUN_SOURCE_KEYS`), the built-in demo's settings come first (the user's overrides win: `shardrl train
    trainer.total_steps=50` is a shorter demo). A run configured on the command line alone starts from the
    plain defaults, as it would with an empty YAML file. `make_demo_assets=False` (`shardrl plan`) only names
    the demo's folder, which its first run makes."""
    if config is not None or any(names_run_source(o) for o in overrides):
        return list(overrides)
    from shardrl.trainer.demo import DEMO_ASSETS, demo_overrides, prepare_demo_assets

    assets = prepare_demo_assets(DEMO_ASSETS) if make_demo_assets else DEMO_ASSETS
    return demo_overrides(assets.resolve()) + list(overrides)


def verl_overrides(config: str | None, args: list[str], config_path: str | None = None,
                   config_name: str | None = None) -> list[str]:
    """`shardrl train --verl`: verl's key=value arguments (after those of verl's `--config-path/--config-name` YAML)
    translated (`shardrl.compat.verl.translate`), the translation shown."""
    from shardrl.compat.verl.translate import config_file_args, translate

    if config is not None:
        raise ValueError(f"--verl takes verl's key=value arguments only, not a config file ({config!r}); drop "
                         "--verl to run a shardrl config, or give verl's --config-path DIR --config-name NAME")
    if (config_path is None) != (config_name is None):
        raise ValueError("give verl's --config-path and --config-name together")
    if config_path is not None:
        args = config_file_args(config_path, config_name) + args
    translation = translate(args)
    if not any(o.startswith("model.path=") for o in translation.overrides):
        raise ValueError("the verl command line gives no actor_rollout_ref.model.path (a local model folder)")
    logging.getLogger("shardrl").info(translation.describe())
    return translation.overrides


def names_run_source(override: str) -> bool:
    key = override.split("=", 1)[0].strip()
    return any(key == k or key.startswith(k + ".") for k in RUN_SOURCE_KEYS)


def run(config: str | None, overrides: list[str]) -> Path | None:
    """Runs training on this rank (the process group is started from torchrun's environment); the run folder,
    or None on a rank that only generates (async_rl.rollout_ranks)."""
    import torch.distributed as dist

    from shardrl.config.schema import load_config
    from shardrl.distributed import init_distributed
    from shardrl.plan.layout import derive_layout
    from shardrl.trainer.logger import check_sinks_installed
    from shardrl.trainer.rl import RLTrainer
    from shardrl.trainer.run_folder import prepare_run_dir
    from shardrl.trainer.run_folder import release_run_dir

    cfg = load_config(config, overrides)
    check_sinks_installed(cfg.trainer.logger)  # before the model loads
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    owns_group = not dist.is_initialized()  # a test (or a caller) may have started it already
    init_distributed()
    split, ok = None, False
    if cfg.async_rl.rollout_ranks:  # disaggregated: from here the default group holds this rank's side only
        from shardrl.trainer.placement import split_world
        from shardrl.trainer.async_rl import RemoteBatches, run_rollout_side

        split = split_world(cfg)
    try:
        if split is not None and split.is_rollout:
            run_rollout_side(cfg, split)
            ok = True
            return None
        # the layout as torchrun made it (a cluster may launch us directly, whatever the config says); the
        # training ranks of a disaggregated run are laid out as one node of their own
        world = dist.get_world_size()
        per_node = world if split is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cfg.trainer.nnodes, cfg.trainer.nproc_per_node = world // per_node, per_node
        derive_layout(cfg, cfg.trainer.nnodes, per_node)
        run_dir = prepare_run_dir(cfg)  # chosen and checked writable; RLTrainer creates and locks it
        failed = True
        try:
            source = None if split is None else (lambda t: RemoteBatches(t, split))  # None: colocated
            trainer = RLTrainer(cfg, run_dir, batch_source=source)
            try:
                trainer.fit()
            except BaseException as e:  # Ctrl-C: rank 0 still writes the summary and curve of the steps done
                if not _was_interrupted(e):
                    raise
                records, total = getattr(trainer, "records", []), cfg.trainer.total_steps
                raise RunInterrupted(write_results(run_dir, records, total) if dist.get_rank() == 0 else "") from None
            if dist.get_rank() == 0:
                done = write_results(run_dir, trainer.records, cfg.trainer.total_steps)
                logging.getLogger("shardrl").info("run folder %s; %s", run_dir, done)
            failed = False
        finally:  # a run that failed before writing anything leaves no folder behind
            release_run_dir(run_dir, failed)
        ok = True
        return run_dir
    finally:
        if split is not None:  # after a failure the other side may be gone: no world group again then
            split.close(restore_world=ok and not owns_group, failed=not ok)
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def train_main(args) -> int:
    """The `shardrl train` subcommand: launches torchrun itself when more than one process is asked for."""
    _setup_logging()
    if getattr(args, "verl", False):
        overrides = verl_overrides(args.config, list(args.overrides), getattr(args, "config_path", None),
                                   getattr(args, "config_name", None))
    else:
        overrides = resolve_overrides(args.config, list(args.overrides))
    from shardrl.config.schema import load_config

    cfg = load_config(args.config, overrides)  # bad config: a clear error before anything starts
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.trainer.nproc_per_node
    nnodes = args.nnodes if args.nnodes is not None else cfg.trainer.nnodes
    for flag, value in (("--nproc-per-node", nproc), ("--nnodes", nnodes)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1 (processes per node / nodes)")
    from shardrl.trainer.logger import check_sinks_installed

    check_sinks_installed(cfg.trainer.logger)  # a missing tensorboard/wandb: said now, not after the model loads
    overrides += [f"trainer.nproc_per_node={nproc}", f"trainer.nnodes={nnodes}"]
    if nnodes > 1 and "RANK" not in os.environ:
        raise ValueError(
            f"a run over {nnodes} nodes needs a rendezvous: on each node start "
            f"`torchrun --nnodes {nnodes} --nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
            "-m shardrl.trainer.main CONFIG key=value ...` (HOST: a node every node reaches)")
    if nproc > 1 and "RANK" not in os.environ:
        warn_oversubscribed(nproc, cfg.trainer.device)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run as torchrun

        from shardrl.plan.layout import derive_layout

        # batch sizes that do not divide: one clear error, before any process (rollout ranks do not train)
        if cfg.async_rl.rollout_ranks:
            from shardrl.trainer.placement import check_rollout_ranks

            check_rollout_ranks(cfg.async_rl.rollout_ranks, nnodes * nproc)
            derive_layout(cfg, 1, nnodes * nproc - cfg.async_rl.rollout_ranks)
        else:
            derive_layout(cfg, nnodes, nproc)
        argv = [f"--nproc-per-node={nproc}", "--nnodes=1", "--standalone", "-m", "shardrl.trainer.main"]
        argv += ([args.config] if args.config else ["--no-config"]) + overrides
        # torchrun forwards Ctrl-C to the ranks and raises here once they are down; rank 0 said how far it got
        for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
            logging.getLogger(name).addFilter(_not_about_sigint)
        _quiet_interrupted_finalizers()
        try:
            torchrun(parse_args(argv))
        except ChildFailedError as e:  # the ranks have said why (a user error: rank 0's `error:` line)
            return _failed_ranks_status(e)
        except (SignalException, KeyboardInterrupt) as e:
            return launcher_interrupted_exit(e)
        return 0
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    reset_stop_signal()
    previous = catch_stop_signals() if main_thread else {}
    try:
        run(args.config, overrides)
    except BaseException as e:
        if not _was_interrupted(e):
            raise
        print(_interrupted_line(e if isinstance(e, KeyboardInterrupt) else KeyboardInterrupt()), file=sys.stderr)
        return interrupted_exit()
    finally:
        restore_signals(previous)
    return 0


def _failed_ranks_status(error) -> int:
    """The exit status of a run whose ranks failed (torchrun's `ChildFailedError`), from the first rank that
    failed (torchrun then stops the others). A rank killed by a signal (the kernel's OOM killer, a `kill`) cannot
    say why itself: one line names it, and the status is 128 + the signal, as a shell reports a killed program;
    a rank that failed otherwise printed its own error, and its status is the run's."""
    rank, failure = error.get_first_failure()
    if failure.exitcode is None or failure.exitcode >= 0:
        return failure.exitcode or 1
    sig = -failure.exitcode
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if sig == signal.SIGKILL else ""
    print(f"error: rank {rank} was killed by {name}{hint}; the other ranks stopped with it", file=sys.stderr)
    return 128 + sig


def warn_oversubscribed(nproc: int, device: str) -> None:
    """A warning when a CPU run starts more processes than the machine has cores: each rank then gets a share of
    a core, and collectives wait on the slowest (it runs, slowly)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and nproc > cores:
        logging.getLogger("shardrl").warning(
            "--nproc-per-node %d on a CPU machine with %d cores: each rank gets a fraction of a core and the run "
            "will crawl; use --nproc-per-node %d or fewer", nproc, cores, cores)


def _not_about_sigint(record: logging.LogRecord) -> bool:
    """torchrun's own lines about passing Ctrl-C on (rank 0 says the one line that matters), and about stopping
    the ranks after one was killed (the launcher says that in one line)."""
    text = record.getMessage()
    return not ("death signal" in text or "closing signal SIGINT" in text or "closing signal SIGTERM" in text
                or "failed (exitcode: -" in text)


def _quiet_interrupted_finalizers() -> None:
    """In the launcher: a finalizer that Ctrl-C itself interrupted (torchrun raises its SignalException in the main
    thread, which may be joining the rendezvous keep-alive thread in a weakref finalizer just then) prints nothing;
    Python would print it as "Exception ignored in ..." with a traceback. Anything else goes to the usual hook."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    default = sys.unraisablehook
    if getattr(default, "quiet_interrupts", False):  # (installed already: a process may launch more than once)
        return

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, (KeyboardInterrupt, SignalException)):
            return
        default(unraisable)

    hook.quiet_interrupts = True
    sys.unraisablehook = hook


def _interrupted_line(e: KeyboardInterrupt) -> str:
    done = f"after {e}" if isinstance(e, RunInterrupted) else "before the first step"
    how = ("interrupted (Ctrl-C)" if _stop_signal in (None, signal.SIGINT)
           else f"stopped by {signal.Signals(_stop_signal).name}")
    return f"{how} {done}"


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so killing the launcher's process group (or the
    launcher alone, by SIGKILL) would leave the ranks training on, holding the run lock and the GPUs. On Linux the
    kernel sends this rank SIGTERM when its launcher dies (prctl PR_SET_PDEATHSIG); one that died already is
    not waited for."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    # SIGKILL: a rank blocked in a collective (no Python runs there to take a SIGTERM) ends all the same
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _peer_gone(e: BaseException) -> bool:
    """Whether `e` is a collective's failure because another rank's process is gone (gloo's closed connection,
    NCCL's remote error)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, (RuntimeError, getattr(dist, "DistError", RuntimeError))) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "remote process exited",
                            "Broken pipe"))


def _rank_main(argv: list[str]) -> int:
    """A rank torchrun started. A user's mistake found here (a `ValueError`: data, model folder, reward
    file) is one `error:` line from rank 0 and exit status 2 on every rank, as in a single process."""
    _die_with_launcher()
    _setup_logging()
    config = None if argv and argv[0] == "--no-config" else (argv[0] if argv and "=" not in argv[0] else None)
    overrides = [a for a in argv if "=" in a]
    rank0 = int(os.environ.get("RANK", 0)) == 0
    catch_stop_signals()
    try:
        run(config, overrides)
    except BaseException as e:
        if _was_interrupted(e):  # Ctrl-C: one line from rank 0; the others stop quietly, whatever they were in
            if rank0:
                print(_interrupted_line(e if isinstance(e, KeyboardInterrupt) else KeyboardInterrupt()),
                      file=sys.stderr)
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
        if _peer_gone(e):  # another rank died mid-collective: the launcher names it in one line
            return 1
        raise
    finally:
        try:
            end_of_run_signals()
        except KeyboardInterrupt:  # (a SIGTERM landing just before it: the run is over, it only exits)
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
