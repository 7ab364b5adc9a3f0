"""One engine's state as a DCP checkpoint folder: model and optimizer (sharded state dicts, the optimizer
flattened to per-parameter keys), lr_scheduler, global_step.

DCP reshards on load: each rank reads the pieces of the global tensors its current shards cover, so a
folder saved on N ranks loads on M (FSDP2, HSDP or FSDP1) with no conversion step. Before loading, the
folder's keys and shapes are compared with the engine's and any difference is a ValueError.

The functions take the engine's parts (module, optimizer, schedule), not the engine, so this module sits
below `shardrl.engine.base`, which calls it from `Engine.save` / `Engine.load`. A run's checkpoints (one
folder per engine, RNG, trainer state, atomic renames) are `shardrl.trainer.checkpoint`'s job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardrl.engine.optim import continue_lr_schedule


def _options(trained_only: bool) -> StateDictOptions:
    # flattened optimizer state: per-parameter keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") that
    # do not depend on how parameters are grouped or sharded
    # trained_only (LoRA): the model's entries are the trained parameters (the adapters); the frozen base is
    # the model folder's, read again on resume
    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=trained_only, strict=not trained_only)


def engine_state_dict(module: nn.Module, optimizer=None, lr_scheduler=None, global_step: int = 0,
                      trained_only: bool = False) -> dict[str, Any]:
    """The engine's sharded state: DTensors (or FSDP1 sharded tensors) of this rank's shards; `trained_only`:
    the model's trained parameters only (a LoRA engine's adapters)."""
    options = _options(trained_only)
    state: dict[str, Any] = {"model": get_model_state_dict(module, options=options)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=options)
        state["lr_scheduler"] = lr_scheduler.state_dict()
    state["global_step"] = global_step
    return state


def save_engine_state(path: str | os.PathLike, module: nn.Module, optimizer=None, lr_scheduler=None,
                      global_step: int = 0, trained_only: bool = False, lora: Mapping | None = None) -> None:
    """Writes the engine's state as a DCP checkpoint at `path` (a folder); every rank must call it. `lora`: the
    settings that make the adapters' function (`lora_settings`), kept beside them for `load_engine_state` to check."""
    # an optimizer that has not stepped (its steps so far skipped for a non-finite gradient norm) has no state:
    # torch's get_optimizer_state_dict makes some with a step of lr 0, which would count in AdamW's bias correction
    # from then on; it is dropped again after the save (and on load: `global_step` 0)
    stateless = optimizer is not None and not optimizer.state
    state = engine_state_dict(module, optimizer, lr_scheduler, global_step, trained_only)
    if lora is not None:
        state["lora"] = json.dumps(dict(lora), sort_keys=True)
    dcp.save(state, checkpoint_id=str(path))
    if stateless:
        optimizer.state.clear()


def lora_settings(lora) -> dict[str, Any]:
    """The `model.lora` keys a checkpoint's adapters only mean under (the scale alpha / rank, or / sqrt(rank) with
    rslora, multiplies them; rank and targets shape them); dropout and seed do not change a trained adapter's output."""
    targets = lora.target_modules if isinstance(lora.target_modules, str) else sorted(lora.target_modules)
    return {"rank": lora.rank, "alpha": float(lora.alpha), "use_rslora": bool(lora.use_rslora),
            "target_modules": targets}


def check_settings(path, then: Mapping[str, Any], now: Mapping[str, Any], what: str, fix: str,
                   prefix: str = "") -> None:
    """A checkpoint resumed under settings other than those it recorded (`then`) is a ValueError naming each key
    (`prefix` + key) with both values, then `fix`; a key the checkpoint did not record (it was written before the key
    was) is not checked. The one check for LoRA settings (here) and a trainer's (`trainer.checkpoint`)."""
    differ = [f"{prefix}{k}={then[k]!r} in the checkpoint, {v!r} here" for k, v in now.items()
              if k in then and then[k] != v]
    if differ:
        raise ValueError(f"checkpoint {path} was trained with other {what}: {'; '.join(differ)}; {fix}")


def _check_lora_settings(path: Path, saved: Mapping[str, Any], lora: Mapping | None) -> None:
    """A checkpoint that recorded its LoRA settings, resumed under others, is an error naming them (a checkpoint
    written before they were recorded is not checked)."""
    if lora is None or "lora" not in saved:
        return
    record = {"lora": ""}
    dcp.load(record, checkpoint_id=str(path))
    check_settings(path, json.loads(record["lora"]), lora, "LoRA settings",
                   "resume it with the settings it was trained with", prefix="model.lora.")


def load_engine_state(path: str | os.PathLike, module: nn.Module, optimizer=None, lr_scheduler=None,
                      trained_only: bool = False, lora: Mapping | None = None) -> int:
    """Loads a folder `save_engine_state` wrote, at any world size and layout; returns its global step. `lora`: this
    run's `lora_settings`, checked against those the checkpoint recorded."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a DCP checkpoint (no .metadata); expected a folder save_engine_state wrote")
    state = engine_state_dict(module, optimizer, lr_scheduler, trained_only=trained_only)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved_lora = any(".lora_" in k for k in saved if k.startswith("model."))
    if saved_lora != trained_only:
        raise ValueError(f"checkpoint {path} holds {'LoRA adapters' if saved_lora else 'a whole model'}, but this run "
                         f"{'trains LoRA adapters (model.lora.rank > 0)' if trained_only else 'has no model.lora'}: "
                         "resume it with the model.lora settings it was trained with")
    _check_lora_settings(path, saved, lora)
    check_matches(state, saved, path)
    if "lr_scheduler" in state:  # entries another torch version's scheduler does not have keep their value
        state["lr_scheduler"] = {k: v for k, v in state["lr_scheduler"].items() if f"lr_scheduler.{k}" in saved}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(module, state["model"], options=_options(trained_only))
    if optimizer is not None:
        base_lrs = list(lr_scheduler.base_lrs)  # this run's optim.lr, not the saving run's
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=_options(trained_only))
        if int(state["global_step"]) == 0:  # saved before its first optimizer step: no state (`save_engine_state`)
            optimizer.state.clear()
        keep_fused(optimizer)
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        continue_lr_schedule(lr_scheduler, base_lrs)
    return int(state["global_step"])


def keep_fused(optimizer) -> None:
    """Loading an optimizer's state replaces its groups' settings with the saved ones: a checkpoint of an unfused AdamW
    (an offloaded or CPU run before the fused CPU kernel) would turn this run's fused kernel off. Keep this run's
    choice, with each step count where the fused kernel reads it (a float32 tensor on its parameter's device)."""
    fused = optimizer.defaults.get("fused")
    for group in optimizer.param_groups:
        if "fused" not in group or group["fused"] == fused:
            continue
        group["fused"] = fused
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if fused and torch.is_tensor(step):
                optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


def flat_keys(state: Mapping, prefix: str = "") -> dict[str, Any]:
    """The keys DCP stores `state` under: nested mappings joined by dots (lists of plain values are leaves)."""
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_keys(value, name + "."))
        else:
            out[name] = value
    return out


def check_matches(state: Mapping, saved: Mapping[str, Any], path: Path) -> None:
    """Raises ValueError when the checkpoint's model/optimizer keys or tensor shapes differ from `state`'s."""
    want = {k: v for k, v in flat_keys(state).items() if k.split(".", 1)[0] in ("model", "optimizer")}
    have = {k for k in saved if k.split(".", 1)[0] in ("model", "optimizer")}
    missing = sorted(set(want) - have)
    unexpected = sorted(k for k in have - set(want) if k.startswith("model."))
    if not any(k.startswith("model.") for k in have):
        raise ValueError(f"checkpoint {path} holds no model weights")
    if "optimizer" in state and not any(k.startswith("optimizer.") for k in have):
        raise ValueError(f"checkpoint {path} holds no optimizer state, but this engine trains; "
                         "it was saved by a forward-only engine")
    shapes = []
    for key in sorted(set(want) & have):
        meta, value = saved[key], want[key]
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if tuple(meta.size) != tuple(value.shape):
                shapes.append(f"{key}: checkpoint {tuple(meta.size)}, model {tuple(value.shape)}")
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing from the checkpoint", missing), ("not in this model", unexpected),
                             ("of another shape", shapes)):
            if items:
                more = f" (and {len(items) - 5} more)" if len(items) > 5 else ""
                parts.append(f"{len(items)} {label}: {', '.join(items[:5])}{more}")
        raise ValueError(f"checkpoint {path} does not match this model (another architecture or size?); "
                         + "; ".join(parts))
