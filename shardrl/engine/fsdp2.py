"""FSDP2 backend: `fully_shard` on every decoder block, then on the root (the PolicyModel).

Parameters become DTensors sharded on dim 0 over the `fsdp` mesh axis (and replicated over `ddp` for
HSDP). `reshard_after_forward=False` keeps gathered parameters until backward: ZeRO-2. `accumulate_unsharded`
keeps them gathered over a mini-batch's micro-batches and reduces the gradients once, after the last.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from shardrl.engine.base import Engine, register_engine
from shardrl.engine.expert_parallel import apply_expert_parallel
from shardrl.engine.lora import LORA_MARK, merge_lora, scaling_of
from shardrl.engine.model import DTYPES, PolicyModel, decoder_blocks, strip_prefix


def non_persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers a state dict does not hold (e.g. rotary `inv_freq`), which meta init leaves empty."""
    for mod_name, mod in module.named_modules():
        for buf_name in sorted(mod._non_persistent_buffers_set):
            buf = mod._buffers.get(buf_name)
            if buf is not None:
                yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


def broadcast_non_persistent_buffers(module: nn.Module, full: nn.Module | None, device: torch.device) -> None:
    for name, buf in non_persistent_buffers(module):
        if full is not None:
            buf.copy_(full.get_buffer(name).to(buf.device))
        if dist.get_world_size() > 1:
            tmp = buf.to(device)
            dist.broadcast(tmp, src=0)
            buf.copy_(tmp)


@register_engine("fsdp2")
class FSDP2Engine(Engine):
    supports_sharded_load = True

    def _wrap(self, module: PolicyModel, full: PolicyModel | None) -> nn.Module:
        module = self._shard(module)
        set_model_state_dict(
            module, full.state_dict() if full is not None else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        broadcast_non_persistent_buffers(module, full, self.device)
        return module

    def _shard(self, module: PolicyModel) -> nn.Module:
        cfg = self.cfg
        # the dtype of the trained parameters: with LoRA the fp32 adapters (the base is stored in param_dtype)
        master = torch.float32 if self.lora is not None else DTYPES[self.model_cfg.dtype]
        param_dtype = DTYPES[cfg.param_dtype]
        mp = MixedPrecisionPolicy(
            param_dtype=None if param_dtype == master else param_dtype,
            reduce_dtype=DTYPES[cfg.reduce_dtype],
        )
        # pinned host memory speeds up copies to a GPU; without one there is nothing to pin
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if cfg.offload_params else OffloadPolicy()
        self._accumulate_unsharded = cfg.accumulates_unsharded(self.mesh.fsdp_size)
        # params that stay gathered over the micro-batches are not freed between forward and backward either
        reshard = cfg.reshard_after_forward and not self._accumulate_unsharded
        kwargs = dict(mesh=self.mesh.fsdp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        self._num_units = 0
        blocks = decoder_blocks(module.lm)
        experts_mesh = self.mesh.expert_mesh(cfg.expert_parallel_size) if cfg.expert_parallel_size > 1 else None
        for i, block in enumerate(blocks):
            if experts_mesh is not None:
                self._spread_experts(block, experts_mesh, kwargs)
            if cfg.compile:
                block.compile()
            # the last block's parameters are needed again first thing in backward: keep them gathered
            last = i == len(blocks) - 1
            fully_shard(block, **{**kwargs, "reshard_after_forward": reshard and not last})
        fully_shard(module, **kwargs)
        self._num_units += len(blocks) + 1
        if cfg.forward_prefetch:
            for block, nxt in zip(blocks, blocks[1:]):
                block.set_modules_to_forward_prefetch([nxt])
            for block, prev in zip(blocks[1:], blocks):
                block.set_modules_to_backward_prefetch([prev])

        module.to_empty(device="cpu" if cfg.offload_params else self.device)
        for mod in module.modules():  # buffers are not offloaded: they meet activations on the device
            for name, buf in mod._buffers.items():
                if buf is not None:
                    mod._buffers[name] = buf.to(self.device)
        return module

    def _spread_experts(self, block: nn.Module, mesh, kwargs: dict) -> None:
        """Expert parallelism (`engine.expert_parallel_size`): each experts module of `block` becomes this rank's
        share over mesh["ep"] (`ExpertParallelExperts`), its two weights DTensors sharded over "ep" on the expert
        dim, then FSDP-sharded over "efsdp" on their second dim, in an FSDP unit of its own inside the block's.

        Gradients: every token routed to an expert, on any rank of the "ep" row, sends its gradient back to the
        expert's rank, so a rank's local expert gradient already sums the row's ep shares; FSDP averages over the
        world // ep ranks of "efsdp" where it averages the other parameters over the whole world (each rank's loss
        share is scaled by the world: `train_batch`), so the experts' gradients are scaled by 1 / ep on their way
        back (`ExpertParallelExperts.grad_scale`; FSDP's own divide factor needs a reduction gloo lacks)."""
        for spread in apply_expert_parallel(block, mesh.get_group("ep")):
            for name in ("gate_up_proj", "down_proj"):
                local = getattr(spread, name)
                dt = DTensor.from_local(local.data, mesh["ep"], [Shard(0)], run_check=False)
                setattr(spread, name, nn.Parameter(dt, requires_grad=local.requires_grad))
            self._num_units += 1
            spread.grad_scale = 1.0 / mesh.size(1)
            fully_shard(spread, **{**kwargs, "mesh": mesh["efsdp"]}, shard_placement_fn=lambda p: Shard(1))

    def num_fsdp_units(self) -> int:
        return self._num_units

    def _before_micro_batch(self, last: bool) -> None:
        """With `accumulate_unsharded`: the gradients are reduced, and the params resharded (so that the next
        forward gathers the stepped ones), in the last micro-batch's backward only."""
        if self._accumulate_unsharded:
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # one group per device mesh (expert parallelism puts the experts on a mesh of their own): DTensors of two
        # meshes do not meet in one norm or one product
        groups: dict = {}
        for p in self.module.parameters():
            if p.grad is not None:
                groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        norms = []
        for params in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=None)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # (sums the shards' squares)
        if not norms:
            return torch.zeros(())
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        if max_norm > 0 and torch.isfinite(total):
            for params in groups.values():
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
        return total.detach().float().cpu()

    def export_weights(self, dtype: torch.dtype | None = None,
                       original: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`original`: with LoRA, the base's tensors as the model folder stores them (`merge_lora`)."""
        from shardrl.engine.state import export_fsdp2_weights

        if self.lora is None:
            yield from export_fsdp2_weights(self.module.named_parameters(), self.device, dtype, self.hf_name)
            return
        # LoRA: each layer's base weight with its adapters merged in, under the HF name (the rollout and an HF
        # folder see a plain model)
        full = export_fsdp2_weights(self.module.named_parameters(), self.device, None, strip_prefix)
        for name, tensor in merge_lora(full, scaling_of(self.lora), original):
            yield name, tensor.to(dtype) if dtype is not None else tensor

    def export_adapters(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """With `model.lora`: (HF name of a LoRA layer, e.g. `model.layers.0.self_attn.q_proj`, A (r, in),
        B (out, r)), the adapters' full fp32 tensors in module order, and nothing of the base (an adapter-only
        weight sync). Every rank must iterate (the gathers are collectives)."""
        from shardrl.engine.state import export_fsdp2_weights

        adapters = ((n, p) for n, p in self.module.named_parameters() if LORA_MARK in n)
        held: dict[str, torch.Tensor] = {}
        for name, tensor in export_fsdp2_weights(adapters, self.device, None, strip_prefix):
            layer, part = name.split(".lora_")
            held[part[0]] = tensor
            if len(held) == 2:
                yield layer, held.pop("A"), held.pop("B")

    def base_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """With `model.lora`: (hf_name, full tensor) of the frozen base alone, unmerged; every rank iterates."""
        from shardrl.engine.state import export_fsdp2_weights

        base = ((n, p) for n, p in self.module.named_parameters() if LORA_MARK not in n)
        yield from export_fsdp2_weights(base, self.device, dtype, self.hf_name)

    def local_base_weights(self) -> dict[str, torch.Tensor] | None:
        """With `model.lora`: the frozen base's own tensors by HF name (no copy, no gather) where this rank holds
        every one whole (a shard group of one: one GPU, or HSDP with fsdp_size=1) on its device; else None. They never change
        (frozen) and stay where they are while the engine trains, so a colocated rollout may read them.

        The sharded storage, never a gathered copy: units left unsharded by a forward (reshard_after_forward=false,
        or gathered over the micro-batches) are resharded first, as their gathered buffers are freed later."""
        if self.lora is None:
            return None
        for mod in self.module.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()
        out = {}
        for name, p in self.module.named_parameters():
            if LORA_MARK in name:
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            if tuple(local.shape) != tuple(p.shape) or local.device != self.device:  # (offload_params: on the CPU)
                return None
            out[self.hf_name(name)] = local.detach()
        return out

    # ---- state: offload, export, checkpoints ------------------------------------------------------
    def _move_params(self, device: torch.device) -> None:
        from shardrl.engine.state import move_fsdp2_params

        move_fsdp2_params(self.module, device)
