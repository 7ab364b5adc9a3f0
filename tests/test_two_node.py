"""Two nodes, on one CPU machine: two `torchrun` launchers of 2 processes each, joined by a c10d rendezvous
on loopback (as two hosts would be over the network), run a GRPO step with HSDP (`fsdp_size=2`: sharded
within a node, replicated across the two) and end with the same actor parameters as one launcher of 4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardrl.testing import _free_port, small_demo_run
from shardrl.trainer.demo import prepare_demo_assets

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 600


def _torchrun(launcher_args: list[str], overrides: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "shardrl.trainer.main", "--no-config",
           *overrides]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, f"launcher exit {proc.returncode}:\n{log.read_text()[-4000:]}"


def _actor_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / "actor.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "step_000001" / "actor", out)
    return {k: v for k, v in torch.load(out, weights_only=False)["model"].items()}


def test_two_node_hsdp_run_equals_one_node_of_four(tmp_path):
    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=5)
    # one step; HSDP 2 x 2; a fixed-size micro-batch; the entropy bonus gives a gradient whatever the rewards
    args = ("trainer.total_steps=1", "trainer.save_freq=1", "trainer.logger=[jsonl]", "actor.engine.fsdp_size=2",
            "actor.entropy_coeff=0.01", "trainer.nnodes=2", "trainer.nproc_per_node=2")
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    port = _free_port()
    rdzv = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two_node_test", "--max-restarts=0"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_torchrun(rdzv, small_demo_run(assets, two, *args), log) for log in logs]
    _wait(nodes, logs)
    log = tmp_path / "single.log"
    _wait([_torchrun(["--standalone", "--nnodes=1", "--nproc-per-node=4"],
                     small_demo_run(assets, one, *args[:-2]), log)], [log])

    records = {}
    for name, folder in (("two", two), ("one", one)):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        records[name] = [json.loads(line) for line in lines]
    assert [r["step"] for r in records["two"]] == [1]
    assert records["two"][0]["actor/grad_norm"] > 0  # the step moved the weights
    for key in ("reward/mean", "actor/loss", "actor/grad_norm"):
        assert records["two"][0][key] == pytest.approx(records["one"][0][key], rel=1e-5, abs=1e-7), key
    got, want = _actor_params(two), _actor_params(one)
    assert sorted(got) == sorted(want) and len(got) > 5
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
