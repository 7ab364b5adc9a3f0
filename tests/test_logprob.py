"""Chunked log-probs and entropy equal the plain full-vocab computation, in value and gradient; packing
removes padding and puts values back where they came from."""

from __future__ import annotations

import pytest
import torch

from shardrl.engine.logprob import chunked_log_probs, next_token_log_probs, pack, unpack

N, H, V = 7, 5, 11


def make_inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, targets


def reference(hidden, weight, bias, targets, temperature=1.0):
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (N, V)
    p = logp_all.exp()
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(p * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, N, N + 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_values_match_full_log_softmax(chunk_size, temperature, bias):
    hidden, weight, b, targets = make_inputs(bias=bias)
    ref_lp, ref_ent = reference(hidden, weight, b, targets, temperature)
    lp, ent = chunked_log_probs(hidden, weight, b, targets, temperature, chunk_size, with_entropy=True)
    assert lp.shape == (N,) and ent.shape == (N,)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    assert (ent > 0).all() and (ent <= torch.log(torch.tensor(float(V))) + 1e-6).all()
    lp2, ent2 = chunked_log_probs(hidden, weight, b, targets, temperature, chunk_size, with_entropy=False)
    assert ent2 is None
    torch.testing.assert_close(lp2, ref_lp, rtol=1e-5, atol=1e-6)


def test_temperature_changes_the_numbers():
    hidden, weight, b, targets = make_inputs()
    lp1, _ = chunked_log_probs(hidden, weight, b, targets, 1.0, 3)
    lp2, _ = chunked_log_probs(hidden, weight, b, targets, 2.0, 3)
    assert (lp1 - lp2).abs().max() > 1e-2
    torch.testing.assert_close(lp2, reference(hidden * 0.5, weight, b * 0.5, targets)[0])


def test_bf16_inputs_give_fp32_log_probs():
    hidden, weight, b, targets = make_inputs()
    lp, ent = chunked_log_probs(hidden.bfloat16(), weight.bfloat16(), b.bfloat16(), targets, chunk_size=3,
                                with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_input(dtype):
    hidden, weight, b, targets = make_inputs(dtype=dtype)
    lp, ent = chunked_log_probs(hidden[:0], weight, b, targets[:0], chunk_size=3, with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    assert lp.dtype == ent.dtype == dtype


def test_one_token_row_still_in_the_graph():
    """A rank's placeholder micro-batch is one token: nothing is scored, but its outputs (entropy
    included) must exist and reach the weights, so its backward runs like the other ranks'."""
    hidden, weight, b, _ = make_inputs()
    h, w = hidden[:1].clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = next_token_log_probs(h, torch.tensor([3]), w, None, torch.tensor([True]), 1.0, 4, True)
    assert lp.tolist() == [0.0] and ent.tolist() == [0.0]
    assert lp.requires_grad and ent.requires_grad
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(h.grad, torch.zeros_like(h))


@pytest.mark.parametrize("chunk_size", [1, 3, N, N + 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])  # checkpointed chunks / the log-prob-only function
def test_gradients_match_unchunked(chunk_size, temperature, with_entropy):
    hidden, weight, b, targets = make_inputs(dtype=torch.float64, seed=1)
    g = torch.Generator().manual_seed(2)
    w_lp = torch.randn(N, generator=g, dtype=torch.float64)  # a weighted sum, so each token's grad counts
    w_ent = torch.randn(N, generator=g, dtype=torch.float64) * with_entropy

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, b)]
        lp, ent = fn(*leaves)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if ent is not None else 0.0)
        loss.backward()
        return lp.detach(), [t.grad for t in leaves]

    lp, got = grads(lambda h, w, bb: chunked_log_probs(h, w, bb, targets, temperature, chunk_size, with_entropy))
    ref_lp, want = grads(lambda h, w, bb: reference(h, w, bb, targets, temperature))
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    for name, a, e in zip(["hidden", "weight", "bias"], got, want):
        assert a.abs().max() > 1e-3, name
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("bias", [True, False])
def test_log_prob_function_passes_gradcheck(bias):
    """The log-prob-only path has a hand-written backward: check it against finite differences (fp64)."""
    hidden, weight, b, targets = make_inputs(dtype=torch.float64, bias=bias, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, b) if t is not None]

    def fn(*xs):
        return chunked_log_probs(xs[0], xs[1], xs[2] if bias else None, targets, 0.8, 3)[0]

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("triton_head", [True, False])
def test_cuda_kernels_match_eager(dtype, tol, with_entropy, triton_head, monkeypatch):
    """On CUDA the log-normalizer (and entropy) and the logits' gradient run as Triton kernels (or, with
    TRITON_HEAD off, compiled torch): same values and gradients as the plain full-vocab computation, with a
    vocabulary and chunking of realistic shape."""
    import shardrl.engine.logprob as logprob

    monkeypatch.setattr(logprob, "TRITON_HEAD", triton_head)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 3000, 64, 50_000
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    w_lp = torch.randn(n, device="cuda", generator=g)
    w_ent = torch.randn(n, device="cuda", generator=g) * with_entropy

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
        lp, ent = fn(*leaves)
        (lp.float() * w_lp + (ent.float() * w_ent if with_entropy else 0.0)).sum().backward()
        return lp.detach().float(), ent, [t.grad.float() for t in leaves]

    def reference_fn(hh, ww):
        log_p = torch.log_softmax((hh @ ww.T).float() / 0.9, -1)
        return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    lp, ent, got = grads(lambda hh, ww: chunked_log_probs(hh, ww, None, targets, 0.9, 1024, with_entropy))
    ref_lp, ref_ent, want = grads(reference_fn)
    torch.testing.assert_close(lp, ref_lp, rtol=tol, atol=tol)
    if with_entropy:
        torch.testing.assert_close(ent.detach().float(), ref_ent.detach(), rtol=tol, atol=tol)
    for a, e in zip(got, want):
        assert (a - e).norm() / e.norm() < tol
    with torch.no_grad():  # inference (old and reference log-probs) takes the same compiled normalizer
        torch.testing.assert_close(chunked_log_probs(hidden, weight, None, targets, 0.9, 1024)[0].float(), ref_lp,
                                   rtol=tol, atol=tol)


def test_checkpointing_only_under_autograd():
    hidden, weight, b, targets = make_inputs()
    with torch.no_grad():
        lp, _ = chunked_log_probs(hidden.requires_grad_(), weight, b, targets, chunk_size=2)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, reference(hidden.detach(), weight, b, targets)[0])


def padded_batch(side: str):
    lengths = [4, 1, 6, 3]
    B, T = len(lengths), 6
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, T - n:] = 1
        else:
            mask[i, :n] = 1
    input_ids = (torch.arange(B * T).view(B, T) + 1) * mask  # distinct ids, 0 at padding
    return input_ids, mask, lengths


@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_unpack_round_trip(side):
    input_ids, mask, lengths = padded_batch(side)
    packed = pack(input_ids, mask)
    n = sum(lengths)
    assert packed.input_ids.shape == (1, n) and packed.position_ids.shape == (1, n)
    assert packed.shape == (4, 6)
    # real tokens in row-major order, and positions restarting at 0 for each sequence
    assert packed.input_ids[0].tolist() == input_ids[mask.bool()].tolist()
    assert (packed.input_ids > 0).all()
    assert packed.position_ids[0].tolist() == [p for n_i in lengths for p in range(n_i)]

    values = packed.input_ids[0].double() * 0.5 - 3.0  # (n,) any per-token value
    out = unpack(values, packed)
    assert out.shape == (4, 6) and out.dtype == torch.float64
    expected = torch.where(mask.bool(), input_ids.double() * 0.5 - 3.0, torch.zeros((), dtype=torch.float64))
    assert torch.equal(out, expected)

    # the gradient flows back to exactly the packed values
    v = values.clone().requires_grad_(True)
    (unpack(v, packed) * torch.arange(24.0, dtype=torch.float64).view(4, 6)).sum().backward()
    assert torch.equal(v.grad, torch.arange(24.0, dtype=torch.float64).view(4, 6)[mask.bool()])


@pytest.mark.parametrize("side", ["left", "right"])
def test_next_token_log_probs_alignment(side):
    input_ids, mask, lengths = padded_batch(side)
    ids = (input_ids % V) * mask  # vocab-sized ids
    packed = pack(ids, mask)
    n = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    seq_start = packed.position_ids[0] == 0
    tok = packed.input_ids[0]

    lp, ent = next_token_log_probs(hidden, tok, weight, bias, seq_start, 0.9, 2, True)
    assert lp.shape == (n,) and ent.shape == (n,)
    full = torch.log_softmax((hidden @ weight.T + bias) / 0.9, dim=-1)  # (n, V)
    starts = [0]
    for n_i in lengths[:-1]:
        starts.append(starts[-1] + n_i)
    assert seq_start.nonzero().squeeze(-1).tolist() == starts
    for t in range(n):
        if t in starts:
            assert lp[t] == 0 and ent[t] == 0
        else:
            # the log-prob of token t comes from the hidden state at t-1, within the same sequence
            assert torch.isclose(lp[t], full[t - 1, tok[t]], rtol=1e-12, atol=1e-12), t
            p = full[t - 1].exp()
            assert torch.isclose(ent[t], -(p * full[t - 1]).sum(), rtol=1e-12, atol=1e-12), t

    # back on the padded grid: zeros at padding and at each sequence's first token
    grid = unpack(lp, packed)
    first = mask.long().cumsum(-1) == 1
    assert (grid[~mask.bool() | first] == 0).all()
    assert (grid[mask.bool() & ~first] < 0).all()
    # a one-token sequence scores nothing
    assert (grid[1] == 0).all()


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_final_logit_softcap(with_entropy, grad):
    """Gemma 2's final_logit_softcapping: log p and entropy of softcap * tanh(logits / softcap), under autograd
    (with gradients) or not; a cap of 2 on logits of size ~3 changes them by far more than the tolerance."""
    hidden, weight, b, targets = make_inputs(dtype=torch.float64, seed=3)
    cap, temperature = 2.0, 0.8
    g = torch.Generator().manual_seed(4)
    w_lp, w_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)

    def capped_reference(h, w, bb):
        logits = torch.tanh((h @ w.T + bb) / cap) * cap
        logp_all = torch.log_softmax(logits / temperature, dim=-1)
        return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)

    def run(fn):
        leaves = [t.clone().requires_grad_(grad) for t in (hidden, weight, b)]
        with torch.set_grad_enabled(grad):
            lp, ent = fn(*leaves)
        if not grad:
            return lp, ent, []
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if ent is not None else 0.0)
        loss.backward()
        return lp.detach(), ent, [t.grad for t in leaves]

    lp, ent, got = run(lambda h, w, bb: chunked_log_probs(h, w, bb, targets, temperature, 3, with_entropy, cap))
    ref_lp, ref_ent, want = run(lambda h, w, bb: (lambda r: (r[0], r[1] if with_entropy else None))(
        capped_reference(h, w, bb)))
    uncapped = reference(hidden, weight, b, targets, temperature)[0]
    assert (ref_lp - uncapped).abs().max() > 0.1
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-12, atol=1e-12)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
