"""Old log-probs from the update's own forward (`actor.recompute_old_log_probs=auto` with one mini-batch and
one epoch) give the update that a separate forward pass gives: the same gradients, parameters and metrics;
a non-detached or stale log-prob in their place would not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardrl.algos.aggregate import masked_metric
from shardrl.metrics import metric_value
from shardrl.testing import TINY_MODELS, random_batch, record_grads, run_distributed, small_demo_run

pytestmark = pytest.mark.multiproc


def _one_update_each_way() -> dict:
    from torch.distributed.tensor import DTensor

    from shardrl.config.schema import ActorConfig, EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.trainer.updates import actor_loss_fn

    batch = random_batch(8, 12, 101, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = batch["loss_mask"]
    batch["sampled_log_probs"] = -torch.rand(8, 12, generator=g) * mask
    batch["ref_log_probs"] = -torch.rand(8, 12, generator=g) * mask
    actor_cfg = ActorConfig(use_kl_loss=True, entropy_coeff=0.01)
    reference = actor_loss_fn(actor_cfg, "token-mean")

    def wrong_loss(old_of):  # a loss fed the wrong old log-probs: what a broken skip would do
        def fn(outputs, mb, num_tokens, num_seqs):
            mb = mb.select(list(mb.keys()))
            mb["old_log_probs"] = old_of(outputs, mb)
            return reference(outputs, mb, num_tokens, num_seqs)
        return fn

    out = {}
    for way in ("recompute", "from_forward", "not_detached", "stale"):
        # the same random init each time (seeded by the engine config); micro-batches of 2: 4 forwards
        engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                              EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2),
                              OptimConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.0), total_steps=4)
        grads = record_grads(engine)
        b = batch.select(list(batch.keys()))
        inferred = engine.infer_batch(b, with_entropy=True)
        old = inferred["log_probs"].cpu()
        if way == "recompute":
            b["old_log_probs"] = old
            loss_fn = reference
        elif way == "from_forward":
            loss_fn = actor_loss_fn(actor_cfg, "token-mean", old_from_forward=True, with_ref=True)
        elif way == "not_detached":
            loss_fn = wrong_loss(lambda outputs, mb: outputs["log_probs"])
        else:  # the log-probs of another policy: the same model at temperature 1.5
            b["stale"] = engine.infer_batch(b, temperature=1.5)["log_probs"].cpu()
            loss_fn = wrong_loss(lambda outputs, mb: mb["stale"])
        metrics = engine.train_batch(b, loss_fn, with_entropy=True)
        params = {engine.hf_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                  for n, p in engine.module.named_parameters()}
        out[way] = {"grads": grads[0], "params": params, "metrics": metrics, "old": old,
                    "entropy": inferred["entropy"].cpu()}
    out["batch"] = batch
    return out


def test_the_update_is_identical_either_way():
    out = run_distributed(_one_update_each_way, 1)
    ref, mine = out["recompute"], out["from_forward"]
    assert sum(float(g.abs().sum()) for g in ref["grads"].values()) > 1e-3  # a gradient to compare
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(mine["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, p in ref["params"].items():
        torch.testing.assert_close(mine["params"][name], p, atol=1e-6, rtol=1e-5, msg=name)
    for key in ("loss", "grad_norm", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss",
                "actor/kl_loss"):
        assert mine["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-6, rel=1e-5), key
    # what the trainer measured on the separate pass's old log-probs, now measured in the update
    batch, old, mask = out["batch"], ref["old"], out["batch"]["loss_mask"]
    for key, values in (("rollout/logprob_abs_diff", (old - batch["sampled_log_probs"]).abs()),
                        ("kl/actor_ref", old - batch["ref_log_probs"]), ("actor/entropy", ref["entropy"])):
        assert key not in ref["metrics"]
        assert mine["metrics"][key] == pytest.approx(metric_value(masked_metric(values, mask)), abs=1e-6), key
    # the comparison can tell: a non-detached or a stale log-prob changes the gradient
    for wrong in ("not_detached", "stale"):
        diff = max(float((out[wrong]["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        assert diff > 1e-3, wrong


def _rollout_is_each_way(level: str) -> dict:
    from shardrl.algos.rollout_correction import rollout_is_weights
    from shardrl.config.schema import ActorConfig, AlgorithmConfig, EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.trainer.updates import actor_loss_fn

    batch = random_batch(8, 12, 101, seed=3)
    algo = AlgorithmConfig(rollout_is=True, rollout_is_level=level, rollout_is_threshold=1.3)
    actor_cfg = ActorConfig()
    out = {}
    for way in ("before_update", "in_loss", "no_weights"):
        engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                              EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2),
                              OptimConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.0), total_steps=4)
        grads = record_grads(engine)
        b = batch.select(list(batch.keys()))
        old = engine.infer_batch(b)["log_probs"].cpu()
        # a sampler off by up to +-0.3 nats a token: weights both sides of 1, some above the cap
        noise = (torch.rand(old.shape, generator=torch.Generator().manual_seed(4)) - 0.5) * 0.6
        b["sampled_log_probs"] = (old + noise) * b["loss_mask"]
        if way == "before_update":  # what the trainer does when it runs the old log-prob pass
            b["old_log_probs"] = old
            w, _, m = rollout_is_weights(old, b["sampled_log_probs"], b["loss_mask"], level, "truncate", 1.3)
            b["rollout_is_weights"] = w
            out["expected_metrics"] = {k: float(s_) / float(c) for k, (s_, c) in m.items()}
            loss_fn = actor_loss_fn(actor_cfg, "token-mean", batch_weights=True)
        elif way == "in_loss":
            loss_fn = actor_loss_fn(actor_cfg, "token-mean", old_from_forward=True, rollout_is=algo)
        else:
            loss_fn = actor_loss_fn(actor_cfg, "token-mean", old_from_forward=True)
        metrics = engine.train_batch(b, loss_fn, with_entropy=True)
        out[way] = {"grads": grads[0], "metrics": metrics}
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_in_the_loss_give_the_update_of_the_old_pass(level):
    out = run_distributed(_rollout_is_each_way, 1, level)
    ref, mine = out["before_update"], out["in_loss"]
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(mine["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for key, value in out["expected_metrics"].items():
        assert mine["metrics"][f"rollout_is/{key}"] == pytest.approx(value, abs=1e-6), key
    assert 0 < out["expected_metrics"]["truncated_frac"] < 1  # the cap bites on some tokens, not all
    # the comparison can tell: the same update without the weights has another gradient
    diff = max(float((out["no_weights"]["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
    assert diff > 1e-3


def _train(overrides: list[str]) -> tuple[list[dict], dict]:
    import torch.distributed as dist

    from shardrl.engine.base import Engine
    from shardrl.launch.rank import run

    calls = []  # infer_batch calls on the actor (the ref and critic engines are other objects)
    original = Engine.infer_batch

    def counting(self, *args, **kwargs):
        calls.append(self.optimizer is not None and self.head == "lm")
        return original(self, *args, **kwargs)

    Engine.infer_batch = counting
    try:
        run_dir = run(None, overrides)
    finally:
        Engine.infer_batch = original
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return records, {"actor_infer_calls": sum(calls), "rank": dist.get_rank()}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardrl.trainer.demo import prepare_demo_assets

    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)


def test_runs_with_and_without_the_old_log_prob_pass_log_the_same(assets, tmp_path: Path):
    # one mini-batch (4 prompts x 4 responses), one epoch, KL loss (a ref, so kl/actor_ref is logged)
    # and the rollout correction (truncate mode), whose weights the update then computes in its loss
    common = ["trainer.logger=[jsonl]", "trainer.total_steps=2", "actor.ppo_mini_batch_size=4",
              "actor.use_kl_loss=true", "ref.engine.param_dtype=float32", "actor.entropy_coeff=0.01",
              "algorithm.rollout_is=true"]
    runs = {}
    for mode in ("auto", "always"):
        runs[mode] = run_distributed(_train, 2, small_demo_run(
            assets, tmp_path / mode, *common, f"actor.recompute_old_log_probs={mode}"))
    (auto, auto_info), (always, always_info) = runs["auto"], runs["always"]
    assert auto_info["actor_infer_calls"] == 0 and always_info["actor_infer_calls"] == 2  # one per step
    # timing/ and perf/ are the clock's, and perf/step_tflop counts the pass the skip saves
    # (a maximum is no (sum, count) pair an update's loss can report: rollout/logprob_abs_diff_max needs the pass)
    keys = [k for k in always[0] if not k.startswith(("timing/", "perf/")) and k != "rollout/logprob_abs_diff_max"]
    if "perf/step_tflop" in always[0]:
        assert auto[0]["perf/step_tflop"] < always[0]["perf/step_tflop"]
    assert {"rollout/logprob_abs_diff", "kl/actor_ref", "actor/grad_norm", "rollout_is/weight_mean"} <= set(keys)
    assert set(keys) <= set(auto[0])
    for a, b in zip(auto, always):
        for k in keys:  # step 2 samples from the updated weights: equal only if the updates were
            assert a[k] == pytest.approx(b[k], abs=1e-5, rel=1e-4), (a["step"], k)
    # "auto" recomputes when the update takes 2 mini-batches
    two, info = run_distributed(_train, 1, small_demo_run(
        assets, tmp_path / "two", *common[:2], "trainer.total_steps=1", "actor.ppo_mini_batch_size=2"))
    assert info["actor_infer_calls"] == 1 and "rollout/logprob_abs_diff" in two[0]
