"""Sharded loading: a model built on the meta device and sharded is filled from a Hugging Face folder's
safetensors files, each rank reading only the slices its shards cover (`safe_open(...).get_slice`, which
reads those bytes and no others), so no rank ever holds the whole model.

What the files do not hold is made on every rank alike: non-persistent buffers (rotary `inv_freq`) by the
model's own `_init_weights` (what `from_pretrained` does after its meta init), before sharding, and a
critic's new value head from its seed. A folder this cannot serve (no safetensors, names that differ from the model's) is
found before anything is built, by `sharded_load_problem`, and the engine loads it the old way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard


def safetensors_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index when there is one); {} when the
    folder has no safetensors files."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def sharded_load_problem(module: nn.Module, folder: str | Path, hf_name: Callable[[str], str],
                         skip: Iterable[str] = ()) -> str | None:
    """Why `folder` cannot fill `module`'s parameters (and persistent buffers) by name and shape, or None.
    `module` may be on the meta device; `skip`: names filled otherwise (a new value head)."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    if not files:
        return "no safetensors files"
    skip = set(skip)
    wanted = {hf_name(n): t for n, t in _loadable(module) if n not in skip}
    missing = sorted(set(wanted) - set(files))
    if missing:
        return f"{len(missing)} tensors of the model are not in the files, e.g. {missing[:3]}"
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(wanted[name].shape):
                    return f"{name} has shape {shape} in {file.name}, the model {tuple(wanted[name].shape)}"
    return None


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    """Which part of the global tensor this rank's local tensor is: FSDP2's `Shard(d)` cuts dim d as
    `torch.chunk` does (ceil-sized pieces, the last ones shorter or empty), `Replicate` keeps it whole."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    starts, sizes = [0] * tensor.dim(), list(tensor.shape)
    mesh = tensor.device_mesh
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            d, n, r = placement.dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            chunk = math.ceil(sizes[d] / n)
            start = min(r * chunk, sizes[d])
            starts[d], sizes[d] = starts[d] + start, min(chunk, sizes[d] - start)
        elif placement.is_partial():
            raise AssertionError(f"cannot load into a tensor with placement {placement}")
    local = tensor.to_local()
    assert tuple(local.shape) == tuple(sizes), (tuple(local.shape), sizes, tensor.placements)
    return tuple(slice(s, s + n) for s, n in zip(starts, sizes))


@torch.no_grad()
def load_sharded(module: nn.Module, folder: str | Path, hf_name: Callable[[str], str], skip: Iterable[str] = ()) -> None:
    """Copies into each parameter (and persistent buffer) of `module` the slice of its weight this rank
    holds, read from `folder`'s safetensors files (one open per file, converted to the parameter's dtype)."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    skip = set(skip)
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in _loadable(module):
        if name not in skip:
            by_file.setdefault(files[hf_name(name)], []).append((hf_name(name), tensor))
    for file, tensors in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name, tensor in tensors:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.numel() > 0:
                    local.copy_(f.get_slice(name)[local_slices(tensor)])


@torch.no_grad()
def random_shards(module: nn.Module, seed: int, std: float, skip: Iterable[str] = ()) -> None:
    """Fills this rank's slice of each parameter (and persistent buffer) of a materialized `module` on its own
    device: norm weights 1, biases 0, everything else normal(0, std) from a generator seeded by `seed`, the
    name and where the slice starts (`model.load_weights=random_shards`): replicas of a shard hold the same
    values, the shards of one tensor and the tensors of a model differ."""
    import zlib

    skip = set(skip)
    for name, tensor in _loadable(module):
        if name in skip:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            continue
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(".bias"):
            local.zero_()
        else:
            start = tuple(sl.start for sl in local_slices(tensor))
            g = torch.Generator(device=local.device).manual_seed(
                (seed * 1_000_003 + zlib.crc32(f"{name}@{start}".encode())) % 2**63)
            local.normal_(0.0, std, generator=g)


@torch.no_grad()
def copy_full_into(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Fills a (possibly sharded) tensor from the whole value, which every rank holds."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local.copy_(full[local_slices(tensor)])


@torch.no_grad()
def compute_non_persistent_buffers(lm: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The non-persistent buffers (rotary `inv_freq`, Gemma's `embed_scale`) of a model built on the meta
    device, computed on the CPU by the model's own `_init_weights` (what `from_pretrained` does after its
    meta init; transformers >= 5 fills rotary tables there) or, on older transformers, by the rotary
    module's `rope_init_fn`. Run before sharding: the parameters are still on meta, so `_init_weights`
    touches no data of theirs. Returns {name under `lm`: value} and the names it could not compute."""
    values, left = {}, []
    for mod_name, mod in lm.named_modules():
        names = [n for n in mod._non_persistent_buffers_set if mod._buffers.get(n) is not None]
        if not names:
            continue
        for n in names:  # NaN marks what no initializer set
            buf = mod._buffers[n]
            mod._buffers[n] = torch.full(buf.shape, float("nan") if buf.is_floating_point() else 0, dtype=buf.dtype)
        if hasattr(lm, "_init_weights"):
            lm._init_weights(mod)
        rope_init = getattr(mod, "rope_init_fn", None)
        if rope_init is not None and getattr(mod, "config", None) is not None and _unset(mod, names):
            inv_freq, _ = rope_init(mod.config, "cpu")
            for n in set(names) & {"inv_freq", "original_inv_freq"}:
                mod._buffers[n].copy_(inv_freq)
        left += [f"{mod_name}.{n}" for n in _unset(mod, names)]
        values.update({f"{mod_name}.{n}" if mod_name else n: mod._buffers[n].clone() for n in names})
    return values, left


def _unset(mod: nn.Module, names: list[str]) -> list[str]:
    """The floating buffers among `names` still holding the NaN they were filled with."""
    return [n for n in names if mod._buffers[n].is_floating_point() and bool(mod._buffers[n].isnan().any())]


def _loadable(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and persistent buffers: what a state dict holds and a file fills."""
    out = list(module.named_parameters())
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out
