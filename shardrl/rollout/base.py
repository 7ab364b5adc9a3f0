"""The rollout contract: what a generation engine takes (prompts, `SamplingParams`), what it returns
(`RolloutOutput`), and how the trainer keeps it in step with the actor (`load_weights`, `release`/`resume`).

Layout of a `RolloutOutput` with B prompts, n samples each, prompt width P and response width R:

    row        b*n + j  is sample j of prompt b            (prompt-major; prompt_index[row] == b)
    prompt_ids      (B*n, P)  left-padded, as given
    response_ids    (B*n, R)  right-padded with the pad id; R is the longest response
    response_mask   (B*n, R)  1 on response tokens (the EOS token too, when one ended the response)
    sampled_log_probs (B*n, R)  log softmax(logits / T) of each sampled token, 0 where the mask is 0
    token_version   (B*n, R)  only when a `weight_hook` was set: the policy version that sampled each token
                              (-1 on padding); it changes inside a response when weights arrive mid-generation
    top_ids         (B*n, R, k) only when `SamplingParams.top_logprobs` = k > 0: the k likeliest tokens at each
    top_log_probs   (B*n, R, k) response position, best first, in the distribution of `sampled_log_probs` (the
                              sampled token's entry, where it is among them, carries its sampled log-prob)

Log-probs are those of the temperature-scaled distribution without top-k/top-p truncation, i.e. what the
training engine recomputes with the same temperature (1 for greedy decoding), so that the two can be
compared as a health metric of the weight sync and the numerics. A server in its raw_logprobs mode asks for the
model's own instead (`SamplingParams.raw_log_probs`: temperature 1); the trainer never does.
"""

from __future__ import annotations

import abc
import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.nn.utils.rnn import pad_sequence

from shardrl.batch import Batch
from shardrl.tokenizer import decode_rows

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
"""Alternatives a token may come with at most (`SamplingParams.top_logprobs`; OpenAI's and vLLM's default limit)."""


@dataclass
class SamplingParams:
    n: int = 1
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 is off."""
    top_k: int = 0
    """Top-k sampling; 0 is off."""
    max_new_tokens: int = 32
    """Response length limit in tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (besides EOS); the response text is cut before them."""
    seed: int | None = 0
    """Seed of sampling; None draws from (and advances) the global RNG."""
    greedy: bool = False
    """Take the argmax at every step (also implied by temperature == 0)."""
    raw_log_probs: bool = False
    """Record the model's own log-probs (log softmax of the logits: temperature 1, no truncation) instead of the
    sampled distribution's; what is sampled is the same (a server's `raw_logprobs` mode)."""
    top_logprobs: int = 0
    """Also record this many likeliest tokens at each step, with their log-probs in the same distribution
    (`RolloutOutput.top_ids`, a server's `top_logprobs`); what is sampled is the same. 0 (training): none, at no
    cost."""

    def __post_init__(self):
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature == 0 or 1e-5 <= self.temperature <= 1e4, "temperature",
             "must be 0 (greedy) or in [1e-5, 1e4] (the logits are divided by it)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.top_k < 2**31, "top_k", "must be in [0, 2**31) (0 = off)"),
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (self.seed is None or -2**63 <= self.seed < 2**64, "seed", "must be in [-2**63, 2**64)"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")
        self.stop = list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the sampled log-probs (and the engine's recomputation) use: 1 when greedy or raw."""
        return 1.0 if self.is_greedy or self.raw_log_probs else self.temperature

    @classmethod
    def from_config(cls, rollout_cfg, **overrides) -> SamplingParams:
        """From a `RolloutConfig`; `overrides` replace fields, e.g. `n=1, greedy=True` for validation."""
        params = cls(n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                     top_k=rollout_cfg.top_k, max_new_tokens=rollout_cfg.max_new_tokens,
                     stop=list(rollout_cfg.stop), seed=rollout_cfg.seed)
        return dataclasses.replace(params, **overrides) if overrides else params


@dataclass
class RolloutOutput:
    prompt_ids: torch.Tensor  # (N, P) left-padded, N = B*n
    prompt_mask: torch.Tensor  # (N, P) attention mask of the prompts
    response_ids: torch.Tensor  # (N, R) right-padded with the pad id
    response_mask: torch.Tensor  # (N, R)
    sampled_log_probs: torch.Tensor  # (N, R) float32
    response_text: list[str]  # N decoded responses, stop string cut off
    prompt_index: torch.Tensor  # (N,) which prompt each row came from
    token_version: torch.Tensor | None = None  # (N, R) long, with a weight hook only
    routed_experts: torch.Tensor | None = None  # (N, P+R, L, k) int16, a rollout recording its routing only
    top_ids: torch.Tensor | None = None  # (N, R, k) long, with `SamplingParams.top_logprobs` = k > 0 only
    top_log_probs: torch.Tensor | None = None  # (N, R, k) float32, likewise

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to_batch(self) -> Batch:
        """A training batch: the per-token tensors are full width (P+R) and aligned with `input_ids`,
        except `response_mask`, which stays (N, R). `loss_mask` is `response_mask` placed after the
        prompt; `sampled_log_probs` sits on the token it scores, as the engine's `log_probs` do."""
        prompt_zeros = torch.zeros_like(self.prompt_mask)
        response_mask = self.response_mask.to(self.prompt_mask.dtype)
        log_probs = torch.cat([torch.zeros_like(self.prompt_ids, dtype=torch.float32), self.sampled_log_probs], dim=1)
        tensors = {
            "input_ids": torch.cat([self.prompt_ids, self.response_ids], dim=1),  # (N, P+R)
            "attention_mask": torch.cat([self.prompt_mask, response_mask], dim=1),  # (N, P+R)
            "loss_mask": torch.cat([prompt_zeros, response_mask], dim=1),  # (N, P+R)
            "response_mask": response_mask,  # (N, R)
            "sampled_log_probs": log_probs,  # (N, P+R)
            "prompt_index": self.prompt_index,  # (N,)
        }
        if self.token_version is not None:
            tensors["token_version"] = self.token_version  # (N, R), like response_mask
        if self.routed_experts is not None:
            tensors["routed_experts"] = self.routed_experts  # (N, P+R, L, k), like input_ids (router replay R3)
        return Batch(tensors, {"response_text": list(self.response_text)})


class Rollout(abc.ABC):
    """A generation engine holding its own copy of the policy weights."""

    weight_hook: Callable[[], int] | None = None
    """Partial rollouts (asynchronous RL): when set, `generate` calls it between decode steps (the fast
    engine at each host sync, HF at each step); it may load new weights in place (`load_weights`) and returns
    the policy version now loaded. Tokens sampled after a change belong to the new version
    (`RolloutOutput.token_version`); the KV cache of the tokens before it is kept, not recomputed."""
    abort: Callable[[], bool] | None = None
    """Asked between decode steps (hf: each step; fast: each host sync, `generate` only): once true, the call's rows
    end where they are, those not started yet with no tokens (a server that stops ends the batch nobody will read).
    None: never."""

    @abc.abstractmethod
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sampling: SamplingParams) -> RolloutOutput:
        """`sampling.n` responses to each of the B left-padded prompts `(B, P)`, prompt-major."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies `(hf_name, full tensor)` pairs into the model in place, one at a time (e.g. straight
        from `Engine.export_weights()`); an unknown name raises."""

    @abc.abstractmethod
    def release(self) -> None:
        """Frees the device memory the rollout holds (weights, caches) while training runs."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Takes the device memory back before the next `generate`."""


class VersionTrack:
    """Which policy version sampled each response token while `hook` (a `Rollout.weight_hook`) may swap the
    weights mid-generation."""

    def __init__(self, hook: Callable[[], int]):
        self.hook = hook
        self.version = hook()
        self.changes: dict[int, list[tuple[int, int]]] = {}  # row -> [(first token index, version)]

    def begin(self, row: int) -> None:
        """Row `row` starts (its first token is sampled next) under the version loaded now."""
        self.changes[row] = [(0, self.version)]

    def poll(self, live: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """Runs the hook; when it changed the version, each (row, index) of `live()` (the rows in flight, and
        the index of the token each samples next) gets the new version from that token on."""
        version = self.hook()
        if version != self.version:
            for row, index in live():
                self.changes[row].append((index, version))
            self.version = version

    def tensor(self, response_mask: torch.Tensor) -> torch.Tensor:
        """(N, R) long: each response token's version, -1 where `response_mask` is 0."""
        out = torch.full(response_mask.shape, -1, dtype=torch.long)
        for row, segments in self.changes.items():
            for index, version in segments:
                out[row, index:] = version
        return out.to(response_mask.device).masked_fill(response_mask == 0, -1)


def assemble_output(prompt_ids: torch.Tensor, attention_mask: torch.Tensor, n: int,
                    responses: list[tuple[torch.Tensor, torch.Tensor]], texts: list[str], pad_id: int,
                    tops: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> RolloutOutput:
    """The `RolloutOutput` of B prompts from their B*n responses (prompt-major), each given as its token ids
    (L,) and sampled log-probs (L,), already cut to its length; right-padded to the longest. `tops`: each
    response's likeliest tokens' ids and log-probs, (L', k) each with L' >= L (`SamplingParams.top_logprobs`)."""
    # (on the host; an empty row more, so that no responses give width 0)
    ids = [i.long().cpu() for i, _ in responses] + [torch.zeros(0, dtype=torch.long)]
    response_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)[:-1]  # (B*n, R)
    log_probs = pad_sequence([lp.float().cpu() for _, lp in responses] + [torch.zeros(0)], batch_first=True)[:-1]
    lengths = torch.tensor([len(i) for i, _ in responses], dtype=torch.long)
    response_mask = (torch.arange(response_ids.shape[1]) < lengths[:, None]).long()  # (B*n, R)
    device = prompt_ids.device
    top_ids = top_log_probs = None
    if tops is not None:  # (cut to each response's length, padded with id 0 and log-prob 0)
        cut = [(i[:len(r)].long().cpu(), lp[:len(r)].float().cpu()) for (i, lp), (r, _) in zip(tops, responses)]
        top_ids = pad_sequence([i for i, _ in cut], batch_first=True)[:, :response_ids.shape[1]].to(device)
        top_log_probs = pad_sequence([lp for _, lp in cut], batch_first=True)[:, :response_ids.shape[1]].to(device)
    return RolloutOutput(
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
        prompt_mask=attention_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids.to(device),
        response_mask=response_mask.to(device),
        sampled_log_probs=log_probs.to(device),
        response_text=list(texts),
        prompt_index=torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(n),
        top_ids=top_ids, top_log_probs=top_log_probs,
    )


def likeliest_tokens(scored: torch.Tensor, k: int, tokens: torch.Tensor,
                  log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` likeliest tokens of each row of `scored` (B, V) (the logits of the distribution the log-probs are
    reported in, fp32) and their log-probs, best first: (B, k) ids and (B, k) log-probs. The sampled token's entry
    (`tokens` (B,), where among them) carries its reported log-prob `log_probs` (B,) exactly, whatever kernel
    computed that."""
    values, ids = scored.topk(k, dim=-1)  # (B, k)
    values = values - scored.logsumexp(-1, keepdim=True)
    return ids, torch.where(ids == tokens[:, None], log_probs[:, None].to(values.dtype), values)


# ---- shared by the backends -------------------------------------------------------------------------
def check_prompts(prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Raises ValueError unless the prompts are a non-empty, left-padded (B, P) batch."""
    if prompt_ids.dim() != 2 or prompt_ids.shape != attention_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must both be (B, P)")
    if prompt_ids.shape[0] == 0:
        raise ValueError("generate needs at least one prompt")
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: the last column of attention_mask must be 1 in every row")


def check_images(multi_modal_inputs: list | None, num_prompts: int, vision: bool, model_type: str) -> list:
    """The prompts' images, one entry (or None) per prompt; a ValueError for a count unlike the prompts' or images
    for a model that is not a vision-language model (`vision` False)."""
    if multi_modal_inputs is None:
        return [None] * num_prompts
    if len(multi_modal_inputs) != num_prompts:
        raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries for {num_prompts} prompts; "
                         "give one per prompt (None for a prompt without images)")
    if not vision and any(multi_modal_inputs):
        raise ValueError(f"prompts with images, but the rollout's {model_type!r} model is not a vision-language "
                         "model (shardrl.models.vision.VL_FAMILIES)")
    return list(multi_modal_inputs)


def contains_stop(text: str, stop: list[str]) -> bool:
    return any(s in text for s in stop)


def stop_window(stop: list[str]) -> int:
    """How many of a response's last tokens hold a stop string that ends at its newest token: a token stands for at
    least one byte of text (a byte-level BPE's, or a byte fallback's), so a string takes at most its UTF-8 length
    in tokens (an emoji or a rare CJK character takes several), and a few more for a token that begins before it."""
    return max(len(s.encode()) for s in stop) + 8


def stop_length(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The fewest leading tokens of `ids` whose decoded text contains a stop string, or None."""

    def hit(k: int) -> bool:
        return contains_stop(tokenizer.decode(ids[:k], skip_special_tokens=True), stop)

    if not ids or not hit(len(ids)):
        return None
    # containment only grows with the prefix. A rollout ends a row a few tokens past its stop string, so the search
    # steps back from the end, doubling the step, until a prefix misses; then halves the interval left
    hi, step = len(ids), 1
    while hi - step >= 1 and hit(hi - step):
        hi, step = hi - step, 2 * step
    lo = max(hi - step, 0) + 1  # every prefix shorter than lo misses
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def cut_responses(tokenizer, stop_ids, generated: torch.Tensor, stop: list[str]) -> tuple[list[int], list[str]]:
    """Each row of `generated` (rows, L): its response length (through its first EOS, or through the token
    completing a stop string) and its text (special tokens skipped, cut before the stop string). The EOS search is
    one tensor op and the texts `decode_rows`'s: for 512 rows of a few hundred tokens the row-by-row Python scan
    and decode took a few hundred ms while the GPU waited at the end of each generation."""
    rows, width = generated.shape
    generated = generated.cpu()
    hit = torch.zeros_like(generated, dtype=torch.bool)
    for stop_id in set(stop_ids):  # (a few ids: an equality each is cheaper than isin)
        hit |= generated == stop_id
    # the first EOS, or the row's end (rows of no tokens: a call aborted before any was made)
    ends = torch.where(hit.any(1), hit.to(torch.uint8).argmax(1), width).tolist() if width else [0] * rows
    ids = generated.tolist()
    lengths = [end + 1 if end < width else width for end in ends]  # EOS counts as a response token
    if stop:
        for r, end in enumerate(ends):
            stop_at = stop_length(tokenizer, ids[r][:end], stop)  # (in the text before EOS)
            if stop_at is not None:
                lengths[r] = stop_at
    texts = decode_rows(tokenizer, [row[:length] for row, length in zip(ids, lengths)])
    return lengths, [cut_at_stop(text, stop) for text in texts] if stop else texts


@torch.no_grad()
def copy_weights_in_place(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                          copy=None) -> list[str]:
    """Copies `(hf_name, tensor)` pairs into `model`'s parameters in place (casting and moving), one at a
    time, so the caller may free each tensor right after; unknown names and wrong shapes raise. Returns the
    names of the parameters it left untouched. `copy(name, param, tensor)`: how one is copied (default
    `param.copy_(tensor)`; the FP8 rollout quantizes)."""
    # remove_duplicate=False: a tied head answers to both its names (the engine exports only one)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[int] = set()
    for name, tensor in weights:
        param = params.get(name)
        if param is None:
            raise KeyError(f"the rollout model has no parameter {name!r} (it has e.g. {list(params)[:4]}); "
                           "are the actor and rollout built from the same model config?")
        if param.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the rollout model expects "
                             f"{tuple(param.shape)}")
        if copy is None:
            param.copy_(tensor)
        else:
            copy(name, param, tensor)
        loaded.add(id(param))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        log.warning("load_weights left %d parameters untouched, e.g. %s", len(missing), missing[:4])
    return missing
