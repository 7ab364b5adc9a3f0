"""Ulysses pieces: the head checks, the sequence<->head all-to-all, and attention over an sp group equal
to attention over the whole row (the engine-level equivalence is in test_engine_equivalence.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardrl.engine.attention import varlen_attention_forward
from shardrl.engine.ulysses import check_heads, head_to_seq, seq_to_head
from shardrl.testing import run_distributed


def test_head_counts_sp_cannot_serve():
    check_heads(12, 2, 4)  # 2 KV heads repeated over 4 ranks
    check_heads(12, 4, 2)
    with pytest.raises(ValueError, match=r"cannot split the model's 12 attention heads.*\[1, 2, 3, 4, 6, 12\]"):
        check_heads(12, 2, 5)
    with pytest.raises(ValueError, match="6 KV heads: one must divide the other"):
        check_heads(12, 6, 4)


def _exchange_and_attend(num_kv_heads: int):
    sp, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(sp)))
    g = torch.Generator().manual_seed(0)
    n_total, heads, dim = 12, 4, 8
    x = torch.randn(n_total, heads, dim, generator=g)
    piece = slice(r * n_total // sp, (r + 1) * n_total // sp)
    to_heads = seq_to_head(x[piece], group)
    ok_exchange = torch.equal(to_heads, x[:, r * heads // sp:(r + 1) * heads // sp]) and torch.equal(
        head_to_seq(to_heads, group), x[piece])
    q = torch.randn(1, heads, n_total, dim, generator=g, requires_grad=True)
    k = torch.randn(1, num_kv_heads, n_total, dim, generator=g, requires_grad=True)
    v = torch.randn(1, num_kv_heads, n_total, dim, generator=g, requires_grad=True)
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    full, _ = varlen_attention_forward(None, q, k, v, None, scaling=dim ** -0.5, cu_seq_lens_q=cu, max_length_q=5)
    part, _ = varlen_attention_forward(None, q[:, :, piece], k[:, :, piece], v[:, :, piece], None,
                                       scaling=dim ** -0.5, cu_seq_lens_q=cu, max_length_q=5, sp_group=group)
    return ok_exchange, float((part - full[:, piece]).abs().max())


@pytest.mark.multiproc
@pytest.mark.parametrize("world,kv_heads", [(2, 2), (4, 2), (4, 4)])
def test_sp_attention_equals_whole_row_attention(world, kv_heads):
    ok_exchange, diff = run_distributed(_exchange_and_attend, world, kv_heads)
    assert ok_exchange
    assert diff < 1e-6
