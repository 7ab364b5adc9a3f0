"""The rollouts' likeliest tokens (`SamplingParams.top_logprobs`, a server's `top_logprobs`, issue 59): the fast and
HF rollouts give, at each response token, the k likeliest tokens and their log-probs in the distribution the sampled
token's log-prob is reported in (checked against a plain forward of the model), the sampled token's entry carries
exactly its sampled log-prob, and what is sampled (ids and log-probs) is the same with and without them at a seed."""

from __future__ import annotations

import pytest
import torch

from shardrl.rollout import RolloutOutput, SamplingParams
from test_rollout_fast import encode, make_rollout, reference_model

K = 5


@pytest.fixture(scope="module")
def tok():
    from shardrl.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def forward_top(model, out, row: int, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, k) ids and log-probs of the k likeliest tokens at each of row `row`'s response positions, from a plain
    forward of `model` over its prompt and response: log softmax(logits / temperature)."""
    prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
    length = int(out.response_mask[row].sum())
    reply = out.response_ids[row, :length]
    with torch.no_grad():
        logits = model(torch.cat([prompt, reply])[None]).logits[0, len(prompt) - 1:-1].float()  # (L, V)
    values, ids = (logits / temperature).log_softmax(-1).topk(k, -1)
    return ids, values


SAMPLINGS = [SamplingParams(n=2, temperature=0.7, top_k=4, max_new_tokens=10, seed=3),
             SamplingParams(n=1, greedy=True, max_new_tokens=10),
             SamplingParams(n=2, temperature=1.3, max_new_tokens=10, seed=5, raw_log_probs=True),
             SamplingParams(n=2, temperature=0.9, max_new_tokens=10, seed=6)]
KINDS = ["truncated", "greedy", "raw", "sample"]


@pytest.mark.parametrize("name", ["fast", "hf"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=KINDS)
def test_top_logprobs_are_the_forwards_and_leave_the_samples_alone(tok, name, sampling):
    model = reference_model(tok, seed=1)
    # (max_batch 3 of 12 rows, min_width 1: rows join as others end and the slots compact, on the fast rollout)
    kwargs = dict(max_batch=3, sync_every=2, min_width=1) if name == "fast" else {}
    check_top_logprobs(model, make_rollout(name, tok, model, **kwargs), sampling, *encode(tok))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=KINDS)
def test_top_logprobs_in_cuda_graphs_with_the_fused_sampler(tok, sampling):
    """CUDA's defaults: graphs, compiled, the Triton attention and (plain sampling, greedy) the fused sampler; and
    after release/resume, which recaptures the graphs."""
    model = reference_model(tok, seed=1, hidden_size=64)  # (head dim 16: the Triton kernel's smallest)
    rollout = make_rollout("fast", tok, model, "cuda", max_batch=3, sync_every=2, min_width=1)
    ids, mask = (t.cuda() for t in encode(tok))
    check_top_logprobs(model, rollout, sampling, ids, mask, atol=1e-3)
    rollout.release()
    rollout.resume()
    check_top_logprobs(model, rollout, sampling, ids, mask, atol=1e-3)


def check_top_logprobs(model, rollout, sampling, ids, mask, atol: float = 1e-4):
    def on_cpu(out: RolloutOutput) -> RolloutOutput:
        return RolloutOutput(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(out).items()})

    plain = on_cpu(rollout.generate(ids, mask, sampling))
    out = on_cpu(rollout.generate(ids, mask, SamplingParams(**{**vars(sampling), "top_logprobs": K})))
    assert plain.top_ids is None and plain.top_log_probs is None  # (nothing asked, nothing made)
    assert torch.equal(out.response_ids, plain.response_ids) and torch.equal(out.response_mask, plain.response_mask)
    assert torch.equal(out.sampled_log_probs, plain.sampled_log_probs)  # (bit for bit)
    assert out.top_ids.shape == out.top_log_probs.shape == (*out.response_ids.shape, K)
    mask_ = out.response_mask.bool()
    # the sampled token's entry, where it is among the k, is its sampled log-prob exactly
    sampled = out.top_ids == out.response_ids[..., None]
    at = sampled & mask_[..., None]
    assert bool(at.any())
    assert torch.equal(out.top_log_probs[at], out.sampled_log_probs[..., None].expand_as(sampled)[at])
    assert bool((out.top_log_probs[..., :-1] >= out.top_log_probs[..., 1:])[mask_].all())  # (best first)
    for row in range(len(out)):
        more_ids, more = forward_top(model, out, row, sampling.logprob_temperature, K + 1)
        want_ids, want, length = more_ids[..., :K], more[..., :K], more.shape[0]
        # the same ids in the same order, but where two alternatives' log-probs are within atol of each other
        # (the k-th and the (k+1)-th included): there the order is the rounding's (CUDA graphs, bf16 matmuls)
        tie = (more[..., :-1] - more[..., 1:]) <= atol
        loose = torch.zeros_like(want_ids, dtype=torch.bool)
        loose |= tie[..., :K]
        loose[..., 1:] |= tie[..., :K - 1]
        got_ids = out.top_ids[row, :length]
        assert bool(((got_ids == want_ids) | loose).all()), (row, got_ids, want_ids)
        torch.testing.assert_close(out.top_log_probs[row, :length], want, atol=atol, rtol=0)
