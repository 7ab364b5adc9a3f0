"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) train through the FSDP2 engine: gradients equal a plain
HF loop's, where the plain loop runs HF's eager experts (a Python loop over the experts a batch hit) and the engine
its default grouped matrix products, over world 1/2, micro-batches and dynamic batches; a router whose top-k
weights are normalized otherwise fails the comparison. Also the FLOP count and the memory ledger of an MoE model
(active parameters)."""

from __future__ import annotations

import logging

import pytest
import torch

from shardrl.config import ConfigError, EngineConfig, ModelConfig, load_config
from shardrl.engine import build_engine
from shardrl.engine.model import load_hf_config
from shardrl.engine.moe import apply_experts_implementation, moe_layer_count, resolve_experts_implementation
from shardrl.perf import model_shape
from shardrl.testing import TINY_MOE_MODELS, run_distributed, tiny_config
from test_engine_equivalence import assert_same_grads, engine_step, reference_step

FAMILIES = sorted(TINY_MOE_MODELS)
# world -> variant -> engine settings
VARIANTS = {
    1: {"mb1": dict(micro_batch_size_per_gpu=1), "mb8": dict(micro_batch_size_per_gpu=8),
        "eager_mb4": dict(micro_batch_size_per_gpu=4)},
    2: {"mb2": dict(micro_batch_size_per_gpu=2), "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24)},
}
EAGER = {"eager_mb4"}  # variants whose engine runs HF's eager experts too


def _engine_runs(world: int, kinds: list[str], model_overrides: dict | None = None) -> dict:
    out = {}
    for kind in kinds:
        for name, engine in VARIANTS[world].items():
            model = {"experts_implementation": "eager" if name in EAGER else "auto"}
            if model_overrides:
                model["tiny"] = {**tiny_config(kind), **model_overrides}
            out[kind, name] = engine_step(kind, engine, model_kwargs=model)
    # which experts' forward the engine's model dispatches to
    engine = build_engine(ModelConfig(tiny=tiny_config(kinds[0])), EngineConfig(param_dtype="float32"))
    experts = next(m for n, m in engine.module.named_modules() if n.endswith("mlp.experts"))
    out["implementation"] = experts.config._experts_implementation
    return out


@pytest.fixture(scope="module")
def reference():
    return {kind: reference_step(kind) for kind in FAMILIES}


@pytest.fixture(scope="module")
def runs():
    return {world: run_distributed(_engine_runs, world, world, FAMILIES) for world in VARIANTS}


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", FAMILIES)
def test_moe_gradients_equal_a_plain_loop_with_eager_experts(runs, reference, kind):
    want = reference[kind]
    for world, variants in VARIANTS.items():
        for name in variants:
            got = runs[world][kind, name]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (world, name)
            assert_same_grads(got["grads"], want["grads"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (world, name)
            diff = (got["log_probs"] - want["log_probs"]).abs().max().item()
            assert diff < 1e-5, (world, name, diff)
    assert runs[1]["implementation"] == runs[2]["implementation"] == "grouped_mm"  # against the loop
    # the experts' own parameters are compared (and have a gradient): the routing is exercised
    experts = [n for n in want["grads"] if "experts" in n]
    assert experts and all(want["grads"][n].abs().max() > 0 for n in experts)


@pytest.mark.multiproc
def test_a_router_normalized_otherwise_fails_the_comparison(reference):
    """What the comparison must catch: Qwen3-MoE's top-k weights left unnormalized (norm_topk_prob off) in the
    engine, against the plain loop's renormalized ones."""
    wrong = run_distributed(_engine_runs, 1, 1, ["qwen3_moe"], {"norm_topk_prob": False})
    with pytest.raises(AssertionError, match="grad diff"):
        assert_same_grads(wrong["qwen3_moe", "mb1"]["grads"], reference["qwen3_moe"]["grads"])


def test_experts_implementation_auto_takes_grouped_mm_where_the_shapes_allow(caplog):
    config = load_hf_config(None, TINY_MOE_MODELS["qwen3_moe"])
    assert resolve_experts_implementation("auto", config) == "grouped_mm"
    assert apply_experts_implementation(config, "auto") == "grouped_mm" and config._experts_implementation == "grouped_mm"
    odd = load_hf_config(None, {**TINY_MOE_MODELS["qwen3_moe"], "moe_intermediate_size": 12})
    with caplog.at_level(logging.INFO, logger="shardrl.engine.moe"):
        assert resolve_experts_implementation("auto", odd) == "eager"
    assert "expert intermediate size 12 not a multiple of 8" in caplog.text
    with pytest.raises(ValueError, match=r"experts_implementation=grouped_mm needs the expert intermediate size \(12\)"):
        apply_experts_implementation(odd, "grouped_mm")
    assert apply_experts_implementation(load_hf_config(None, tiny_config("qwen2")), "auto") is None  # dense
    with pytest.raises(ConfigError, match="model.experts_implementation"):
        load_config(None, ["model.experts_implementation=loop"])


def test_flops_and_ledger_count_the_active_experts():
    from shardrl.layout import derive_layout
    from shardrl.memory import activation_bytes_per_token_layer, phase_ledger

    kwargs = TINY_MOE_MODELS["qwen3_moe"]
    config = load_hf_config(None, kwargs)
    h, i, k, e, layers = 32, 16, 2, 8, 2
    attention = h * 8 * (2 * 4 + 2 * 2)  # q, o: 4 heads of 8; k, v: 2
    mlp = 3 * h * i * k + h * e  # the k routed experts' three matrices, and the router
    shape = model_shape(config)
    assert shape.num_params == layers * (attention + mlp) + h * 101
    # Qwen3-MoE's dense layers (mlp_only_layers) count their dense MLP
    mixed = load_hf_config(None, {**kwargs, "mlp_only_layers": [0]})
    assert moe_layer_count(mixed) == 1
    assert model_shape(mixed).num_params == 2 * attention + mlp + 3 * h * 64 + h * 101
    # activations: the k experts' hidden units per token, not the (unused) dense intermediate_size
    per_token, formula = activation_bytes_per_token_layer(config, 2)
    dense_like, _ = activation_bytes_per_token_layer(load_hf_config(None, {**tiny_config("qwen2")}), 2)
    assert "MLP 2 experts x (4 x 2 B x 16 + 2 x 2 B x 32) + router 4 B x 8" in formula
    cfg = load_config(None, [f"model.tiny={kwargs}".replace("'", '"')])
    ledger = phase_ledger(cfg, derive_layout(cfg, 1, 1), config)
    total = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(config).parameters())
    assert ledger["num_params"] == total  # every expert is stored
    norms_attn = 2 * (4 * 32 + 2 * 32) + 2 * (3 * 32 + 2 * 16) + 2 * 32
    assert per_token == norms_attn + 2 * (4 * 2 * 16 + 2 * 2 * 32) + 4 * 8
    assert per_token != dense_like
