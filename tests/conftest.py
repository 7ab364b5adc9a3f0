"""Test-session settings. Under pytest-xdist (the README's `-n 2`) each worker and every process it starts (gloo
ranks, CLI runs) computes on one thread: two workers already fill CI's two cores, and torch's default of a thread
per core in each of them (and in each of a test's 2-4 ranks) only makes them take turns."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

    import torch

    torch.set_num_threads(1)


# The test files that take longest, longest first (`--durations` on CI's 2 cores, 2026-12-05; a file's tests
# summed). Under `-n 2 --dist loadfile` a file runs whole on one worker, in the order the files are handed out;
# pytest-xdist's own order (most tests first) left files of a few long runs to the end, one worker running them
# alone while the other idled. Longest first, the last files to start are short ones. Files not listed follow,
# most tests first.
LONGEST_FILES = (
    "test_trainer_e2e.py", "test_engine_equivalence.py", "test_serve.py", "test_async_rl.py",
    "test_triton_kernels_cpu.py", "test_checkpoint.py", "test_expert_parallel.py", "test_demo.py", "test_lora.py",
    "test_moe.py", "test_rollout_fast_families.py", "test_real_model.py", "test_step_metrics.py",
    "test_interrupt.py", "test_mesh.py", "test_metrics_invariance.py", "test_trainer_algos.py", "test_two_node.py",
    "test_old_log_probs.py", "test_preference.py", "test_engine_state.py", "test_ulysses.py", "test_model_inputs.py",
    "test_multiturn.py",
)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order below (xdist's reorder: most tests first)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    # a stable sort: each file's tests stay together and in their order
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], item.path.name))
