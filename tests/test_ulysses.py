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


SP_CASES = [(2, 2), (4, 2), (4, 4)]  # world (the sp group), KV heads


def _each_exchange_and_attend(kv_heads: list[int]) -> dict:
    """`_exchange_and_attend` for each KV head count, one after the other on the same processes."""
    return {n: _exchange_and_attend(n) for n in kv_heads}


@pytest.fixture(scope="module")
def sp_runs():
    """world size -> KV heads -> `_exchange_and_attend`; each world is spawned once, on first use, for all its
    cases."""
    class Lazy(dict):
        def __missing__(self, world):
            self[world] = run_distributed(_each_exchange_and_attend, world, [n for w, n in SP_CASES if w == world])
            return self[world]
    return Lazy()


@pytest.mark.multiproc
@pytest.mark.parametrize("world,kv_heads", SP_CASES)
def test_sp_attention_equals_whole_row_attention(sp_runs, world, kv_heads):
    ok_exchange, diff = sp_runs[world][kv_heads]
    assert ok_exchange
    assert diff < 1e-6


def test_uniform_lengths_take_batched_sdpa_with_the_same_result():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 12, 8, generator=g)
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    per_seq, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=4)
    batched, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=4,
                                          uniform_lengths=True)
    torch.testing.assert_close(batched, per_seq, atol=1e-6, rtol=1e-6)


def test_attention_kwargs_detect_uniform_lengths():
    from shardrl.engine.attention import attention_kwargs

    assert attention_kwargs(torch.tensor([[0, 1, 2, 0, 1, 2]]))["uniform_lengths"]
    assert not attention_kwargs(torch.tensor([[0, 1, 2, 0, 1, 0]]))["uniform_lengths"]
