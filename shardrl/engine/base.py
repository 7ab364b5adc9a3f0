"""The engine contract: one class that builds, shards and runs a model; backends fill in the sharding.

A backend (`fsdp2`, `fsdp`) implements `_wrap`, `_clip_grad_norm` and the state functions; the
micro-batch loop, loss normalization, optimizer, schedule and metrics live here once.

Loss normalization: a loss function gets the token and sequence counts of the whole mini-batch summed
over the data-parallel ranks, and returns its micro-batch's share of the mini-batch loss. The shares
add up to the mini-batch loss whatever the cut, and FSDP's gradient averaging over the `world` ranks is
undone by scaling each share by `world`, so the update equals that of one process on the whole batch.

Metrics: a loss function returns each metric as a `shardrl.metrics` metric of tensors (a token mean as a
`SumCount`); the engine combines them over micro-batches and the data-parallel ranks (one all-reduce per step,
one more for extremes) and reports sum / count, so a logged number is a property of the mini-batch, not of
how it was cut. A placeholder micro-batch (run by a rank that has run out of samples) counts nothing.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardrl.config.checks import check_lora_engine
from shardrl.batch import Batch
from shardrl.distributed import MeshLayout, all_reduce_sum, build_device_mesh, device_type
from shardrl.metrics import Sum, accumulate, reduce_metrics
from shardrl.engine.attention import resolve_attn_implementation
from shardrl.engine.checkpoint import load_engine_state, lora_settings, save_engine_state
from shardrl.engine.loading import (compute_non_persistent_buffers, copy_full_into, load_sharded, random_shards,
                                    sharded_load_problem)
from shardrl.engine.lora import (LORA_MARK, adapters_off, hf_base_name, inject_lora, lora_init, lora_summary,
                                 save_peft_adapter)
from shardrl.engine.microbatch import RowSizes, restore_order, row_sizes, split_micro_batches
from shardrl.engine.moe import apply_experts_implementation
from shardrl.models.families import expert_intermediate_size, num_experts
from shardrl.engine.model import (DTYPES, PolicyModel, build_causal_lm, check_model_weights, disable_dropout,
                                  load_hf_config, strip_prefix)
from shardrl.engine.ulysses import check_heads
from shardrl.engine.vision import MULTI_MODAL_KEY, check_vision_engine, freeze_vision_tower
from shardrl.models.vision import is_vision_language
from shardrl.models.config import text_config
from shardrl.engine.optim import build_lr_scheduler, build_optimizer
from shardrl.engine.state import CPU, move_optimizer_state, persistent_buffers, release_accelerator_memory, save_hf

DISTILL_IDS_KEY = "teacher_top_k_ids"
"""The batch key of a distillation student's targets (B, T, k): `train_batch` scores them (`distill_log_probs`)."""

log = logging.getLogger(__name__)

# loss_fn(outputs, micro_batch, num_global_tokens, num_global_seqs) -> (loss share, {name: (sum, count)})
LossFn = Callable[[dict, Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]

MAX_PARAM_ABS = 1e10
"""A parameter beyond this after a step is taken as diverged: trained weights are O(1), and weights this
large overflow the activations (the next rollout would die with NaN probabilities)."""


class NonFiniteParametersError(ValueError):
    """An optimizer step left non-finite (or diverged) parameters; the run cannot go on from them."""

_ENGINES: dict[str, type["Engine"]] = {}


def register_engine(name: str):
    def deco(cls):
        _ENGINES[name] = cls
        cls.strategy = name
        return cls

    return deco


class Engine(abc.ABC):
    strategy: str = ""

    def __init__(self, model_cfg, engine_cfg, optim_cfg=None, head: str = "lm",
                 total_steps: int | None = None, mesh: MeshLayout | None = None):
        self.model_cfg, self.cfg, self.optim_cfg = model_cfg, engine_cfg, optim_cfg
        self.device = torch.device(device_type(), torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # the run's mesh for this layout (`ParallelDims.for_engine`); a standalone engine builds its own
        self.mesh = mesh or build_device_mesh(engine_cfg.fsdp_size, engine_cfg.ulysses_sequence_parallel_size)
        self.mesh.check_matches(engine_cfg.fsdp_size, engine_cfg.ulysses_sequence_parallel_size)
        self.rank = dist.get_rank()
        self.head = head
        # a score head with an optimizer is a reward model in training: it may start from a causal LM
        self.hf_config = load_hf_config(model_cfg.path, model_cfg.tiny, model_cfg.trust_remote_code,
                                        task="seq_cls" if head == "score" else "causal_lm",
                                        new_head_ok=optim_cfg is not None, override=model_cfg.override_config)
        if (experts := apply_experts_implementation(self.hf_config, model_cfg.experts_implementation)) is not None:
            log.info("mixture of experts: experts_implementation=%s", experts)
        if model_cfg.disable_dropout and (changed := disable_dropout(self.hf_config)):
            log.info("dropout off (model.disable_dropout): %s set to 0", ", ".join(changed))
        if model_cfg.path is not None:
            check_model_weights(model_cfg.path)
        self.lora = model_cfg.lora if model_cfg.lora.rank > 0 else None
        if self.lora is not None:
            self._check_lora(head)
        if engine_cfg.expert_parallel_size > 1:
            self._check_expert_parallel()
        check_vision_engine(self.hf_config, head)
        if model_cfg.freeze_vision_tower and not is_vision_language(self.hf_config):
            raise ValueError(f"model.freeze_vision_tower=true: the {self.hf_config.model_type!r} model has no vision "
                             "tower; set it to false")
        self.module = self._build_module(head)
        self.optimizer = self.lr_scheduler = None
        if optim_cfg is not None:
            o = optim_cfg
            # one fused kernel: on the GPU, and on the host where offloaded parameters step (torch's fused CPU AdamW,
            # 4.6x the per-tensor loop's speed or more: bench/RESULTS.md, "CPU Adam of offloaded parameters"); a CPU
            # run's resident parameters keep the loop (a multi-process CPU run aborted once on a heap check with the
            # fused kernel everywhere, not reproduced in 15 reruns: kept to where it pays)
            fused = self.device.type == "cuda" or engine_cfg.offload_params
            trained = [p for p in self.module.parameters() if p.requires_grad]  # with LoRA: the adapters only
            self.optimizer = build_optimizer(trained, o.lr, o.betas, o.eps, o.weight_decay, fused)
            steps = o.total_steps or total_steps
            self.lr_scheduler = build_lr_scheduler(self.optimizer, o.warmup_steps, o.warmup_ratio, steps,
                                                   o.lr_schedule, o.min_lr_ratio)
        self.global_step = 0

    # ---- building -------------------------------------------------------------------------------
    def _check_lora(self, head: str) -> None:
        check_lora_engine(self.lora, self.cfg, "engine")  # the config's rule, for an engine built in code
        if head != "lm":
            raise ValueError(f"model.lora is for the policy (and its reference); this engine has a {head!r} head")

    def _check_expert_parallel(self) -> None:
        ep, world = self.cfg.expert_parallel_size, self.mesh.world_size
        key = f"engine.expert_parallel_size={ep}"
        experts = num_experts(self.hf_config)
        problems = [
            (self.strategy != "fsdp2", "needs strategy=fsdp2"),
            (not experts, f"is for mixtures of experts; {self.hf_config.model_type!r} has no routed experts: set it to 1"),
            (bool(self.cfg.compile), "with compile=true is not supported yet: set compile=false"),
            (self.lora is not None, "with model.lora is not supported yet"),
            (self.cfg.offload_params, "with offload_params=true is not supported yet"),
            (self.mesh.sp_size > 1, "with ulysses_sequence_parallel_size > 1 is not supported yet"),
            (self.mesh.is_hsdp, f"with HSDP (fsdp_size={self.cfg.fsdp_size}) is not supported yet: set fsdp_size=-1"),
            (world % ep != 0, f"does not divide the world size {world}; choose one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}"),
            (bool(experts) and experts % ep != 0, f"does not divide the model's {experts} experts a layer"),
        ]
        if experts and world % ep == 0:  # the experts are FSDP-sharded on their second dim over world // ep ranks
            efsdp, inner = world // ep, expert_intermediate_size(self.hf_config)
            hidden = text_config(self.hf_config).hidden_size
            problems.append(((2 * inner) % efsdp != 0 or hidden % efsdp != 0,
                             f"leaves world // ep = {efsdp} ranks to shard each expert's weights over (on their second "
                             f"dim, 2 x {inner} and {hidden}), which FSDP2 needs to divide both; choose ep so that it "
                             "does"))
        for bad, why in problems:
            if bad:
                raise ValueError(f"{key} {why}")

    def _build_module(self, head: str) -> nn.Module:
        mc = self.model_cfg
        # with LoRA the frozen base is stored as it computes, in param_dtype: no fp32 master copy of it
        master_dtype = DTYPES[self.cfg.param_dtype] if self.lora is not None else DTYPES[mc.dtype]
        sp = self.mesh.sp_size
        attn = resolve_attn_implementation(mc.attn_implementation, mc.use_remove_padding, sp)
        if sp > 1:
            text = text_config(self.hf_config)  # (a vision-language model's decoder)
            check_heads(text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                        sp)
        lm_meta = build_causal_lm(self.hf_config, None, "meta", master_dtype, attn_implementation=attn,
                                  trust_remote_code=mc.trust_remote_code, sequence_classification=head == "score")
        if mc.freeze_vision_tower:  # before sharding: FSDP keeps each parameter's requires_grad
            log.info("vision tower frozen (model.freeze_vision_tower): %d parameters not trained",
                     freeze_vision_tower(lm_meta))
        if self.lora is not None:
            inject_lora(lm_meta, self.lora)
            line, warning = lora_summary(lm_meta, self.lora)
            log.info(line)
            if warning:
                log.warning(warning)
        module = PolicyModel(lm_meta, head, self.cfg.logprob_chunk_size)
        self.sharded_load = sharded = self._sharded_load(module)
        # otherwise rank 0 reads the weights once; the others start on meta and receive their shards
        full = None
        if self.rank == 0 and not sharded:
            lm = build_causal_lm(self.hf_config, mc.path, "cpu", master_dtype, self.cfg.seed,
                                 attn, mc.trust_remote_code, head == "score")
            if self.lora is not None:
                inject_lora(lm, self.lora)
            full = PolicyModel(lm, head, self.cfg.logprob_chunk_size)
            self._init_lora(full)
            if head == "value":
                with torch.no_grad():
                    full.value_head.weight.copy_(self._value_head_init(full.value_head.weight.shape))
                    full.value_head.bias.zero_()
        if mc.gradient_checkpointing:
            module.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.lm.config.use_cache = False
        if sp > 1:
            module.sp_group = self.mesh.sp_group
            if full is not None:
                full.sp_group = self.mesh.sp_group  # FSDP1 wraps rank 0's full module
        if not sharded:
            return self._wrap(module, full)
        buffers, _ = compute_non_persistent_buffers(module.lm)  # while the parameters are on meta
        module = self._shard(module)
        self._load_own_shards(module, buffers)
        return module

    def _sharded_load(self, module: PolicyModel) -> bool:
        """Whether every rank reads its own shards from the files (`model.load_weights=sharded`), decided
        alike on every rank; a folder that cannot be read so is loaded by rank 0, and the log says why."""
        mc = self.model_cfg
        if mc.load_weights == "random_shards":
            if not self.supports_sharded_load:
                raise ValueError(f"model.load_weights=random_shards needs strategy=fsdp2 (here {self.cfg.strategy})")
            return True
        if mc.load_weights != "sharded" or mc.path is None or not self.supports_sharded_load:
            return False
        if is_vision_language(self.hf_config):  # HF renames a VL folder's keys as it loads them (not done here yet)
            log.info("model.load_weights=sharded: rank 0 loads the vision-language model %s instead", mc.path)
            return False
        problem = sharded_load_problem(module, mc.path, self.hf_name, skip=self._not_in_files(module))
        if problem is None:
            _, left = compute_non_persistent_buffers(copy.deepcopy(module.lm))  # a copy of the meta model: cheap
            if left:
                problem = f"cannot compute the buffers {left} (this transformers version does not initialize them)"
        if problem is not None:
            log.info("model.load_weights=sharded: rank 0 loads %s instead (%s)", mc.path, problem)
        return problem is None

    @staticmethod
    def _not_in_files(module: PolicyModel) -> list[str]:
        return [n for n, _ in module.named_parameters() if n.startswith("value_head.") or LORA_MARK in n]

    @torch.no_grad()
    def _init_lora(self, module: PolicyModel) -> None:
        """The adapters' initial values (`lora.lora_init`: the same on every rank, whichever way the base loads)."""
        if self.lora is None:
            return
        for name, p in module.named_parameters():
            if LORA_MARK in name:
                copy_full_into(p, lora_init(name, p.shape, self.lora.seed).to(p.dtype))

    @contextlib.contextmanager
    def adapters_off(self):
        """The base model inside (LoRA's adapters skipped): the reference policy of a LoRA actor."""
        if self.lora is None:
            raise RuntimeError("adapters_off: this engine has no LoRA adapters (model.lora.rank=0)")
        with adapters_off(self.module):
            yield

    def _value_head_init(self, shape) -> torch.Tensor:
        """A critic's new value head, the same on every rank: normal(0, 1/sqrt(hidden)) from `seed + 1`."""
        weight = torch.empty(shape)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed + 1)
            nn.init.normal_(weight, std=1.0 / math.sqrt(text_config(self.hf_config).hidden_size))
        return weight

    @torch.no_grad()
    def _load_own_shards(self, module: PolicyModel, buffers: dict[str, torch.Tensor]) -> None:
        """Fills a sharded, materialized `module`: this rank's slices from the files, the rest computed
        (`buffers`: the non-persistent buffers under `module.lm`, which materializing left as garbage)."""
        if self.model_cfg.load_weights == "random_shards":
            random_shards(module, self.cfg.seed, getattr(self.hf_config, "initializer_range", 0.02),
                          skip=self._not_in_files(module))
        else:
            load_sharded(module, self.model_cfg.path, self.hf_name, skip=self._not_in_files(module))
        self._init_lora(module)
        if module.value_head is not None:
            copy_full_into(module.value_head.weight, self._value_head_init(module.value_head.weight.shape))
            copy_full_into(module.value_head.bias, torch.zeros(module.value_head.bias.shape))
        for name, value in buffers.items():
            module.lm.get_buffer(name).copy_(value)

    supports_sharded_load = False
    """Whether the backend implements `_shard` (the sharded loading path)."""

    def _shard(self, module: PolicyModel) -> nn.Module:
        """Shards `module` (on meta) on `self.mesh` and materializes it, uninitialized, on the device."""
        raise NotImplementedError(f"{type(self).__name__} loads weights through rank 0 only")

    @abc.abstractmethod
    def _wrap(self, module: PolicyModel, full: PolicyModel | None) -> nn.Module:
        """Shards `module` (on meta) on `self.mesh` and fills it with `full`'s weights (rank 0 only)."""

    @abc.abstractmethod
    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The total gradient norm over all shards; clips to `max_norm` when it is > 0."""

    @abc.abstractmethod
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) one parameter at a time; every rank must iterate (collectives)."""

    def num_fsdp_units(self) -> int:
        return 0

    # ---- running --------------------------------------------------------------------------------
    @property
    def dp_group(self):
        return self.mesh.dp_group

    def _micro_batches(self, batch: Batch, group_size: int = 1):
        if self.cfg.use_dynamic_bsz:  # the budget is per rank: with sp, a rank holds 1/sp of each row
            budget = self.cfg.max_token_len_per_gpu * self.mesh.sp_size
            return split_micro_batches(batch, max_token_len=budget, dp_group=self.dp_group, group_size=group_size)
        return split_micro_batches(batch, micro_batch_size=self.cfg.micro_batch_size_per_gpu, dp_group=self.dp_group,
                                   group_size=group_size)

    def _before_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch of `train_batch` (`last`: the mini-batch's last); a backend that can
        defer the gradient reduction to the last one does so here."""

    @staticmethod
    def _score_from(batch: Batch) -> int | None:
        """An RL batch ([prompt | response] columns) is scored on its responses only: the prompts' log-probs
        are never read, and the vocabulary projection over them would be most of the head's work."""
        return batch["input_ids"].shape[1] - batch["response_mask"].shape[1] if "response_mask" in batch else None

    def _sized_micro_batches(self, batch: Batch, group_size: int = 1):
        """`_micro_batches`, with each one's `RowSizes` (None for an empty one), read back in one copy: each
        forward then queues without a host sync (`PolicyModel.forward`'s `sizes`)."""
        micro_batches, perm = self._micro_batches(batch, group_size)
        return micro_batches, perm, row_sizes(micro_batches, self._score_from(batch))

    def _forward(self, mb: Batch, temperature: float, with_entropy: bool, record_routing: bool = False,
                 replay: torch.Tensor | None = None, count_replay: bool = True,
                 with_top1: bool = False, top_k: int = 0, top_k_vocab: int | None = None,
                 sizes: RowSizes | None = None) -> dict[str, torch.Tensor]:
        score_from = self._score_from(mb)
        return self.module(
            mb["input_ids"], mb["attention_mask"], remove_padding=self.model_cfg.use_remove_padding,
            temperature=temperature, with_entropy=with_entropy, score_from=score_from, routed_experts=replay,
            record_routing=record_routing, count_replay=count_replay, with_top1=with_top1,
            images=mb[MULTI_MODAL_KEY] if MULTI_MODAL_KEY in mb else None, top_k=top_k, top_k_vocab=top_k_vocab,
            # a distillation student's update scores its teacher's top-k tokens too (the loss reads them)
            distill_ids=mb[DISTILL_IDS_KEY] if self.module.training and DISTILL_IDS_KEY in mb else None,
            sizes=sizes,
        )

    def _placeholder(self, like: Batch, rows: int = 1) -> Batch:
        """A micro-batch of `rows` one-token rows with no loss tokens, run by a rank that has run out of samples."""
        ones = torch.ones(rows, 1, dtype=torch.long, device=self.device)
        tensors = {k: torch.zeros((rows, *v.shape[1:]), dtype=v.dtype, device=self.device) for k, v in like.tensors.items()}
        tensors.update(input_ids=ones * 0, attention_mask=ones, loss_mask=ones * 0)
        tensors = {k: v[:, :1] if v.dim() > 1 else v for k, v in tensors.items()}
        return Batch(tensors, {k: [None] * rows for k in like.fields}, dict(like.meta))

    def train_batch(self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0,
                    with_entropy: bool = False, group_size: int = 1) -> dict[str, float]:
        """One optimizer step on a per-rank mini-batch; `batch["loss_mask"]` marks the tokens that count.

        Returns "loss" (the mini-batch loss over all ranks), "grad_norm", "lr", the layout ("num_tokens",
        "num_micro_batches"), "skipped_step" (a non-finite gradient norm skips the step), and each of
        `loss_fn`'s metrics (`shardrl.metrics`) over the whole mini-batch. A step that leaves
        non-finite or diverged parameters raises NonFiniteParametersError. `group_size` consecutive rows share a
        micro-batch (a preference pair, for a pairwise loss)."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (forward-only)")
        self.module.train()
        batch = batch.to(self.device)
        # on the device once (a host tensor moved there in the loop would be a host sync a micro-batch)
        num_tokens = all_reduce_sum(batch["loss_mask"].sum().double(), self.dp_group).to(self.device)
        num_seqs = all_reduce_sum(torch.tensor(float(len(batch)), dtype=torch.float64), self.dp_group).to(self.device)
        micro_batches, _, sizes = self._sized_micro_batches(batch, group_size)
        grad_scale = self.mesh.world_size  # FSDP averages gradients over every rank of the mesh

        self.optimizer.zero_grad(set_to_none=True)
        # a mixture of experts: a batch holding `routed_experts` (B, T, L, k) trains routed as they say (the actor's
        # update under actor.router_replay; inference passes, the reference's too, route their own way)
        replay = getattr(self.module, "router_replay", None) if "routed_experts" in batch else None
        if replay is not None:  # counts the (token, layer) routings that differ from the replayed ones
            replay.reset_counts(self.device)
        # sums and counts stay on the device until the step ends: no host sync per micro-batch
        totals = {"loss": Sum(torch.zeros((), dtype=torch.float64, device=self.device))}
        for i, mb in enumerate(micro_batches):
            real = len(mb) > 0
            mb = mb if real else self._placeholder(batch, group_size)
            self._before_micro_batch(last=i == len(micro_batches) - 1)
            outputs = self._forward(mb, temperature, with_entropy, replay=mb["routed_experts"] if replay else None,
                                    count_replay=real, sizes=sizes[i])
            loss, metrics = loss_fn(outputs, mb, num_tokens, num_seqs)
            if not real:
                loss = loss * 0.0
            # ties every output to the graph so each rank runs the same backward collectives
            anchor = sum(v.sum() for v in outputs.values()) * 0.0
            ((loss + anchor) * grad_scale).backward()
            if replay is not None:  # (a checkpoint's recompute in backward was routed the same)
                replay.end()
            totals["loss"] = accumulate(totals["loss"], Sum(loss), self.device)
            for k, metric in metrics.items():  # a placeholder counts nothing, but every rank names the same keys
                totals[k] = accumulate(totals.get(k), metric, self.device, real)

        grad_norm = self._clip_grad_norm(self.optim_cfg.clip_grad)
        finite = bool(torch.isfinite(grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
            self.lr_scheduler.step()
            self.global_step += 1
            if not self._params_sane():
                raise NonFiniteParametersError(
                    f"optimizer step {self.global_step} (lr={lr:g}, gradient norm {float(grad_norm):.4g}) left "
                    f"non-finite parameters, or parameters beyond {MAX_PARAM_ABS:g} in magnitude: the learning "
                    "rate is most likely too high")
        else:
            log.warning("step skipped: gradient norm is %s", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        # the mini-batch loss is the sum of the shares; every other metric is sum / count over all pieces (every
        # rank names the same keys: a placeholder micro-batch names its loss function's)
        metrics = reduce_metrics(totals, self.dp_group, same_keys=True)
        metrics.update({
            "grad_norm": float(grad_norm),
            "lr": lr,
            "num_tokens": float(num_tokens),
            "num_micro_batches": float(len(micro_batches)),
            "skipped_step": float(not finite),
        })
        if replay is not None:
            counts = all_reduce_sum(torch.stack([replay.mismatched, replay.compared]).double().cpu(), self.dp_group)
            metrics["router_replay_mismatch"] = float(counts[0] / counts[1].clamp(min=1))
        return metrics

    @torch.no_grad()
    def _params_sane(self) -> bool:
        """Whether every rank's parameter shards are finite and below MAX_PARAM_ABS: one fused max-norm per
        rank and one all-reduce of a flag (the only host sync)."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.module.parameters()]
        local = [t for t in local if t.numel() > 0]  # FSDP1: a rank may hold no piece of a parameter
        largest = (torch.nn.utils.get_total_norm(local, norm_type=float("inf"), foreach=None) if local
                   else torch.zeros(()))
        bad = (~(largest <= MAX_PARAM_ABS)).to(torch.float64).reshape(1)  # NaN compares False: bad
        return float(all_reduce_sum(bad, dist.group.WORLD)) == 0.0

    def enable_router_aux_loss(self) -> None:
        """A mixture of experts: training forwards also return `router_aux_loss`, HF's load-balancing loss over
        the micro-batch's tokens (`shardrl.engine.moe.load_balancing_loss`), for the loss function to add."""
        replay = getattr(self.module, "router_replay", None)
        if replay is None or not replay.routers:
            raise ValueError("actor.router_aux_loss_coef > 0 needs a mixture-of-experts model (HF top-k routers); "
                             "this model has none: set it to 0")
        replay.capture_logits = True

    @torch.no_grad()
    def infer_batch(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                    record_routing: bool = False, replay_routing: bool = False, with_top1: bool = False,
                    top_k: int = 0, top_k_vocab: int | None = None) -> Batch:
        """Forward only: per-token `log_probs` (and `entropy`; `with_top1`: `top1`, 1.0 where the token is the
        model's argmax), or `values` for a critic, `(B, T)`, in the order of `batch`. `record_routing` (a mixture
        of experts): also `routed_experts` (B, T, L, k), each token's experts per MoE layer, for `train_batch` to
        replay (actor.router_replay);
        `replay_routing`: routed as `batch["routed_experts"]` says (R3: the rollout's routing). `top_k` (a
        distillation teacher): also `top_k_ids` and `top_k_log_probs` (B, T, k), each token's k likeliest
        alternatives under this model and their log-probs (among the ids below `top_k_vocab`, when given)."""
        self.module.eval()
        batch = batch.to(self.device)
        micro_batches, perm, sizes = self._sized_micro_batches(batch)
        results, empty = [], None
        as_float = lambda v: v.float() if v.is_floating_point() else v  # noqa: E731 (expert ids stay integers)
        for mb, mb_sizes in zip(micro_batches, sizes):
            real = len(mb) > 0
            mb = mb if real else self._placeholder(batch)
            outputs = self._forward(mb, temperature, with_entropy, record_routing,
                                    replay=mb["routed_experts"] if replay_routing else None, count_replay=False,
                                    with_top1=with_top1, top_k=top_k, top_k_vocab=top_k_vocab, sizes=mb_sizes)
            if replay_routing:
                self.module.router_replay.end()
            if real:
                results.append(Batch({k: as_float(v) for k, v in outputs.items()}))
            else:  # a rank with no samples here still answers with the right keys, and no rows
                width = batch["input_ids"].shape[1:]
                empty = Batch({k: as_float(v.new_zeros((0, *width[: min(v.dim() - 1, 1)], *v.shape[2:])))
                               for k, v in outputs.items()})
        return restore_order(results, perm) if results else empty

    # ---- helpers shared by backends ---------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        return hf_base_name(strip_prefix(name))  # a LoRA layer's base weight under its HF name

    @contextlib.contextmanager
    def eval_mode(self):
        was = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(was)

    # ---- state: offload, export, checkpoints ------------------------------------------------------
    @abc.abstractmethod
    def _move_params(self, device: torch.device) -> None:
        """Moves this rank's parameter shards (with grads and buffers) to `device`, keeping the parameter
        objects the optimizer holds."""

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Moves parameters (with grads) and optimizer state to the CPU and releases the accelerator memory
        they held, e.g. for a colocated rollout. Parameters under `offload_params` live on the CPU already."""
        if params and not self.cfg.offload_params:
            self._move_params(CPU)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, CPU)
        release_accelerator_memory()

    def onload(self, params: bool = True, optimizer: bool = True) -> None:
        """Brings back what `offload` moved: parameters to the device, optimizer state next to them."""
        if params and not self.cfg.offload_params:
            self._move_params(self.device)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, None)

    @contextlib.contextmanager
    def phase(self, optimizer: bool = True):
        """A phase that computes with this engine: onloads its parameters (and optimizer state when
        `optimizer`); on leaving, moves the optimizer state back to the CPU when `offload_optimizer` is
        set. (Under `offload_params`, FSDP's CPU offload keeps the parameters there by itself.)"""
        self.onload(params=True, optimizer=optimizer)
        try:
            yield self
        finally:
            if self.cfg.offload_optimizer:
                self.offload(params=False, optimizer=True)

    def training(self):
        """`with engine.training(): engine.train_batch(...)`: the phase of updates."""
        return self.phase(optimizer=self.optimizer is not None)

    def save_hf(self, path, tokenizer=None, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30):
        """Writes a Hugging Face model folder (see `shardrl.engine.state.save_hf`); every rank calls it."""
        dtype = dtype or DTYPES[self.model_cfg.dtype]
        original = self._original_base(dtype)
        weights = self.export_weights(dtype, original) if original is not None else self.export_weights(dtype)
        return save_hf(path, weights, persistent_buffers(self.module, self.hf_name), self.hf_config,
                       self.module.lm, self.head, dtype, tokenizer, max_shard_bytes)

    def _original_base(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """With LoRA, where the frozen base is held narrower than `dtype` (bf16 param_dtype, fp32 export): the
        base's tensors reread from model.path at `dtype` (rank 0, which writes), so that the export's frozen
        weights are the folder's own and its merged layers W + scale * B @ A on them, as peft computes on the
        base; else (no LoRA, the same dtype, a random base) None: the held tensors are already exact."""
        mc = self.model_cfg
        if (self.lora is None or mc.path is None or self.rank != 0
                or DTYPES[self.cfg.param_dtype].itemsize >= dtype.itemsize):
            return None
        lm = build_causal_lm(self.hf_config, mc.path, "cpu", dtype, self.cfg.seed,
                             trust_remote_code=mc.trust_remote_code, sequence_classification=self.head == "score")
        return {name: tensor.detach() for name, tensor in lm.state_dict().items()}

    def save_lora_adapter(self, path) -> str:
        """The adapters as a peft adapter folder at `path` (rank 0 writes; every rank must call: the gathers are
        collectives); `PeftModel.from_pretrained(base model, path)` loads it."""
        if self.lora is None:  # (the config refuses trainer.export_lora_adapter without model.lora)
            raise RuntimeError("save_lora_adapter: this engine has no LoRA adapters (model.lora.rank=0)")
        adapters = {}
        for name, p in self.module.named_parameters():
            if LORA_MARK in name:
                full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
                adapters[self.hf_name(name)] = full.float().cpu()
        if self.rank == 0:
            save_peft_adapter(path, adapters, self.lora, self.model_cfg.path, is_vision_language(self.hf_config))
        dist.barrier()
        return str(path)

    def save(self, path) -> None:
        """This engine's model, optimizer, LR schedule and step as a DCP checkpoint folder (all ranks call it)."""
        save_engine_state(path, self.module, self.optimizer, self.lr_scheduler, self.global_step,
                          trained_only=self.lora is not None,  # LoRA: the adapters and their optimizer only
                          lora=None if self.lora is None else lora_settings(self.lora))

    def load(self, path) -> None:
        """Loads `save`'s folder, written at any world size; a checkpoint of another model is a ValueError."""
        self.global_step = load_engine_state(path, self.module, self.optimizer, self.lr_scheduler,
                                             trained_only=self.lora is not None,
                                             lora=None if self.lora is None else lora_settings(self.lora))
