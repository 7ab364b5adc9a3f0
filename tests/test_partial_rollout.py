"""Partial rollouts (asynchronous RL): weights that arrive while a rollout generates serve the tokens after
that moment, each token records the version that sampled it, and nothing before the swap changes. Both
backends, CPU, fp32.

The check is exact because the new weights differ from the old only in the output head: the KV cache of the
tokens before the swap (kept, not recomputed) is then the same under both versions, so every token's sampled
log-prob must equal a plain forward of the version that sampled it."""

from __future__ import annotations

import copy

import pytest
import torch

from shardrl.rollout import SamplingParams
from test_rollout_fast import encode, make_rollout, reference_model, tok  # noqa: F401 (tok: the fixture)
from test_rollout_hf import recomputed_log_probs


# hf: 6 prompts in chunks of 4 and 2, the hook runs at every step (the swap lands inside the first chunk, the
# second starts under the new weights); fast: 12 rows through 4 slots, the hook runs every 3 decode steps
@pytest.mark.parametrize("backend,kwargs,swap_at", [("hf", dict(micro_batch_size=4), 8),
                                                    ("fast", dict(max_batch=4, sync_every=3), 4)])
def test_weights_swapped_mid_generation_serve_the_tokens_after(tok, backend, kwargs, swap_at):
    old = reference_model(tok, seed=1)  # qwen2: an untied head
    new = copy.deepcopy(old)
    new.lm_head.weight.data.mul_(-1.5)
    rollout = make_rollout(backend, tok, old, **kwargs)
    ids, mask = encode(tok)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=5)
    plain = rollout.generate(ids, mask, sampling)
    assert plain.token_version is None

    calls = [0]

    def hook() -> int:
        calls[0] += 1
        if calls[0] == swap_at:
            rollout.load_weights([("lm_head.weight", new.lm_head.weight)])
        return int(calls[0] >= swap_at)

    rollout.weight_hook = hook
    out = rollout.generate(ids, mask, sampling)
    versions, real = out.token_version, out.response_mask.bool()
    assert torch.equal(versions >= 0, real)  # -1 on padding only
    first, last = versions[:, 0], versions.masked_fill(~real, -2).max(1).values
    split = (first == 0) & (last == 1)
    # the rows in flight at the swap change version once, in their middle; rows that started after it are new
    assert 2 <= int(split.sum()) < len(out) and bool((first == 1).any())
    assert bool(((versions[:, 1:] >= versions[:, :-1]) | ~real[:, 1:]).all())

    # each token's log-prob is the full forward of the version that sampled it
    width = ids.shape[1]
    want = torch.where(versions == 1, recomputed_log_probs(new, out, 1.0)[:, width:],
                       recomputed_log_probs(old, out, 1.0)[:, width:])
    torch.testing.assert_close(out.sampled_log_probs[real], want[real], atol=1e-4, rtol=0)
    # the tokens before the swap are the plain run's (the same seed draws the same noise)
    before = versions == 0
    assert torch.equal(out.response_ids[before], plain.response_ids[before])
    assert not torch.equal(out.response_ids[split], plain.response_ids[split])
    assert torch.equal(out.to_batch()["token_version"], versions)
