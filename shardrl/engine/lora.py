"""LoRA adapters on an engine's model (`model.lora`), with PyPI `peft`: injected into the Hugging Face model in
place (`inject_adapter_in_model`, no PeftModel wrapper: the model keeps its class, its decoder blocks and its
forward), before the engine shards it.

    a LoRA linear   `...q_proj.base_layer.weight` (frozen, stored in engine.param_dtype: no fp32 master copy, no
                    gradient, no optimizer state) + `...q_proj.lora_A.default.weight` (r, in) and
                    `...q_proj.lora_B.default.weight` (out, r), fp32, trained; out = base(x) + scaling * B(A(x))
    HF names        `.base_layer.` dropped; the lora_* tensors have none (the export merges them into the base)
    reference       the same model with the adapters off (`adapters_off`): the base policy, no second copy

FSDP2 takes a block that mixes frozen bf16 and trainable fp32 parameters (its one-dtype rule covers the trainable
ones); peft must come before `fully_shard` (after it, the adapters would be plain tensors that FSDP never reduces).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterable, Iterator

import torch
from torch import nn

LORA_MARK = ".lora_"
"""In the name of every adapter parameter (`lora_A`, `lora_B`)."""


def peft_lora_config(lora_cfg, targets=None):
    """peft's LoraConfig of shardrl's `model.lora` section (`targets`: leaf names in place of its target_modules)."""
    from peft import LoraConfig

    targets = lora_cfg.target_modules if targets is None else targets
    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=targets if targets == "all-linear" else list(targets), bias="none",
                      use_rslora=lora_cfg.use_rslora, init_lora_weights=True)


def linear_module_names(model: nn.Module) -> list[str]:
    """The leaf names of the model's linear layers (what target_modules may name), output head excluded."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names - {"lm_head", "score"})


def language_model_linears(lm: nn.Module, leaves) -> list[str]:
    """A vision-language model's adapted layers: the full names of its language model's linear layers whose leaf
    name is in `leaves` ("all-linear": every one), so that no layer of the vision tower (whose MLP shares the
    decoder's leaf names, gate_proj / up_proj / down_proj) gets an adapter."""
    from shardrl.models.vision import vision_family

    prefix = vision_family(lm.config).language_model + "."
    return [name for name, m in lm.named_modules() if isinstance(m, nn.Linear) and name.startswith(prefix)
            and (leaves == "all-linear" or name.rsplit(".", 1)[-1] in leaves)]


def inject_lora(lm: nn.Module, lora_cfg) -> list[str]:
    """Adds `model.lora`'s adapters to the HF model `lm` (on any device, meta included), freezes everything
    else, and makes the adapters fp32; returns the adapter parameters' names. A ValueError naming the key for
    target modules that match nothing. A vision-language model's adapters go on its language model only (its
    vision tower stays as it is, frozen)."""
    from peft import inject_adapter_in_model

    from shardrl.models.families import is_moe
    from shardrl.models.vision import is_vision_language, vision_family

    vision = is_vision_language(lm.config)
    part = lm.get_submodule(vision_family(lm.config).language_model) if vision else lm
    known = linear_module_names(part)
    targets = lora_cfg.target_modules
    if targets != "all-linear":
        missing = [t for t in targets if t not in known]
        if missing or not targets:
            where = "the language model" if vision else "the model"
            raise ValueError(f"model.lora.target_modules={list(targets)}: {missing or 'none'} match no linear layer "
                             f"of {where}; its linear layers are {known} (or give \"all-linear\")")
    # a mixture of experts: peft's all-linear would also wrap the routers and the experts' 3-D weights, which the
    # rollouts' adapter sync and the merged export do not handle; its linear layers (attention, dense MLPs) only
    explicit = known if targets == "all-linear" and is_moe(lm.config) else None
    if vision:  # by full name: peft matches a leaf name anywhere, the vision tower's layers too
        explicit = language_model_linears(lm, explicit or targets)
    inject_adapter_in_model(peft_lora_config(lora_cfg, explicit), lm)
    names = []
    for name, p in lm.named_parameters():
        if LORA_MARK in name:
            p.data = p.data.float()  # the adapters train in fp32 whatever the base is stored in
            p.requires_grad_(True)
            names.append(name)
        else:
            p.requires_grad_(False)
    if not names:
        raise ValueError(f"model.lora.target_modules={targets!r} added no adapter; the model's linear layers are "
                         f"{known}")
    return names


def lora_summary(lm: nn.Module, lora_cfg) -> tuple[str, str | None]:
    """Start-up lines for a model with adapters: (how many layers carry them and the trainable parameters against
    the base's; a warning where the rank is at least a wrapped layer's smaller side, since that adapter is no
    smaller than the weight it adapts (peft takes such a rank), else None)."""
    layers = {id(m): m for m in lora_modules(lm)}
    named = [(n.rsplit(".", 1)[-1], m) for n, m in lm.named_modules() if id(m) in layers]
    trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in lm.named_parameters() if LORA_MARK not in n)
    line = (f"LoRA rank {lora_cfg.rank} on {len(named)} linear layers ({', '.join(sorted({k for k, _ in named}))}): "
            f"{trainable:,} trainable parameters, {100 * trainable / max(total, 1):.2f}% of the base's {total:,}")
    small = sorted({k for k, m in named if min(m.base_layer.in_features, m.base_layer.out_features) <= lora_cfg.rank})
    warning = (f"model.lora.rank={lora_cfg.rank} is at least the smaller side of {', '.join(small)}: those adapters "
               f"are no smaller than the weights they adapt" if small else None)
    return line, warning


def lora_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial value of adapter `name`, the same on every rank and in every process: A Kaiming-uniform (as
    peft's default, from a generator seeded by `seed` and the name), B zeros, so training starts at the base."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    fan_in = shape[1]
    bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_(a=sqrt(5)), what nn.Linear and peft use
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def lora_modules(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(module: nn.Module):
    """The base model inside: every LoRA layer skips its adapter. (peft's `disable_adapter()` also turns the
    adapters' requires_grad off, which FSDP2, first run inside it, would take for a model without trainable
    parameters: the reduce dtype would never be set up.)"""
    layers = lora_modules(module)
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def hf_base_name(name: str) -> str:
    """The HF name of a base weight under a LoRA layer (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in fp32, on W's device (A (r, in), B (out, r))."""
    return torch.addmm(w.float(), b.to(w.device, torch.float32), a.to(w.device, torch.float32), alpha=scaling)


def merge_lora(stream: Iterable[tuple[str, torch.Tensor]], scaling: float,
               original: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in module order -> the same with each LoRA layer's base weight merged
    (W + scaling * B @ A, computed in fp32, in W's dtype) under the base weight's HF name; adapters dropped.
    `original` (HF name -> tensor): the base as the model folder stores it, used in place of the streamed frozen
    tensors it names (the engine holds them rounded to param_dtype; an fp32 export must not be)."""
    original = original or {}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a LoRA layer's prefix -> what arrived of it so far

    def ready(prefix: str):
        parts = pending[prefix]
        if {"base", "A", "B"} <= set(parts):
            del pending[prefix]
            w = original.pop(f"{prefix}weight", parts["base"])
            return f"{prefix}weight", merged_weight(w, parts["A"], parts["B"], scaling).to(w.dtype)
        return None

    for name, tensor in stream:
        if ".base_layer.weight" in name:
            prefix, part = name.split("base_layer.weight")[0], "base"
        elif ".lora_A." in name:
            prefix, part = name.split("lora_A.")[0], "A"
        elif ".lora_B." in name:
            prefix, part = name.split("lora_B.")[0], "B"
        else:
            name = hf_base_name(name)  # base_layer.bias and everything outside LoRA layers
            yield name, original.pop(name, tensor)
            continue
        pending.setdefault(prefix, {})[part] = tensor
        out = ready(prefix)
        if out is not None:
            yield out
    if pending:
        raise RuntimeError(f"LoRA layers without their base weight or adapters in the export: {sorted(pending)}")


def scaling_of(lora_cfg) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), as peft scales B @ A."""
    return lora_cfg.alpha / (math.sqrt(lora_cfg.rank) if lora_cfg.use_rslora else lora_cfg.rank)


def save_peft_adapter(path, adapters: dict[str, torch.Tensor], lora_cfg, base_model_path: str | None,
                      by_full_name: bool = False) -> None:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) of the full adapter tensors
    `adapters` (by HF name, `...q_proj.lora_A.default.weight`) of a causal LM (LoRA is the policy's only):
    `PeftModel.from_pretrained(base, path)` and `AutoPeftModelForCausalLM.from_pretrained(path)` load it.
    `by_full_name`: its target_modules name each adapted layer in full (a vision-language model's language model
    shares leaf names with its vision tower, which has no adapters)."""
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the layers that hold adapters, by leaf name (what peft's all-linear would pick for a dense model)
    layers = {name.split(".lora_")[0] for name in adapters}
    config = peft_lora_config(lora_cfg, sorted(layers if by_full_name else {n.rsplit(".", 1)[-1] for n in layers}))
    config.task_type = "CAUSAL_LM"  # what AutoPeftModelForCausalLM checks, and what peft's own causal-LM save writes
    # a local folder as an absolute path (a relative one would be read from the loader's working folder, not the
    # run's); a hub id as given
    if base_model_path and Path(base_model_path).exists():
        base_model_path = str(Path(base_model_path).resolve())
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(str(path))
    tensors = {"base_model.model." + name.replace(".default.", "."): t.detach().float().contiguous().cpu()
               for name, t in adapters.items()}  # peft's saved names: no adapter name
    save_file(tensors, str(path / "adapter_model.safetensors"))
