"""Where an engine's state lives, and writing its weights out.

Offload/onload move this rank's parameter shards (with their grads) and the optimizer state between the
accelerator and the CPU, so that a colocated rollout can use the memory training held. The parameter
objects never change (the optimizer keeps pointing at them); only their storage moves:
- FSDP2: `module.to(device)`; `FSDPModule._apply` reshards first and re-points each FSDPParam at the
  moved shard.
- FSDP1: each unit's flat parameter moves (`FlatParamHandle.flat_param_to`, which refreshes the
  `use_orig_params` views). There is no public API for this; it is what verl does too.
- Optimizer state: every state tensor of dim > 0 moves; an onload sends it to its parameter's device, so
  state of CPU-offloaded parameters (`offload_params`) stays on the CPU where their update runs. Scalars
  (AdamW's `step`) stay where they are: they are tiny and the optimizer wants them on the CPU.

`save_hf` writes a Hugging Face model folder from `export_weights`, one tensor at a time: every rank takes
part in each gather, rank 0 alone keeps the tensors, in the layout the model's family publishes (`hub_layout`),
at most `max_shard_bytes` of them before a safetensors file is written.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

CPU = torch.device("cpu")


# ---- offload / onload -------------------------------------------------------------------------------
@torch.no_grad()
def move_fsdp2_params(module: nn.Module, device: torch.device) -> None:
    module.to(device)


@torch.no_grad()
def move_fsdp1_params(module: nn.Module, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(module):
        handle = getattr(unit, "_handle", None)
        if handle is None or handle._offload_params:  # CPUOffload keeps its shards on the CPU already
            continue
        flat = handle.flat_param
        if flat.device == device:
            continue
        handle.flat_param_to(device, non_blocking=True)
        flat._local_shard = flat.data  # the shard FSDP all-gathers from
        if flat.grad is not None:
            flat.grad = flat.grad.to(device, non_blocking=True)
            handle._use_sharded_grad_views()
    for mod in module.modules():  # buffers are not sharded; they follow the parameters
        for name, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[name] = buf.to(device)


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | None) -> None:
    """Moves the state tensors of dim > 0 to `device`, or, with None, to their parameter's device."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            target = param.device if device is None else device
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != target:
                    state[key] = value.to(target, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # non_blocking copies to pinned-less CPU memory must land before use


def release_accelerator_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def state_devices(engine) -> dict[str, set[str]]:
    """Device types holding this rank's parameter shards, gradients and optimizer state tensors (of an
    `Engine`: its `module` and `optimizer`)."""
    out: dict[str, set[str]] = {"params": set(), "grads": set(), "optimizer": set()}
    for p in engine.module.parameters():
        out["params"].add(p.device.type)
        if p.grad is not None:
            out["grads"].add(p.grad.device.type)
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            out["optimizer"].update(v.device.type for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


# ---- export -----------------------------------------------------------------------------------------
def fsdp1_unit_parameters(unit: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name under `unit`, parameter) for the parameters `unit` itself manages: those not inside a nested
    FSDP unit, each shared parameter once, in `named_parameters` order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    seen: set[int] = set()

    def walk(mod: nn.Module, prefix: str):
        for name, param in mod.named_parameters(recurse=False):
            if id(param) not in seen and "flat_param" not in name:
                seen.add(id(param))
                yield prefix + name, param
        for name, child in mod.named_children():
            if not isinstance(child, FSDP):
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(unit, "")


def export_fsdp1_weights(module: nn.Module, hf_name, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """One FSDP1 unit at a time: gather its flat parameter, copy out its tensors, reshard. The root unit
    comes first (`fsdp_modules` is pre-order), so its lazy init makes it the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    prefixes = {id(mod): f"{name}." if name else "" for name, mod in module.named_modules()}
    for unit in FSDP.fsdp_modules(module):
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for name, param in fsdp1_unit_parameters(unit):
                yield hf_name(prefixes[id(unit)] + name), param.detach().to(dtype=dtype or param.dtype, copy=True)


EXPORT_BUCKET_BYTES = 256 * 2**20
"""FSDP2 export gathers consecutive parameters together until this many bytes (of the export dtype)."""


def _shard_mesh_dim(tensor: DTensor) -> int | None:
    """The mesh dim over which `tensor` is split on its dim 0 (all other mesh dims replicate it), as FSDP2
    and HSDP lay parameters out; None for any other layout."""
    dims = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard) and p.dim == 0]
    others_replicate = all(p.is_replicate() for i, p in enumerate(tensor.placements) if i not in dims)
    return dims[0] if len(dims) == 1 and others_replicate and tensor.dim() > 0 else None


def export_fsdp2_weights(named_params, device: torch.device, dtype: torch.dtype | None, hf_name,
                         bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of FSDP2 (DTensor) parameters, gathered a bucket of consecutive parameters at a time
    with one all-gather (`all_gather_single`) each: a per-tensor `full_tensor()` pays a collective's fixed cost
    ~340 times for a 1.5B model. Shards are cast to the export dtype before the gather (fewer bytes, same
    rounding). Parameters laid out otherwise (or not sharded) are gathered one by one."""
    bucket: list[tuple[str, DTensor]] = []
    key, size = None, 0
    for name, param in named_params:
        tensor = param.detach()
        mesh_dim = _shard_mesh_dim(tensor) if isinstance(tensor, DTensor) else None
        out_dtype = dtype or tensor.dtype
        if mesh_dim is None:
            yield from _gather_bucket(bucket, key, device, hf_name)
            bucket, key, size = [], None, 0
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield hf_name(name), full.to(out_dtype) if dtype is not None else full
            continue
        this_key = (tensor.device_mesh.get_group(mesh_dim), out_dtype)
        if bucket and (this_key != key or size >= bucket_bytes):
            yield from _gather_bucket(bucket, key, device, hf_name)
            bucket, size = [], 0
        bucket.append((name, tensor))
        key = this_key
        size += tensor.numel() * out_dtype.itemsize
    yield from _gather_bucket(bucket, key, device, hf_name)


# torch 2.13 renamed `all_gather_into_tensor` (same signature); the device image has torch 2.11
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_bucket(bucket: list[tuple[str, DTensor]], key, device: torch.device,
                   hf_name) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather for the dim-0 shards of `bucket`, then each full tensor cut out of the result."""
    if not bucket:
        return
    group, dtype = key
    world = dist.get_world_size(group)
    pieces, layout = [], []
    for name, tensor in bucket:
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        per_rank = -(-rows // world)  # dim-0 split as torch.chunk does it; trailing ranks may hold fewer rows
        width = per_rank * math.prod(rest)
        local = tensor.to_local().to(device=device, dtype=dtype).reshape(-1)
        pieces.append(F.pad(local, (0, width - local.numel())))
        layout.append((name, rows, rest, per_rank, width))
    send = torch.cat(pieces)  # (sum of widths,)
    received = torch.empty(world * send.numel(), dtype=dtype, device=device)
    _all_gather_single(received, send, group=group)
    received = received.view(world, -1)  # row r: rank r's padded shards, in bucket order
    start = 0
    for name, rows, rest, per_rank, width in layout:
        full = received[:, start : start + width].reshape(world * per_rank, *rest)[:rows]
        if len(layout) > 1 and full.untyped_storage().data_ptr() == received.untyped_storage().data_ptr():
            full = full.clone()  # a view would keep the whole bucket alive while the caller holds it
        yield hf_name(name), full
        start += width


def persistent_buffers(module: nn.Module, hf_name) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers a state dict holds (not sharded by FSDP: every rank has them whole)."""
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield hf_name(f"{mod_name}.{name}" if mod_name else name), buf


class SafetensorsShardWriter:
    """Writes tensors as they come into safetensors files of at most `max_shard_bytes` (one tensor
    larger than that gets a file of its own), named and indexed as `save_pretrained` does."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        self.folder, self.max_shard_bytes = folder, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # tensor names per written file
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in f for f in self.files):
            raise AssertionError(f"tensor {name} exported twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to(CPU).contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self.folder / f"part-{len(self.files):05d}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.rename(self.folder / "part-00000.safetensors", self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.folder / f"part-{i:05d}.safetensors", self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def replace_folder(tmp: Path, path: Path) -> None:
    """Puts `tmp` at `path` with a rename; a folder already there is moved aside first, then deleted."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old)


def hub_layout(lm: nn.Module) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(name, tensor) -> {name: tensor} in the layout the model's family publishes, which `save_pretrained` writes
    and inference engines read. transformers 5 loads a Mixtral's or Qwen3-MoE's per-expert checkpoint tensors
    (`experts.0.gate_proj.weight`) into fused ones (`mlp.experts.gate_up_proj` (E, 2I, H)) by the model's conversion
    mapping, and `save_pretrained` writes them back by its reverse, `revert_weight_conversion`, taken here one tensor
    at a time (each reverse conversion of the families shardrl knows splits or renames one tensor). transformers 4
    holds the published layout in memory: nothing to convert."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return lambda name, tensor: {name: tensor}

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        # the parts of a split are views of one storage, which a safetensors file refuses: each its own copy
        return {k: v if v is tensor else v.clone() for k, v in revert_weight_conversion(lm, {name: tensor}).items()}
    return convert


def save_hf(path: str | os.PathLike, weights: Iterable[tuple[str, torch.Tensor]],
            buffers: Iterable[tuple[str, torch.Tensor]], hf_config, lm: nn.Module, head: str, dtype: torch.dtype,
            tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads: safetensors
    (sharded with an index past `max_shard_bytes`), config.json, generation_config.json and the tokenizer
    if given. `weights` is an engine's `export_weights(dtype)` (every rank must iterate it: collectives),
    `buffers` its `persistent_buffers`, `lm` the HF model inside it. Every rank must call it; rank 0
    writes, into a temporary folder renamed into place at the end. As in `save_pretrained`, a tied output head
    is not written, and the tensors are in the layout the model's family publishes (`hub_layout`: a mixture of
    experts' per-expert tensors, where the engine and the rollout hold them fused)."""
    path = Path(path)
    writer = tmp = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = SafetensorsShardWriter(tmp, max_shard_bytes)
        to_hub = hub_layout(lm)
    for name, tensor in weights:
        if writer is not None:
            for hub_name, part in to_hub(name, tensor).items():
                writer.add(hub_name, part)
        del tensor  # other ranks drop each gathered tensor at once
    if writer is not None:
        for name, buf in buffers:
            for hub_name, part in to_hub(name, buf.to(dtype) if buf.is_floating_point() else buf).items():
                writer.add(hub_name, part)
        writer.close()
        config = copy.deepcopy(hf_config)
        config.use_cache = True  # the engine turns the KV cache off for training; generation wants it
        config.dtype = dtype
        if head in ("lm", "score"):  # a reward model trained from a causal LM becomes a sequence classifier
            config.architectures = [type(lm).__name__.removeprefix("FSDP")]
        config.save_pretrained(tmp)
        if getattr(lm, "generation_config", None) is not None:
            lm.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_folder(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path
