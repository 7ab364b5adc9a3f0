"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, ...) in the engine.

Hugging Face stores a layer's experts as two 3-D parameters (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I))
and dispatches the experts' forward by `config._experts_implementation`: "eager" loops over the experts a batch
hit, "grouped_mm" sorts the (token, expert) pairs by expert and runs each projection as one grouped matrix
product (`torch._grouped_mm`, forward and backward, CPU and CUDA), "batched_mm" gathers one weight copy per pair
(for decoding; too much memory to train with). FSDP2 shards each 3-D parameter on its expert dimension with the
rest of its decoder block.

`model.experts_implementation` "auto" takes grouped_mm where the grouped product accepts the shapes (its
operands' rows are 16-byte aligned: hidden and expert sizes multiples of 8 elements, which covers fp32 and bf16),
else eager, which computes the same numbers (tests/test_moe.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from shardrl.models.config import text_config
from shardrl.models.families import expert_intermediate_size, is_moe, num_experts, router_rule

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATIONS = ("auto", "grouped_mm", "eager", "batched_mm")
ALIGN = 8  # elements: 16 bytes of bf16 (32 of fp32), what torch._grouped_mm needs of a row's stride


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands here: rows 16-byte aligned; on CUDA bf16 (it has no
    fp32 kernel there) on an SM80 or newer GPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if any(w.shape[-1] * w.element_size() % 16 or w.shape[-2] * w.element_size() % 16 for w in weights):
        return False
    if x.device.type == "cuda":  # (as HF's check: Hopper only before torch 2.9)
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= (8 if version >= (2, 9) else 9)
    return x.device.type == "cpu" and version >= (2, 9)


def resolve_experts_implementation(name: str, hf_config) -> str:
    """`model.experts_implementation` for this model: auto -> grouped_mm where its shapes allow, else eager."""
    if name not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"model.experts_implementation={name!r}: must be one of {list(EXPERTS_IMPLEMENTATIONS)}")
    if name != "auto":
        return name
    c = text_config(hf_config)
    sizes = {"hidden_size": c.hidden_size, "expert intermediate size": expert_intermediate_size(c)}
    odd = [f"{k} {v}" for k, v in sizes.items() if v % ALIGN]
    if odd:
        log.info("model.experts_implementation=eager (auto: %s not a multiple of %d, which grouped_mm needs)",
                 ", ".join(odd), ALIGN)
        return "eager"
    return "grouped_mm"


def apply_experts_implementation(hf_config, name: str) -> str | None:
    """Sets the experts' forward of an MoE config (every model built from it uses it); None for a dense model."""
    if not is_moe(hf_config):
        return None
    impl = resolve_experts_implementation(name, hf_config)
    if impl == "grouped_mm" and name == "grouped_mm":
        c = text_config(hf_config)
        for key, value in (("hidden_size", c.hidden_size), ("expert intermediate size", expert_intermediate_size(c))):
            if value % ALIGN:
                raise ValueError(f"model.experts_implementation=grouped_mm needs the {key} ({value}) to be a multiple "
                                 f"of {ALIGN} (torch._grouped_mm's row alignment); use auto or eager")
    for config in {id(hf_config): hf_config, id(text_config(hf_config)): text_config(hf_config)}.values():
        config._experts_implementation = impl
    return impl


# ---- router replay ------------------------------------------------------------------------------------


class RouterReplay:
    """Records or replays the experts each token is routed to, per MoE layer, in an HF MoE model's forward.

    The routers (HF's `*TopKRouter` modules, whose forward returns (logits, top-k weights, top-k experts)) get a
    wrapped forward, run outside torch.compile. Recording keeps each layer's chosen experts; replaying replaces them
    with given ones (N, L, k; -1 keeps the token's own choice in that layer) and recomputes their weights from this forward's router probabilities (softmax in fp32, gathered at the
    given experts, renormalized as the model does), so the gradient still reaches the router. A replay lasts
    from `replay` to `end` (after the backward: a gradient checkpoint's recompute must route the same);
    `mismatched` / `compared` (device tensors) count, in the forward only and over the `real` tokens, the
    (token, layer) pairs whose own top-k differed from the replayed set."""

    def __init__(self, lm):
        self.lm = lm
        self.routers = [m for m in lm.modules() if type(m).__name__.endswith("TopKRouter")]
        self._rule: tuple[bool, bool] | None = None  # (router_rule, asked for at the first replay)
        self.mode: str | None = None
        self.replayed: torch.Tensor | None = None  # (N, L, k) in the forward's token order
        self.real: torch.Tensor | None = None  # (N,) bool: the tokens the mismatch counts
        self.counting = False
        self.recorded: list[torch.Tensor | None] = []
        self.mismatched = self.compared = None
        self.capture_logits = False  # training forwards collect each layer's router logits (load-balancing loss)
        self.logits: list[torch.Tensor] | None = None  # collecting when a list (set by the forward)
        for i, router in enumerate(self.routers):
            router.forward = self._wrapped(router.forward, i)

    def _wrapped(self, forward, i: int):
        """The router's forward, then `_hook`, kept out of torch.compile (a graph break): recording and replay are
        Python state keyed by the layer, and a forward hook traced into the compiled blocks lost it (on the
        GPU's torch 2.11 a compiled run's recording came back with layers missing)."""
        @torch.compiler.disable
        def routed(*args, **kwargs):
            out = forward(*args, **kwargs)
            changed = self._hook(i, out)
            return out if changed is None else changed

        return routed

    def _hook(self, i: int, out):
        if self.logits is not None:
            self.logits.append(out[0])
        if self.mode is None:
            return None
        logits, _, experts = out
        if self.mode == "record":
            self.recorded[i] = experts.detach()
            return None
        given = self.replayed[:, i].to(experts.device, torch.long)
        known = given[:, 0] >= 0  # -1: no routing recorded for the token (R3: padding, a last token), its own kept
        given = torch.where(known[:, None], given, experts)
        if self.counting:
            with torch.no_grad():
                differ = (experts.sort(-1).values != given.sort(-1).values).any(-1) & self.real & known
                self.mismatched = self.mismatched + differ.sum()
                self.compared = self.compared + (self.real & known).sum()
        normalize, fp32 = self._rule or router_rule(self.lm.config)
        self._rule = (normalize, fp32)
        weights = logits.float().softmax(-1).gather(-1, given)
        if normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, (weights if fp32 else weights.to(logits.dtype)), given

    def reset_counts(self, device) -> None:
        self.mismatched = self.compared = torch.zeros((), dtype=torch.long, device=device)

    @contextlib.contextmanager
    def recording(self):
        self.mode, self.recorded = "record", [None] * len(self.routers)
        try:
            yield
        finally:
            self.mode = None

    @contextlib.contextmanager
    def replay(self, experts: torch.Tensor, real: torch.Tensor, count: bool = True):
        """Routes as `experts` (N, L, k) from here until `end`; counts mismatches over `real` (N,) while the
        block runs (the forward) when `count`."""
        self.mode, self.replayed, self.real, self.counting = "replay", experts, real, count
        if self.mismatched is None:
            self.reset_counts(real.device)
        try:
            yield
        finally:
            self.counting = False

    def end(self) -> None:
        self.mode = self.replayed = self.real = None

    def stacked(self) -> torch.Tensor:
        """The recorded experts, (N, L, k), as int16 (int32 past 32767 experts)."""
        experts = torch.stack(self.recorded, dim=1)
        return experts.to(torch.int16 if num_experts(self.lm.config) < 2**15 else torch.int32)


def load_balancing_loss(lm, logits: list[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor:
    """HF's own auxiliary load-balancing loss of the model's family (`load_balancing_loss_func` of its modeling
    module: num_experts x sum over experts of the routed fraction x the mean router probability, from every
    MoE layer's router logits), over the forward's tokens (`attention_mask` (B, T) for a padded layout)."""
    import sys

    fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(f"actor.router_aux_loss_coef: {type(lm).__name__}'s module has no load_balancing_loss_func")
    c = text_config(lm.config)
    return fn(tuple(logits), num_experts(c), c.num_experts_per_tok, attention_mask)
