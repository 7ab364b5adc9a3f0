"""FSDP1 backend (legacy `FullyShardedDataParallel`): transformer auto-wrap, `use_orig_params=True`.

Sharding strategy follows the mesh and `reshard_after_forward`:
1-D mesh -> FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2); 2-D mesh -> HYBRID_SHARD or
_HYBRID_SHARD_ZERO2. FSDP1 needs CUDA.
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from shardrl.engine.base import Engine, register_engine
from shardrl.engine.model import DTYPES, PolicyModel, decoder_block_classes


def sharding_strategy(hsdp: bool, reshard_after_forward: bool) -> ShardingStrategy:
    if hsdp:
        return ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


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
        wrapped = FSDP(
            target,
            device_mesh=self.mesh.fsdp_mesh,
            sharding_strategy=sharding_strategy(self.mesh.is_hsdp, cfg.reshard_after_forward),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes),
            mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype],
                                           buffer_dtype=torch.float32),
            cpu_offload=CPUOffload(offload_params=cfg.offload_params),
            use_orig_params=True,
            device_id=self.device,
            sync_module_states=True,
            param_init_fn=(lambda m: m.to_empty(device=self.device, recurse=False)) if full is None else None,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=True,
        )
        return wrapped

    def num_fsdp_units(self) -> int:
        return self._num_units

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        total = self.module.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
        return total.detach().float().cpu()

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        # one FSDP unit at a time: gather its flat parameter, copy out its tensors, reshard
        with FSDP.summon_full_params(self.module, writeback=False, rank0_only=False, recurse=True,
                                     offload_to_cpu=False):
            for name, param in self.module.named_parameters():
                yield self.hf_name(name), param.detach().to(dtype) if dtype is not None else param.detach().clone()

    # ---- state: offload, export, checkpoints ------------------------------------------------------
    def _move_params(self, device: torch.device) -> None:
        from shardrl.engine.state import move_fsdp1_params

        move_fsdp1_params(self.module, device)

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # noqa: F811
        # supersedes the definition above (which gathers every unit at once): one unit at a time
        from shardrl.engine.state import export_fsdp1_weights

        yield from export_fsdp1_weights(self.module, self.hf_name, dtype)
