"""A decoder layer of the fast rollout's model (`shardrl.rollout.fast.model`) as functions of tensors: the math
(RMSNorm, rotary, the q/k/v projection, the gated MLP, LoRA deltas, FP8-aware linears), the parts around attention
that compile (`attention_inputs`, `attention_output_and_mlp`), and `DecoderBlock`, which runs them with the cache
writes and attention for a prefill chunk or a decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardrl.rollout.fast.attention import (LayerConsts, SDPADecodeAttention, TritonDecodeAttention,
                                            softcapped_attention, visible_keys)
from shardrl.rollout.fast.fp8 import Fp8Weight, fp8_linear
from shardrl.rollout.fast.moe import moe_mlp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """HF's RMSNorm: normalized in fp32, then scaled by `weight` after the cast back (Llama, Qwen, Mistral)
    or, with `offset` (Gemma), by (1 + weight) in fp32 before it."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0,
                   axes: torch.Tensor | None = None):
    """cos, sin (*positions.shape, head_dim) in `dtype`; angles in fp32, times `scaling` (yarn's attention
    factor, 1 otherwise), as HF computes them. With `axes` (head_dim / 2,) (M-RoPE, `families.mrope_axes`),
    `positions` is (3, *shape): frequency j turns by the position on axis axes[j]; cos, sin (*shape, head_dim)."""
    if axes is not None:
        positions = positions[axes].movedim(0, -1)  # (*shape, D/2): each frequency's own axis
        freqs = positions.float() * inv_freq
    else:
        freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def lora_delta(x, adapter, scale: float):
    """scale * B (A x) computed in the adapters' fp32 (x cast to it), or None without an adapter. (The trainer's
    FSDP2 mixed precision computes it in param_dtype; in fp32 the rollout came closer to the trainer's log-probs
    than a merged bf16 weight: bench/RESULTS.md, "LoRA".)"""
    if adapter is None:
        return None
    a, b = adapter
    return F.linear(F.linear(x.to(a.dtype), a), b) * scale


def plus(y, delta):
    """y + delta, added in fp32 and rounded to y's dtype."""
    return y if delta is None else (y.float() + delta).to(y.dtype)


def linear(x, w, b=None):
    """F.linear, or `fp8_linear` where `w` is an `Fp8Weight` (rollout.quantization=fp8)."""
    return fp8_linear(x, w, b) if isinstance(w, Fp8Weight) else F.linear(x, w, b)


def project_qkv(x, qkv_w, qkv_b, num_heads: int, num_kv_heads: int, head_dim: int, lora=None, scale: float = 1.0):
    """q (..., Hq*D), k, v (..., Hkv*D): one GEMM on the fused q/k/v weight, or three where `qkv_w` is the
    tuple (q, k, v) (a base shared with the trainer, see `FastCausalLM.share_weights`); `lora`: the (A, B)
    adapters of q, k, v (or None), added times `scale`."""
    if isinstance(qkv_w, tuple) and not isinstance(qkv_w, Fp8Weight):
        q, k, v = (F.linear(x, w, b) for w, b in zip(qkv_w, qkv_b))
    else:
        kv_size = num_kv_heads * head_dim
        q, k, v = linear(x, qkv_w, qkv_b).split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    if lora is not None:
        q, k, v = (plus(y, lora_delta(x, ab, scale)) for y, ab in zip((q, k, v), lora))
    return q, k, v


def gated_mlp(x, gate_up_w, gate_up_b, down_w, down_b, act: str = "silu", lora=None, scale: float = 1.0):
    """down(act(gate(x)) * up(x)) with gate and up as one GEMM on the fused weight (or two where `gate_up_w` is
    the tuple (gate, up)): SwiGLU, or GeGLU with act='gelu_tanh' (Gemma); `lora`: the adapters of gate, up,
    down (or None)."""
    if isinstance(gate_up_w, tuple) and not isinstance(gate_up_w, Fp8Weight):
        gate, up = (F.linear(x, w, b) for w, b in zip(gate_up_w, gate_up_b))
    else:
        gate, up = linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
    if lora is not None:
        gate, up = plus(gate, lora_delta(x, lora[0], scale)), plus(up, lora_delta(x, lora[1], scale))
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    h = gate * up
    out = linear(h, down_w, down_b)
    return out if lora is None else plus(out, lora_delta(h, lora[2], scale))


def attention_inputs(x, cos, sin, ln1, qkv_w, qkv_b, q_norm, k_norm, eps: float, num_heads: int,
                     num_kv_heads: int, head_dim: int, gemma: bool, lora=None, scale: float = 1.0):
    """RMSNorm, q/k/v projection, q/k norms (if given) and rotary for N tokens: x (N, hidden), cos, sin
    (N, 1, D) -> q (N, Hkv, G, D) (in decode, the G query heads sharing a KV head are its "query positions":
    GQA without copying the cache), k, v (N, Hkv, D). `gemma`: norms scale by (1 + weight); `lora`, `scale`: as
    `project_qkv`."""
    b = x.shape[0]
    q, k, v = project_qkv(rms_norm(x, ln1, eps, gemma), qkv_w, qkv_b, num_heads, num_kv_heads, head_dim, lora, scale)
    if q_norm is not None and q_norm.shape[0] != head_dim:  # OLMoE: one norm over all heads (shapes decide)
        q, k = rms_norm(q, q_norm, eps, gemma), rms_norm(k, k_norm, eps, gemma)
        q_norm = k_norm = None
    q, k = q.view(b, num_heads, head_dim), k.view(b, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, gemma), rms_norm(k, k_norm, eps, gemma)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k, v.view(b, num_kv_heads, head_dim)


def attention_output_and_mlp(x, attn, o_w, o_b, post_attn_ln, ln2, gate_up_w, gate_up_b, down_w, down_b,
                             post_ff_ln, eps: float, gemma: bool, act: str, o_lora=None, mlp_lora=None,
                             scale: float = 1.0, top_k: int = 0, normalize_top_k: bool = False,
                             fp32_route: bool = False, with_route: bool = False):
    """o_proj and the residual add, then the MLP and its residual add; Gemma norms each output first. `o_lora`,
    `mlp_lora`: LoRA adapters (see `project_qkv`). `top_k` > 0: routed experts (`moe_mlp`), gate_up_w the
    router's weight, gate_up_b the experts' gate_up_proj, down_w their down_proj; `with_route` (routed experts
    only) returns (x, experts (T, k))."""
    attn = attn.reshape(x.shape[0], -1)
    h = plus(linear(attn, o_w, o_b), lora_delta(attn, o_lora, scale))
    if post_attn_ln is not None:
        h = rms_norm(h, post_attn_ln, eps, gemma)
    x = x + h
    experts = None
    if top_k:
        h = moe_mlp(rms_norm(x, ln2, eps, gemma), gate_up_w, gate_up_b, down_w, act, top_k, normalize_top_k,
                    fp32_route, with_route)
        h, experts = h if with_route else (h, None)
    else:
        h = gated_mlp(rms_norm(x, ln2, eps, gemma), gate_up_w, gate_up_b, down_w, down_b, act, mlp_lora, scale)
    if post_ff_ln is not None:
        h = rms_norm(h, post_ff_ln, eps, gemma)
    return (x + h, experts) if with_route else x + h


def _prefill_inputs(*args):
    return attention_inputs(*args)


def _prefill_output(*args):
    return attention_output_and_mlp(*args)


PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


class DecoderBlock:
    """A decoder layer as functions of tensors only (one compilation serves every layer), for the N tokens
    of a prefill chunk or the one token per slot of a decode step. `compile` runs the parts before and after
    attention through `torch.compile` (fusing the norms, rotary, residuals and the gated MLP around the
    GEMMs): decode with static shapes, the same at every attended length; prefill separately (its own
    compiled code, shapes free to vary with the chunk). The cache writes and attention stay outside them, so
    no compiled layer code mutates the cache or sees the attended length. `attention` is the decode step's
    (`SDPADecodeAttention` by default, or `TritonDecodeAttention`); a prefill attends with causal SDPA (or
    `softcapped_attention`), masked to the window on a sliding-window layer, and after a cached prefix through the
    attention's own `prefill` (the Triton kernel reads the blocks; SDPA a gathered copy).

    `flash_below`: a causal prefill of fewer tokens (U * L) than this runs on flash attention first, whatever SDPA
    would pick. SDPA picks cuDNN here, which builds a plan for every shape it has not seen: 45-60 ms each (the first
    1.1 s), against 0.1 ms for flash (one H200, 12 query and 2 K/V heads of 128, 256 tokens; exp_admit.py at 0a7d397,
    session 24). A server admits a few prompts at a time, nearly each admission a new shape. `FastRollout` sets it
    to `prefill_tokens`: every chunk runs on flash but one that fills the budget exactly (equal prompt lengths, as
    in the benches, whose shapes repeat), which keeps cuDNN, faster once planned (0.21 against 0.39 ms for
    8 x 2,048 tokens). Where prompt lengths vary (RL batches), nearly every chunk is a new shape: flash. The flags
    are set through `sdpa_kernel`, process-wide while the call runs: no other thread should pick SDPA backends
    meanwhile."""

    # the decode parts compile once per slot width (a call's widths, `scheduler.slot_widths`: 9 at 512 slots, more
    # over calls of other slot counts); past dynamo's per-function limit (8 by default) a new width would run its
    # layers uncompiled, so the limit is raised to this while compiled blocks exist (never lowered)
    RECOMPILE_LIMIT = 64

    def __init__(self, compile: bool = False, attention: SDPADecodeAttention | TritonDecodeAttention | None = None):
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, self.RECOMPILE_LIMIT)
        static = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self.inputs, self.output = static(attention_inputs), static(attention_output_and_mlp)
        # distinct functions: their compiled code and shape history are their own
        free = torch.compile if compile else (lambda fn: fn)
        self.prefill_inputs, self.prefill_output = free(_prefill_inputs), free(_prefill_output)
        self.compiled = compile
        self.attention = attention or SDPADecodeAttention()
        self.flash_below = 0

    def decode(self, x, cos, sin, kv_layer, table, positions, mask, weights: tuple, c: LayerConsts,
               with_route: bool = False):
        """x (B, hidden) at `positions` (B,); `table` (B, max_blocks) the slots' blocks; `mask` from
        `self.attention.mask` for the layer's window; `weights` from `DecoderLayer.block_weights`. `with_route`
        (a routed layer): (x, experts)."""
        (ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_attn_ln, ln2, gu_w, gu_b, down_w, down_b, post_ff_ln,
         qkv_lora, o_lora, mlp_lora, scale) = weights
        q, k, v = self.inputs(x, cos, sin, ln1, qkv_w, qkv_b, q_norm, k_norm, *c[:5], qkv_lora, scale)
        attn = self.attention(q, k, v, kv_layer, table, positions, mask, c)
        return self.output(x, attn, o_w, o_b, post_attn_ln, ln2, gu_w, gu_b, down_w, down_b, post_ff_ln,
                           c.eps, c.gemma, c.act, o_lora, mlp_lora, scale, c.top_k, c.normalize_top_k,
                           c.fp32_route, with_route)

    def prefill(self, x, cos, sin, kv_layer, write_at: tuple, prefix: tuple | None, length: int, weights: tuple,
                c: LayerConsts, with_route: bool = False):
        """x (U * length, hidden): the U prompts' tokens past their cached prefixes, right-padded, flattened;
        writes their K/V at `write_at` = (token index, block, offset) of the real ones. `prefix` None: no prompt
        has a cached prefix (causal attention over the chunk); else the prefixes are read from the blocks, by the
        attention's `prefill` (what `prefix` holds is its own: `FastCausalLM.prefill` makes it)."""
        (ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_attn_ln, ln2, gu_w, gu_b, down_w, down_b, post_ff_ln,
         qkv_lora, o_lora, mlp_lora, scale) = weights
        if self.compiled:  # the chunk's token count varies: one compilation for every count, from the first call
            for t in (x, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        q, k, v = self.prefill_inputs(x, cos, sin, ln1, qkv_w, qkv_b, q_norm, k_norm, *c[:5], qkv_lora, scale)
        u = x.shape[0] // length
        index, blocks, offsets = write_at  # k, v (U * L, Hkv, D): the real tokens' into the blocks
        kv_layer[0][blocks, :, offsets] = k[index]
        kv_layer[1][blocks, :, offsets] = v[index]
        if prefix is not None and self.attention.prefix_from_blocks:
            attn = self.attention.prefill(q, kv_layer, prefix, c).view(u, length, c.num_heads, c.head_dim)
        else:
            q = q.view(u, length, c.num_heads, c.head_dim).transpose(1, 2)  # (U, H, L, D)
            k = k.view(u, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (U, Hkv, L, D)
            v = v.view(u, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
            if prefix is not None:  # keys: the cached prefix, then the chunk's own
                attn = self.attention.prefill(q, k, v, kv_layer, prefix, c)
            # causal suffices: padding sits after each prompt, so no real query sees it
            elif c.softcap is not None or (c.window is not None and c.window < length):
                pos = torch.arange(length, device=x.device)
                attn = softcapped_attention(q, k, v, visible_keys(pos, pos, c.window), c.scale, c.softcap)
            elif q.is_cuda and u * length < self.flash_below:  # (flash first; the others where it cannot run)
                with sdpa_kernel(PREFILL_BACKENDS, set_priority=True):
                    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scale, enable_gqa=True)
            else:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scale, enable_gqa=True)
            attn = attn.transpose(1, 2)
        # (U * L, heads * head_dim): one dynamic size, never 1 for U = 1 (a size-1 dimension compiles anew)
        attn = attn.reshape(x.shape[0], -1)
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(attn, 0)
        return self.prefill_output(x, attn, o_w, o_b, post_attn_ln, ln2, gu_w, gu_b, down_w,
                                   down_b, post_ff_ln, c.eps, c.gemma, c.act, o_lora, mlp_lora, scale, c.top_k,
                                   c.normalize_top_k, c.fp32_route, with_route)
