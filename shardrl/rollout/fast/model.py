"""The decoder of the fast rollout's model families (`shardrl.models.families`: Llama, Qwen2/3, Mistral,
Gemma 2/3, the mixtures of experts Qwen3-MoE, Mixtral and OLMoE, and the decoders of Qwen2.5-VL and Qwen3-VL, HF's
vision tower beside them: `shardrl.rollout.fast.vision`) in plain PyTorch, for generation against a static KV cache.

Parameters are named exactly as in Hugging Face's `*ForCausalLM` of each family
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so `(hf_name, tensor)` pairs from
`Engine.export_weights()` copy straight in. The math follows HF's step for step (RMSNorm in fp32, rotary
angles in fp32 cast to the compute dtype, rotary tables from HF's own rotary class, GQA, gated MLP,
Gemma's extra norms, soft-caps and sliding windows), so greedy decoding matches HF's in fp32.

KV cache layout, one tensor for the whole model:

    kv  (num_layers, 2, num_slots, num_kv_heads, max_seq, head_dim)     [:, 0] keys, [:, 1] values

Slot s holds one sequence from position 0 (no padding); its length lives with the caller. Positions past
a slot's length hold stale values that attention masks out and the next write replaces.

The layer's math and `DecoderBlock`, which runs it, are `shardrl.rollout.fast.block`'s; the modules below
`FastCausalLM` (`model.layers.{i}.*`), `shardrl.rollout.fast.layers`'.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.nn as nn

from shardrl.models.config import text_config
from shardrl.models.families import (FAST_ROLLOUT_TYPES, activation, attention_scale, attention_softcap,
                                      check_supported, family_of, final_softcap, head_dim_of, layer_rope_keys,
                                      layer_windows, max_rope_positions, moe_layers, mrope_axes, rope_tables,
                                      top_k_normalized)
from shardrl.models.vision import is_vision_language
from shardrl.rollout.fast.attention import LayerConsts
from shardrl.rollout.fast.block import DecoderBlock, rotary_cos_sin
from shardrl.rollout.fast.fp8 import FP8_DTYPE, quantize_fp8_into, scale_shape
from shardrl.rollout.fast.layers import MLP, Decoder, fuse_linears, fuse_scales
from shardrl.rollout.fast.moe import SparseMoE
from shardrl.rollout.fast.vision import PrefillImages, VisionDecoder, reset_tower_buffers, vision_tower

SUPPORTED_MODEL_TYPES = FAST_ROLLOUT_TYPES


class FastCausalLM(nn.Module):
    """`model.*` and `lm_head` as in HF; `prefill` and `decode` read and write a KV cache laid out as in
    the module docstring. Build it with `build_fast_lm`, which checks the names against HF's model.

    q/k/v and gate/up projections run as one GEMM each: their weights are views into fused tensors
    (`fuse_projections`), re-made after every move of the module (`_apply`). Rotary tables are per key of
    `families.rope_tables` (one, or Gemma 3's local and global), fp32 buffers `inv_freq_{key}`.

    A vision-language model (`visual`: HF's vision tower; `config` its text config): `model` is a
    `VisionDecoder` (HF's names, `model.language_model.*` and `model.visual.*`), `mrope` the frequencies' M-RoPE
    axes (`families.mrope_axes`); a prefill rotates by the `PrefillImages` positions, a decode step by
    its positions plus a per-slot offset (`shardrl.rollout.fast.vision`)."""

    def __init__(self, config, bias: dict[str, bool], rope: dict[str, tuple[torch.Tensor, float]],
                 visual: nn.Module | None = None, mrope: list[int] | None = None):
        super().__init__()
        self.config = config
        self.model = Decoder(config, bias) if visual is None else VisionDecoder(Decoder(config, bias), visual)
        self.mrope_source = mrope  # (host ints; the buffer `mrope_axes` is set with the rotary tables)
        self.register_buffer("mrope_axes", None, persistent=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_scaling = {key: scaling for key, (_, scaling) in rope.items()}
        self.rope_source = rope  # the CPU tables, for `materialize`
        self.shared = False  # `share_weights`: the parameters are another module's tensors, never fused
        self.fp8: tuple[int, bool] | None = None  # `quantize_fp8`: (block size, dynamic activations)
        for key, (inv_freq, _) in rope.items():
            self.register_buffer(f"inv_freq_{key}", inv_freq, persistent=False)
        self.layer_rope = layer_rope_keys(config)
        gemma = family_of(config).gemma
        family = family_of(config)
        self.layer_consts = [
            LayerConsts(config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads,
                        head_dim_of(config), gemma, activation(config), attention_scale(config),
                        attention_softcap(config), window, config.num_experts_per_tok if moe else 0,
                        moe and top_k_normalized(config), moe and family.moe_fp32_weights)
            for window, moe in zip(layer_windows(config), moe_layers(config))]
        self.embed_scale = config.hidden_size**0.5 if gemma else None
        self.final_softcap = final_softcap(config)
        self.max_positions = max_rope_positions(config)  # None, or where HF's dynamic rope would change

    def set_rope(self, rope: dict[str, tuple[torch.Tensor, float]], device) -> None:
        """(Re)sets the fp32 rotary buffers, whatever the weights' dtype (and the vision tower's, the M-RoPE axes)."""
        for key, (inv_freq, _) in rope.items():
            setattr(self, f"inv_freq_{key}", inv_freq.to(device))
        if self.mrope_source is not None:
            self.mrope_axes = torch.tensor(self.mrope_source, dtype=torch.long, device=device)
        if isinstance(self.model, VisionDecoder):
            reset_tower_buffers(self.model.visual, device)

    def fuse_projections(self) -> None:
        if self.shared:
            return
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight, a.qkv_bias = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            a.qkv_scale = fuse_scales([a.q_proj, a.k_proj, a.v_proj])
            if isinstance(m, MLP):  # (experts are fused already: HF stores gate and up as one tensor)
                m.gate_up_weight, m.gate_up_bias = fuse_linears([m.gate_proj, m.up_proj])
                m.gate_up_scale = fuse_scales([m.gate_proj, m.up_proj])

    def quantized_linears(self) -> dict[str, nn.Linear]:
        """{HF name: module} of the linear layers FP8 covers: each decoder layer's q/k/v/o and dense gate/up/down.
        The embeddings, norms, LM head, a mixture's router and experts keep the model's dtype (vLLM's FP8
        likewise leaves the embeddings, norms and LM head unquantized)."""
        linears = {}
        for i, layer in enumerate(self.model.layers):
            a, m = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linears[f"model.layers.{i}.self_attn.{name}"] = getattr(a, name)
            if isinstance(m, MLP):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    linears[f"model.layers.{i}.mlp.{name}"] = getattr(m, name)
        return linears

    @torch.no_grad()
    def quantize_fp8(self, block_size: int = 0, dynamic: bool = False) -> None:
        """The linear layers of `quantized_linears` hold E4M3 weights (`weight`, same name and shape) with fp32
        scales (`weight_scale`, `shardrl.rollout.fast.fp8`), quantized from their weights now (nothing computed on
        meta); later loads quantize what they copy in (`load_fp8_weight`). `block_size`: 0 per output channel,
        else B x B tiles; `dynamic`: FP8 activations too (CUDA, `fp8.check_dynamic_activations`)."""
        if self.shared:
            raise ValueError("the rollout reads the trainer's own weights (share_weights): they cannot be FP8")
        for lin in self.quantized_linears().values():
            w = lin.weight
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            s = torch.empty(scale_shape(tuple(w.shape), block_size), dtype=torch.float32, device=w.device)
            if not w.is_meta:
                quantize_fp8_into(w, q, s, block_size)
            lin.weight = nn.Parameter(q, requires_grad=False)
            lin.register_buffer("weight_scale", s, persistent=False)
        for layer in self.model.layers:
            layer.fp8 = (block_size, dynamic)
        self.fp8 = (block_size, dynamic)
        if not self.model.norm.weight.is_meta:
            self.fuse_projections()

    def load_fp8_weight(self, name: str, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor | None:
        """Copies `tensor` into the parameter `name`, quantizing it where the parameter is FP8 (in place: the
        captured graphs stay valid); returns the amax of a quantized one (None otherwise), for one check of the
        whole load (`fp8.check_finite`)."""
        if param.dtype != FP8_DTYPE:
            param.copy_(tensor)
            return None
        owner = self.get_submodule(name.rpartition(".")[0])
        return quantize_fp8_into(tensor, param, owner.weight_scale, self.fp8[0])

    def _apply(self, fn, recurse=True):
        # a move or cast gives each parameter its own storage again: fuse anew (meta modules are not fused)
        out = super()._apply(fn, recurse)
        if not self.model.norm.weight.is_meta:
            self.fuse_projections()
        return out

    def materialize(self, device: torch.device) -> None:
        """Storage on `device` for a model built on meta (`build_fast_lm(..., materialize=False)`): uninitialised,
        every parameter to be loaded; the rotary tables set."""
        self.to_empty(device=device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_rope(self.rope_source, device)

    @torch.no_grad()
    def share_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every parameter becomes the tensor given under its HF name, itself (no copy): the rollout reads a
        frozen base where the trainer holds it whole on this device. The tensors must have the parameters'
        shapes and dtype; q/k/v and gate/up then run as separate GEMMs (nothing is fused into a copy)."""
        if self.fp8 is not None:
            raise ValueError("share_weights: an FP8 rollout (rollout.quantization=fp8) holds its own quantized "
                             "copy; it cannot read the trainer's bf16 tensors (set rollout.lora_sync=merged or "
                             "full, or rollout.quantization=none)")
        params = dict(self.named_parameters(remove_duplicate=False))
        given = dict(weights)
        missing = sorted(set(params) - set(given) - ({"lm_head.weight"} if self.config.tie_word_embeddings else set()))
        if missing or set(given) - set(params):
            raise ValueError(f"share_weights: the shared tensors do not match the rollout's parameters (missing "
                             f"{missing[:4]}, unknown {sorted(set(given) - set(params))[:4]})")
        dtype = self.model.norm.weight.dtype
        device = next(iter(given.values())).device
        for name, tensor in given.items():
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape) or tensor.dtype != dtype:
                raise ValueError(f"share_weights: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the rollout "
                                 f"needs {tuple(p.shape)} {dtype}")
            owner, leaf = self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))  # the same storage, no copy
        self.shared = True
        for layer in self.model.layers:  # the fused copies go; each layer reads the shared tensors themselves
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight = a.qkv_bias = None
            if isinstance(m, MLP):
                m.gate_up_weight = m.gate_up_bias = None
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_rope(self.rope_source, device)

    @torch.no_grad()
    def set_lora(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """LoRA adapters, added at run time (out = base(x) + scale * B (A x), in fp32): `adapters` maps a linear
        layer's HF name (`model.layers.3.self_attn.q_proj`; a VL model's `model.language_model.layers.3...`) to its
        (A (r, in), B (out, r)). The first call allocates fp32 buffers on the model's device; later calls with the
        same layers copy into them in place (so captured CUDA graphs stay valid). Layers not named keep no
        adapter."""
        device = self.model.norm.weight.device
        projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        layers = self.model.layers
        decoder = "model.language_model." if isinstance(self.model, VisionDecoder) else "model."
        for name, (a, b) in adapters.items():
            parts = ["model", *name[len(decoder):].split(".")] if name.startswith(decoder) else name.split(".")
            if (len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
                    or int(parts[2]) >= len(layers) or parts[4] not in projections):
                raise ValueError(f"set_lora: {name!r} is not a q/k/v/o or gate/up/down projection of a decoder layer")
            layer = layers[int(parts[2])]
            if parts[3] == "mlp" and isinstance(layer.mlp, SparseMoE):
                raise ValueError(f"set_lora: {name!r}: the fast rollout adds no adapters to routed experts")
            module = getattr(getattr(layer, parts[3]), parts[4])
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features or a.shape[0] != b.shape[1]:
                raise ValueError(f"set_lora: {name!r} has A {tuple(a.shape)}, B {tuple(b.shape)}; the layer is "
                                 f"{module.in_features} -> {module.out_features}")
            if layer.lora is None:
                layer.lora = {}
            held = layer.lora.get(parts[4])
            if held is None or held[0].shape != a.shape:
                layer.lora[parts[4]] = (a.to(device, torch.float32, copy=True), b.to(device, torch.float32, copy=True))
            else:
                held[0].copy_(a)
                held[1].copy_(b)
            layer.lora_scale = float(scale)

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The paged cache: per layer, K and V of `num_blocks` blocks of `block_size` positions."""
        c = self.config
        return (c.num_hidden_layers, 2, num_blocks, c.num_key_value_heads, block_size, head_dim_of(c))

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype,
               axes: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{rope key: (cos, sin) (*positions.shape, D)}; with `axes` (M-RoPE), positions (3, *shape) give
        (*shape, D)."""
        return {key: rotary_cos_sin(getattr(self, f"inv_freq_{key}"), positions, dtype, scaling, axes)
                for key, scaling in self.rope_scaling.items()}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        if self.embed_scale is not None:  # Gemma: times sqrt(hidden) rounded to the weights' dtype, as HF
            x = x * float(torch.tensor(self.embed_scale, dtype=x.dtype))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(x))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @property
    def routed_layers(self) -> list[int]:
        """The layers with routed experts, in order (the L of a routing record (..., L, k))."""
        return [i for i, c in enumerate(self.layer_consts) if c.top_k]

    def prefill(self, ids, lengths: list[int], kv, tables, starts: list[int] | None = None,
                block: DecoderBlock | None = None, routes: torch.Tensor | None = None,
                to_device=None, images: PrefillImages | None = None) -> torch.Tensor:
        """ids (U, L): U prompts' tokens from position starts[i] on (default 0; a multiple of the block size, the
        positions before it already in the blocks), right-padded, with `lengths` (U ints, on the host) tokens each;
        writes their K/V into the blocks of `tables` (U, max_blocks) and returns the logits after each prompt's
        last token, (U, V). `routes` (U * L, len(routed_layers), k) receives each token's experts per routed layer.
        `to_device` moves host integers to the device (default: a plain copy); nothing here waits for the device.
        `images` (a vision-language model): the tokens' M-RoPE positions, and the image features spliced in."""
        u, length = ids.shape
        dev, size = ids.device, kv.shape[4]
        to_device = to_device or (lambda xs: torch.as_tensor(xs, dtype=torch.long).to(dev))
        starts = list(starts or [0] * u)
        # the real tokens' indices in the flattened chunk, made on the host (a nonzero on the device would wait)
        index = to_device(torch.cat([torch.arange(i * length, i * length + n) for i, n in enumerate(lengths)]))
        starts_t, lengths = to_device(starts), to_device(list(lengths))
        positions = starts_t[:, None] + torch.arange(length, device=dev)  # (U, L)
        x = self.embed(ids.flatten())  # (U * L, hidden)
        if images is not None and images.features is not None:  # the placeholders' embeddings: the tower's output
            x = x.index_copy(0, images.index, images.features.to(x.dtype))
        rope_at = positions if images is None else images.positions  # (U, L), or M-RoPE's (3, U, L)
        rotary = {key: (cos.flatten(0, 1)[:, None], sin.flatten(0, 1)[:, None])  # (U * L, 1, D)
                  for key, (cos, sin) in self.rotary(rope_at, x.dtype, self.mrope_axes if images else None).items()}
        flat = positions.flatten()[index]
        write_at = (index, tables[index // length, flat // size], flat % size)
        block = block or DecoderBlock()
        prefixes = {}
        if max(starts) > 0 and block.attention.prefix_from_blocks:  # read through the block table
            prefixes = {c.window: (tables, starts_t, lengths) for c in self.layer_consts}
        elif max(starts) > 0:  # the cached prefixes' blocks and each window's visibility
            cached = max(starts)
            keys = torch.cat([torch.arange(cached, device=dev).expand(u, -1), positions], 1)  # (U, C + L)
            known = torch.cat([torch.arange(cached, device=dev) < starts_t[:, None],
                               torch.ones(u, length, dtype=torch.bool, device=dev)], 1)
            for window in {c.window for c in self.layer_consts}:
                visible = (keys[:, None, :] <= positions[:, :, None]) & known[:, None, :]  # (U, L, C + L)
                if window is not None:
                    visible &= keys[:, None, :] > positions[:, :, None] - window
                prefixes[window] = (tables, visible)
        routed = {layer: j for j, layer in enumerate(self.routed_layers)} if routes is not None else {}
        for i, layer in enumerate(self.model.layers):
            c = self.layer_consts[i]
            x = block.prefill(x, *rotary[self.layer_rope[i]], kv[i], write_at, prefixes.get(c.window), length,
                              layer.block_weights(), c, i in routed)
            if i in routed:
                x, experts = x
                routes[:, routed[i]] = experts
            if images is not None and i < len(images.deepstack):  # Qwen3-VL: the tower's early features join
                x = x.index_put((images.index,), x[images.index] + images.deepstack[i].to(x.dtype))
        last = x.view(u, length, -1)[torch.arange(u, device=x.device), lengths - 1]  # (U, hidden)
        return self.logits(last)

    def decode(self, tokens, positions, kv, table, seq_len: int, block: DecoderBlock | None = None,
               routes: torch.Tensor | None = None, rope_offset: torch.Tensor | None = None) -> torch.Tensor:
        """One token per slot: tokens, positions (B,) for the B slots whose blocks `table` (B, max_blocks) names
        in the paged cache `kv` (`kv_shape`); attends to cache entries
        [0, positions] (from the window's start on a sliding-window layer) within the first `seq_len`
        (`TritonDecodeAttention` reads no further than positions). `block`: how to run a layer (default:
        eager, SDPA). Returns logits (B, V); `routes` (B, len(routed_layers), k) receives each token's experts.
        `rope_offset` (B,): the slots' M-RoPE deltas, the rotary position being positions + offset on all three
        axes (a plain rotary table there)."""
        x = self.embed(tokens)  # (B, hidden)
        rope_at = positions if rope_offset is None else positions + rope_offset
        rotary = {key: (cos[:, None], sin[:, None])  # broadcast over heads
                  for key, (cos, sin) in self.rotary(rope_at, x.dtype).items()}
        block = block or DecoderBlock()
        masks = {c.window: block.attention.mask(positions, seq_len, x.dtype, c.window) for c in self.layer_consts}
        routed = {layer: j for j, layer in enumerate(self.routed_layers)} if routes is not None else {}
        for i, layer in enumerate(self.model.layers):
            c = self.layer_consts[i]
            x = block.decode(x, *rotary[self.layer_rope[i]], kv[i], table, positions, masks[c.window],
                             layer.block_weights(), c, i in routed)
            if i in routed:
                x, experts = x
                routes[:, routed[i]] = experts
        return self.logits(x)


def build_fast_lm(config, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  materialize: bool = True) -> FastCausalLM:
    """The decoder for `config` on `device`, randomly initialised (weights arrive by `load_weights`).
    Its parameter names and shapes are checked against HF's model for the same config, and its rotary
    tables come from that model's own rotary class. `materialize=False`: left on meta in `dtype`, no memory
    taken (`FastCausalLM.materialize` or `share_weights` later). A vision-language `config`: the decoder of its
    text config, HF's vision tower as `model.visual`, the parameters named as in HF's image-text-to-text model."""
    import transformers

    check_supported(config)
    vision = is_vision_language(config)
    with torch.device("meta"):
        if vision:
            reference = transformers.AutoModelForImageTextToText.from_config(config)
        else:
            reference = transformers.AutoModelForCausalLM.from_config(config)
    decoder = reference.model.language_model if vision else reference.model
    layer0 = "model.language_model.layers.0" if vision else "model.layers.0"
    full, config = config, text_config(config) if vision else config
    if vision:  # the decoder's config, told whether the head is tied (the VL config says it)
        config = copy.deepcopy(config)
        config.tie_word_embeddings = full.tie_word_embeddings
    rope = rope_tables(config, type(decoder.rotary_emb))
    hf_params = {n: tuple(p.shape) for n, p in reference.named_parameters(remove_duplicate=False)}
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    block = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    bias = {n: f"{layer0}.{block.get(n, 'mlp')}.{n}.bias" in hf_params for n in names}
    axes = mrope_axes(config, type(decoder.rotary_emb))
    with torch.device("meta"):
        visual = vision_tower(full, type(reference.model.visual)) if vision else None
        model = FastCausalLM(config, bias, rope, visual, axes)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if ours != hf_params:
        diff = sorted(set(ours.items()) ^ set(hf_params.items()))[:6]
        raise ValueError(f"the fast rollout's {config.model_type} decoder does not mirror HF's parameters "
                         f"(differences, e.g.: {diff}); use rollout.backend=hf")
    if not materialize:
        return model.to(dtype).eval().requires_grad_(False)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if family_of(config).gemma else 1.0)  # Gemma's norms scale by (1 + weight)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    model = model.to(dtype).eval().requires_grad_(False)
    model.set_rope(rope, device)  # fp32 whatever the weights' dtype
    return model
