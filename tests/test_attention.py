"""Packed causal attention (`shardrl.engine.attention`) against attention written out by hand per sequence:
the padded one-call path and the per-sequence loop, outputs and gradients, with and without GQA."""

from __future__ import annotations

import pytest
import torch

import shardrl.engine.attention as attention


def reference(q, k, v, lens, scale):
    """softmax(q k^T * scale + causal mask) v, each sequence alone, K/V heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("path", ["padded", "loop"])
def test_packed_attention_equals_attention_per_sequence(kv_heads, path, monkeypatch):
    if path == "loop":
        monkeypatch.setattr(attention, "PADDED_ATTENTION_MAX_SCORES", 0)
    torch.manual_seed(0)
    lens = [5, 1, 9, 3, 9, 2]
    n, scale = sum(lens), 0.3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(n, 4, 8, dtype=torch.float64)
    out = attention._causal_varlen(q, k, v, cu, max(lens), scale)
    ref = reference(q, k, v, lens, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref * grad_out).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert w.abs().max() > 0.1
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
