"""The policy head scores the responses only (`PolicyModel.forward`'s `score_from`, which the engine sets from
an RL batch's `response_mask`): the log-probs and entropies of response tokens, and the gradients of a loss
over them, equal those of the forward that scores every token; prompt positions read 0; and the vocabulary
projection runs on the positions that predict a response token, no others."""

from __future__ import annotations

import pytest
import torch
import transformers

import shardrl.engine.model as model_mod
from shardrl.engine.model import PolicyModel, build_causal_lm

P, R, V = 6, 5, 61


def rl_batch():
    """Left-padded prompts of width P, right-padded responses of width R (one response empty, one full)."""
    g = torch.Generator().manual_seed(0)
    prompt_lens, response_lens = [6, 3, 4, 1], [5, 2, 0, 3]
    ids = torch.randint(1, V, (4, P + R), generator=g)
    mask = torch.zeros(4, P + R, dtype=torch.long)
    response_mask = torch.zeros(4, R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, P - p:P + r] = 1
        response_mask[b, :r] = 1
    return ids * mask, mask, response_mask


def policy(chunk_size=3):
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                      max_position_embeddings=64)
    return PolicyModel(build_causal_lm(config, None, "cpu", torch.float64, seed=3, attn_implementation="sdpa"),
                       chunk_size=chunk_size)


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_response_scores_and_gradients_equal_the_full_head(remove_padding, temperature):
    ids, mask, response_mask = rl_batch()
    loss_mask = torch.cat([torch.zeros(4, P, dtype=torch.long), response_mask], 1).double()
    weights = torch.linspace(0.5, 2.0, P + R, dtype=torch.float64)[None]
    results = []
    for score_from in (None, P):
        module = policy()
        out = module(ids, mask, remove_padding=remove_padding, temperature=temperature, with_entropy=True,
                     score_from=score_from)
        # a loss over the response tokens through both outputs (the entropy bonus's gradient too)
        loss = ((out["log_probs"] * weights + 0.1 * out["entropy"]) * loss_mask).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        results.append((out, grads))
    (full, full_grads), (resp, resp_grads) = results
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(resp[key] * loss_mask, full[key] * loss_mask, rtol=1e-10, atol=1e-12)
        assert (resp[key][:, :P] == 0).all()  # prompts are not scored
        assert (full[key][:, 1:P] * mask[:, 1:P]).abs().sum() > 0  # (the full head does score them)
    assert (resp["log_probs"] * loss_mask).abs().sum() > 1.0
    for name, g in full_grads.items():
        torch.testing.assert_close(resp_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_the_head_runs_on_response_predicting_positions_only(remove_padding, monkeypatch):
    ids, mask, response_mask = rl_batch()
    rows = []
    plain = model_mod.chunked_log_probs
    monkeypatch.setattr(model_mod, "chunked_log_probs",
                        lambda hidden, *a: rows.append(hidden.shape[0]) or plain(hidden, *a))
    with torch.no_grad():
        policy()(ids, mask, remove_padding=remove_padding, score_from=P)
        policy()(ids, mask, remove_padding=remove_padding)
    assert rows[0] == int(response_mask.sum())  # one position per response token: the one before it
    assert rows[1] == (int(mask.sum()) if remove_padding else mask.numel())


def _engine_scores(_=None):
    from shardrl.batch import Batch
    from shardrl.config.schema import EngineConfig, ModelConfig
    from shardrl.engine import build_engine
    from shardrl.testing import TINY_MODELS

    ids, mask, response_mask = rl_batch()
    seen = []
    plain = PolicyModel.forward
    PolicyModel.forward = lambda self, *a, **kw: seen.append(kw["score_from"]) or plain(self, *a, **kw)
    try:
        engine = build_engine(ModelConfig(tiny={**TINY_MODELS["qwen2"], "vocab_size": V}),
                              EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=4))
        rl = Batch({"input_ids": ids, "attention_mask": mask, "response_mask": response_mask})
        with_resp = engine.infer_batch(rl)
        whole = engine.infer_batch(Batch({"input_ids": ids, "attention_mask": mask}))
    finally:
        PolicyModel.forward = plain
    return seen, with_resp["log_probs"].cpu(), whole["log_probs"].cpu()


@pytest.mark.multiproc
def test_engine_scores_responses_of_rl_batches_only():
    """The engine passes `score_from` from the batch's `response_mask`; a batch without one is scored whole."""
    from shardrl.testing import run_distributed

    seen, with_resp, whole = run_distributed(_engine_scores, 1)
    ids, mask, response_mask = rl_batch()
    assert seen == [P, None]
    loss_mask = torch.cat([torch.zeros(4, P), response_mask.float()], 1)
    torch.testing.assert_close(with_resp * loss_mask, whole * loss_mask)
    assert (with_resp[:, :P] == 0).all() and (whole[:, 1:P] * mask[:, 1:P]).abs().sum() > 0
