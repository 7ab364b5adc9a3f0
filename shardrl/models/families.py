"""Which models the fast rollout computes: the one place that lists the model types and config features it
supports, and reads from an HF config what its decoder needs (per-layer windows and rotary tables,
attention scale, soft-caps). Anything else is a ValueError naming the feature and pointing at
`rollout.backend=hf`.

    family        model_type    what differs from Llama
    Llama 2/3.x   llama         rope scaling (llama3, linear, dynamic, yarn)
    Qwen2/2.5     qwen2         q/k/v biases; sliding-window layers (use_sliding_window)
    Qwen3         qwen3         per-head RMSNorm on q and k before rotary
    Mistral       mistral       a sliding window on every layer (config.sliding_window)
    Gemma 2       gemma2        Gemma's layout (below), attention and final logit soft-caps, alternating
                                sliding-window layers
    Gemma 3 text  gemma3_text   Gemma's layout, q/k RMSNorm, per-layer-type rotary (local and global)
    Qwen3-MoE     qwen3_moe     Qwen3's attention; routed experts: softmax, top-k, renormalized if norm_topk_prob
    Mixtral       mixtral       Mistral's attention; routed experts: softmax, top-k, always renormalized
    OLMoE         olmoe         RMSNorm on the whole q and k projections (all heads at once) before rotary;
                                routed experts as Qwen3-MoE's (on every layer)

Gemma's layout: RMSNorm scales by (1 + weight), embeddings are multiplied by sqrt(hidden_size), each
attention and MLP output is normed before the residual add, the MLP is GeGLU (tanh GELU), and attention
scales by query_pre_attn_scalar ** -0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # per-head RMSNorm on q and k, before rotary
    qk_norm_whole: bool = False  # with qk_norm: the norms span all heads' q (and k) at once (OLMoE)
    gemma: bool = False  # Gemma's layout (module docstring)
    moe: bool = False  # routed experts in place of the MLP (`moe_layers`)
    moe_always_renormalized: bool = False  # the top-k weights always sum to 1 (else config.norm_topk_prob says)
    moe_fp32_weights: bool = False  # the routing weights scale the experts' outputs in fp32 (Mixtral)


FAMILIES: dict[str, Family] = {
    "llama": Family(), "qwen2": Family(), "mistral": Family(), "qwen3": Family(qk_norm=True),
    "gemma2": Family(gemma=True), "gemma3_text": Family(qk_norm=True, gemma=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
    "mixtral": Family(moe=True, moe_always_renormalized=True, moe_fp32_weights=True),
    "olmoe": Family(qk_norm=True, qk_norm_whole=True, moe=True),
}


def moe_layers(config) -> list[bool]:
    """Per layer: whether its MLP is routed experts (Qwen3-MoE keeps `mlp_only_layers` and, with
    `decoder_sparse_step` > 1, the layers between, dense)."""
    n = config.num_hidden_layers
    if not family_of(config).moe:
        return [False] * n
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", None) or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def top_k_normalized(config) -> bool:
    return family_of(config).moe_always_renormalized or bool(getattr(config, "norm_topk_prob", False))
# rope types whose frequencies are fixed for positions the cache holds (dynamic: below max_position_embeddings)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
USE_HF = "; use rollout.backend=hf for this model"


def family_of(config) -> Family:
    return FAMILIES[config.model_type]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation(config) -> str:
    """'silu' or 'gelu_tanh': the MLP's gate activation (Gemma's config calls it hidden_activation)."""
    name = getattr(config, "hidden_activation", None) if family_of(config).gemma else None
    name = name or getattr(config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported by the fast rollout (supported: "
                         f"{sorted(ACTIVATIONS)})" + USE_HF)
    return ACTIVATIONS[name]


def rope_parameters(config) -> dict[str, dict]:
    """{layer_type or 'all': rope params}; Gemma 3 keeps one set per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        return {k: v for k, v in params.items() if v is not None}
    return {"all": params}


def check_supported(config) -> None:
    """Raises a ValueError naming the feature when `config` is not a model the fast decoder computes."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        hint = " (Gemma 3: pass its text config, model_type 'gemma3_text')" if model_type == "gemma3" else ""
        raise ValueError(f"the fast rollout supports model types {sorted(FAMILIES)}, not {model_type!r}{hint}"
                         + USE_HF)
    activation(config)
    for key, params in rope_parameters(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported by the fast rollout (supported: "
                             f"{list(ROPE_TYPES)})" + USE_HF)
    unknown = sorted(set(getattr(config, "layer_types", None) or []) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported by the fast rollout (supported: "
                         f"{list(LAYER_TYPES)})" + USE_HF)
    for flag in ("use_bidirectional_attention", "attention_chunk_size"):
        if getattr(config, flag, None):
            raise ValueError(f"{flag}={getattr(config, flag)!r} is not supported by the fast rollout" + USE_HF)
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={config.clip_qkv!r} (q, k, v clamped) is not supported by the fast rollout"
                         + USE_HF)
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the fast rollout" + USE_HF)


def layer_windows(config) -> list[int | None]:
    """Per layer: the sliding window W (a query at position i sees keys j with i - W < j <= i, as HF's
    `sliding_window_overlay`), or None for full attention."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "mixtral"):  # one window on every layer, when set
        return [window] * n
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def layer_rope_keys(config) -> list[str]:
    """Per layer: the key of its rotary table in `rope_tables` ('all' unless rope differs by layer type)."""
    tables = rope_parameters(config)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [t if t in tables and "all" not in tables else "all" for t in types]


def rope_tables(config, rotary_class) -> dict[str, tuple[torch.Tensor, float]]:
    """{key: (inv_freq (head_dim / 2,) fp32, cos/sin scale)} computed on the CPU by HF's own rotary class
    for the model (`rotary_class`, e.g. `type(model.model.rotary_emb)`), so every scaling type matches HF."""
    with torch.device("cpu"):
        rotary = rotary_class(config)
    if hasattr(rotary, "inv_freq"):
        return {"all": (rotary.inv_freq.float().clone(), float(getattr(rotary, "attention_scaling", 1.0)))}
    # one table per layer type that has layers (Gemma 3 makes none for a type no layer has)
    return {key: (getattr(rotary, f"{key}_inv_freq").float().clone(),
                  float(getattr(rotary, f"{key}_attention_scaling", 1.0)))
            for key in rope_parameters(config) if hasattr(rotary, f"{key}_inv_freq")}


def max_rope_positions(config) -> int | None:
    """Positions past which HF would change the rotary frequencies (dynamic NTK), or None."""
    for params in rope_parameters(config).values():
        if params.get("rope_type", params.get("type")) == "dynamic":
            return int(config.max_position_embeddings)
    return None


def attention_scale(config) -> float:
    if family_of(config).gemma:
        return float(config.query_pre_attn_scalar) ** -0.5
    return head_dim_of(config) ** -0.5


def attention_softcap(config) -> float | None:
    return getattr(config, "attn_logit_softcapping", None) if family_of(config).gemma else None


def final_softcap(config) -> float | None:
    return getattr(config, "final_logit_softcapping", None) if family_of(config).gemma else None
