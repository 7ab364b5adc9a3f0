"""Expert parallelism: a mixture-of-experts layer's experts spread over the ranks of an `ep` process group, each
token's hidden state sent to the ranks that hold its experts and back with two all-to-alls.

In the engine (`engine.expert_parallel_size`, FSDP2):
- Mesh: the world is cut as `world = efsdp x ep` (`MeshLayout.expert_mesh`); a rank's `ep` group is the `ep`
  consecutive ranks that hold the different experts, `efsdp` the ranks that hold the same ones. Attention, norms,
  routers, embeddings and the head are FSDP-sharded over the whole world as without it; each MoE layer's experts
  are cut over `ep` (`ExpertParallelExperts`: E / ep whole experts a rank, as DTensors sharded on the expert dim)
  and FSDP-sharded over `efsdp` on their second dim, in an FSDP unit of their own. Tokens stay data-parallel over
  every rank: no rank sees another's batch except the rows its experts are asked for.
- Forward of a layer: route locally; send each (token, expert) pair's hidden state to the expert's rank
  (all-to-all, splits by destination, exchanged first); run the local experts over what arrived (one grouped
  product per projection, or the loop); send the results back (the reverse all-to-all); weight and sum each
  token's k results. Backward is the same two all-to-alls reversed (autograd through torch's functional
  collectives), so the router and the inputs get their gradients and each expert's gradient is the sum over
  every rank's tokens that chose it.
- Gradients: an expert's gradient is complete on its `ep` rank after backward; FSDP averages it over `efsdp` only
  (where the other parameters are averaged over the world), so the experts' gradients are scaled by 1 / ep on the
  way back. Clipping takes the norm over both meshes. Checkpoints (DCP) hold the experts at their global shape:
  a run resumes at another world size and `ep` (or without expert parallelism); the exported weights are whole.
- Memory: per rank, the sharded state is plain FSDP's (the experts are split over all `efsdp x ep` ranks either
  way); a layer gathers E / ep experts, not E (the ledger, `shardrl plan`, counts that).
- Not yet: HSDP, Ulysses, LoRA, offload and compile together with it (each a config error), and GPU figures (the
  all-to-all over NVLink against plain FSDP's all-gather of every expert).

The layer's numbers equal the unsharded HF experts' over the union of every rank's tokens, and the engine's the
plain loop's (tests/test_expert_parallel.py, gloo, 2 and 4 processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardrl.engine.moe import grouped_mm_usable


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of `rows` (split by `in_splits` to the group's ranks; `out_splits` arrive from each) with its
    gradient sent back the reverse way: torch's functional collective where it has one (torch >= 2.3), else the
    one `torch.distributed.nn` kept until 2.13 deprecated it."""
    try:
        from torch.distributed._functional_collectives import all_to_all_single_autograd
    except ImportError:
        from torch.distributed.nn.functional import all_to_all_single

        return all_to_all_single(rows.new_empty(sum(out_splits), *rows.shape[1:]), rows, out_splits, in_splits,
                                 group=group)
    out = all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group or dist.group.WORLD)
    return out.wait() if hasattr(out, "wait") else out


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """An HF experts module (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), `act_fn`; forward(hidden (T, H),
    top_k_index (T, k), top_k_weights (T, k)) -> (T, H)) holding only this rank's E / ep experts: experts
    [rank * E / ep, (rank + 1) * E / ep) of the `group`'s ranks. Same call, same result as the whole module run on
    every rank's tokens together."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None = None, grouped: bool | None = None):
        super().__init__()
        self.group, self.grouped = group, grouped  # grouped: None = grouped products where they run
        gate_up, down = experts.gate_up_proj, experts.down_proj
        biases = [n for n, _ in experts.named_parameters() if n.endswith("bias")]
        if biases or gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
            raise ValueError(f"expert parallelism: {type(experts).__name__} is not laid out as gate_up_proj (E, 2I, H), "
                             f"down_proj (E, H, I) without biases (got {tuple(gate_up.shape)}, {tuple(down.shape)}, "
                             f"biases {biases}); this family's experts are not supported")
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        total = gate_up.shape[0]
        if total % ep:
            raise ValueError(f"expert parallelism: {total} experts do not divide over {ep} ranks; choose an "
                             f"expert-parallel size that divides {total}")
        self.num_experts, self.ep, self.local = total, ep, total // ep
        self.first = rank * self.local
        local = slice(self.first, self.first + self.local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[local].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[local].clone())
        self.act_fn = experts.act_fn

    grad_scale = 1.0
    """What the weights' gradients are multiplied by on their way back (the engine's `_spread_experts` sets 1 / ep)."""

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (gate_up (E / ep, 2I, H), down (E / ep, H, I)): the parameters, or their local parts where
        the engine made them DTensors over the `ep` mesh (`FSDP2Engine`: sharded on the expert dimension), with
        `grad_scale` applied to their gradients."""
        def local(p):
            p = p.to_local() if isinstance(p, DTensor) else p
            return p if self.grad_scale == 1.0 else _ScaleGrad.apply(p, self.grad_scale)

        return local(self.gate_up_proj), local(self.down_proj)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        experts = top_k_index.reshape(-1)  # pair j: token j // k's (j % k)-th expert
        order = experts.argsort(stable=True)  # pairs grouped by expert, so by destination rank
        send_counts = torch.bincount(experts // self.local, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = hidden_states[order // k]
        arrived = _exchange(rows, recv, send, self.group)
        arrived_ids = experts.new_empty(sum(recv))
        dist.all_to_all_single(arrived_ids, experts[order].contiguous(), recv, send, group=self.group)
        done = self._local_experts(arrived, arrived_ids - self.first)
        back = _exchange(done, send, recv, self.group)
        out = torch.empty_like(back)
        out[order] = back  # back in pair order
        weighted = out * top_k_weights.reshape(-1, 1).to(out.dtype)
        return weighted.view(t, k, hidden_states.shape[1]).sum(1).to(hidden_states.dtype)

    def _local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each arrived row through its local expert (rows from several ranks, each source's sorted by expert, not
        the whole): one grouped product per projection (`torch._grouped_mm`) where it runs, else a loop."""
        order = local_ids.argsort(stable=True)
        sorted_rows, sorted_ids = rows[order], local_ids[order]
        counts = torch.bincount(sorted_ids, minlength=self.local)
        gate_up, down = self.local_weights()
        grouped = grouped_mm_usable(rows, gate_up, down) if self.grouped is None else self.grouped
        if rows.shape[0] and grouped:
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(sorted_rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            out = torch._grouped_mm(self.act_fn(gate) * up, down.transpose(1, 2), offs=offs)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                part = sorted_rows[start:start + n]
                gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
                parts.append(F.linear(self.act_fn(gate) * up, down[e]))
                start += n
            out = torch.cat(parts) if parts else rows.new_empty(0, down.shape[1])
        result = torch.empty_like(out)
        result[order] = out
        return result


def experts_modules(module: nn.Module) -> list[str]:
    """The names of `module`'s HF experts modules (those with a 3-D `gate_up_proj` and `down_proj`)."""
    return [n for n, m in module.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3]


def apply_expert_parallel(lm: nn.Module, group: dist.ProcessGroup | None = None) -> list[ExpertParallelExperts]:
    """Replaces every MoE layer's experts module of `lm` (an HF model, or one of its blocks) by its expert-parallel
    share over `group`; returns the new modules."""
    out = []
    for name in experts_modules(lm):
        parent, _, child = name.rpartition(".")
        holder = lm.get_submodule(parent) if parent else lm
        out.append(ExpertParallelExperts(getattr(holder, child), group))
        setattr(holder, child, out[-1])
    return out
