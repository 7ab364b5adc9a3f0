"""The reference rollout: Hugging Face `model.generate` on the rollout's own copy of the policy.

Simple and slow (dynamic KV cache, Python loop per token); it defines the behaviour a fast backend must match.

Sampled log-probs are recorded by a logits processor that runs before HF's temperature/top-k/top-p
warpers, so it sees the raw logits. Asking `generate` for `output_logits=True` would give the same numbers
but keep `steps x rows x vocab` fp32 logits alive (about 150 GB for 1k steps of 256 rows of a 150k
vocab); the processor keeps one step's log-probs and scores each token one step later, when it appears
as the last column of `input_ids`.

A vision-language model (`shardrl.models.vision`) generates from each prompt's images: `generate` takes the
prompts' `multi_modal_inputs` (one per prompt, None for a prompt without images), repeats each for the prompt's n
samples, and hands the chunk's `pixel_values` / `image_grid_thw` to HF's `generate`, which runs the vision tower
at prefill and decodes with the M-RoPE positions its `get_rope_index` gives the left-padded rows.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Iterable

import torch
import transformers
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shardrl.models.vision import image_token_id, is_vision_language, stack_images
from shardrl.rollout.base import (Rollout, RolloutOutput, SamplingParams, VersionTrack, assemble_output, check_images,
                                   check_prompts, contains_stop, copy_weights_in_place, cut_responses,
                                   stop_window)
from shardrl.tokenizer import stop_token_ids

log = logging.getLogger(__name__)


class _LogProbRecorder(LogitsProcessor):
    """Records log softmax(raw logits / T) of each sampled token, one step behind the sampler; with `top` > 0 also
    the `top` likeliest tokens of each step and their log-probs in that distribution."""

    def __init__(self, temperature: float, top: int = 0):
        self.temperature, self.top = temperature, top
        self.last: torch.Tensor | None = None  # (rows, V) log-probs of the latest step
        self.scored: list[torch.Tensor] = []  # one (rows,) per generated token
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # one ((rows, top) ids, log-probs) per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # input_ids[:, -1] was sampled from self.last
            self.scored.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self.top:  # (the sampled token's entry is the very element `scored` gathers: the same number)
            values, ids = self.last.topk(self.top, dim=-1)
            self.tops.append((ids, values))
        return scores

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(rows, L) log-probs of `response_ids`; `generate` may have run (and undone) extra steps."""
        num_tokens = response_ids.shape[1]
        if len(self.scored) < num_tokens:  # the last token was never seen by a later call
            step = len(self.scored)
            self.scored.append(self.last.gather(-1, response_ids[:, step : step + 1]).squeeze(-1))
        if not self.scored:
            return response_ids.new_zeros(response_ids.shape, dtype=torch.float32)
        return torch.stack(self.scored[:num_tokens], dim=1)

    def finish_top(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, L, top) ids and log-probs of the likeliest tokens at each of the `num_tokens` steps."""
        steps = self.tops[:num_tokens]
        rows = self.last.shape[0] if self.last is not None else 0
        if not steps:
            return torch.zeros(rows, 0, self.top, dtype=torch.long), torch.zeros(rows, 0, self.top)
        return torch.stack([i for i, _ in steps], 1).cpu(), torch.stack([v for _, v in steps], 1).cpu()


class _Suppress(LogitsProcessor):
    """Never samples `token_ids` (a VL model's image and video placeholders): one in a response would ask the
    vision tower for an image the row does not have. It runs after the log-prob recorder, so the recorded
    log-probs stay the model's whole distribution, what the engine recomputes (the placeholders' mass is left in)."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor(self.token_ids, dtype=torch.long, device=scores.device)
        return scores.index_fill(-1, ids, float("-inf"))


class _WeightPoll(LogitsProcessor):
    """Runs a `VersionTrack`'s hook at every step; weights it loads serve the next step's forward."""

    def __init__(self, track: VersionTrack, rows: range, prompt_width: int):
        self.track, self.rows, self.prompt_width = track, rows, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # this step's logits (token `index`) came from the weights loaded so far; token index + 1 reads the new
        index = input_ids.shape[1] - self.prompt_width
        self.track.poll(lambda: [(row, index + 1) for row in self.rows])
        return scores


class _StopStringCriteria(StoppingCriteria):
    """Ends a row once its decoded response contains a stop string (an early exit only: the response
    mask is cut afterwards from the full decode, by `shardrl.rollout.base.stop_length`)."""

    def __init__(self, tokenizer, stop: list[str], prompt_width: int):
        self.tokenizer, self.stop, self.prompt_width = tokenizer, stop, prompt_width
        # a stop string first appears ending at the newest token; this many tokens hold it
        self.window = stop_window(stop)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        response = input_ids[:, self.prompt_width :]
        tails = self.tokenizer.batch_decode(response[:, -self.window :], skip_special_tokens=True)
        done = [
            contains_stop(tail, self.stop)
            and contains_stop(self.tokenizer.decode(row, skip_special_tokens=True), self.stop)
            for tail, row in zip(tails, response)
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _Abort(StoppingCriteria):
    """Ends every row once `abort()` (`Rollout.abort`) is true."""

    def __init__(self, abort):
        self.abort = abort

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.abort()), dtype=torch.bool, device=input_ids.device)


class HFRollout(Rollout):
    """Generation with `transformers`' `generate` on a model built from `hf_config` (weights arrive by
    `load_weights`). `micro_batch_size` prompts (times n samples) go into one `generate` call."""

    def __init__(self, hf_config, tokenizer, device: torch.device | str, dtype: torch.dtype,
                 micro_batch_size: int = 64, attn_implementation: str = "sdpa", seed: int = 0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.eos_id = tokenizer.eos_token_id
        self.stop_ids = stop_token_ids(tokenizer)  # EOS and the chat template's end-of-turn token
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
        # a copy: from_config sets the attention implementation (and below, use_cache) on the config object it
        # is given, and the caller's is usually the actor engine's, which its model reads at every forward
        # (the actor would run the rollout's attention, e.g. plain SDPA on its 1/sp piece of a row under sp)
        hf_config = copy.deepcopy(hf_config)
        self.vision = is_vision_language(hf_config)
        self.placeholder_ids = [i for i in (getattr(hf_config, "image_token_id", None),
                                            getattr(hf_config, "video_token_id", None)) if i is not None]
        auto = transformers.AutoModelForCausalLM
        if self.vision:  # HF's image-text-to-text class, the engine's: the same parameter names
            auto = transformers.AutoModelForImageTextToText
            attn_implementation = {"": attn_implementation, "text_config": attn_implementation,
                                   "vision_config": "sdpa"}
        with torch.random.fork_rng(devices=[]), torch.device(self.device):
            torch.manual_seed(seed)  # random init, overwritten by load_weights; seeded so tests are stable
            self.model = auto.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
        self.model.eval().requires_grad_(False)
        self.model.config.use_cache = True
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.stop_ids or None, pad_token_id=self.pad_id, bos_token_id=tokenizer.bos_token_id)
        self._released = False

    # ---- weights and memory ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights_in_place(self.model, weights)

    def release(self) -> None:
        if self._released:
            return
        self.model.to("cpu")
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if not self._released:
            return
        self.model.to(self.device)
        self._released = False

    # ---- generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingParams,
                 multi_modal_inputs: list[dict | None] | None = None) -> RolloutOutput:
        """As `Rollout.generate`; a vision-language model also takes each prompt's images, `multi_modal_inputs`
        (B entries of {"pixel_values", "image_grid_thw"} or None, `shardrl.data.images`)."""
        if self._released:
            raise RuntimeError("the rollout is released (its model sits on the CPU); call resume() before generate()")
        check_prompts(prompt_ids, attention_mask)
        num_prompts, n = prompt_ids.shape[0], sampling.n
        images = check_images(multi_modal_inputs, num_prompts, self.vision, self.model.config.model_type)
        track = VersionTrack(self.weight_hook) if self.weight_hook is not None else None
        with self._seeded(sampling.seed):
            chunks = [
                self._generate_chunk(prompt_ids[s : s + self.micro_batch_size],
                                     attention_mask[s : s + self.micro_batch_size], sampling,
                                     track, s * n, images[s : s + self.micro_batch_size])
                for s in range(0, num_prompts, self.micro_batch_size)
            ]

        responses = [(ids[i, :length], logp[i, :length]) for ids, lengths, logp, _, _ in chunks
                     for i, length in enumerate(lengths)]
        texts = [t for _, _, _, chunk_texts, _ in chunks for t in chunk_texts]
        tops = None
        if sampling.top_logprobs:
            tops = [(top_ids[i], top_lps[i]) for *_, (top_ids, top_lps) in chunks for i in range(len(top_ids))]
        out = assemble_output(prompt_ids, attention_mask, n, responses, texts, self.pad_id, tops)
        if track is not None:
            out.token_version = track.tensor(out.response_mask)
        return out

    def _image_kwargs(self, ids: torch.Tensor, images: list, n: int) -> dict:
        """`generate`'s image inputs for the chunk's rows `ids` (each prompt's images repeated for its n samples,
        in row order, as the placeholders are), and the placeholders' modality (`mm_token_type_ids`, 1 at an image
        token), from which transformers >= 5.2x's `get_rope_index` reads where the images are."""
        if not self.vision:
            return {}
        kwargs = stack_images([row for row in images for _ in range(n)], self.device)
        if kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.model.dtype)
        return {**kwargs, "mm_token_type_ids": (ids == image_token_id(self.model.config)).int()}

    def _generate_chunk(self, prompt_ids, attention_mask, sampling: SamplingParams,
                        track: VersionTrack | None = None, first_row: int = 0, images: list | None = None):
        """One `generate` call; returns (ids (rows, L) on CPU, lengths, log-probs (rows, L), texts, the likeliest
        tokens' (ids, log-probs) (rows, L, k) each or None without `sampling.top_logprobs`). With
        `track`, the chunk's rows are `first_row`, `first_row + 1`, ... of the whole output. `images`: the chunk's
        prompts' `multi_modal_inputs` (a vision-language model)."""
        first = int(attention_mask.any(0).nonzero()[0])  # drop columns that are padding in every row
        ids = prompt_ids[:, first:].to(self.device).repeat_interleave(sampling.n, dim=0)  # (rows, P')
        mask = attention_mask[:, first:].to(self.device).repeat_interleave(sampling.n, dim=0)
        recorder = _LogProbRecorder(sampling.logprob_temperature, sampling.top_logprobs)
        processors = [recorder] + ([_Suppress(self.placeholder_ids)] if self.vision else [])
        if track is not None:
            track.poll(lambda: [])  # weights that came between chunks serve this whole chunk
            rows = range(first_row, first_row + ids.shape[0])
            for row in rows:
                track.begin(row)
            processors.append(_WeightPoll(track, rows, ids.shape[1]))
        stopping = StoppingCriteriaList(
            [_StopStringCriteria(self.tokenizer, sampling.stop, ids.shape[1])] if sampling.stop else [])
        if self.abort is not None:
            stopping.append(_Abort(self.abort))
        sequences = self.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=self._generation_config(sampling),
            logits_processor=LogitsProcessorList(processors), stopping_criteria=stopping,
            **self._image_kwargs(ids, images or [None] * prompt_ids.shape[0], sampling.n),
        )
        generated = sequences[:, ids.shape[1] :]  # (rows, L)
        logp = recorder.finish(generated).cpu()
        top = recorder.finish_top(generated.shape[1]) if sampling.top_logprobs else None
        generated = generated.cpu()
        lengths, texts = cut_responses(self.tokenizer, self.stop_ids, generated, sampling.stop)
        return generated, lengths, logp, texts, top

    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        sample = not sampling.is_greedy
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            # 0 turns HF's top-k off; None would leave its default (50) on and sample from another policy
            top_k=(sampling.top_k or 0) if sample else None,
            eos_token_id=self.stop_ids or None,
            pad_token_id=self.pad_id,
            bos_token_id=self.tokenizer.bos_token_id,
            use_cache=True,
        )

    @contextlib.contextmanager
    def _seeded(self, seed: int | None):
        """Seeds sampling without touching the caller's RNG state (CPU and this rollout's GPU)."""
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            yield
