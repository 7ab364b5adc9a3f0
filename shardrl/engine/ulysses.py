"""Ulysses sequence parallelism: a packed row of N tokens is cut into `sp` contiguous pieces, one per rank
of an sp group. Everything but attention is per token and runs on the local piece; attention turns the
sequence-sharded q/k/v into head-sharded ones over the whole row with one all-to-all, runs the varlen
kernel on its heads, and turns the output back with another.

Heads: rank r of the group takes query heads [r*H/sp, (r+1)*H/sp). KV heads are split the same way when
there are at least `sp` of them; with fewer, each is repeated so every rank holds the one its query heads
read (GQA groups are contiguous, so query head i reads KV head i // (H / H_kv)).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    if num_heads % sp != 0:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} cannot split the model's {num_heads} attention heads evenly; "
            f"choose an sp that divides {num_heads} (e.g. {[d for d in range(1, num_heads + 1) if num_heads % d == 0]})"
        )
    if num_kv_heads % sp != 0 and sp % num_kv_heads != 0:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} and the model's {num_kv_heads} KV heads: one must divide the other "
            f"(KV heads are split over sp ranks, or repeated when there are fewer of them than sp)"
        )


class _AllToAll(torch.autograd.Function):
    """(sp, ...) -> (sp, ...): chunk i goes to rank i; its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # chunk-major memory; `out` must be laid out the same way
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(n, H, D) this rank's tokens, all heads -> (sp*n, H/sp, D) all tokens, this rank's heads."""
    sp = dist.get_world_size(group)
    n, h, d = x.shape
    chunks = x.reshape(n, sp, h // sp, d).transpose(0, 1)  # (sp, n, H/sp, D)
    return _AllToAll.apply(chunks, group).reshape(sp * n, h // sp, d)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(sp*n, h, D) all tokens, this rank's heads -> (n, sp*h, D) this rank's tokens, all heads."""
    sp = dist.get_world_size(group)
    total, h, d = x.shape
    chunks = _AllToAll.apply(x.reshape(sp, total // sp, h, d), group)  # (sp, n, h, D): rank i's heads
    return chunks.transpose(0, 1).reshape(total // sp, sp * h, d)


def expand_kv_heads(kv: torch.Tensor, sp: int) -> torch.Tensor:
    """(n, H_kv, D) -> (n, max(H_kv, sp), D): repeat KV heads when there are fewer than sp."""
    h_kv = kv.shape[1]
    return kv if h_kv % sp == 0 else kv.repeat_interleave(sp // math.gcd(sp, h_kv), dim=1)


class _GatherSeq(torch.autograd.Function):
    """All-gather the sp pieces of a per-token tensor along dim 0. Every rank then computes the same loss
    of the whole row; backward keeps only this rank's slice of the gradient (not the sum over ranks),
    so each token's gradient is counted once, on the rank that holds it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


def pad_to_multiple(ids: torch.Tensor, pos: torch.Tensor, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends a dummy sequence so N divides by sp; its outputs are dropped after the gather."""
    extra = -ids.numel() % sp
    if extra == 0:
        return ids, pos
    return (torch.cat([ids, ids.new_zeros(extra)]),
            torch.cat([pos, torch.arange(extra, device=pos.device, dtype=pos.dtype)]))
