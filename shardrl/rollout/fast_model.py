"""The Llama / Qwen2 decoder in plain PyTorch, for generation against a static KV cache.

Parameters are named exactly as in Hugging Face's `LlamaForCausalLM` / `Qwen2ForCausalLM`
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so `(hf_name, tensor)` pairs from
`Engine.export_weights()` copy straight in. The math follows HF's step for step (RMSNorm in fp32, rotary
angles in fp32 cast to the compute dtype, GQA, SiLU MLP), so greedy decoding matches HF's in fp32.

KV cache layout, one tensor for the whole model:

    kv  (num_layers, 2, num_slots, num_kv_heads, max_seq, head_dim)     [:, 0] keys, [:, 1] values

Slot s holds one sequence from position 0 (no padding); its length lives with the caller. Positions past
a slot's length hold stale values that attention masks out and the next write replaces.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def rope_theta(config) -> float:
    """The rotary base of `config`; raises for rope types other than the default (no scaling)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported by the fast rollout (only 'default' rotary "
                         "embeddings); use rollout.backend=hf for this model")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_supported(config) -> None:
    """Raises a ValueError naming the problem when `config` is not a model this decoder computes."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the fast rollout supports {SUPPORTED_MODEL_TYPES} models, not {config.model_type!r}; "
                         "use rollout.backend=hf")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported by the fast rollout (only 'silu')")
    if getattr(config, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        raise ValueError("sliding-window attention is not supported by the fast rollout; use rollout.backend=hf")
    rope_theta(config)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm: normalized in fp32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin (*positions.shape, head_dim) in `dtype`; angles in fp32 as HF computes them."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def project_qkv(x, qkv_w, qkv_b, num_heads: int, num_kv_heads: int, head_dim: int):
    """q (..., Hq*D), k, v (..., Hkv*D) from the fused q/k/v weight: one GEMM."""
    kv_size = num_kv_heads * head_dim
    return F.linear(x, qkv_w, qkv_b).split([num_heads * head_dim, kv_size, kv_size], dim=-1)


def swiglu_mlp(x, gate_up_w, gate_up_b, down_w, down_b):
    """down(silu(gate(x)) * up(x)) with gate and up as one GEMM on the fused weight."""
    gate, up = F.linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w, down_b)


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


class Attention(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        hidden, d = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias["q_proj"])
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias["k_proj"])
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias["v_proj"])
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias["o_proj"])
        self.qkv_weight = self.qkv_bias = None  # set by FastCausalLM.fuse_projections


class MLP(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=bias["gate_proj"])
        self.up_proj = nn.Linear(hidden, inter, bias=bias["up_proj"])
        self.down_proj = nn.Linear(inter, hidden, bias=bias["down_proj"])
        self.gate_up_weight = self.gate_up_bias = None  # set by FastCausalLM.fuse_projections


class DecoderLayer(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        self.self_attn = Attention(config, bias)
        self.mlp = MLP(config, bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def block_weights(self) -> tuple:
        """The weights a `DecoderBlock` reads, in its order."""
        a, m = self.self_attn, self.mlp
        return (self.input_layernorm.weight, a.qkv_weight, a.qkv_bias, a.o_proj.weight, a.o_proj.bias,
                self.post_attention_layernorm.weight, m.gate_up_weight, m.gate_up_bias, m.down_proj.weight,
                m.down_proj.bias)


def attention_inputs(x, cos, sin, ln1, qkv_w, qkv_b, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int):
    """RMSNorm, q/k/v projection and rotary for N tokens: x (N, hidden), cos, sin (N, 1, D) -> q (N, Hkv, G, D)
    (in decode, the G query heads sharing a KV head are its "query positions": GQA without copying the
    cache), k, v (N, Hkv, D)."""
    b = x.shape[0]
    q, k, v = project_qkv(rms_norm(x, ln1, eps), qkv_w, qkv_b, num_heads, num_kv_heads, head_dim)
    q = apply_rotary(q.view(b, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(b, num_kv_heads, head_dim), cos, sin)
    return q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k, v.view(b, num_kv_heads, head_dim)


def triton_head_dim(head_dim: int) -> bool:
    """Whether the Triton decode kernel takes this head dim: a power of two >= 16 (Triton's dot needs 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def write_kv(k, v, kv_layer, slots, positions) -> None:
    """Writes one token's k, v (B, Hkv, D) per slot at `positions` into kv_layer (2, B, Hkv, max_seq, D)."""
    kv_layer[0][slots, :, positions] = k
    kv_layer[1][slots, :, positions] = v


class SDPADecodeAttention:
    """Decode attention over the first `seq_len` cache positions of every slot, with an additive mask
    (-inf past each slot's position): SDPA, any device. The attended length is a static shape, so the
    caller buckets it (one CUDA graph per bucket)."""

    bucketed = True

    def mask(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, 1, seq_len); made once per step: SDPA converts a boolean mask in every layer, and ran slower
        with one (bench/profile_decode.py, H200: 0.11 vs 0.06 ms per layer at batch 256, S 512)."""
        visible = torch.arange(seq_len, device=positions.device) <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
        return mask[:, None, None, :]

    def __call__(self, q, k, v, kv_layer, slots, positions, mask) -> torch.Tensor:
        """Writes k, v (B, Hkv, D) into the cache (`write_kv`), then attends: q (B, Hkv, G, D) (the G query
        heads of a KV head as its "query positions": GQA without copying the cache) -> (B, Hkv, G, D)."""
        write_kv(k, v, kv_layer, slots, positions)
        seq = mask.shape[-1]
        return F.scaled_dot_product_attention(q, kv_layer[0][:, :, :seq], kv_layer[1][:, :, :seq], attn_mask=mask)


class TritonDecodeAttention:
    """Decode attention in which each slot reads its cache only up to its own position: one Triton kernel
    (`shardrl.rollout.decode_kernel`, CUDA only). The attended length plays no part, so one CUDA graph
    serves every length. Measured against `SDPADecodeAttention` in bench/RESULTS.md. `fuse_kv_write`: the
    kernel writes the new K/V itself (0.2 ms less per step than two indexed copies at batch 256, H200)."""

    bucketed = False

    def __init__(self, fuse_kv_write: bool = True):
        from shardrl.rollout.decode_kernel import decode_attention

        self.attend, self.fuse_kv_write = decode_attention, fuse_kv_write

    def mask(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        return positions

    def __call__(self, q, k, v, kv_layer, slots, positions, mask) -> torch.Tensor:
        """As `SDPADecodeAttention`; slot b is row b (slots = arange(B))."""
        if self.fuse_kv_write:
            return self.attend(q.contiguous(), kv_layer, positions, k, v)
        write_kv(k, v, kv_layer, slots, positions)
        return self.attend(q.contiguous(), kv_layer, positions)


def attention_output_and_mlp(x, attn, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, eps: float):
    x = x + F.linear(attn.reshape(x.shape[0], -1), o_w, o_b)
    return x + swiglu_mlp(rms_norm(x, ln2, eps), gate_up_w, gate_up_b, down_w, down_b)


def _prefill_inputs(*args):
    return attention_inputs(*args)


def _prefill_output(*args):
    return attention_output_and_mlp(*args)


class DecoderBlock:
    """A decoder layer as functions of tensors only (one compilation serves every layer), for the N tokens
    of a prefill chunk or the one token per slot of a decode step. `compile` runs the parts before and after
    attention through `torch.compile` (fusing the norms, rotary, residuals and SwiGLU around the GEMMs):
    decode with static shapes, the same at every attended length; prefill separately (its own compiled
    code, shapes free to vary with the chunk). The cache writes and attention stay outside them, so no
    compiled layer code mutates the cache or sees the attended length. `attention` is the decode step's
    (`SDPADecodeAttention` by default, or `TritonDecodeAttention`); a prefill attends with causal SDPA."""

    def __init__(self, compile: bool = False, attention: SDPADecodeAttention | TritonDecodeAttention | None = None):
        static = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self.inputs, self.output = static(attention_inputs), static(attention_output_and_mlp)
        # distinct functions: their compiled code and shape history are their own
        free = torch.compile if compile else (lambda fn: fn)
        self.prefill_inputs, self.prefill_output = free(_prefill_inputs), free(_prefill_output)
        self.attention = attention or SDPADecodeAttention()

    def decode(self, x, cos, sin, kv_layer, slots, positions, mask, weights: tuple, consts: tuple):
        """x (B, hidden) at `positions` (B,); slots = arange(B); `mask` from `self.attention.mask`;
        `weights` from `DecoderLayer.block_weights`; consts = (eps, num_heads, num_kv_heads, head_dim)."""
        ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b = weights
        q, k, v = self.inputs(x, cos, sin, ln1, qkv_w, qkv_b, *consts)
        attn = self.attention(q, k, v, kv_layer, slots, positions, mask)
        return self.output(x, attn, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, consts[0])

    def prefill(self, x, cos, sin, kv_layer, slots, source, length: int, weights: tuple, consts: tuple):
        """x (U * length, hidden): U right-padded prompts at positions 0..length-1, flattened; writes their
        K/V into `slots` (prompt i of the chunk goes to slot slots[j] for every j with source[j] == i)."""
        ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b = weights
        num_heads, num_kv_heads, head_dim = consts[1:]
        q, k, v = self.prefill_inputs(x, cos, sin, ln1, qkv_w, qkv_b, *consts)
        u = x.shape[0] // length
        q = q.view(u, length, num_heads, head_dim).transpose(1, 2)  # (U, H, L, D)
        k = k.view(u, length, num_kv_heads, head_dim).transpose(1, 2)  # (U, Hkv, L, D)
        v = v.view(u, length, num_kv_heads, head_dim).transpose(1, 2)
        kv_layer[0][slots, :, :length] = k[source]
        kv_layer[1][slots, :, :length] = v[source]
        # causal suffices: padding sits after each prompt, so no real query sees it
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.prefill_output(x, attn, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, consts[0])


class Decoder(nn.Module):
    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, bias) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FastCausalLM(nn.Module):
    """`model.*` and `lm_head` as in HF; `prefill` and `decode` read and write a KV cache laid out as in
    the module docstring. Build it with `build_fast_lm`, which checks the names against HF's model.

    q/k/v and gate/up projections run as one GEMM each: their weights are views into fused tensors
    (`fuse_projections`), re-made after every move of the module (`_apply`)."""

    def __init__(self, config, bias: dict[str, bool]):
        super().__init__()
        self.config = config
        self.model = Decoder(config, bias)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(config), persistent=False)

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight, a.qkv_bias = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            m.gate_up_weight, m.gate_up_bias = fuse_linears([m.gate_proj, m.up_proj])

    def _apply(self, fn, recurse=True):
        # a move or cast gives each parameter its own storage again: fuse anew (meta modules are not fused)
        out = super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.fuse_projections()
        return out

    def kv_shape(self, num_slots: int, max_seq: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_hidden_layers, 2, num_slots, c.num_key_value_heads, max_seq, head_dim_of(c))

    def block_consts(self) -> tuple:
        c = self.config
        return c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, head_dim_of(c)

    def prefill(self, ids, lengths, kv, slots, source, block: DecoderBlock | None = None) -> torch.Tensor:
        """ids (U, L) right-padded prompts with `lengths` (U,); writes K/V to kv[:, :, slots] (see
        `DecoderBlock.prefill`) and returns the logits after each prompt's last token, (U, V)."""
        u, length = ids.shape
        x = self.model.embed_tokens(ids.flatten())  # (U * L, hidden)
        cos, sin = rotary_cos_sin(self.inv_freq, torch.arange(length, device=ids.device), x.dtype)  # (L, D)
        cos, sin = cos.repeat(u, 1)[:, None], sin.repeat(u, 1)[:, None]  # (U * L, 1, D)
        block = block or DecoderBlock()
        for i, layer in enumerate(self.model.layers):
            x = block.prefill(x, cos, sin, kv[i], slots, source, length, layer.block_weights(), self.block_consts())
        last = x.view(u, length, -1)[torch.arange(u, device=x.device), lengths - 1]  # (U, hidden)
        return self.lm_head(self.model.norm(last))

    def decode(self, tokens, positions, kv, seq_len: int, block: DecoderBlock | None = None) -> torch.Tensor:
        """One token per slot: tokens, positions (B,) over all B slots of `kv`; attends to cache entries
        [0, positions] within the first `seq_len` (`TritonDecodeAttention` reads no further than positions).
        `block`: how to run a layer (default: eager, SDPA). Returns logits (B, V)."""
        x = self.model.embed_tokens(tokens)  # (B, hidden)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)  # (B, D)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        slots = torch.arange(tokens.shape[0], device=tokens.device)
        block = block or DecoderBlock()
        mask = block.attention.mask(positions, seq_len, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = block.decode(x, cos, sin, kv[i], slots, positions, mask, layer.block_weights(), self.block_consts())
        return self.lm_head(self.model.norm(x))


def build_fast_lm(config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> FastCausalLM:
    """The decoder for `config` on `device`, randomly initialised (weights arrive by `load_weights`).
    Its parameter names and shapes are checked against HF's model for the same config."""
    import transformers

    check_supported(config)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    hf_params = {n: tuple(p.shape) for n, p in reference.named_parameters(remove_duplicate=False)}
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    block = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    bias = {n: f"model.layers.0.{block.get(n, 'mlp')}.{n}.bias" in hf_params for n in names}
    with torch.device("meta"):
        model = FastCausalLM(config, bias)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if ours != hf_params:
        diff = sorted(set(ours.items()) ^ set(hf_params.items()))[:6]
        raise ValueError(f"the fast rollout's {config.model_type} decoder does not mirror HF's parameters "
                         f"(differences, e.g.: {diff}); use rollout.backend=hf")
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    model = model.to(dtype).eval().requires_grad_(False)
    model.inv_freq = _inv_freq(config).to(device)  # fp32 whatever the weights' dtype
    return model


def _inv_freq(config) -> torch.Tensor:
    """Rotary inverse frequencies, (head_dim / 2,) fp32, computed on the CPU as HF does (same bits)."""
    d = head_dim_of(config)
    return 1.0 / (rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.float) / d))
