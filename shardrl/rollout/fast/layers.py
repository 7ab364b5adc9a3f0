"""The fast rollout's decoder modules (`shardrl.rollout.fast.model`), parameter for parameter as HF's
(`model.layers.{i}.self_attn.q_proj.weight`, ...): the norms, attention and MLP projections, the decoder layer (and
the weights it hands a `DecoderBlock`), and the fusing of q/k/v and gate/up into one tensor each."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardrl.models.families import family_of, head_dim_of, moe_layers
from shardrl.rollout.fast.block import rms_norm
from shardrl.rollout.fast.fp8 import Fp8Weight
from shardrl.rollout.fast.moe import SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the rows of `linears`, which become views into it: a GEMM instead of
    several, while each parameter keeps its HF name and an in-place copy into it lands in the fused tensor.
    A missing bias is zeros in the fused one."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                          lin.weight.new_zeros(lin.weight.shape[0]) for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if lin.bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


def fuse_scales(linears: list[nn.Linear]) -> torch.Tensor | None:
    """As `fuse_linears`, for the FP8 scales (`weight_scale` buffers) of `linears`: one tensor, the layers' views
    into it. None where the layers are not quantized."""
    if getattr(linears[0], "weight_scale", None) is None:
        return None
    scale = torch.cat([lin.weight_scale for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight_scale.shape[0]
        lin.weight_scale = scale[start : start + rows]
        start += rows
    return scale


class Attention(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        hidden, d = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias["q_proj"])
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias["k_proj"])
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias["v_proj"])
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias["o_proj"])
        family = family_of(config)
        if family.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's q and k; OLMoE: over all heads' at once
            whole = family.qk_norm_whole
            self.q_norm = RMSNorm(self.num_heads * d if whole else d, config.rms_norm_eps, family.gemma)
            self.k_norm = RMSNorm(self.num_kv_heads * d if whole else d, config.rms_norm_eps, family.gemma)
        self.qkv_weight = self.qkv_bias = self.qkv_scale = None  # set by FastCausalLM.fuse_projections


class MLP(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=bias["gate_proj"])
        self.up_proj = nn.Linear(hidden, inter, bias=bias["up_proj"])
        self.down_proj = nn.Linear(inter, hidden, bias=bias["down_proj"])
        self.gate_up_weight = self.gate_up_bias = self.gate_up_scale = None  # set by FastCausalLM.fuse_projections


class DecoderLayer(nn.Module):
    def __init__(self, config, bias: dict[str, bool], moe: bool = False):
        super().__init__()
        self.self_attn = Attention(config, bias)
        self.mlp = SparseMoE(config) if moe else MLP(config, bias)
        hidden, eps, gemma = config.hidden_size, config.rms_norm_eps, family_of(config).gemma
        self.input_layernorm = RMSNorm(hidden, eps, gemma)
        # Llama's post_attention_layernorm is the MLP's input norm; Gemma's norms the attention output, and
        # its MLP sits between pre_ and post_feedforward_layernorm
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # see `FastCausalLM.set_lora`
        self.lora_scale = 1.0
        self.fp8: tuple[int, bool] | None = None  # (block size, dynamic): see `FastCausalLM.quantize_fp8`

    def block_weights(self) -> tuple:
        """The weights a `DecoderBlock` reads, in its order (None where the family has no such weight)."""
        a, m = self.self_attn, self.mlp
        weight = lambda owner, name: getattr(owner, name).weight if hasattr(owner, name) else None  # noqa: E731
        gemma = hasattr(self, "pre_feedforward_layernorm")
        post_attn = self.post_attention_layernorm.weight if gemma else None
        ln2 = self.pre_feedforward_layernorm.weight if gemma else self.post_attention_layernorm.weight
        fp8 = self.fp8
        quantized = (lambda w, s: Fp8Weight(w, s, *fp8)) if fp8 else (lambda w, s: w)  # noqa: E731
        if a.qkv_weight is None:  # unfused: the base is shared with the trainer (`FastCausalLM.share_weights`)
            qkv = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        else:
            qkv = (quantized(a.qkv_weight, a.qkv_scale), a.qkv_bias)
        if isinstance(m, SparseMoE):  # the MLP slots carry the router and the experts (LayerConsts.top_k > 0)
            gate_up, down = (m.gate.weight, m.experts.gate_up_proj), (m.experts.down_proj, None)
        elif m.gate_up_weight is None:
            gate_up = (m.gate_proj.weight, m.up_proj.weight), (m.gate_proj.bias, m.up_proj.bias)
            down = (m.down_proj.weight, m.down_proj.bias)
        else:
            gate_up = (quantized(m.gate_up_weight, m.gate_up_scale), m.gate_up_bias)
            down = (quantized(m.down_proj.weight, getattr(m.down_proj, "weight_scale", None)), m.down_proj.bias)
        lora = self.lora
        qkv_lora = o_lora = mlp_lora = None
        if lora is not None:  # (A, B) per projection, None where that projection has no adapter
            get = lambda names: (tuple(lora.get(n) for n in names)  # noqa: E731
                                 if any(n in lora for n in names) else None)
            qkv_lora, mlp_lora = get(("q_proj", "k_proj", "v_proj")), get(("gate_proj", "up_proj", "down_proj"))
            o_lora = lora.get("o_proj")
        return (self.input_layernorm.weight, *qkv, weight(a, "q_norm"), weight(a, "k_norm"),
                quantized(a.o_proj.weight, getattr(a.o_proj, "weight_scale", None)), a.o_proj.bias, post_attn, ln2, *gate_up,
                *down, weight(self, "post_feedforward_layernorm"),
                qkv_lora, o_lora, mlp_lora, self.lora_scale)


class Decoder(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, bias, moe) for moe in moe_layers(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, family_of(config).gemma)
