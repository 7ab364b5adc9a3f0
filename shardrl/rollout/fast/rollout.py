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
composes them with the paged cache (`paged`) and the model (`model`).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from shardrl.engine.lora import merged_weight
from shardrl.models.config import text_config
from shardrl.models.families import check_supported
from shardrl.models.vision import is_vision_language
from shardrl.rollout.base import (Rollout, RolloutOutput, SamplingParams, VersionTrack, assemble_output, check_images,
                                   check_prompts, contains_stop, copy_weights_in_place, cut_responses, likeliest_tokens)
from shardrl.rollout.fast.kernel_support import cascade_members
from shardrl.rollout.fast.paged import BlockPool, SharedPrefixGroups
from shardrl.rollout.fast.attention import TritonDecodeAttention
from shardrl.rollout.fast.fp8 import check_dynamic_activations, check_finite
from shardrl.rollout.fast.model import DecoderBlock, FastCausalLM, build_fast_lm, head_dim_of
from shardrl.rollout.fast.scheduler import (RowFeed, RowScheduler, blocks_for, prefill_chunks, rows_that_fit,
                                            shared_prefix_groups, slot_widths)
from shardrl.rollout.fast.step import (GREEDY, SAMPLE, TRUNCATED, DecodeRunner, SlotState,  # noqa: F401 (for callers)
                                       decode_attention, fused_sampler, reported_logits, sample_tokens,
                                       sampling_mode)
from shardrl.rollout.fast.vision import CallImages, ImageEncoder
from shardrl.tokenizer import stop_token_ids

log = logging.getLogger(__name__)


class FastRollout(Rollout):
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
                    self._steps.capture(self._state, mode, seq_len, width, cascade, top)
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

    def _decode_rows(self, prompts, limits, n, mode, stop, generator, track: VersionTrack | None = None,
                     feed: RowFeed | None = None, overlap: bool = False) -> list[tuple[list[int], torch.Tensor]]:
        """(tokens, log-probs) of every row b*n+j, uncut: through EOS, the limit, or past a stop string.
        With `track`, its weight hook runs at every host sync (between decode steps: the next step reads the
        new weights) and records which rows it splits where. With `feed` (n == 1; `prompts` and `limits` grow),
        finished rows are reported at each sync and new rows taken: waited for when nothing else is left.
        The decisions are the scheduler's (`RowScheduler`); here they are applied to the device state."""
        st = self._state
        sched = RowScheduler(len(prompts) * n, st.num_slots, self._widths(st.num_slots), st.max_seq)
        stats = sched.stats
        self._routes = {}
        self._registering = track is None  # a row that saw a weight change holds K/V of two versions
        self._prompt_tokens: dict[int, list[int]] = {}
        self._prompt_keys: dict[int, list[bytes]] = {}
        captures = self.captures
        clock = time.perf_counter()
        while True:
            sched.sync(*torch.stack([st.done.long(), st.lengths, st.num_generated]).tolist())
            now = time.perf_counter()
            stats["decode_s"] += now - clock  # the steps since the last sync, to their end (launches included)
            clock, inner = now, 0.0
            self._end_rows(sched, prompts, n, stop, feed)
            if feed is not None:
                inner += self._take_rows(sched, prompts, limits, feed)
            if track is not None:
                track.poll(sched.rows_in_flight)
            # `overlap` with rows decoding: their next steps are launched first and the admission runs while the
            # device runs them. Its host work (a prefill's launches: 20-40 ms for a few prompts of the Qwen2-1.5B
            # shape on one H200, of a few ms on the device) then leaves the device idle no longer; its rows decode
            # from the next sync on
            later = overlap and bool(sched.live())
            if not later:
                inner += self._admit_waiting(sched, prompts, limits, n, mode, generator, track)
            if not sched.live():
                break
            move = sched.compaction()  # rows left decoding in slots past the narrowest prefix that holds them
            if move is not None:
                self._compact(*move, sched)
            width, num_steps, seq_len = sched.plan(limits, n, self.sync_every, self.seq_bucket, st.max_seq,
                                                   self._block.attention.bucketed)
            cascade = self._groups is not None and self._groups.active()
            if cascade:
                self._groups.push()
                stats["cascade_steps"] += num_steps
            now = time.perf_counter()
            stats["host_s"] += now - clock - inner  # bookkeeping at the sync (not the feed's wait or the prefill)
            clock = now
            for _ in range(num_steps):
                self._run_step(mode, seq_len, generator, width, cascade)
            stats["launch_s"] += time.perf_counter() - clock  # (of decode_s: the host's share, launching the steps)
            sched.count_steps(num_steps, width)
            if later:
                clock += self._admit_waiting(sched, prompts, limits, n, mode, generator, track)  # (admit_s)
        stats["captures"] = self.captures - captures
        self.last_stats = stats
        return sched.results

    def _end_rows(self, sched: RowScheduler, prompts, n: int, stop, feed: RowFeed | None) -> None:
        """A sync's endings: the rows a stop string ends, all of them once the caller aborts (`generate` only),
        those the feed cancels; then every done row is retired (its output to `sched.results`, and to the feed)."""
        if stop:
            sched.stop(self._find_stops(sched.running(), sched.generated, stop))
        if feed is None and self.abort is not None and self.abort():  # nobody will read the rest (a server)
            sched.abort()  # (`_retire` marks the slots done on the device)
        if feed is not None and hasattr(feed, "cancelled"):
            gone = set(feed.cancelled())
            ended = sched.cancel(gone) if gone else []
            if ended:
                self._state.done[torch.tensor(ended, dtype=torch.long, device=self.device)] = True
        finished = sched.finished()
        if not finished:
            return
        self._retire(finished, sched.slot_row, sched.generated, sched.results, prompts, n)
        if feed is not None:
            for s in finished:
                row = sched.slot_row[s]
                # (the likeliest tokens only where the call asks: a feed that never does takes no such argument)
                top = {"top": self._tops.pop(row)} if self._top else {}
                feed.finished(row, *sched.results[row], **top)
                # a stream may run for hours: what a finished row held goes (its prompt, its output)
                prompts[row] = sched.results[row] = None
                self._prompt_tokens.pop(row, None)
                self._prompt_keys.pop(row, None)
        sched.free(finished)

    def _take_rows(self, sched: RowScheduler, prompts, limits, feed: RowFeed) -> float:
        """Queues the rows the feed hands over, waiting for them only when nothing is queued or decoding; returns
        the seconds waited."""
        idle = sched.idle()
        t0 = time.perf_counter()
        taken = feed.take(block=idle)
        sched.stats["feed_wait_s"] += (waited := time.perf_counter() - t0)
        for prompt, limit in taken:
            # its ids on the host now: read back from the device in the admission, they would wait for the decode
            # steps queued before it (`overlap`)
            self._prompt_tokens[len(prompts)] = prompt.tolist()
            prompts.append(prompt.to(self.device))
            limits.append(int(limit))
            sched.add_row()
        return waited

    def _admit_waiting(self, sched: RowScheduler, prompts, limits, n, mode, generator,
                       track: VersionTrack | None) -> float:
        """Prefills the queue's head into the free slots, as many as the pool holds; returns the seconds taken."""
        admitted = sched.admit(lambda free, busy: rows_that_fit(sched.queue, lambda b: len(prompts[b]), limits, n,
                                                                free, busy, self._pool.reclaimable(),
                                                                self.block_size))
        if not admitted:
            return 0.0
        if track is not None:
            for _, row in admitted:
                track.begin(row)
        t0 = time.perf_counter()
        run, cached = self._admit(admitted, prompts, limits, n, mode, generator)
        took = time.perf_counter() - t0
        stats = sched.stats
        stats["admit_s"] += took
        stats["admissions"] += 1
        stats["prefill_tokens"] += run
        stats["cached_tokens"] += cached
        sched.place(admitted, lambda row: len(prompts[row // n]))
        return took

    def _widths(self, num_slots: int) -> list[int]:
        """The slot prefixes a decode step may run on (`slot_widths`)."""
        return slot_widths(num_slots, self.min_width, self.width_step)

    def _compact(self, src: list[int], dst: list[int], sched: RowScheduler) -> None:
        """Moves the rows decoding in slots `src` into the free slots `dst` (`RowScheduler.compaction`): their
        block-table rows (the K/V stays where it is), next token, counters and outputs, in one indexed copy per
        tensor; the scheduler, the slots' blocks and the shared-prefix groups follow."""
        st = self._state
        s_t = torch.tensor(src, dtype=torch.long, device=self.device)
        d_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        made = max(sched.generated[s] for s in src)
        for t in (st.table, st.tokens, st.lengths, st.done, st.num_generated, st.max_new, st.rope_delta):
            if t is not None:
                t[d_t] = t[s_t]
        st.table[s_t] = 0
        st.out_tokens[d_t, :made] = st.out_tokens[s_t, :made]
        st.out_log_probs[d_t, :made] = st.out_log_probs[s_t, :made]
        if st.out_routes is not None:
            st.out_routes[d_t, :made] = st.out_routes[s_t, :made]
        if self._top:
            for t in st.top_buffers():
                t[d_t, :made] = t[s_t, :made]
        st.lengths[s_t] = 0
        st.done[s_t] = True
        for s, d in zip(src, dst):
            if self._groups is not None:
                self._groups.move(s, d)
            self._slot_blocks[d], self._slot_blocks[s] = self._slot_blocks[s], []
        sched.move(src, dst)

    def _admit(self, admitted, prompts, limits, n, mode, generator) -> tuple[int, int]:
        """Prefills the prompts of `admitted` (slot, row) pairs into their slots' blocks and samples each row's
        first token. Each distinct prompt (by its tokens: a prompt's n samples, and rows whose prompts are equal,
        such as a conversation's copies at its first turn) runs once, from the end of its longest cached prefix
        (`BlockPool.lookup`), in chunks of at most `prefill_tokens` tokens run (and four times that read from the
        cache where SDPA attends to a gathered copy of the cached prefixes, sixteen with the Triton prefill); its
        rows share its full blocks (each gets its own copy of the last, partly filled one). Returns (tokens run,
        prompt tokens read from the cache)."""
        lookup = self.prefix_cache and not self.record_routing  # (R3 records the routing of every prompt token)
        # a chunk's reads of the cache are bounded when they gather it (SDPA); the Triton prefill reads the blocks,
        # but a chunk stays bounded by its whole contexts too: an estimated cached prefix may be evicted by the
        # chunk's own allocations before its lookup, and then runs whole
        wide = (16 if self._block.attention.prefix_from_blocks else 4) * self.prefill_tokens

        def cached_of(b: int, toks: list[int]) -> int:  # (nothing in the chunking changes the pool)
            return self._pool.match(toks, len(toks) - 1, self._keys_of(b)) * self.block_size if lookup else 0

        chunks, same = prefill_chunks(admitted, n, lambda b: self._tokens_of(prompts, b), cached_of,
                                      self.prefill_tokens, wide)
        run = cached = 0
        for chunk in chunks:
            chunk_run, chunk_cached = self._prefill_chunk(chunk, same, prompts, limits, n, mode, generator, lookup)
            run, cached = run + chunk_run, cached + chunk_cached
        return run, cached

    def _prefill_chunk(self, chunk, same: dict[int, int], prompts, limits, n, mode, generator,
                       lookup: bool) -> tuple[int, int]:
        """One chunk of `_admit`: its distinct prompts prefilled, its rows given their blocks and first tokens.
        Returns (tokens run, prompt tokens read from the cache)."""
        st, pool, size, to_dev = self._state, self._pool, self.block_size, self._to_device
        order = list(dict.fromkeys(same[row // n] for _, row in chunk))  # distinct prompts, in order
        index = {b: i for i, b in enumerate(order)}
        index.update({row // n: index[same[row // n]] for _, row in chunk})
        tokens = [self._tokens_of(prompts, b) for b in order]
        first_limit = {}  # each prompt's first row in the chunk takes its blocks: room for that row's limit
        for _, row in chunk:
            first_limit.setdefault(index[row // n], limits[row // n])
        owned, starts = [], []
        for i, toks in enumerate(tokens):  # the first row of each prompt prefills it into its blocks
            # (its last token is run: the logits)
            hit = pool.lookup(toks, len(toks) - 1, self._keys_of(order[i])) if lookup else []
            owned.append(hit + pool.allocate(blocks_for(len(toks), first_limit[i], size) - len(hit)))
            starts.append(len(hit) * size)
        lens = [len(t) - c for t, c in zip(tokens, starts)]
        # the prompts' ids past their cached prefixes, right-padded: from their copies on the device
        ids = pad_sequence([prompts[b][c:] for b, c in zip(order, starts)], batch_first=True,
                           padding_value=self.pad_id).long()
        routes = None
        if st.out_routes is not None:
            routes = torch.empty((ids.numel(), *st.step_routes.shape[1:]), dtype=torch.long, device=self.device)
        images = None
        if self._call_images is not None:  # the tower's output at the placeholders, M-RoPE positions
            images = self._call_images.prefill_inputs(order, tokens, starts, ids.shape[1], to_dev)
        logits = self.model.prefill(ids, lens, st.kv, self._table_rows(owned), starts, self._block, routes,
                                    to_device=to_dev, images=images)
        if self._registering and lookup:
            for b, toks, blocks in zip(order, tokens, owned):
                pool.register(toks, blocks, len(toks), self._keys_of(b))
        # the rows: a prompt's first takes its blocks; the others share its full blocks and copy the partial one
        copies, rows_blocks, firsts = [], [], set()
        for _, row in chunk:
            b = row // n
            i, plen = index[b], len(tokens[index[b]])
            if i not in firsts:
                firsts.add(i)
                rows_blocks.append(owned[i])
                continue
            full = owned[i][: plen // size]
            pool.hold(full)
            own = pool.allocate(blocks_for(plen, limits[b], size) - len(full))
            if plen % size:
                copies.append((owned[i][len(full)], own[0]))
            rows_blocks.append(full + own)
        if copies:
            src, dst = to_dev([c[0] for c in copies]), to_dev([c[1] for c in copies])
            st.kv[:, :, dst] = st.kv[:, :, src]
        if self._groups is not None:  # rows starting with the same blocks read them together in the decode steps
            # (blocks two rows both hold are full and never written again: only a row's own blocks are)
            for members, common in shared_prefix_groups([s for s, _ in chunk], rows_blocks):
                self._groups.add(members, common * size)
        slots = to_dev([s for s, _ in chunk])
        source = to_dev([index[row // n] for _, row in chunk])
        for (slot, _), blocks in zip(chunk, rows_blocks):
            self._slot_blocks[slot] = blocks
        st.table[slots] = self._table_rows(rows_blocks)
        logits = logits.float()[source]  # (k, V)
        if routes is not None:  # each row's prompt: the routing of the prefill that wrote its K/V
            routes = routes.view(*ids.shape, *routes.shape[1:]).to(torch.int16).cpu()
            for (_, row), i in zip(chunk, source.tolist()):
                self._routes[row] = (routes[i, : lens[i]], None)
        limit_t = to_dev([limits[row // n] for _, row in chunk])
        noise = None if mode == GREEDY else torch.empty_like(logits).exponential_(generator=generator)
        tokens_out, log_probs = sample_tokens(logits, mode, noise, st.temperature, st.top_k, st.top_p, st.banned)
        st.tokens[slots] = tokens_out
        st.lengths[slots] = to_dev([len(tokens[index[row // n]]) for _, row in chunk])
        st.num_generated[slots] = 1
        st.max_new[slots] = limit_t
        if self._call_images is not None:  # each row decodes at cache position + its prompt's M-RoPE delta
            call = self._call_images
            st.rope_delta[slots] = to_dev([call.rope_of(order[index[row // n]], tokens[index[row // n]])[1]
                                           for _, row in chunk])
            call.admitted([row // n for _, row in chunk])
        st.out_tokens[slots, 0] = tokens_out
        st.out_log_probs[slots, 0] = log_probs
        if self._top:
            top_ids, top_values = st.top_buffers()
            ids, values = likeliest_tokens(reported_logits(logits, mode, st.temperature), self._top, tokens_out,
                                           log_probs)
            top_ids[slots, 0, :self._top], top_values[slots, 0, :self._top] = ids, values
        st.done[slots] = (tokens_out[:, None] == st.eos).any(-1) | (limit_t <= 1)
        self.totals["prompt_tokens"] += sum(lens)
        self.totals["cached_tokens"] += sum(starts)
        return ids.numel(), sum(starts)

    def _table_rows(self, block_lists: list[list[int]]) -> torch.Tensor:
        """Block-table rows (on the device) for lists of blocks: each list, then the scratch block 0."""
        width = self._state.table.shape[1]
        return self._to_device([blocks + [0] * (width - len(blocks)) for blocks in block_lists])

    def _to_device(self, values) -> torch.Tensor:
        """Integers (a list, nested lists, or a CPU tensor) on the device, sent without waiting for it: a copy from
        pinned memory is queued behind the kernels already launched, where a copy from pageable memory makes the
        host wait for all of them (in the admission, the device then idles while the host prepares each chunk)."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _tokens_of(self, prompts, b: int) -> list[int]:
        """Prompt b's ids on the host (read once per call); a VL prompt's image placeholders stand as their image's
        digest (`vision.identity`), so that the prefix index and the sharing of equal prompts key on the image."""
        if b not in self._prompt_tokens:
            tokens = prompts[b].tolist()
            if self._call_images is not None:
                tokens = self._call_images.identity(b, tokens)
            self._prompt_tokens[b] = tokens
        return self._prompt_tokens[b]

    def _keys_of(self, b: int) -> list[bytes]:
        """The prefix-index keys of prompt b's full blocks (`BlockPool.keys`; made once per call, after
        `_tokens_of`)."""
        if b not in self._prompt_keys:
            toks = self._prompt_tokens[b]
            self._prompt_keys[b] = self._pool.keys(toks, len(toks) // self.block_size)
        return self._prompt_keys[b]

    def _retire(self, finished, slot_row, generated, results, prompts, n: int) -> None:
        """Copies the finished slots' tokens to the host (one transfer), indexes the full blocks of what each
        row's cache holds (prompt and fed tokens; `prefix_cache`), releases the rows' blocks and marks the slots
        empty."""
        st = self._state
        idx = self._to_device(finished)
        width = max(generated[s] for s in finished)
        tokens = st.out_tokens[idx, :width].tolist()
        log_probs = st.out_log_probs[idx, :width].cpu()
        if self._top:
            top_ids, top_values = (t[idx, :width, :self._top].cpu() for t in st.top_buffers())
        for i, s in enumerate(finished):
            results[slot_row[s]] = (tokens[i][: generated[s]], log_probs[i, : generated[s]])
            if self._top:
                self._tops[slot_row[s]] = (top_ids[i, : generated[s]], top_values[i, : generated[s]])
            blocks = self._slot_blocks[s]
            if self.prefix_cache and self._registering and not self.record_routing:
                prompt = self._tokens_of(prompts, slot_row[s] // n)
                self._pool.register(prompt + results[slot_row[s]][0], blocks, len(prompt) + generated[s] - 1,
                                    self._keys_of(slot_row[s] // n))
            self._pool.release(blocks)
            self._slot_blocks[s] = []
            if self._groups is not None:
                self._groups.remove(s)
        if st.out_routes is not None:  # the tokens fed: all but the last
            routes = st.out_routes[idx, : max(width - 1, 1)].cpu()
            for i, s in enumerate(finished):
                row = slot_row[s]
                self._routes[row] = (self._routes[row][0], routes[i, : generated[s] - 1])
        st.lengths[idx] = 0
        st.done[idx] = True
        st.table[idx] = 0

    def _find_stops(self, live: list[int], generated: list[int], stop: list[str]) -> list[int]:
        """The live slots whose response now holds a stop string (marked done on the device too). Only the
        tail a check can have missed is decoded first, as `hf._StopStringCriteria` does."""
        if not live:
            return []
        st = self._state
        idx = torch.tensor(live, dtype=torch.long, device=self.device)
        rows = st.out_tokens[idx, : max(generated[s] for s in live)].cpu().tolist()
        window = self.sync_every + 1 + max(len(s) for s in stop) + 8
        ids = [row[: generated[s]] for row, s in zip(rows, live)]
        tails = self.tokenizer.batch_decode([r[-window:] for r in ids], skip_special_tokens=True)
        decode = lambda r: self.tokenizer.decode(r, skip_special_tokens=True)  # noqa: E731
        hits = [s for s, tail, r in zip(live, tails, ids)
                if contains_stop(tail, stop) and contains_stop(decode(r), stop)]
        if hits:
            st.done[torch.tensor(hits, dtype=torch.long, device=self.device)] = True
        return hits

    def _assemble(self, prompt_ids, attention_mask, rows, n, stop) -> RolloutOutput:
        """The `RolloutOutput` of the uncut rows, cut by the HF reference's own rule (`cut_responses`)."""
        width = max(len(t) for t, _ in rows)
        full = torch.tensor([tokens + [self.pad_id] * (width - len(tokens)) for tokens, _ in rows], dtype=torch.long)
        lengths, texts = cut_responses(self.tokenizer, self.stop_ids, full, stop)
        # a row shorter than `full` without EOS ended at its own limit (or a stop string): padding is no response
        lengths = [min(length, len(tokens)) for length, (tokens, _) in zip(lengths, rows)]
        responses = [(full[r, :length], rows[r][1][:length]) for r, length in enumerate(lengths)]
        tops = None
        if self._top:  # (a row never admitted (`abort`) has none)
            none = (torch.zeros(0, self._top, dtype=torch.long), torch.zeros(0, self._top))
            tops = [self._tops.get(r, none) for r in range(len(rows))]
            self._tops = {}
        out = assemble_output(prompt_ids, attention_mask, n, responses, texts, self.pad_id, tops)
        if self.record_routing:
            out.routed_experts = self._routed_experts(out, lengths, n)
        return out

    def _routed_experts(self, out: RolloutOutput, lengths: list[int], n: int) -> torch.Tensor:
        """(N, P+R, L, k) int16: the recorded routing of each row laid out as `out.to_batch()`'s input_ids; -1
        where nothing was run (padding; the last response token, never fed)."""
        width = out.prompt_ids.shape[1]
        routed = torch.full((len(out), width + out.response_ids.shape[1], *self._state.step_routes.shape[1:]), -1,
                            dtype=torch.int16)
        for r, length in enumerate(lengths):
            if r not in self._routes:  # (never admitted: a call ended by `abort`)
                continue
            prompt, response = self._routes[r]
            routed[r, width - prompt.shape[0]:width] = prompt
            fed = min(length, response.shape[0])
            routed[r, width:width + fed] = response[:fed]
        self._routes = {}
        return routed
