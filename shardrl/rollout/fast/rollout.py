"""The fast rollout: generation for the model families of `shardrl.models.families` (Llama, Qwen2/3,
Mistral, Gemma 2/3, the mixtures of experts, and the vision-language Qwen2.5-VL and Qwen3-VL) in plain PyTorch with a
static KV cache and continuous batching.

What one `generate` does (gpt-fast's habits: cache sized once, a decode step that can be captured, no host
sync per token):

    rows b*n+j wait in a queue (prompt-major)
    admit    waiting rows take the free slots: their prompts are prefilled (each distinct prompt once,
             batched up to `prefill_tokens`, from the end of the longest prefix the cache already holds), K/V
             written into blocks the prompt's rows share (a paged cache, `shardrl.rollout.fast.paged`), the first
             token sampled
    decode   `sync_every` steps over all slots; each step feeds one token per slot, samples the next on
             the device (Gumbel-max; noise keyed by a seeded generator) and updates the per-slot lengths,
             done flags and token buffers in place. On CUDA a step is one CUDA graph replay.
    sync     one device->host copy: finished slots (EOS, length limit, stop string) hand back their
             tokens and take waiting rows, so a batch of mixed lengths does not decode at the pace of its
             longest row
    compact  when no row waits and the live rows fit in a narrower prefix of the slots (the widths step down
             by an eighth of the slots, to `min_width`), they move to the first slots (block-table rows,
             tokens, counters: one indexed copy; the K/V stays) and the steps run on that prefix, so the tail
             of a batch of uneven lengths does not pay for its finished rows
    retire   a finished row's full blocks stay indexed by their tokens (`prefix_cache`): a later prompt that
             starts with them (a conversation's next turn, an agent's next request) reads them

Attention in a step reads each slot's cache up to its own length (the Triton kernel, CUDA's default: one
graph per sampling mode), or, with attention="sdpa", the first `seq_len` positions of every slot, `seq_len`
being the longest live slot rounded up to `seq_bucket` (one graph per sampling mode and `seq_len`). Graphs
are captured on first use and again by `resume()`. `load_weights` copies in place, so graphs stay valid across syncs;
`release()` frees the cache and graphs (and, if asked, moves the weights to the CPU).

Tokens, log-probs (log softmax(logits / T) of the sampled token, no top-k/top-p truncation) and output
fields mean exactly what they mean for the HF reference (`shardrl.rollout.hf`), whose helpers cut the
responses at EOS and stop strings here too.

The parts: the host-side decisions (which rows are admitted into which slots, stopped, retired, compacted; how
many steps to the next sync) are `shardrl.rollout.fast.scheduler`'s, plain host code; the device side (the slots'
state, the decode step as a function over it, its CUDA graphs) is `shardrl.rollout.fast.step`'s; `FastRollout`
composes them with the paged cache (`paged`) and the model (`model`). Its host loop from sync to sync is `loop`'s
(`DecodeLoop`), the prefill of the rows it admits `admission`'s (`Admission`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch

from shardrl.engine.lora import merged_weight
from shardrl.models.config import text_config
from shardrl.models.families import check_supported, head_dim_of
from shardrl.models.vision import is_vision_language
from shardrl.rollout.base import (Rollout, RolloutOutput, SamplingParams, VersionTrack, check_images, check_prompts,
                                   copy_weights_in_place)
from shardrl.rollout.fast.admission import Admission
from shardrl.rollout.fast.kernel_support import cascade_members
from shardrl.rollout.fast.loop import DecodeLoop
from shardrl.rollout.fast.paged import BlockPool, SharedPrefixGroups
from shardrl.rollout.fast.attention import TritonDecodeAttention
from shardrl.rollout.fast.block import DecoderBlock
from shardrl.models.fp8 import check_dynamic_activations
from shardrl.rollout.fast.fp8 import check_finite
from shardrl.rollout.fast.model import FastCausalLM, build_fast_lm
from shardrl.rollout.fast.scheduler import RowFeed
from shardrl.rollout.fast.step import (GREEDY, SAMPLE, TRUNCATED, DecodeRunner, SlotState,  # noqa: F401 (for callers)
                                       decode_attention, fused_sampler, sample_tokens, sampling_mode)
from shardrl.rollout.fast.vision import CallImages, ImageEncoder
from shardrl.tokenizer import stop_token_ids

log = logging.getLogger(__name__)


class FastRollout(DecodeLoop, Admission, Rollout):
    """Static-KV-cache generation for the configs `models.families.check_supported` accepts (module docstring).

    `max_batch`: decode slots (the static batch); default min(rows, micro_batch_size * n) at first use,
    grown when a later call has more rows. `max_seq_len`: cache positions per slot; default the longest
    prompt + max_new_tokens rounded up to `seq_bucket`, grown as needed. `cuda_graphs` (default: on CUDA)
    captures the decode step; `compile` (default: on CUDA) runs the decoder layer's parts around attention
    (compiled once for all layers and attended lengths; see `DecoderBlock`) and the torch sampler through
    `torch.compile`. `attention`: "triton" reads each slot's cache only up to its length
    (`TritonDecodeAttention`, CUDA; one graph for all lengths), "sdpa" the first `seq_len` positions of
    every slot with a mask; "auto" = triton where it can run (CUDA, a power-of-two head dim >= 16, the
    triton package), else sdpa. `sampler`: "triton" samples in one pass over the logits
    (`shardrl.rollout.fast.sample_kernel`; greedy and plain sampling, top-k/top-p stay in torch), "torch" by
    `sample_tokens`; "auto" = triton where the Triton attention runs. `release_weights` makes `release()` move
    the weights to the CPU too. `min_width`: the narrowest slot prefix that decode steps compact to (module
    docstring; a width at or above the slot count turns compaction off); `width_step`: the step between the
    widths, from the slot count down (default an eighth of the slots, a multiple of 8); each width has its
    own graphs. `lazy_weights`: the model takes no memory until the first `load_weights` (every parameter must
    then arrive) or `share_weights`.

    LoRA (an adapter-only sync, `shardrl.trainer.generation.LoRASync`): `share_weights` makes the model read a
    frozen base that the trainer holds whole on this device; `load_lora` adds adapters at run time (unmerged),
    `merge_lora` writes base + scale * B @ A into the rollout's own weights (merged).

    The KV cache is paged (`shardrl.rollout.fast.paged`, blocks of `block_size` positions): the n samples of a prompt
    read its blocks, prefilled once; with `prefix_cache` (default), a full block stays indexed by the tokens through
    it after its row ends, so a later prompt that starts with them (a conversation's next turn, an agent's next
    request, the n samples admitted later) prefills only what follows. The index is forgotten when the weights
    change. `kv_cache_tokens` caps the cache's positions (default: every slot's longest row, slots x max_seq):
    rows are admitted only while the free blocks hold them at their longest, so many slots can share a cache sized
    for the rows' real lengths (a server's slots, each allowed a long context).

    `quantization="fp8"` holds the decoder's linear weights in FP8 E4M3 (`shardrl.rollout.fast.fp8`; per-channel
    scales, or `fp8_block_size` tiles), quantized as `load_weights` copies them in; `fp8_activations="dynamic"`
    multiplies in FP8 (CUDA, compute capability >= 8.9).

    `record_routing` (a mixture of experts; router replay R3): `generate`'s output carries `routed_experts`
    (N, P+R, L, k), the experts each token was routed to in each routed layer when the rollout ran it (the
    prompts' in the prefill, a response token's in the step that fed it), -1 where it ran nothing (padding, the
    last token).

    A vision-language model (`families.FAST_VL_TYPES`) generates from each prompt's images (`generate`'s
    `multi_modal_inputs`), as the HF rollout does: `shardrl.rollout.fast.vision`. Its image placeholders are never
    sampled (the torch sampler masks them; the fused one cannot, so "auto" takes the torch one)."""

    supports_lora = True

    def __init__(self, hf_config, tokenizer, device: torch.device | str, dtype: torch.dtype,
                 micro_batch_size: int = 64, max_batch: int | None = None, max_seq_len: int | None = None,
                 cuda_graphs: bool | None = None, compile: bool | None = None, sync_every: int = 16,
                 seq_bucket: int = 128, prefill_tokens: int = 16384, release_weights: bool = False, seed: int = 0,
                 attention: str = "auto", sampler: str = "auto", min_width: int = 32, width_step: int | None = None,
                 lazy_weights: bool = False, record_routing: bool = False, block_size: int = 64,
                 prefix_cache: bool = True, cascade: bool = True, prefix_splits: int = 2,
                 kv_cache_tokens: int | None = None, quantization: str = "none", fp8_block_size: int | None = None,
                 fp8_activations: str = "none"):
        for name, value in (("micro_batch_size", micro_batch_size), ("sync_every", sync_every),
                            ("min_width", min_width), ("width_step", 1 if width_step is None else width_step),
                            ("seq_bucket", seq_bucket), ("prefill_tokens", prefill_tokens), ("block_size", block_size),
                            ("prefix_splits", prefix_splits),
                            ("max_batch", max_batch or 1), ("max_seq_len", max_seq_len or 1),
                            ("kv_cache_tokens", kv_cache_tokens or 1)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        check_supported(hf_config)  # (first: a model it cannot run is said before anything is read)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_id = tokenizer.eos_token_id
        self.stop_ids = stop_token_ids(tokenizer)  # EOS and the chat template's end-of-turn token
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
        self.micro_batch_size, self.max_batch, self.max_seq_len = micro_batch_size, max_batch, max_seq_len
        self.sync_every, self.seq_bucket, self.prefill_tokens = sync_every, seq_bucket, prefill_tokens
        self.release_weights, self.min_width, self.width_step = release_weights, min_width, width_step
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.model: FastCausalLM = build_fast_lm(hf_config, self.device, dtype, seed=seed,
                                                 materialize=not lazy_weights)
        self.vision = is_vision_language(hf_config)
        self.model_type = hf_config.model_type
        self.images = ImageEncoder(hf_config, lambda: self.model.model.visual) if self.vision else None
        self.placeholder_ids = self.images.placeholder_ids if self.vision else []
        self._call_images: CallImages | None = None  # the current generate call's (a VL model)
        if quantization not in ("none", "fp8") or fp8_activations not in ("none", "dynamic"):
            raise ValueError(f"quantization={quantization!r}, fp8_activations={fp8_activations!r}: choose "
                             "quantization none or fp8, fp8_activations none or dynamic")
        if quantization == "fp8":
            if fp8_activations == "dynamic":
                check_dynamic_activations(self.device)
                if fp8_block_size:
                    raise ValueError("rollout.fp8.activations=dynamic runs with per-channel scales; block scales "
                                     "(rollout.fp8.block_size) run weight-only: set one of them back")
            self.model.quantize_fp8(fp8_block_size or 0, fp8_activations == "dynamic")
        self.vocab_size = text_config(hf_config).vocab_size
        if record_routing and not self.model.routed_layers:
            raise ValueError(f"record_routing needs a mixture of experts; {hf_config.model_type!r} routes no tokens")
        self.record_routing = record_routing
        self.block_size, self.prefix_cache, self.kv_cache_tokens = block_size, prefix_cache, kv_cache_tokens
        self._pool: BlockPool | None = None  # with the cache (`_allocate`)
        self._slot_blocks: list[list[int]] = []  # the blocks each slot's row holds
        self._registering = True  # whether finished rows index their blocks (not while weights change in a call)
        self._routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (prompt's, response's) routes
        self._top = 0  # the call's `SamplingParams.top_logprobs`
        self._tops: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> its likeliest tokens (ids, log-probs)
        compile = self.device.type == "cuda" if compile is None else compile
        self._block = DecoderBlock(compile, decode_attention(attention, self.device, head_dim_of(self.model.config)))
        self._block.flash_below = prefill_tokens  # (a chunk short of the budget: flash, no cuDNN plan per new shape)
        # the n samples of a prompt read its shared blocks once a step (Triton attention only)
        self.cascade = cascade and isinstance(self._block.attention, TritonDecodeAttention)
        if self.cascade:
            self._block.attention.prefix_splits = prefix_splits
        self._groups: SharedPrefixGroups | None = None  # with the cache, when `cascade`
        self._steps = DecodeRunner(self.model, self._block, torch.compile(sample_tokens) if compile else sample_tokens,
                                   fused_sampler(sampler, self.device, self._block.attention, self.vision),
                                   self.cuda_graphs,
                                   self.device, self.vocab_size)
        self._state: SlotState | None = None
        self._released, self._weights_on_cpu, self._kept_shape = False, False, None
        self.last_stats: dict = {}  # the last generate call's counts
        # prompt tokens prefilled (padding not counted) and read from the prefix cache, over every call so far
        # and (a VL model) the images run through the vision tower
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "images": 0}

    @property
    def captures(self) -> int:
        """Decode graphs captured so far (each a new (mode, seq_len, width, cascade))."""
        return self._steps.captures

    @property
    def _graphs(self) -> dict[tuple, torch.cuda.CUDAGraph]:
        return self._steps.graphs

    # ---- weights and memory ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.model.shared:
            raise RuntimeError("load_weights into a rollout that reads the trainer's own tensors (share_weights) "
                               "would write into the trainer's base; sync it by load_lora")
        if self.model.model.norm.weight.is_meta:  # lazy_weights: the first load brings every parameter
            self.model.materialize(self.device)
            missing = self._copy_weights(weights)
            if missing:
                raise ValueError(f"the first load_weights of a lazy rollout left {len(missing)} parameters "
                                 f"unset, e.g. {missing[:4]}")
            return
        self._copy_weights(weights)  # same addresses, so the captured graphs stay valid
        self._forget_prefixes()

    def _copy_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """`copy_weights_in_place`; an FP8 model quantizes its linear layers' weights on the way in (on this
        device), and refuses a load with a non-finite weight after it (one host sync)."""
        if self.model.fp8 is None:
            return copy_weights_in_place(self.model, weights)
        amaxes = []

        def copy(name, param, tensor):
            amax = self.model.load_fp8_weight(name, param, tensor)
            if amax is not None:
                amaxes.append(amax.amax())  # (NaN stays NaN)

        missing = copy_weights_in_place(self.model, weights, copy)
        if amaxes:
            check_finite(torch.stack(amaxes), "a weight loaded into the FP8 rollout")
        return missing

    def pin_session(self, session: str, tokens: list[int]) -> int:
        """Keeps the cached blocks of `tokens` (a conversation so far) for `session` until its next pin, or until
        space runs short (`BlockPool.pin`); returns the positions kept. Called between generate calls, or from the
        generating thread (a stream's feed)."""
        if self._pool is None or not self.prefix_cache:
            return 0
        return self._pool.pin(session, list(tokens)) * self.block_size

    def unpin_session(self, session: str) -> None:
        if self._pool is not None:
            self._pool.unpin(session)

    def _forget_prefixes(self) -> None:
        """The cached K/V came from other weights: no later prompt may read it."""
        if self._pool is not None:
            self._pool.clear_index()

    @torch.no_grad()
    def share_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The model reads these tensors (hf_name -> the trainer's own, on this device, in the rollout's dtype)
        instead of holding a copy (`FastCausalLM.share_weights`); `release` then leaves them in place."""
        self.model.share_weights(weights)
        self._steps.drop_graphs()
        self._forget_prefixes()

    @torch.no_grad()
    def load_lora(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """LoRA adapters applied at run time (unmerged; `FastCausalLM.set_lora`), copied in place after the first."""
        first = not any(layer.lora for layer in self.model.model.layers)
        self.model.set_lora(adapters, scale)
        self._forget_prefixes()
        if first:
            self._steps.drop_graphs()

    @torch.no_grad()
    def merge_lora(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
                   base: dict[str, torch.Tensor]) -> None:
        """Writes base + scale * B @ A (in fp32, rounded to the rollout's dtype) into each adapted layer's weight
        in place (merged: the decode step is the plain model's); `base` maps `<layer>.weight` to the unmerged
        base weight (the trainer's own, or a copy the caller keeps)."""
        if self.model.shared:
            raise RuntimeError("merge_lora into a rollout that reads the trainer's own tensors (share_weights) "
                               "would write into the trainer's base; use load_lora")
        if self.model.fp8 is not None:
            raise RuntimeError("merge_lora into an FP8 rollout (rollout.quantization=fp8) is not supported; use "
                               "load_lora (adapters at run time) or rollout.quantization=none")
        params = dict(self.model.named_parameters())
        for name, (a, b) in adapters.items():
            params[f"{name}.weight"].copy_(merged_weight(base[f"{name}.weight"], a, b, scale))
        self._forget_prefixes()

    def release(self, weights: bool | None = None) -> None:
        """Frees the KV cache and graphs; with `weights` (default: the constructor's `release_weights`)
        the weights go to the CPU too."""
        if self._released:
            return
        self._kept_shape = (self._state.num_slots, self._state.max_seq) if self._state is not None else None
        self._drop_state()
        if (self.release_weights if weights is None else weights) and not self.model.shared:
            self.model.to("cpu")  # (shared weights are the trainer's: they stay)
            self._weights_on_cpu = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._released = True

    @torch.no_grad()
    def resume(self) -> None:
        """Moves the weights back if they left, reallocates the cache at its last size and recaptures the
        graphs the last rollouts used, so the next `generate` starts warm."""
        if not self._released:
            return
        if self._weights_on_cpu:
            self.model.to(self.device)
            self._weights_on_cpu = False
        if self._kept_shape is not None:
            self._state = self._allocate(*self._kept_shape)
            for mode, seq_len, width, cascade, top in sorted(self._steps.keys):
                if self.cuda_graphs and seq_len <= self._state.max_seq and width <= self._state.num_slots:
                    self._steps.capture(self._state, mode, seq_len, width, cascade, top, warm=False)
        self._released = False

    def _drop_state(self) -> None:
        self._steps.drop_graphs()
        self._steps.pool = None
        self._state = None
        self._pool, self._slot_blocks, self._groups = None, [], None

    def _allocate(self, num_slots: int, max_seq: int) -> SlotState:
        if self.cuda_graphs:
            self._steps.pool = torch.cuda.graph_pool_handle()
        blocks = num_slots * -(-max_seq // self.block_size)  # every slot's longest row (and the scratch block)
        if self.kv_cache_tokens is not None:  # or the budget
            if self.kv_cache_tokens < max_seq:
                raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} (rollout.fast.kv_cache_tokens) cannot "
                                 f"hold one row of {max_seq} positions (prompt + max_new_tokens, rounded up); raise "
                                 "it, or shorten prompts or responses")
            blocks = min(blocks, -(-self.kv_cache_tokens // self.block_size))
        self._pool = BlockPool(blocks + 1, self.block_size)
        self._slot_blocks = [[] for _ in range(num_slots)]
        route_shape = members = None
        if self.record_routing:
            route_shape = (len(self.model.routed_layers), self.model.layer_consts[self.model.routed_layers[0]].top_k)
        if self.cascade:
            heads = self.model.layer_consts[0]
            members = cascade_members(heads.num_heads // heads.num_kv_heads)
        state = SlotState.allocate(self.model.kv_shape(self._pool.num_blocks, self.block_size),
                                   self.model.model.embed_tokens.weight.dtype, self.device, num_slots, max_seq,
                                   self.block_size, self.vocab_size, self.stop_ids, route_shape, members,
                                   self.placeholder_ids, self.vision)
        if self.cascade:
            self._groups = SharedPrefixGroups(num_slots, members, state.shared, state.groups, self.block_size)
        return state

    def _ensure_capacity(self, num_rows: int, n: int, need_seq: int, num_slots: int | None = None) -> None:
        if self.max_seq_len is not None and need_seq > self.max_seq_len:
            raise ValueError(f"a prompt plus max_new_tokens needs {need_seq} cache positions, more than "
                             f"max_seq_len={self.max_seq_len}; raise max_seq_len or shorten the prompts")
        if self.model.max_positions is not None and need_seq > self.model.max_positions:
            raise ValueError(f"a prompt plus max_new_tokens needs {need_seq} positions, past the "
                             f"{self.model.max_positions} after which the 'dynamic' rope scaling changes its "
                             "frequencies, which the fast rollout does not; lower max_new_tokens or use "
                             "rollout.backend=hf")
        slots = self.max_batch or num_slots or min(num_rows, self.micro_batch_size * n)
        seq = self.max_seq_len or -(-need_seq // self.seq_bucket) * self.seq_bucket
        st = self._state
        if st is not None and st.num_slots >= slots and st.max_seq >= need_seq:
            return
        if st is not None and self.max_batch is None:
            slots = max(slots, st.num_slots)  # grow, never shrink: the graphs of the bigger shape are wanted
        if st is not None and self.max_seq_len is None:
            seq = max(seq, st.max_seq)
        self._drop_state()
        self._state = self._allocate(slots, seq)

    # ---- the decode step --------------------------------------------------------------------------
    def _run_step(self, mode: str, seq_len: int, generator: torch.Generator, width: int | None = None,
                  cascade: bool = False) -> None:
        """One decode step over the first `width` slots (default: all): `DecodeRunner.run`."""
        self._steps.run(self._state, mode, seq_len, generator, self._state.num_slots if width is None else width,
                        cascade, self._top)

    # ---- generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | torch.Tensor | None = None,
                 num_slots: int | None = None, multi_modal_inputs: list[dict | None] | None = None) -> RolloutOutput:
        """As `Rollout.generate`; `max_new_tokens` (B,) optionally sets each prompt's own response limit
        in place of `sampling.max_new_tokens` (benchmarks use it for mixed-length batches). `num_slots`: decode
        slots for the call (default min(B * n, micro_batch_size * n); `max_batch`, when set, wins); a caller
        whose rows are already the n samples of its prompts (the multi-turn rollout: n = 1 a call) names them.
        A vision-language model also takes each prompt's images, `multi_modal_inputs` (B entries of
        {"pixel_values", "image_grid_thw"} or None, `shardrl.data.images`)."""
        if self._released:
            raise RuntimeError("the rollout is released (no KV cache); call resume() before generate()")
        check_prompts(prompt_ids, attention_mask)
        num_prompts, width = prompt_ids.shape
        n = sampling.n
        images = check_images(multi_modal_inputs, num_prompts, self.vision, self.model_type)
        lengths = attention_mask.sum(1).tolist()
        limits = [sampling.max_new_tokens] * num_prompts if max_new_tokens is None else [int(x) for x in max_new_tokens]
        if len(limits) != num_prompts or min(limits) < 1:
            raise ValueError(f"max_new_tokens must hold one limit >= 1 per prompt ({num_prompts}), got {limits[:8]}")
        prompts = [prompt_ids[b, width - lengths[b]:].to(self.device) for b in range(num_prompts)]
        generator = self._start(sampling, num_prompts * n, n, max(p + m for p, m in zip(lengths, limits)), num_slots)
        track = VersionTrack(self.weight_hook) if self.weight_hook is not None else None
        self._call_images = CallImages(self.images, images, n) if self.vision else None
        try:
            rows = self._decode_rows(prompts, limits, n, sampling_mode(sampling), sampling.stop, generator, track)
        finally:
            if self._call_images is not None:
                self.totals["images"] += self._call_images.encoded
                self.last_stats["images"] = self._call_images.encoded
            self._call_images = None  # (its tower outputs go)
        out = self._assemble(prompt_ids, attention_mask, rows, n, sampling.stop)
        if track is not None:
            out.token_version = track.tensor(out.response_mask)
        return out

    def generate_stream(self, prompts: list[torch.Tensor], limits: list[int], sampling: SamplingParams,
                        feed: RowFeed, need_seq: int, num_slots: int | None = None, overlap: bool = False) -> None:
        """Generation whose rows keep coming: one row per prompt of `prompts` (1-D id tensors, no padding) with
        its own limit, then whatever `feed.take` hands over while earlier rows decode; each row's uncut
        output goes to `feed.finished` as soon as the row ends, so the caller can act on it (run a tool) while
        the other rows decode. `need_seq` bounds prompt + response of every row, those to come included;
        `num_slots`: decode slots (default: as `generate` sizes them for as many rows as `prompts`; `max_batch`,
        when set, wins).
        `sampling.n` is ignored (one row per prompt). Rows admitted at different steps draw different noise:
        unlike `generate`, the tokens depend on when rows arrive. `overlap`: while rows decode, their next steps are
        launched before the new rows are admitted, so that the admission's host work overlaps them on the device;
        the new rows then decode from the next sync on (a server's many small admissions; see `_decode_rows`)."""
        if self._released:
            raise RuntimeError("the rollout is released (no KV cache); call resume() before generate_stream()")
        if len(limits) != len(prompts) or (limits and min(limits) < 1):
            raise ValueError(f"one limit >= 1 per prompt ({len(prompts)}), got {limits[:8]}")
        if self.record_routing:
            raise ValueError("record_routing (router replay R3) covers single-turn generate only")
        generator = self._start(sampling, max(len(prompts), 1), 1, need_seq, num_slots)
        self._call_images = CallImages(self.images, [], 1) if self.vision else None  # (text rows: plain positions)
        self._decode_rows([p.to(self.device) for p in prompts], list(limits), 1, sampling_mode(sampling),
                          sampling.stop, generator, feed=feed, overlap=overlap)

    def _start(self, sampling: SamplingParams, num_rows: int, n: int, need_seq: int,
               num_slots: int | None = None) -> torch.Generator:
        """Sizes the cache, resets the slots and sets the sampling parameters; the call's noise generator."""
        self._ensure_capacity(num_rows, n, need_seq, num_slots)
        st = self._state
        self._top, self._tops = sampling.top_logprobs, {}
        st.temperature.fill_(1.0 if sampling.is_greedy else sampling.temperature)  # (raw log-probs: RAW's mode)
        st.top_k.fill_(sampling.top_k or self.vocab_size)
        st.top_p.fill_(sampling.top_p if sampling.top_p < 1 else 2.0)
        st.done.fill_(True)
        st.lengths.zero_()
        st.num_generated.zero_()
        st.table.zero_()  # (a call that failed may have left rows, and blocks held)
        self._pool.drop_holders()
        self._slot_blocks = [[] for _ in range(st.num_slots)]
        if self._groups is not None:
            self._groups.reset()
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator(device=self.device).manual_seed(seed)
