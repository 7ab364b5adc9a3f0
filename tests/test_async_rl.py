"""Disaggregated, asynchronous RL on CPU (shardrl.trainer.async_rl): with max_staleness=0 the rank split gives
the synchronous run's numbers; with a bound the staleness follows the schedule and never passes it; every
step trains exactly its own prompts (none twice, none skipped), also after a resume; a failure on the
training ranks stops the rollout ranks at once; the config errors."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from shardrl.config.schema import ConfigError, load_config
from shardrl.testing import run_distributed, small_demo_run
from shardrl.trainer.async_rl import generating_version, pushes_after_step
from shardrl.trainer.demo import prepare_demo_assets

VARIED_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return (sum(map(ord, solution_str)) % 7) / 6.0\n")
COMPARED_SKIP = ("timing/", "perf/", "memory/", "async/", "weight_sync/")


def test_schedule_staleness_stays_in_bound_and_every_pushed_version_is_used():
    for total in (1, 2, 5):
        for bound in (0, 1, 2, 3):
            for start in range(total):
                versions = [generating_version(k, start, bound) for k in range(start, total)]
                # the trained policy at step k is version k: staleness in [0, bound], never from the future
                assert all(0 <= k - v <= bound for k, v in zip(range(start, total), versions))
                assert versions == sorted(versions) and versions[0] == start
                pushed = [k + 1 for k in range(start, total) if pushes_after_step(k, total, bound)]
                # the rollout receives versions start+1 .. the last it generates with, each once
                assert pushed == list(range(start + 1, versions[-1] + 1))
    assert [generating_version(k, 0, 2) for k in range(5)] == [0, 0, 0, 1, 2]


def test_weight_buckets_align_every_tensor():
    from shardrl.rollout.weight_sync import _layout

    header = [("a", (3,), torch.bfloat16), ("b", (2, 5), torch.float32), ("c", (), torch.int64), ("d", (7,), torch.uint8)]
    offsets, total = _layout(header)
    assert offsets == [0, 16, 64, 80] and total == 96  # 6 -> 16, 40 -> 48, 8 -> 16, 7 -> 16 bytes


def test_config_errors():
    with pytest.raises(ConfigError, match="async_rl.rollout_ranks >= 1"):
        load_config(None, ["async_rl.max_staleness=1", "algorithm.rollout_is=true"])
    with pytest.raises(ConfigError, match="algorithm.rollout_is=true"):
        load_config(None, ["async_rl.rollout_ranks=1", "async_rl.max_staleness=1"])
    with pytest.raises(ConfigError, match="dynamic sampling"):
        load_config(None, ["async_rl.rollout_ranks=1", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="async_rl.rollout_ranks"):
        load_config(None, ["async_rl.rollout_ranks=-1"])
    with pytest.raises(ConfigError, match="async_rl.partial_rollout.*rollout_ranks >= 1"):
        load_config(None, ["async_rl.partial_rollout=true"])
    with pytest.raises(ConfigError, match="async_rl.partial_rollout.*multi_turn"):
        load_config(None, ["async_rl.rollout_ranks=1", "async_rl.partial_rollout=true", "rollout.multi_turn.enable=true",
                           "rollout.multi_turn.tools=[calculator]"])
    cfg = load_config(None, ["async_rl.rollout_ranks=1", "async_rl.max_staleness=2", "algorithm.rollout_is=true"])
    assert (cfg.async_rl.rollout_ranks, cfg.async_rl.max_staleness) == (1, 2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)


def _model_numel(assets) -> int:
    """Elements in the demo model's weight files: what one weight push streams."""
    from safetensors import safe_open

    total = 0
    for path in Path(assets).rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def run_recording(overrides: list[str]) -> dict | None:
    """`run` on this rank, recording on each training rank the prompts and policy versions of every step's
    batch; rank 0 returns the metrics and every rank's record (None from a rollout rank)."""
    import torch.distributed as dist

    from shardrl.trainer import async_rl, rl
    from shardrl.launch.rank import run

    steps = []
    batch_sync, batch_async = rl.LocalBatches.batch, async_rl.RemoteBatches.batch

    def recording(original):
        def _batch(self, step, items, round_index=0):
            batch = original(self, step, items, round_index)
            versions = batch["policy_version"].unique().tolist() if "policy_version" in batch else [step]
            steps.append({"step": step, "prompts": async_rl.prompt_key(items), "versions": versions})
            if "token_version" in batch:
                steps[-1]["token_version"] = batch["token_version"].clone()
                steps[-1]["policy_version"] = batch["policy_version"].clone()
            return batch
        return _batch

    rl.LocalBatches.batch = recording(batch_sync)
    async_rl.RemoteBatches.batch = recording(batch_async)
    try:
        run_dir = run(None, overrides)
    finally:
        rl.LocalBatches.batch, async_rl.RemoteBatches.batch = batch_sync, batch_async
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, steps if run_dir is not None else None)
    if run_dir is None:
        return None
    with open(run_dir / "metrics.jsonl") as f:
        return {"ranks": every, "metrics": [json.loads(line) for line in f]}


def _learned(record: dict) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(COMPARED_SKIP)} for m in record["metrics"]]


@pytest.mark.multiproc
def test_async_runs_match_sync_and_keep_the_staleness_bound(assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(VARIED_REWARD)
    args = ("trainer.logger=[jsonl]", "trainer.total_steps=4", "algorithm.rollout_is=true",
            f"reward.function_path={reward}")
    sync = run_distributed(run_recording, 1, small_demo_run(assets, tmp_path / "sync", *args))
    # max_staleness=0 on 1 training + 1 rollout rank: the synchronous run's numbers, step by step (the
    # weights, 1.2 MB, stream in two buckets of 1 MiB)
    on_policy = run_distributed(run_recording, 2, small_demo_run(assets, tmp_path / "s0", *args,
                                                                "async_rl.rollout_ranks=1", "async_rl.weight_bucket_mb=1"))
    assert len(sync["metrics"]) == 4 and all(m["actor/grad_norm"] > 0 for m in sync["metrics"])
    assert _learned(on_policy) == _learned(sync)
    assert [m["async/staleness"] for m in on_policy["metrics"]] == [0, 0, 0, 0]
    assert on_policy["metrics"][0]["weight_sync/bytes"] == 4 * _model_numel(assets)  # fp32 on the CPU
    assert on_policy["metrics"][-1]["weight_sync/bytes"] == 0  # no later batch needs the last weights

    # max_staleness=2: step k is generated by version max(k - 2, 0); the same prompts in the same order
    stale = run_distributed(run_recording, 2, small_demo_run(
        assets, tmp_path / "s2", *args, "async_rl.rollout_ranks=1", "async_rl.max_staleness=2",
        "trainer.save_freq=2", "trainer.keep_last=0"))
    assert [m["async/staleness"] for m in stale["metrics"]] == [0, 1, 2, 2]
    trained = stale["ranks"][0]
    assert [s["versions"] for s in trained] == [[0], [0], [0], [1]]
    assert [s["prompts"] for s in trained] == [s["prompts"] for s in sync["ranks"][0]]
    assert stale["ranks"][1] is None  # the rollout rank
    assert _learned(stale)[0] == _learned(sync)[0]  # step 0 is on-policy: the same numbers
    # step 1 trains version 1 on a batch of version 0: other numbers, and the sampler/trainer mismatch shows
    assert _learned(stale)[1]["actor/grad_norm"] != _learned(sync)[1]["actor/grad_norm"]
    assert stale["metrics"][1]["rollout/logprob_abs_diff"] > 10 * sync["metrics"][1]["rollout/logprob_abs_diff"]

    # resumed from the checkpoint of step 2: the batches in flight then (steps 3, 4) are generated again,
    # from the checkpoint's policy, for the same prompts
    resumed = run_distributed(run_recording, 2, small_demo_run(
        assets, tmp_path / "resumed", *args, "async_rl.rollout_ranks=1", "async_rl.max_staleness=2",
        f"trainer.resume={tmp_path / 's2' / 'checkpoints' / 'step_000002'}"))
    assert [m["step"] for m in resumed["metrics"]] == [3, 4]
    assert [m["async/staleness"] for m in resumed["metrics"]] == [0, 1]
    again = resumed["ranks"][0]
    assert [s["versions"] for s in again] == [[2], [2]]
    assert [s["prompts"] for s in again] == [s["prompts"] for s in sync["ranks"][0][2:]]


def run_partial(overrides: list[str], last_push: int) -> dict | None:
    """`run_recording` with partial rollouts made certain to happen: on its 4th poll of a generate call the
    rollout rank waits for the next push when one is still to come (versions 1..last_push are pushed) and can
    come during that call (version v + 1 is pushed after step v trains, so only once this rank has sent step
    v's batch: never during step 0's generation), so weights change in the middle of those responses whatever
    the speeds of the two sides."""
    from shardrl.trainer import async_rl

    calls, sent = [0], [-1]  # polls in this generate call; batches generated before it
    generate_batch, poll = async_rl.generate_batch, async_rl.RolloutWeights.poll

    def counted_generate(*args, **kwargs):
        calls[0] = 0
        sent[0] += 1
        return generate_batch(*args, **kwargs)

    def waiting_poll(self):
        calls[0] += 1
        if calls[0] == 4 and self.version < min(last_push, sent[0]):
            deadline = time.perf_counter() + 60
            while self._pushed() <= self.received and time.perf_counter() < deadline:
                time.sleep(0.005)
        return poll(self)

    async_rl.generate_batch, async_rl.RolloutWeights.poll = counted_generate, waiting_poll
    try:
        return run_recording(overrides)
    finally:
        async_rl.generate_batch, async_rl.RolloutWeights.poll = generate_batch, poll


@pytest.mark.multiproc
def test_partial_rollouts_change_weights_inside_responses_within_the_bound(assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(VARIED_REWARD)
    args = ("trainer.logger=[jsonl]", "trainer.total_steps=4", "algorithm.rollout_is=true",
            f"reward.function_path={reward}", "async_rl.rollout_ranks=1", "async_rl.max_staleness=1")
    whole = run_distributed(run_recording, 2, small_demo_run(assets, tmp_path / "whole", *args))
    # pushes after steps 0 and 1 (versions 1 and 2) land inside the generation of steps 1 and 2
    partial = run_distributed(run_partial, 2, small_demo_run(assets, tmp_path / "partial", *args,
                                                             "async_rl.partial_rollout=true"), 2)
    trained, metrics = partial["ranks"][0], partial["metrics"]
    assert [s["prompts"] for s in trained] == [s["prompts"] for s in whole["ranks"][0]]
    for s, m in zip(trained, metrics):
        versions, first = s["token_version"], s["policy_version"]
        real = versions >= 0
        assert torch.equal(first, versions[:, 0])  # each response's version: its first token's
        assert 0 <= s["step"] - int(versions[real].min()) <= 1 and int(versions[real].max()) <= s["step"]
        assert m["async/staleness"] == s["step"] - int(versions[real].min())
    # steps 1 and 2: every response began under the old version; those still running at the push end under
    # the new one
    for k in (1, 2):
        versions = trained[k]["token_version"]
        assert trained[k]["versions"] == [k - 1]
        assert set(versions[versions >= 0].tolist()) == {k - 1, k}
        spans = versions.max(1).values > versions[:, 0]
        assert metrics[k]["async/partial_frac"] == pytest.approx(spans.float().mean().item())
        assert spans.float().mean() > 0.3
        assert 0 < metrics[k]["async/token_staleness_mean"] < 1
    assert [metrics[k]["async/partial_frac"] for k in (0, 3)] == [0.0, 0.0]
    assert _learned(partial)[0] == _learned(whole)[0]  # step 0: no push was due, the same numbers
    # step 1 trains tokens of version 1 as well: other numbers than the whole-response run, closer to on-policy
    assert _learned(partial)[1]["actor/grad_norm"] != _learned(whole)[1]["actor/grad_norm"]
    assert metrics[1]["rollout/logprob_abs_diff"] < whole["metrics"][1]["rollout/logprob_abs_diff"]


FAILING_REWARD = ("calls = [0]\n"
                  "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    calls[0] += 1\n"
                  "    if calls[0] > 32:  # steps 0 and 1 score, every sample of step 2 fails\n"
                  "        raise RuntimeError('reward service down')\n"
                  "    return 0.5\n")


def _interrupted_generate(original):
    """Generation that is Ctrl-C'd on its third call (the rollout rank's step 2)."""
    calls = [0]

    def generate_batch(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    return generate_batch


def _failing_worker(rank: int, world: int, port: int, overrides: list[str], out: str, interrupt: bool) -> None:
    if interrupt:
        from shardrl.trainer import async_rl

        async_rl.generate_batch = _interrupted_generate(async_rl.generate_batch)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from shardrl.distributed import init_distributed
    from shardrl.launch.rank import run

    init_distributed(timeout_s=120)
    t0 = time.perf_counter()
    try:
        run(None, overrides)
        result = ("ok", "")
    except BaseException as e:
        result = (type(e).__name__, str(e))
    Path(out, f"rank{rank}.json").write_text(json.dumps([*result, time.perf_counter() - t0]))


@pytest.mark.multiproc
def test_a_failure_on_the_training_side_stops_the_rollout_side(assets, tmp_path):
    import torch.multiprocessing as mp

    from shardrl.testing import _free_port

    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    overrides = small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=6",
                               f"reward.function_path={reward}", "async_rl.rollout_ranks=1",
                               "async_rl.max_staleness=1", "algorithm.rollout_is=true")
    start = time.perf_counter()
    mp.spawn(_failing_worker, args=(2, _free_port(), overrides, str(tmp_path), False), nprocs=2, join=True)
    trainer, rollout = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert trainer[0] == "ValueError" and "failed on all 16 samples" in trainer[1]
    # the rollout rank was waiting for weights or sending a batch: it stops, saying why, not at the timeout
    assert rollout[0] == "PeerStopped" and "training ranks stopped" in rollout[1]
    assert time.perf_counter() - start < 100


@pytest.mark.multiproc
def test_ctrl_c_on_the_rollout_side_stops_the_training_side(assets, tmp_path):
    import torch.multiprocessing as mp

    from shardrl.testing import _free_port

    overrides = small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=6",
                               "async_rl.rollout_ranks=1", "async_rl.max_staleness=1", "algorithm.rollout_is=true")
    start = time.perf_counter()
    mp.spawn(_failing_worker, args=(2, _free_port(), overrides, str(tmp_path), True), nprocs=2, join=True)
    trainer, rollout = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rollout[0] == "KeyboardInterrupt"
    assert trainer[0] == "PeerStopped" and "rollout ranks stopped" in trainer[1]
    assert time.perf_counter() - start < 100
    logged = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    # step 0 trained; step 1's batch was sent but may have died with the rollout rank; step 2's never came
    assert logged in ([1], [1, 2])


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_one_step_off_streams_weights_over_nccl(assets, tmp_path):
    """1 GPU trains, 1 generates with the fast rollout (bf16 weights arrive as views of NCCL buffers); the
    same run with max_staleness=0 samples step 0 as the one-GPU synchronous run does (the same weights and
    seeds; later steps may differ by the GPU's nondeterministic reductions in training)."""
    args = ("trainer.logger=[jsonl]", "trainer.total_steps=3", "algorithm.rollout_is=true", "rollout.backend=fast",
            "rollout.fast.compile=false", "async_rl.weight_bucket_mb=1")
    sync = run_distributed(run_recording, 1, small_demo_run(assets, tmp_path / "sync", *args))
    on_policy = run_distributed(run_recording, 2, small_demo_run(assets, tmp_path / "s0", *args,
                                                                "async_rl.rollout_ranks=1"))
    for key in ("reward/mean", "response/length_mean"):
        assert on_policy["metrics"][0][key] == sync["metrics"][0][key]
    assert [s["prompts"] for s in on_policy["ranks"][0]] == [s["prompts"] for s in sync["ranks"][0]]
    stale = run_distributed(run_recording, 2, small_demo_run(assets, tmp_path / "s1", *args,
                                                            "async_rl.rollout_ranks=1", "async_rl.max_staleness=1"))
    assert [m["async/staleness"] for m in stale["metrics"]] == [0, 1, 1]
    # the fast rollout's bf16 weights, every tensor of the model once
    assert stale["metrics"][0]["weight_sync/bytes"] == 2 * _model_numel(assets)
    assert stale["metrics"][0]["weight_sync/gb_per_s"] > 0
