"""The fast rollout's routed experts (mixtures of experts: Qwen3-MoE, Mixtral, OLMoE): HF's top-k router, the
experts as grouped matrix products (or a loop, or every expert on every token where a CUDA graph cannot take
grouped products), and the modules that hold their weights under HF's names."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardrl.engine.moe import grouped_mm_usable

logger = logging.getLogger(__name__)


def dense_experts(x, weights, experts, gate_up, down, act: str):
    """The routed experts' weighted sum with static shapes and no grouped products: every expert on every token,
    the experts a token did not choose weighted 0 (weights, experts (T, k) from `route`)."""
    gate, up = torch.einsum("th,eoh->eto", x, gate_up).chunk(2, dim=-1)
    gated = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    y = torch.einsum("eti,ehi->eth", gated, down)  # (E, T, hidden)
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    return (y * dense.t()[..., None]).sum(0, dtype=torch.float32).to(x.dtype)


_DENSE_WARNED: list[bool] = []


def _warn_dense_experts(num_experts: int, top_k: int):
    if not _DENSE_WARNED:
        _DENSE_WARNED.append(True)
        logger.warning("the fast rollout's MoE layers run every expert on every token on this GPU (%d / %d "
                       "times the expert work): torch._grouped_mm needs bf16 on an SM80+ GPU and 16-byte aligned "
                       "rows", num_experts, top_k)


def route(x, router_w, top_k: int, normalize: bool, fp32_weights: bool):
    """HF's top-k router: softmax over the experts in fp32, the k largest, renormalized to sum 1 when `normalize`;
    (weights (T, k) in fp32 or x's dtype, experts (T, k))."""
    probs = F.linear(x, router_w).float().softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights if fp32_weights else weights.to(x.dtype)), experts


def moe_mlp(x, router_w, gate_up, down, act: str, top_k: int, normalize: bool, fp32_weights: bool,
            with_route: bool = False):
    """Routed experts, as HF's `*SparseMoeBlock`: each token's k experts' SwiGLU outputs, weighted by the
    router, summed. x (T, hidden); router_w (E, hidden); gate_up (E, 2I, hidden) (gate rows, then up rows);
    down (E, hidden, I). The (token, expert) pairs are sorted by expert and each projection is one grouped
    matrix product over them (`torch._grouped_mm`; static shapes, so a decode step captures in a CUDA graph);
    where it cannot run, a loop over the experts computes the same. `with_route`: (output, experts (T, k))."""
    t, num_experts = x.shape[0], gate_up.shape[0]
    weights, experts = route(x, router_w, top_k, normalize, fp32_weights)
    grouped = grouped_mm_usable(x, gate_up, down)
    if not grouped and x.is_cuda:
        # on a GPU without grouped products (fp32, or rows not 16-byte aligned): every expert on every token
        # (static shapes, so a decode step still captures in a CUDA graph; E / k times the work), the experts a
        # token did not choose weighted 0. Decided by the operands alone, so the warm-up before a capture traces
        # the branch the capture runs.
        _warn_dense_experts(num_experts, top_k)
        out = dense_experts(x, weights, experts, gate_up, down, act)
        return (out, experts) if with_route else out
    flat = experts.reshape(-1)  # (T * k,): pair j is token j // k's (j % k)-th choice
    order = flat.argsort(stable=True)
    token = order // top_k
    rows = x[token]  # (T * k, hidden), grouped by expert
    if grouped:
        counts = F.one_hot(flat, num_experts).sum(0)  # (E,), static shape: no host sync
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        gated = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
        out = torch._grouped_mm(gated, down.transpose(1, 2), offs=offs)
    else:
        out = rows.new_empty(rows.shape)
        sorted_experts = flat[order]
        for e in range(num_experts):
            mask = sorted_experts == e
            gate, up = F.linear(rows[mask], gate_up[e]).chunk(2, dim=-1)
            gated = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
            out[mask] = F.linear(gated, down[e])
    # as HF's grouped path: weighted, back in token order, each token's k summed (accumulated in fp32, and
    # deterministic: no atomic adds)
    weighted = out * weights.reshape(-1)[order, None]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    out = weighted[inverse].view(t, top_k, -1).sum(1).to(x.dtype)
    return (out, experts) if with_route else out


class Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts_of(config), config.hidden_size))


class Experts(nn.Module):
    """A layer's experts as HF stores them: gate_up_proj (E, 2I, hidden), down_proj (E, hidden, I)."""

    def __init__(self, config):
        super().__init__()
        e, h = num_experts_of(config), config.hidden_size
        i = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoE(nn.Module):
    """Routed experts in place of the MLP (`moe_mlp`), under HF's names (`mlp.gate.weight`, `mlp.experts.*`)."""

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)


def num_experts_of(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts
