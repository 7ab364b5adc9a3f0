"""Slow reward functions in worker processes (`reward.num_workers`, `reward.timeout_s`): samples are scored in
parallel, and a sample that runs past its time limit has its worker killed and replaced (pebble's `ProcessPool`
does both) and scores like a failing sample.

Workers start with `spawn` (forking a process that holds torch's threads and a process group is unsafe) and each
imports the reward file itself: a function from a user file cannot be pickled into a fresh process by reference.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import TimeoutError as FutureTimeout


_worker_fn = None  # the user's bound reward function in a worker; None: each row's built-in


def _init_worker(path: str | None, name: str, reward_kwargs: dict) -> None:
    global _worker_fn
    from shardrl.rewards.manager import bind_reward_function, load_reward_function

    if path is not None:
        _worker_fn = bind_reward_function(load_reward_function(path, name, reward_kwargs), reward_kwargs)


def _score_in_worker(item: dict):
    from shardrl.rewards.manager import builtin_scorer, score_item

    try:
        return score_item(_worker_fn or builtin_scorer(item["data_source"]), item)
    except SystemExit as e:  # a worker that exits would look like a crash: the parent says what happened
        return SystemExit(e.code)


class RewardPool:
    """`num_workers` processes scoring one sample each at a time, `timeout_s` seconds at most per sample."""

    def __init__(self, num_workers: int, timeout_s: float | None, path: str | None = None,
                 name: str = "compute_score", reward_kwargs: dict | None = None):
        self.timeout_s = timeout_s
        from pebble import ProcessPool  # here: a run without reward workers does not need it

        self.pool = ProcessPool(max_workers=num_workers, initializer=_init_worker,
                                initargs=(path, name, dict(reward_kwargs or {})),
                                context=multiprocessing.get_context("spawn"))

    def score(self, items: list[dict]) -> list:
        """Per item: (score, metrics) as `rewards.manager.score_item` returns them, or the exception it ended with (a
        `TimeoutError` past `timeout_s`, `SystemExit` when the function called sys.exit)."""
        import pebble

        futures = [self.pool.schedule(_score_in_worker, args=(item,), timeout=self.timeout_s) for item in items]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except FutureTimeout:
                results.append(TimeoutError(f"took longer than reward.timeout_s={self.timeout_s:g} s (its worker "
                                            "was stopped)"))
            except pebble.ProcessExpired as e:
                results.append(RuntimeError(f"its worker process died (exit code {e.exitcode}): out of memory, or "
                                            "a crash in native code"))
            except Exception as e:  # the reward function's own error, raised in the worker
                results.append(e)
        return results

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()
