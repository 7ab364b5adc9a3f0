"""The learning-rate schedule and the step skipped on a non-finite gradient norm. (Clipping on the total
norm over shards is checked by test_engine_equivalence.py: the plain loop's norm there is above the clip.)"""

from __future__ import annotations

import math

import pytest
import torch

from shardrl.engine.optim import lr_lambda
from shardrl.testing import TINY_MODELS, random_batch, run_distributed


def test_warmup_then_constant():
    assert [lr_lambda(s, 4, 100, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_min_ratio():
    f = [lr_lambda(s, 2, 12, "cosine", 0.1) for s in range(13)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == pytest.approx(1.0)
    assert f[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert f[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))


def _steps(clip: float):
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                          EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2),
                          OptimConfig(lr=1e-3, clip_grad=clip))
    batch = random_batch(4, 10, 101, seed=2).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    before = {k: v.clone() for k, v in engine.export_weights()}

    def bad(out, mb, nt, ns):
        return (out["log_probs"] * mb["loss_mask"]).sum() * float("inf"), {}

    def good(out, mb, nt, ns):
        return -(out["log_probs"] * mb["advantages"]).sum() / nt, {}

    skipped = engine.train_batch(batch, bad)
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.export_weights())
    ok = engine.train_batch(batch, good)
    return skipped, unchanged, ok, engine.global_step


@pytest.mark.multiproc
def test_non_finite_grad_norm_skips_the_step():
    skipped, unchanged, ok, global_step = run_distributed(_steps, 2, 1.0)
    assert skipped["skipped_step"] == 1.0 and not math.isfinite(skipped["grad_norm"])
    assert unchanged  # the parameters did not move
    assert ok["skipped_step"] == 0.0 and math.isfinite(ok["grad_norm"]) and ok["grad_norm"] > 0
    assert global_step == 1  # only the good step counted (and stepped the LR schedule)


def test_the_fused_cpu_adamw_of_offloaded_parameters_steps_as_the_loop_does():
    """Offloaded parameters step on the host with torch's fused CPU AdamW; the same three steps as the per-tensor
    loop's (the gradients large and small: Adam's update is about lr * sign(g) only where |g| >> eps)."""
    from shardrl.engine.optim import build_optimizer

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(37, 11, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * 10.0 ** k for p in init] for k in (-9, -3, 1)]
    results = []
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = build_optimizer(params, 1e-2, (0.9, 0.95), 1e-8, 0.1, fused=fused)
        assert bool(opt.defaults["fused"]) == fused
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for loop, fused in zip(*results):
        torch.testing.assert_close(fused, loop, atol=1e-6, rtol=1e-5)
        assert (fused - init[0 if fused.dim() == 2 else 1]).abs().max() > 1e-3  # the steps moved them


def _offloaded_engine_optimizer():
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(offload_params=True), OptimConfig())
    return bool(engine.optimizer.defaults["fused"]), {p.device.type for p in engine.optimizer.param_groups[0]["params"]}


@pytest.mark.multiproc
def test_an_offloaded_engine_steps_with_the_fused_cpu_adamw():
    fused, devices = run_distributed(_offloaded_engine_optimizer, 2)
    assert fused and devices == {"cpu"}


def test_plan_says_what_the_host_adam_step_of_offloaded_parameters_costs(capsys):
    import json

    import transformers

    from shardrl.cli import main
    from shardrl.config.schema import EngineConfig
    from shardrl.plan.memory import model_numbers
    from shardrl.plan.offload import host_adam_estimate

    tiny = TINY_MODELS["qwen2"]
    config = transformers.AutoConfig.for_model(**tiny)
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    numbers = model_numbers(config)
    # a node of 8 ranks sharded over 4 (HSDP, 2 replicas): the node steps its 8 shards of a quarter each, 2x the model
    got = host_adam_estimate(numbers, EngineConfig(offload_params=True), 4, 8, "actor.engine", rate=1e6)
    assert got["trained_params_per_node"] == 2 * total and got["seconds"] == pytest.approx(2 * total / 1e6)
    # its host memory: fp32 parameters, gradients and AdamW's two moments (16 B a parameter) of the node's 2x (bf16:
    # 8 B, torch keeping the moments in the parameters' dtype: tests/test_plan_offload.py)
    assert got["host_state_gib"] == pytest.approx(2 * total * 16 / 2**30)
    assert "too much" not in got["line"]
    small = host_adam_estimate(numbers, EngineConfig(offload_params=True), 4, 8, "actor.engine", rate=1e6,
                               host_gib=got["host_state_gib"])
    assert "too much" in small["line"] and "LoRA" in small["line"]
    bf16 = host_adam_estimate(numbers, EngineConfig(offload_params=True), 4, 8, "actor.engine", rate=1e6, master=2)
    assert bf16["host_state_gib"] == pytest.approx(2 * total * (2 + 2 + 4) / 2**30)
    assert host_adam_estimate(numbers, EngineConfig(), 4, 8, "actor.engine") is None
    spec = "{" + ", ".join(f"{k}: {v}" for k, v in tiny.items()) + "}"
    assert main(["plan", f"model.tiny={spec}", "actor.engine.offload_params=true", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["host_adam"]
    assert out["trained_params_per_node"] == total and out["rate_params_per_s"] > 1e5
    assert main(["plan", f"model.tiny={spec}"]) == 0
    assert "steps on the host's CPU" not in capsys.readouterr().out
    assert main(["plan", f"model.tiny={spec}", "actor.engine.offload_params=true"]) == 0
    assert "actor.engine.offload_params=true: the optimizer steps on the host's CPU, about" in capsys.readouterr().out


def test_plan_with_offload_still_prints_the_layout_where_the_ledger_cannot_size_the_model(capsys):
    from shardrl.cli import main

    spec = "{model_type: biogpt, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64}"
    assert main(["plan", f"model.tiny={spec}", "actor.engine.offload_params=true"]) == 0
    out = capsys.readouterr().out
    assert "memory ledger: skipped (" in out and "steps on the host's CPU" not in out


def test_resuming_an_unfused_optimizers_checkpoint_keeps_the_fused_kernel(tmp_path):
    """A checkpoint of an AdamW stepped by the per-tensor loop (a CPU or offloaded run before the fused CPU kernel)
    loads into this run's fused one, which stays fused and steps on as the loop would have."""
    from shardrl.engine.checkpoint import load_engine_state, save_engine_state
    from shardrl.engine.optim import build_optimizer

    def make(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 5)
        opt = build_optimizer(list(model.parameters()), 1e-2, (0.9, 0.95), 1e-8, 0.1, fused)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step(model, opt, seed):
        opt.zero_grad()
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        opt.step()

    loop, opt, sched = make(False)
    step(loop, opt, 0)
    save_engine_state(tmp_path / "ckpt", loop, opt, sched, 1)
    resumed, fused_opt, fused_sched = make(True)
    load_engine_state(tmp_path / "ckpt", resumed, fused_opt, fused_sched)
    assert fused_opt.param_groups[0]["fused"] is True
    step(resumed, fused_opt, 1)
    step(loop, opt, 1)
    for a, b in zip(resumed.parameters(), loop.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-5)
