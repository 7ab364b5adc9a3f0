"""`engine.accumulate_unsharded` (FSDP2): gradients accumulated unsharded over the micro-batches and reduced once,
params kept gathered, give the gradients of the reduce-every-micro-batch path, over two steps (the second
forward must see the stepped params, not the gathered copy of the first step); it is on by default where a
shard is the whole model (one rank, HSDP with fsdp_size=1), off where shards are smaller, and really defers the
reduction (no sharded gradient exists before the last micro-batch's backward)."""

from __future__ import annotations

import pytest
import torch

from shardrl.testing import TINY_MODELS, random_batch, record_grads, run_distributed

pytestmark = pytest.mark.multiproc

OPTIM = dict(lr=1e-2, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.0, clip_grad=0.0)


def _two_steps(accumulate, fsdp_size, offload=False):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardrl.algos.aggregate import agg_loss
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                          EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2, fsdp_size=fsdp_size,
                                       accumulate_unsharded=accumulate, offload_params=offload),
                          OptimConfig(**OPTIM), total_steps=2)
    grads = record_grads(engine)
    seen = []  # per micro-batch: whether a reduced (sharded) gradient existed when its loss was computed

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        # between micro-batches the module holds its sharded params (DTensors, their reduced grads) or, kept
        # gathered, the unsharded ones (their grads not reduced yet)
        seen.append(any(isinstance(p, DTensor) and p.grad is not None for p in engine.module.parameters()))
        loss = agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                        num_global_tokens=num_tokens)
        return loss, {}

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(2):
        batch = random_batch(8, 14, TINY_MODELS["qwen2"]["vocab_size"], seed=10 + step)
        losses.append(engine.train_batch(batch.index(list(range(rank, 8, world))), loss_fn)["loss"])
    return dict(grads=grads, resolved=engine._accumulate_unsharded, seen=seen, losses=losses)


CASES = [(1, -1, True), (2, 1, True), (2, -1, False)]  # world, fsdp_size, accumulate_unsharded's default there


def _each_two_steps(settings: list[tuple]) -> dict:
    """`_two_steps` for each (accumulate, fsdp_size), one engine after the other on the same processes."""
    return {(accumulate, fsdp_size): _two_steps(accumulate, fsdp_size) for accumulate, fsdp_size in settings}


@pytest.fixture(scope="module")
def runs():
    """world size -> (accumulate, fsdp_size) -> `_two_steps`; each world is spawned once, on first use, for
    all its cases (left null and set against its default)."""
    class Lazy(dict):
        def __missing__(self, world):
            settings = [(flag, fsdp) for w, fsdp, default in CASES if w == world for flag in (None, not default)]
            self[world] = run_distributed(_each_two_steps, world, settings)
            return self[world]
    return Lazy()


@pytest.mark.parametrize("world,fsdp_size,default", CASES)
def test_unsharded_accumulation_gives_the_same_gradients(runs, world, fsdp_size, default):
    out = {flag: runs[world][flag, fsdp_size] for flag in (None, not default)}
    on, off = (out[None], out[not default]) if default else (out[not default], out[None])
    assert out[None]["resolved"] is default and out[not default]["resolved"] is (not default)
    assert len(on["grads"]) == len(off["grads"]) == 2
    for step in range(2):
        for name, g in off["grads"][step].items():
            scale = max(float(g.abs().max()), 1e-6)
            torch.testing.assert_close(on["grads"][step][name], g, rtol=0, atol=1e-5 * scale, msg=f"{name} {step}")
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    assert on["losses"][1] != pytest.approx(on["losses"][0])  # the second step sees other data and params
    # 8 // world samples per rank and step in micro-batches of 2: reduced after the last one only, or after each
    k = 8 // world // 2
    assert on["seen"] == [False] * k * 2 and off["seen"] == ([False] + [True] * (k - 1)) * 2


def _offloaded(settings: list[tuple]) -> dict:
    return {setting: _two_steps(*setting) for setting in settings}


def test_offloaded_params_accumulated_unsharded_give_the_same_gradients():
    """`offload_params` with `accumulate_unsharded=true` (the shards cross the host link once a mini-batch): over two
    steps on two ranks, the gradients and losses of the plain reduce-every-micro-batch run, the reduction deferred."""
    out = run_distributed(_offloaded, 2, [(True, -1, True), (False, -1, False), (None, -1, True)])
    on, off, default = out[True, -1, True], out[False, -1, False], out[None, -1, True]
    assert on["resolved"] is True and default["resolved"] is False  # (null stays off with offload)
    for step in range(2):
        for name, g in off["grads"][step].items():
            scale = max(float(g.abs().max()), 1e-6)
            torch.testing.assert_close(on["grads"][step][name], g, rtol=0, atol=1e-5 * scale, msg=f"{name} {step}")
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    assert on["seen"] == [False, False] * 2  # (no sharded gradient before the last micro-batch's backward)
