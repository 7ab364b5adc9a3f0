"""The Triton kernels (the fast rollout's decode attention and sampler, the policy head's passes) checked on the
CPU by Triton's interpreter (`tests/triton_interpreter_checks.py`, in a fresh process with TRITON_INTERPRET=1).
The same kernels run compiled on a GPU in the cuda tests of tests/test_rollout_fast.py and
tests/test_logprob.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("triton_interpreter_checks.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs the triton package (pip install -e '.[test]' on Linux x86-64)")
@pytest.mark.parametrize("kernel", ["attention", "sampler", "head", "cascade", "prefill"])
def test_kernel_in_triton_interpreter(kernel):
    root = CHECKS.parent.parent
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, str(CHECKS), kernel], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{kernel}: ok" in run.stdout
