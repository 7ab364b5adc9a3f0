"""The model-family table (`shardrl.models.families`): one row a family, read by the fast rollout, router replay,
the FLOP count and the memory ledger."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from shardrl.models.families import (FAMILIES, FAST_ROLLOUT_TYPES, check_supported, gated_mlp, is_moe,
                                     moe_layer_count, router_rule)
from shardrl.models.tiny import TINY_MODELS, TINY_MOE_MODELS


def test_every_tiny_config_is_a_row_of_the_table_and_the_fast_rollout_computes_it():
    for name, kwargs in {**TINY_MODELS, **TINY_MOE_MODELS}.items():
        assert kwargs["model_type"] == name and name in FAMILIES
        check_supported(SimpleNamespace(**kwargs))  # no ValueError
        assert is_moe(SimpleNamespace(**kwargs)) == FAMILIES[name].moe


def test_families_the_fast_rollout_does_not_compute_are_refused_with_the_hf_hint():
    assert "gpt2" in FAMILIES and "gpt2" not in FAST_ROLLOUT_TYPES and "qwen2_moe" not in FAST_ROLLOUT_TYPES
    with pytest.raises(ValueError, match="rollout.backend=hf"):
        check_supported(SimpleNamespace(model_type="qwen2_moe"))


def test_the_gated_mlp_rule_reads_the_table():
    assert gated_mlp(SimpleNamespace(model_type="llama")) and gated_mlp(SimpleNamespace(model_type="qwen3_moe"))
    assert not gated_mlp(SimpleNamespace(model_type="gpt2")) and not gated_mlp(SimpleNamespace(model_type="opt"))
    assert gated_mlp(SimpleNamespace(model_type="some_new_llama_like"))  # unknown: Llama-style


def test_the_flop_count_takes_two_mlp_matrices_for_an_ungated_family():
    from shardrl.plan.perf import model_shape

    shape = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=10)
    gated = model_shape(SimpleNamespace(model_type="llama", **shape))
    ungated = model_shape(SimpleNamespace(model_type="gpt2", **shape))
    assert gated.num_params - ungated.num_params == 8 * 16  # the gate matrix, hidden x intermediate


def test_router_rules_by_family():
    assert router_rule(SimpleNamespace(**TINY_MOE_MODELS["mixtral"])) == (True, True)
    assert router_rule(SimpleNamespace(**TINY_MOE_MODELS["qwen3_moe"])) == (True, False)
    assert router_rule(SimpleNamespace(**{**TINY_MOE_MODELS["qwen3_moe"], "norm_topk_prob": False})) == (False, False)
    assert router_rule(SimpleNamespace(model_type="qwen2_moe", norm_topk_prob=True)) == (True, False)
    with pytest.raises(ValueError, match="router replay"):
        router_rule(SimpleNamespace(**TINY_MODELS["llama"]))


def test_routed_layers_skip_dense_ones():
    c = SimpleNamespace(**{**TINY_MOE_MODELS["qwen3_moe"], "num_hidden_layers": 6, "mlp_only_layers": [0],
                           "decoder_sparse_step": 2})
    assert moe_layer_count(c) == 3  # layers 1, 3, 5
    assert moe_layer_count(SimpleNamespace(**TINY_MODELS["qwen2"])) == 0


def test_the_table_is_read_without_torch():
    code = "import sys, shardrl.models.families, shardrl.models.tiny; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
