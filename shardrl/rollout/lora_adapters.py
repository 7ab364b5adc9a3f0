"""Several LoRA adapters over one served base (`shardrl serve --lora-modules NAME=PATH`, as vLLM's multi-LoRA
serving): each read from a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) and checked
against the base, a request choosing one by its `model` (the base's own name: no adapter).

    a PEFT folder   keys `base_model.model.<hf linear>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r);
                    out = W x + scale * B (A x), scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)
    on the rollout  one adapter at a time (`ServedAdapters.activate`, called by the batcher before each generation):
                    the fast backend adds it unmerged (`FastRollout.load_lora`), every adapter zero-padded to the
                    largest rank over the union of their layers, its scale folded into B, so switching is an
                    in-place copy that keeps the decode step's buffers (and CUDA graphs); the base is all zeros.
                    Other backends (hf) get merged weights (W + scale * B @ A in fp32, from a CPU copy of the
                    base's adapted weights) copied into their model's parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
"""What PEFT's saved keys start with, before the wrapped model's own parameter names."""


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry: the name requests ask for, the adapter folder, and (vLLM's JSON form) the base it
    was trained on (the served model's name where not given: what `/v1/models` lists as its parent)."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(specs: list[str]) -> list[LoraModule]:
    """`--lora-modules` values as vLLM takes them: `NAME=PATH`, or a JSON object {"name", "path",
    "base_model_name"?}; several per flag (space-separated) or the flag repeated. Names must be distinct."""
    modules = []
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                given = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {spec!r}: not valid JSON ({e}); give NAME=PATH or "
                                 '{"name": ..., "path": ..., "base_model_name": ...}') from None
            unknown = set(given) - {"name", "path", "base_model_name"} if isinstance(given, dict) else set()
            if not isinstance(given, dict) or unknown or not given.get("name") or not given.get("path"):
                raise ValueError(f"--lora-modules {spec!r}: a JSON entry is an object with \"name\" and \"path\" "
                                 f"(and optionally \"base_model_name\"){f', not {sorted(unknown)}' if unknown else ''}")
            modules.append(LoraModule(str(given["name"]), str(given["path"]), given.get("base_model_name")))
            continue
        name, eq, path = spec.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r}: give NAME=PATH (the name requests send as `model`, the "
                             "PEFT adapter folder), e.g. --lora-modules math=/ckpt/math_adapter")
        modules.append(LoraModule(name.strip(), path.strip()))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: the names {sorted({n for n in names if names.count(n) > 1})} are given "
                         "twice; each adapter needs a name of its own")
    return modules


@dataclass
class Adapter:
    """An adapter read from its folder: {HF linear name: (A (r, in), B (out, r))} in fp32, and its scale."""
    module: LoraModule
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) adapters are not served: only plain LoRA",
    "modules_to_save": "modules_to_save (fully trained layers saved beside the adapters) is not served",
    "rank_pattern": "per-layer ranks (rank_pattern) are not served: one r for every layer",
    "alpha_pattern": "per-layer alphas (alpha_pattern) are not served: one lora_alpha for every layer",
    "layers_to_transform": "layers_to_transform is not served",
}


def read_adapter(module: LoraModule, linears: dict[str, tuple[int, int]]) -> Adapter:
    """`module`'s PEFT LoRA folder, checked against the base's linear layers `linears` ({HF name: (out, in)}): a
    ValueError naming the adapter and what is wrong (no adapter folder, a full model folder, an option not served,
    a layer the base lacks or of another shape, tensors whose rank is not the config's r)."""
    from safetensors.torch import load_file

    where = f"--lora-modules {module.name}={module.path}"
    folder = Path(module.path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder; give a PEFT adapter folder (adapter_config.json and "
                         "adapter_model.safetensors, as peft's save_pretrained writes); a config's key=value "
                         "overrides go before --lora-modules, which takes every NAME=PATH after it")
    if not (folder / "adapter_config.json").is_file():
        what = " (it holds a config.json: a full model, not an adapter)" if (folder / "config.json").is_file() else ""
        raise ValueError(f"{where}: not a PEFT adapter folder, it has no adapter_config.json{what}")
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: a {config['peft_type']} adapter; only LoRA adapters are served")
    for key, why in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {why} ({key}={config[key]!r} in adapter_config.json)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r}: adapters that train biases are not served (bias='none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: adapter_config.json needs r (an integer >= 1) and lora_alpha, got r={rank!r}, "
                         f"lora_alpha={alpha!r}")
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors (a .bin adapter: load it with peft and save it "
                         "again with safe_serialization=True)")
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        body = key.removeprefix(PEFT_PREFIX)
        layer, dot, kind = body.rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or not dot or kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: the tensor {key!r} is not a LoRA linear's A or B (DoRA magnitudes, embedding "
                             f"adapters and saved modules are not served)")
        pieces.setdefault(layer, {})[kind[0]] = tensor.float()
    if not pieces:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for layer, ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {layer} has lora_{''.join(ab)} but not both lora_A and lora_B")
        if layer not in linears:
            raise ValueError(f"{where}: the layer {layer} is not a linear layer of the served base (it has e.g. "
                             f"{sorted(linears)[:3]}): an adapter trained on another model")
        a, b = ab["A"], ab["B"]
        out_f, in_f = linears[layer]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f:
            raise ValueError(f"{where}: {layer} has A {tuple(a.shape)}, B {tuple(b.shape)}; the base's layer is "
                             f"{in_f} -> {out_f}: an adapter for another base shape")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: {layer}'s tensors have rank {a.shape[0]} (A) and {b.shape[1]} (B), but "
                             f"adapter_config.json says r={rank}: the folder's config and weights disagree")
        weights[layer] = (a, b)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(module, rank, float(scale), weights)


class ServedAdapters:
    """The adapters over one rollout, one active at a time (`activate`; None: the base). See the module docstring
    for how each backend applies it."""

    def __init__(self, rollout, adapters: list[Adapter], base_name: str):
        for a in adapters:
            if a.module.name == base_name:
                raise ValueError(f"--lora-modules {a.module.name}=...: the name is the base model's own; give the "
                                 "adapter another")
            if a.module.base_model_name not in (None, base_name):
                raise ValueError(f"--lora-modules {a.module.name}: base_model_name {a.module.base_model_name!r} is "
                                 f"not the served model {base_name!r} (one base is served)")
        self.rollout, self.base_name = rollout, base_name
        self.adapters = {a.module.name: a for a in adapters}
        self.modules = [a.module for a in adapters]
        self.active: str | None = None
        layers = sorted({layer for a in adapters for layer in a.weights})
        self.unmerged = hasattr(rollout, "load_lora")
        if self.unmerged:  # every adapter (and the base) the same shapes: a switch copies in place
            rank = max(a.rank for a in adapters)
            shapes = {layer: next(a.weights[layer] for a in adapters if layer in a.weights) for layer in layers}
            device = getattr(rollout, "device", "cpu")  # (kept there: a switch is a device-side copy)
            self.padded = {name: {layer: (a.to(device), b.to(device)) for layer, (a, b) in
                                  self._padded(self.adapters.get(name), shapes, rank).items()}
                           for name in [None, *self.adapters]}
            rollout.load_lora(self.padded[None], 1.0)
        else:  # the base's adapted weights, kept on the CPU to merge each adapter into
            params = dict(rollout.model.named_parameters())
            self.base = {layer: params[f"{layer}.weight"].detach().to("cpu", copy=True) for layer in layers}

    @staticmethod
    def _padded(adapter: Adapter | None, shapes: dict, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (A (rank, in), B * scale (out, rank))}: `adapter`'s in the first rows/columns, zeros elsewhere
        (a zero block adds nothing: the base's output is unchanged)."""
        padded = {}
        for layer, (a0, b0) in shapes.items():
            a, b = a0.new_zeros(rank, a0.shape[1]), b0.new_zeros(b0.shape[0], rank)
            if adapter is not None and layer in adapter.weights:
                a_i, b_i = adapter.weights[layer]
                a[: a_i.shape[0]] = a_i
                b[:, : b_i.shape[1]] = b_i * adapter.scale
            padded[layer] = (a, b)
        return padded

    def activate(self, name: str | None) -> None:
        """The rollout generates with adapter `name` (None: the base) from now on; a no-op if it is active."""
        if name == self.active:
            return
        if self.unmerged:
            self.rollout.load_lora(self.padded[name], 1.0)
        else:
            from shardrl.engine.lora import merged_weight

            adapter, params = self.adapters.get(name), dict(self.rollout.model.named_parameters())
            with torch.no_grad():
                for layer, w in self.base.items():
                    if adapter is not None and layer in adapter.weights:
                        w = merged_weight(w, *adapter.weights[layer], adapter.scale)
                    params[f"{layer}.weight"].copy_(w)
        self.active = name


def load_served_adapters(rollout, modules: list[LoraModule], linears: dict[str, tuple[int, int]],
                         base_name: str) -> ServedAdapters:
    """`modules`' adapters read and checked (`read_adapter`), over `rollout`."""
    return ServedAdapters(rollout, [read_adapter(m, linears) for m in modules], base_name)
