"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, ...) in the engine.

Hugging Face stores a layer's experts as two 3-D parameters (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I))
and dispatches the experts' forward by `config._experts_implementation`: "eager" loops over the experts a batch
hit, "grouped_mm" sorts the (token, expert) pairs by expert and runs each projection as one grouped matrix
product (`torch._grouped_mm`, forward and backward, CPU and CUDA), "batched_mm" gathers one weight copy per pair
(for decoding; too much memory to train with). FSDP2 shards each 3-D parameter on its expert dimension with the
rest of its decoder block.

`model.experts_implementation` "auto" takes grouped_mm where the grouped product accepts the shapes (its
operands' rows are 16-byte aligned: hidden and expert sizes multiples of 8 elements, which covers fp32 and bf16),
else eager, which computes the same numbers (tests/test_moe.py).
"""

from __future__ import annotations

import logging

from shardrl.modelconfig import text_config

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATIONS = ("auto", "grouped_mm", "eager", "batched_mm")
ALIGN = 8  # elements: 16 bytes of bf16 (32 of fp32), what torch._grouped_mm needs of a row's stride


def is_moe(hf_config) -> bool:
    """Whether the model routes tokens to experts (a config with a per-token expert count)."""
    c = text_config(hf_config)
    return bool(getattr(c, "num_experts_per_tok", None)) and bool(num_experts(c))


def num_experts(hf_config) -> int:
    c = text_config(hf_config)
    return int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0)


def expert_intermediate_size(hf_config) -> int:
    c = text_config(hf_config)
    return int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)


def moe_layer_count(hf_config) -> int:
    """Decoder layers with a routed MLP (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step` keep some
    dense)."""
    c = text_config(hf_config)
    if not is_moe(c):
        return 0
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", None) or 1
    return sum(1 for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def resolve_experts_implementation(name: str, hf_config) -> str:
    """`model.experts_implementation` for this model: auto -> grouped_mm where its shapes allow, else eager."""
    if name not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"model.experts_implementation={name!r}: must be one of {list(EXPERTS_IMPLEMENTATIONS)}")
    if name != "auto":
        return name
    c = text_config(hf_config)
    sizes = {"hidden_size": c.hidden_size, "expert intermediate size": expert_intermediate_size(c)}
    odd = [f"{k} {v}" for k, v in sizes.items() if v % ALIGN]
    if odd:
        log.info("model.experts_implementation=eager (auto: %s not a multiple of %d, which grouped_mm needs)",
                 ", ".join(odd), ALIGN)
        return "eager"
    return "grouped_mm"


def apply_experts_implementation(hf_config, name: str) -> str | None:
    """Sets the experts' forward of an MoE config (every model built from it uses it); None for a dense model."""
    if not is_moe(hf_config):
        return None
    impl = resolve_experts_implementation(name, hf_config)
    if impl == "grouped_mm" and name == "grouped_mm":
        c = text_config(hf_config)
        for key, value in (("hidden_size", c.hidden_size), ("expert intermediate size", expert_intermediate_size(c))):
            if value % ALIGN:
                raise ValueError(f"model.experts_implementation=grouped_mm needs the {key} ({value}) to be a multiple "
                                 f"of {ALIGN} (torch._grouped_mm's row alignment); use auto or eager")
    for config in {id(hf_config): hf_config, id(text_config(hf_config)): text_config(hf_config)}.values():
        config._experts_implementation = impl
    return impl
