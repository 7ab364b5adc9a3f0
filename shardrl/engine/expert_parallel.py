"""Expert parallelism: a mixture-of-experts layer's experts spread over the ranks of an `ep` process group, each
token's hidden state sent to the ranks that hold its experts and back with two all-to-alls.

The plan for several GPUs (what this module builds, and what is left to the engine):
- Mesh: the data-parallel ranks of a replica are cut as `dp_shard = ep x efsdp`; the `ep` group of a rank is
  the `ep` ranks that hold the different experts, `efsdp` the ranks that hold the same ones. Attention, norms,
  routers, embeddings and the head are FSDP-sharded over all of `dp_shard` as today; each MoE layer's experts
  are first cut over `ep` (`ExpertParallelExperts`: E / ep whole experts a rank) and then FSDP-sharded over
  `efsdp`. Tokens stay data-parallel over every rank: no rank sees another's batch except the rows its experts
  are asked for.
- Forward of a layer: route locally; send each (token, expert) pair's hidden state to the expert's rank
  (all-to-all, splits by destination, exchanged first); run the local experts over what arrived (one grouped
  product per projection, or the loop); send the results back (the reverse all-to-all); weight and sum each
  token's k results. Backward is the same two all-to-alls reversed (`torch.distributed.nn.functional`), so the
  router and the inputs get their gradients and each expert's gradient is the sum over every rank's tokens.
- Gradients: the experts' gradients are complete on their `ep` rank after backward (every token routed to them
  came there); they are reduced over `efsdp` only. The other parameters' gradients are reduced over all of
  `dp_shard`, as without expert parallelism.
- Left to build: the engine's `ep` mesh axis and config key, FSDP2 wrapping with the experts on the `efsdp`
  sub-mesh, the full-weight export and checkpoints gathering the experts over `ep`, the fast rollout (which keeps
  every expert: the export gathers them), and GPU figures (all-to-all over NVLink against the all-gather of
  plain FSDP).

The layer's numbers equal the unsharded HF experts' over the union of every rank's tokens (tests/test_moe.py,
gloo, 2 and 4 processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from shardrl.engine.moe import grouped_mm_usable


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
        arrived = all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send, group=self.group)
        arrived_ids = experts.new_empty(sum(recv))
        dist.all_to_all_single(arrived_ids, experts[order].contiguous(), recv, send, group=self.group)
        done = self._local_experts(arrived, arrived_ids - self.first)
        back = all_to_all_single(done.new_empty(rows.shape), done, send, recv, group=self.group)
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
        grouped = grouped_mm_usable(rows, self.gate_up_proj, self.down_proj) if self.grouped is None else self.grouped
        if rows.shape[0] and grouped:
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(sorted_rows, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            out = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                part = sorted_rows[start:start + n]
                gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
                parts.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
                start += n
            out = torch.cat(parts) if parts else rows.new_empty(0, self.down_proj.shape[1])
        result = torch.empty_like(out)
        result[order] = out
        return result


def apply_expert_parallel(lm: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Replaces every MoE layer's experts module of an HF model (the modules with 3-D `gate_up_proj` and
    `down_proj`) by its expert-parallel share over `group`; returns how many were replaced."""
    names = [n for n, m in lm.named_modules()
             if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3]
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = lm.get_submodule(parent) if parent else lm
        setattr(holder, child, ExpertParallelExperts(getattr(holder, child), group))
    return len(names)
