"""Stop signals and exit codes of a run: Ctrl-C and SIGTERM stop it where it is (rank 0 says how far it got, in one
line), a full disk is one `error:` line, a rank whose launcher or peer died ends with it."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd program
STORAGE_EXIT = 1
# the machine's storage refused a write (disk full, quota, read-only): the message names the path, a
# traceback adds nothing
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Ctrl-C, and what schedulers, `timeout` and `kill` send: both stop the run where it is, with its summary."""

_sigint_seen = False
_stop_signal: int | None = None  # the signal that stopped the run (SIGINT or SIGTERM)
_run_over = True  # no run catching stop signals (`catch_stop_signals` to `restore_signals`/`end_of_run_signals`)
_again: threading.Timer | None = None  # `_on_stop_signal`'s signal sent again, pending


def is_storage_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; on rank 0 the message says how far the run got and what it wrote."""


def _on_stop_signal(signum, frame) -> None:
    """Ctrl-C or SIGTERM (torchrun forwards either to every rank): stop where we are, once. Later ones are ignored
    so they cannot cut the summary short; one landing while an exception already unwinds (a collective a stopped
    peer left) lets that exception stop the run instead of replacing it mid-clean-up; if that exception was only a
    library's own, caught and gone, the signal comes again half a second later and stops the run then."""
    global _sigint_seen, _stop_signal, _again
    _sigint_seen, _stop_signal = True, signum
    if sys.exc_info()[1] is not None:
        _again = threading.Timer(0.5, _signal_again, (signum,))
        _again.daemon = True
        _again.start()
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _signal_again(signum: int) -> None:
    if not _run_over:  # (a run that ended meanwhile only exits: nothing to stop)
        os.kill(os.getpid(), signum)


def catch_stop_signals() -> dict:
    """`_on_stop_signal` for SIGINT and SIGTERM (from the main thread); returns the handlers before, for
    `restore_signals`."""
    global _run_over
    _run_over = False
    return {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}


def reset_stop_signal() -> None:
    """No stop signal seen yet (a caller's process may run more than one training, from any thread); a signal an
    earlier run was to get again is not sent."""
    global _sigint_seen, _stop_signal, _again
    _sigint_seen, _stop_signal = False, None
    if _again is not None:
        _again.cancel()
        _again = None


def forget_earlier_runs_signals() -> None:
    """A training started outside any run's catching of stop signals (`run` called in-process, not from
    `rank_main` or the launcher, which reset and catch first): a stop signal an earlier training of this process saw
    is not this one's. Left set, it made this run's own error (a ValueError) read as a Ctrl-C, raised as
    `RunInterrupted`, a KeyboardInterrupt, to its caller."""
    if _run_over:
        reset_stop_signal()


def end_of_run_signals() -> None:
    """A rank whose run is over only exits: SIGTERM (the launcher stopping it, say after a peer died) ends it at once
    again; `_on_stop_signal` would raise KeyboardInterrupt in an exit finalizer and print its traceback."""
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


def was_interrupted(e: BaseException) -> bool:
    return _sigint_seen or isinstance(e, KeyboardInterrupt)


def interrupted_line(e: BaseException) -> str:
    """The one line a stopped run prints: what stopped it, and how far it got (a `RunInterrupted`'s message)."""
    done = f"after {e}" if isinstance(e, RunInterrupted) else "before the first step"
    how = ("interrupted (Ctrl-C)" if _stop_signal in (None, signal.SIGINT)
           else f"stopped by {signal.Signals(_stop_signal).name}")
    return f"{how} {done}"


def die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so killing the launcher's process group (or the
    launcher alone, by SIGKILL) would leave the ranks training on, holding the run lock and the GPUs. On Linux the
    kernel sends this rank SIGKILL when its launcher dies (prctl PR_SET_PDEATHSIG); one that died already is
    not waited for."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    # SIGKILL: a rank blocked in a collective (no Python runs there to take a SIGTERM) ends all the same
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def peer_gone(e: BaseException) -> bool:
    """Whether `e` is a collective's failure because another rank's process is gone (gloo's closed connection,
    NCCL's remote error)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, (RuntimeError, getattr(dist, "DistError", RuntimeError))) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "remote process exited",
                            "Broken pipe"))
