"""Starting the ranks: torchrun (torch.distributed.run) in this process, one rank per process on this node, and
the launcher's exit status from how its ranks ended."""

from __future__ import annotations

import logging
import os
import signal
import sys

from shardrl.launch.signals import launcher_interrupted_exit

RANK_MODULE = "shardrl.launch"
"""The module torchrun starts on each rank (`python -m shardrl.launch --trainer NAME CONFIG key=value ...`)."""


def spawn_ranks(nproc: int, trainer: str, config: str | None, overrides: list[str]) -> int:
    """Runs `nproc` ranks of trainer `trainer` on this node under torchrun; the run's exit status. torchrun
    forwards Ctrl-C to the ranks and raises here once they are down; rank 0 said how far it got."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    argv = [f"--nproc-per-node={nproc}", "--nnodes=1", "--standalone", "-m", RANK_MODULE, "--trainer", trainer]
    argv += ([config] if config else ["--no-config"]) + list(overrides)
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(not_about_sigint)
    quiet_interrupted_finalizers()
    try:
        torchrun(parse_args(argv))
    except ChildFailedError as e:  # the ranks have said why (a user error: rank 0's `error:` line)
        return failed_ranks_status(e)
    except (SignalException, KeyboardInterrupt) as e:
        return launcher_interrupted_exit(e)
    return 0


def failed_ranks_status(error) -> int:
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


def not_about_sigint(record: logging.LogRecord) -> bool:
    """torchrun's own lines about passing Ctrl-C on (rank 0 says the one line that matters), and about stopping
    the ranks after one was killed (the launcher says that in one line)."""
    text = record.getMessage()
    return not ("death signal" in text or "closing signal SIGINT" in text or "closing signal SIGTERM" in text
                or "failed (exitcode: -" in text)


def quiet_interrupted_finalizers() -> None:
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
