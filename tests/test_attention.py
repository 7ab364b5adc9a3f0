"""Packed causal attention (`shardrl.engine.attention`) against attention written out by hand per sequence:
the padded one-call path and the per-sequence loop, outputs and gradients, with and without GQA."""

from __future__ import annotations

import pytest
import torch

import shardrl.engine.attention as attention


def reference(q, k, v, lens, scale, window=None, softcap=None):
    """softmax(q k^T * scale + causal mask) v, each sequence alone, K/V heads repeated for GQA; `window`: a
    query sees its last `window` keys; `softcap`: scores -> softcap * tanh(scores / softcap)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
        if window:
            hidden |= torch.ones(n, n, dtype=torch.bool).tril(-window)
        scores = scores.masked_fill(hidden, float("-inf"))
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


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 2.0), (4, 1.5), (20, None)])
@pytest.mark.parametrize("path", ["padded", "per_sequence"])
def test_sliding_window_and_softcap_follow_the_reference(window, softcap, path, monkeypatch):
    """HF passes `sliding_window` (Mistral, Qwen2/3, Gemma) and `softcap` (Gemma 2) to the attention function;
    the packed attention honours both (it ignored them before: wrong attention past the window)."""
    if path == "per_sequence":
        monkeypatch.setattr(attention, "PADDED_ATTENTION_MAX_SCORES", 0)
    torch.manual_seed(1)
    lens = [9, 1, 5, 9, 2]
    n, scale = sum(lens), 0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(1, 4, n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True)
    out, _ = attention.varlen_attention_forward(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu,
                                                max_length_q=max(lens), sliding_window=window, softcap=softcap)
    ref = reference(*(t[0].transpose(0, 1) for t in (q, k, v)), lens, scale, window, softcap)
    torch.testing.assert_close(out[0], ref, rtol=1e-10, atol=1e-10)
    plain = reference(*(t[0].transpose(0, 1) for t in (q, k, v)), lens, scale)
    assert window == 20 or (ref - plain).abs().max() > 1e-3  # the limits matter here (a window of 20 does not)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad((out[0] * grad).sum(), (q, k, v))
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window", "gemma2", "gemma3_text"])
def test_engine_forward_with_packed_attention_equals_hf_past_the_window(name):
    """The training engine's packed forward (`PolicyModel`, padding removed, shardrl's attention function,
    what it runs on CUDA) against HF's own forward (eager / SDPA, one sequence at a time) on models with
    sliding-window layers (and Gemma 2's soft-caps), on sequences longer than the window."""
    import transformers

    from shardrl.engine.model import PolicyModel, build_causal_lm
    from test_rollout_fast_families import FAMILIES, WINDOW, attn_of

    cls, kwargs = FAMILIES[name]
    config = cls(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256), **kwargs}, vocab_size=97)
    reference = build_causal_lm(config, None, "cpu", torch.float64, seed=1, attn_implementation=attn_of(config)).eval()
    packed = build_causal_lm(copy_config(config), None, "cpu", torch.float64, seed=1,
                             attn_implementation=attention.register_varlen_attention()).eval()
    packed.load_state_dict(reference.state_dict())
    lens = [3 * WINDOW, 5, 2 * WINDOW + 3]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (len(lens), max(lens)), generator=g)
    mask = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()  # right padding
    packed.config.use_cache = False
    with torch.no_grad():
        got = PolicyModel(packed, chunk_size=7)(ids, mask, remove_padding=True)["log_probs"]
        plain = attention._causal_varlen
        with pytest.MonkeyPatch.context() as mp:  # the same forward with the limits dropped: far off
            mp.setattr(attention, "_causal_varlen", lambda *a, window=None, softcap=None: plain(*a))
            unlimited = PolicyModel(packed, chunk_size=7)(ids, mask, remove_padding=True)["log_probs"]
        for b, n in enumerate(lens):
            logits = reference(ids[b:b + 1, :n]).logits[0]
            want = torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[b, 1:n, None])[:, 0]
            # Gemma's norms compute in fp32 whatever the model's dtype: agreement to ~1e-8, not 1e-12
            torch.testing.assert_close(got[b, 1:n], want, rtol=1e-6, atol=1e-6)
        assert (unlimited - got).abs().max() > 1e-3


def copy_config(config):
    import copy

    return copy.deepcopy(config)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (64, None), (None, 30.0), (48, 20.0)])
def test_packed_attention_on_cuda_follows_the_reference(dtype, window, softcap):
    """The CUDA paths (the varlen kernel without limits, the padded one with a window or a soft-cap) against
    the fp64 reference on the CPU, outputs and gradients, sequences longer than the window."""
    torch.manual_seed(2)
    lens = [300, 1, 77, 200]
    n, scale = sum(lens), 0.125
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, h, n, 64, dtype=torch.float64) for h in (8, 2, 2))
    args = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention.varlen_attention_forward(None, *args, None, scaling=scale, cu_seq_lens_q=cu,
                                                max_length_q=max(lens), sliding_window=window, softcap=softcap)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ref = reference(*(t[0].transpose(0, 1) for t in leaves), lens, scale, window, softcap)
    tol = dict(rtol=0, atol=2e-3) if dtype == torch.float32 else dict(rtol=0, atol=3e-2)
    torch.testing.assert_close(out[0].double().cpu(), ref, **tol)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad((out[0] * grad.to("cuda", dtype)).sum(), args)
    want = torch.autograd.grad((ref * grad).sum(), leaves)
    for g, w in zip(got, want):
        scale_w = w.abs().max()
        assert (g.double().cpu() - w).abs().max() < (5e-3 if dtype == torch.float32 else 5e-2) * scale_w


def test_the_varlen_attention_with_padding_kept_is_refused_naming_both_settings():
    """`model.attn_implementation=shardrl_varlen` reads the packed row's bounds: with `use_remove_padding=false` the
    batch is padded and the forward crashed deep inside the model; now the setting is refused up front."""
    from shardrl.engine.attention import ATTN_NAME, resolve_attn_implementation

    with pytest.raises(ValueError, match="use_remove_padding=true.*auto or sdpa"):
        resolve_attn_implementation(ATTN_NAME, remove_padding=False)
    assert resolve_attn_implementation(ATTN_NAME, remove_padding=True) == ATTN_NAME
    assert resolve_attn_implementation("auto", remove_padding=False) == "sdpa"
