"""FSDP1 backend (legacy `FullyShardedDataParallel`): transformer auto-wrap, `use_orig_params=True`.

Sharding strategy follows the mesh and `reshard_after_forward`:
1-D mesh -> FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2); 2-D mesh -> HYBRID_SHARD or
_HYBRID_SHARD_ZERO2, except a 2-D mesh of one shard per replica (`fsdp_size=1`), which is plain data
parallelism: NO_SHARD over the replica dimension. FSDP1 needs CUDA.
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from shardrl.engine.base import Engine, register_engine
from shardrl.engine.model import DTYPES, PolicyModel, decoder_block_classes


def fsdp1_sharding(mesh: DeviceMesh, reshard_after_forward: bool) -> tuple[DeviceMesh, ShardingStrategy]:
    """The mesh and strategy to hand FSDP1. A hybrid mesh with shards of one rank cannot go in as it is:
    FSDP1 clamps a shard group of size 1 to NO_SHARD over that group alone, which skips both the broadcast
    of rank 0's weights to the other replicas and the all-reduce of gradients across them."""
    if mesh.ndim == 2 and mesh.size(1) == 1:
        return mesh["ddp"], ShardingStrategy.NO_SHARD
    if mesh.ndim == 2:
        return mesh, ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return mesh, ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def materialize_on(device: torch.device):
    """FSDP1's `param_init_fn` for meta modules that keeps tied parameters tied: a parameter shared by two
    modules (a head tied to the embedding) becomes one tensor, where `to_empty` per module makes two."""
    made: dict[int, nn.Parameter] = {}

    def init(module: nn.Module) -> None:
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)

    return init


@register_engine("fsdp")
class FSDP1Engine(Engine):
    def _wrap(self, module: PolicyModel, full: PolicyModel | None) -> nn.Module:
        if not torch.cuda.is_available():
            raise ValueError("strategy 'fsdp' (FSDP1) needs CUDA GPUs; use strategy=fsdp2 on CPU")
        cfg = self.cfg
        # rank 0 wraps the real model and broadcasts it (sync_module_states); others wrap the meta one
        target = full if full is not None else module
        if module.lm.is_gradient_checkpointing and full is not None:
            full.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        target.lm.config.use_cache = False
        classes = decoder_block_classes(target.lm)
        self._num_units = sum(1 for m in target.modules() if type(m) in classes) + 1
        param_dtype = DTYPES[cfg.param_dtype]
        device_mesh, strategy = fsdp1_sharding(self.mesh.fsdp_mesh, cfg.reshard_after_forward)
        wrapped = FSDP(
            target,
            device_mesh=device_mesh,
            sharding_strategy=strategy,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes),
            mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype],
                                           buffer_dtype=torch.float32),
            cpu_offload=CPUOffload(offload_params=cfg.offload_params),
            use_orig_params=True,
            device_id=self.device,
            sync_module_states=True,
            param_init_fn=materialize_on(self.device) if full is None else None,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=True,
        )
        # FSDP1's HSDP `sync_module_states` in torch < 2.13 broadcasts buffers within the shard group only
        # (the replica-group pass skips them as already synced), so another replica kept the garbage of
        # meta materialization in buffers such as rotary `inv_freq`. Buffers are not sharded: send rank 0's.
        if dist.get_world_size() > 1:
            for buf in wrapped.buffers():
                dist.broadcast(buf.data, src=0)
        return wrapped

    def num_fsdp_units(self) -> int:
        return self._num_units

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        total = self.module.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
        return total.detach().float().cpu()

    # ---- state: offload, export, checkpoints ------------------------------------------------------
    def _move_params(self, device: torch.device) -> None:
        from shardrl.engine.state import move_fsdp1_params

        move_fsdp1_params(self.module, device)

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        # one FSDP unit at a time: gather its flat parameter, copy out its tensors, reshard
        from shardrl.engine.state import export_fsdp1_weights

        yield from export_fsdp1_weights(self.module, self.hf_name, dtype)
