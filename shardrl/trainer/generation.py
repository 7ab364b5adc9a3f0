"""Generation, the one part both placements share: the rollout built from the config, the per-step sampling
seed, and one generate call that turns prompt rows into a CPU batch.

A colocated run's trainer (`rl.LocalBatches`) and an asynchronous run's rollout ranks (`async_rl`) both use
`Generation`, so the two draw the same samples from the same weights and seed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import torch

from shardrl.batch import Batch
from shardrl.config.schema import Config
from shardrl.data.prompts import collate_prompts
from shardrl.engine.lora import scaling_of
from shardrl.rollout import SamplingParams
from shardrl.rollout.build import rollout_dtype, rollout_from_config

log = logging.getLogger(__name__)


def sampling_seed(base_seed: int, step: int, dp_rank: int, round_index: int = 0) -> int:
    """A fresh, reproducible sampling stream per step and data-parallel rank (a resumed run draws the same), and
    per round of dynamic sampling (round 0: the step's first batch)."""
    return base_seed + 100_003 * step + dp_rank + 7919 * round_index


def export_for_rollout(actor, device: torch.device):
    """The actor's full weights one tensor at a time, in the rollout's dtype (bf16 on CUDA); every rank of the
    actor's mesh iterates (the gathers are collective)."""
    return actor.export_weights(torch.bfloat16 if device.type == "cuda" else None)  # see `rollout_dtype`


class LoRASync:
    """The colocated weight sync of a LoRA actor to a fast rollout (`rollout.lora_sync`): the base once, then
    only the adapters after each update, tensor by tensor (A and B gathered, never a base weight).

    unmerged: the rollout reads the engine's frozen base tensors themselves where this rank holds them whole
    (`Engine.local_base_weights`; else it loads a copy once) and adds the adapters at run time; merged: the
    rollout holds the model, and each sync writes base + scale * B @ A into it from the engine's base tensors
    (or from a copy of the base it keeps, taken at the first sync)."""

    def __init__(self, actor, rollout, mode: str, dtype: torch.dtype):
        self.actor, self.rollout, self.mode, self.dtype = actor, rollout, mode, dtype
        self.scale = scaling_of(actor.lora)
        self.base: dict[str, torch.Tensor] | None = None  # merged: the unmerged base weights of the adapted layers
        self.started = False

    def _start(self, adapted: Iterable[str]) -> None:
        """The first sync: the base (shared or loaded), before any adapter; `adapted`: the LoRA layers' names."""
        local = self.actor.local_base_weights()
        if local is not None and any(t.dtype != self.dtype for t in local.values()):
            log.warning("the actor stores its base in %s, the rollout computes in %s: the rollout holds a copy of "
                        "the base (set actor.engine.param_dtype to match to share it)",
                        next(iter(local.values())).dtype, self.dtype)
            local = None
        if self.mode == "unmerged" and local is not None:
            self.rollout.share_weights(local.items())
        else:
            self.rollout.load_weights(self.actor.base_weights(self.dtype))
        if self.mode == "merged":
            params = dict(self.rollout.model.named_parameters())
            self.base = {f"{name}.weight": (local if local is not None else params)[f"{name}.weight"] for name in adapted}
            if local is None:  # the rollout's own weights are merged into: keep the unmerged base apart
                self.base = {name: w.detach().clone() for name, w in self.base.items()}
        self.started = True

    def sync(self) -> None:
        """The actor's newest adapters into the rollout (every rank of the actor's mesh: the gathers)."""
        adapters = {name: (a, b) for name, a, b in self.actor.export_adapters()}
        if not self.started:
            self._start(adapters)
        if self.mode == "merged":
            self.rollout.merge_lora(adapters, self.scale, self.base)
        else:
            self.rollout.load_lora(adapters, self.scale)


def lora_sync_for(cfg: Config, actor, rollout, device: torch.device) -> LoRASync | None:
    """The adapter-only sync where it applies (model.lora, a fast rollout, rollout.lora_sync other than full);
    None: the merged model is exported whole after each update."""
    backend = getattr(rollout, "rollout", rollout)  # the multi-turn loop drives a backend
    if actor.lora is None or cfg.rollout.lora_sync == "full" or not getattr(backend, "supports_lora", False):
        return None
    return LoRASync(actor, backend, cfg.rollout.lora_sync or "unmerged", rollout_dtype(device))


class Generation:
    """The rollout of a run (`rollout.backend`, wrapped in the agent loop when `rollout.multi_turn.enable`)
    and the step's sampling settings."""

    def __init__(self, cfg: Config, hf_config, tokenizer, device: torch.device, colocated: bool = False):
        """`colocated`: generation shares the trainer's GPUs; with LoRA's adapter-only sync the fast rollout then
        takes no memory for weights until the first sync (which may share the trainer's base)."""
        ro = cfg.rollout
        self.rollout = rollout_from_config(cfg, hf_config, tokenizer, device, colocated)
        self.multi_turn = ro.multi_turn.enable or ro.runs_agent()
        self.tokenizer, self.device, self.seed = tokenizer, device, ro.seed
        self.sampling = SamplingParams.from_config(ro)

    def prefix_counts(self) -> tuple[int, int] | None:
        """(prompt tokens read from the fast rollout's prefix cache, prompt tokens prefilled) over every call so
        far; None for a backend without the cache."""
        totals = getattr(self.rollout, "totals", None)  # (a multi-turn or agent wrapper: its backend's)
        return (totals["cached_tokens"], totals["prompt_tokens"]) if totals is not None else None

    def step_sampling(self, step: int, dp_rank: int, round_index: int = 0) -> SamplingParams:
        """The training sampling settings of step `step` on data-parallel rank `dp_rank` (and dynamic sampling's
        round `round_index`)."""
        return dataclasses.replace(self.sampling, seed=sampling_seed(self.seed, step, dp_rank, round_index))

    def generate(self, items: list[dict], sampling: SamplingParams) -> Batch:
        """One generate call for prompt rows `items`: a CPU batch with each sample's data_source and extra."""
        prompts = collate_prompts(items, self.tokenizer.pad_token_id)
        per_sample = {"samples": items} if self.multi_turn else {}  # the interaction's per-conversation state
        if any(item.get("multi_modal_inputs") for item in items):  # a VL model's images, one entry a prompt
            per_sample["multi_modal_inputs"] = [item.get("multi_modal_inputs") for item in items]
        out = self.rollout.generate(prompts["input_ids"].to(self.device), prompts["attention_mask"].to(self.device),
                                    sampling, **per_sample)
        return with_sources(out.to_batch().to("cpu"), items)


def with_sources(batch: Batch, items: list[dict]) -> Batch:
    """`batch` with the data_source, extra and prompt (the row's own: a string or chat messages, which a reward
    model with its own tokenizer re-renders) of each sample's prompt row (by its `prompt_index`); a VL model's,
    the row's images (`multi_modal_inputs`, which the engine's forward reads)."""
    rows = batch["prompt_index"].tolist()
    batch["data_source"] = [items[i]["data_source"] for i in rows]
    batch["extra"] = [items[i]["extra"] for i in rows]
    batch["prompt"] = [items[i]["prompt"] for i in rows]
    if any(item.get("multi_modal_inputs") for item in items):  # each prompt's images, for each of its samples
        batch["multi_modal_inputs"] = [items[i].get("multi_modal_inputs") for i in rows]
    return batch
