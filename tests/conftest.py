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
