"""The 2025-26 algorithms against straightforward reference implementations written here, loop by loop:
rollout-training mismatch correction (rollout_is: TIS / MIS), GSPO and GSPO-token, DAPO's overlong shaping
(its dynamic sampling: tests/test_dynamic_sampling.py); with their edge cases (one-token responses, masked
sequences, responses cut at max_new_tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from shardrl.algos import POLICY_LOSSES, policy_loss
from shardrl.metrics import metric_value
from shardrl.algos.dapo import overlong_penalty
from shardrl.algos.gspo import gspo_loss, gspo_token_loss
from shardrl.algos.rollout_correction import mismatch_metrics, rollout_is_weights


def make(lengths, width=6, seed=0):
    """Responses of `lengths` tokens (left-aligned) in (B, width) tensors: log-probs, old log-probs, one
    advantage per sequence, mask."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = torch.zeros(b, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = -torch.rand(b, width, generator=g) * 2
    old = logp + 0.3 * torch.randn(b, width, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, width).clone()  # one advantage per sequence (GRPO)
    return logp, old, adv, mask


def rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


# ---------------------------------------------------------------------------------------------- rollout_is

def ref_is(old, sampled, mask, level, mode, hi, lo):
    w = torch.zeros_like(old, dtype=torch.float64)
    keep = mask.clone()
    for i, toks in enumerate(rows(mask)):
        logs = [float(old[i, t] - sampled[i, t]) for t in toks]
        for j, t in enumerate(toks):
            if level == "token":
                v = math.exp(logs[j])
            elif level == "sequence":
                v = math.exp(sum(logs))
            else:
                v = math.exp(sum(logs) / len(logs))
            if mode == "truncate":
                w[i, t] = min(v, hi)
            elif lo <= v <= hi:
                w[i, t] = v if mode == "mask" else 1.0  # reject: rejection alone, no weight
            else:
                keep[i, t] = 0
    return w, keep


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "reject"])
def test_rollout_is_weights_match_reference(level, mode):
    _, old, _, mask = make([6, 1, 3, 0, 5], seed=1)  # a one-token response and a fully masked row
    sampled = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    sampled[3] = 1e4  # garbage on a masked row must not leak
    w, new_mask, m = rollout_is_weights(old, sampled, mask, level, mode, 1.5, 0.7)
    want_w, want_mask = ref_is(old, sampled, mask, level, mode, 1.5, 0.7)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_mask, want_mask)
    n = mask.sum()
    if mode == "truncate":
        assert metric_value(m["truncated_frac"]) == pytest.approx(float((want_w == 1.5).sum() / n))
        assert 0 < metric_value(m["truncated_frac"]) < 1 and metric_value(m["masked_frac"]) == 0
    else:
        assert metric_value(m["masked_frac"]) == pytest.approx(float((mask - want_mask).sum() / n))
        assert 0 < metric_value(m["masked_frac"]) < 1
    assert metric_value(m["weight_mean"]) == pytest.approx(float(want_w.sum() / n), rel=1e-5)


def test_rollout_is_default_lower_bound_is_one_over_threshold():
    old = torch.zeros(1, 3)
    sampled = torch.tensor([[math.log(2.5), math.log(1.5), 0.0]])  # ratios 0.4, 0.667, 1
    _, keep, _ = rollout_is_weights(old, sampled, torch.ones(1, 3), "token", "mask", 2.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="rollout_is_level"):
        rollout_is_weights(old, sampled, torch.ones(1, 3), "seq", "mask")


def test_rollout_is_leaves_an_exactly_matched_run_unchanged():
    # CPU fp32: the sampler and the trainer agree to ~1e-7, so the corrected loss is the plain one
    logp, old, adv, mask = make([6, 2, 4, 1])
    sampled = old + 1e-7 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask", "reject"):
            w, keep, _ = rollout_is_weights(old, sampled, mask, level, mode)
            assert torch.equal(keep, mask)
            for name, fn in POLICY_LOSSES.items():
                plain, _ = fn(logp, old, adv, mask, 0.2, 0.2)
                weighted, _ = fn(logp, old, adv, mask, 0.2, 0.2, weights=w)
                assert float(weighted) == pytest.approx(float(plain), rel=1e-5, abs=1e-7), (level, mode, name)


def test_rollout_is_weights_scale_each_tokens_loss():
    logp, old, adv, mask = make([5, 3, 6])
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(4)) * mask
    for agg in ("token-mean", "seq-mean-token-mean"):
        lp = logp.clone().requires_grad_()
        loss, _ = policy_loss(lp, old, adv, mask, 0.2, 0.2, 3.0, agg, weights=w)
        pg = torch.maximum(-adv * torch.exp(lp - old), -adv * torch.clamp(torch.exp(lp - old), 0.8, 1.2))
        pg = torch.where((adv < 0), torch.minimum(pg, -adv * 3.0), pg) * w
        want = (pg * mask).sum() / mask.sum() if agg == "token-mean" else ((pg * mask).sum(-1) / mask.sum(-1)).mean()
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)


def test_rollout_is_mismatch_metrics():
    _, old, _, mask = make([4, 1, 0, 6], seed=5)
    sampled = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(6))
    m = mismatch_metrics(old, sampled, mask)
    diffs = [[float(sampled[i, t] - old[i, t]) for t in toks] for i, toks in enumerate(rows(mask))]
    flat = [d for r in diffs for d in r]
    assert metric_value(m["logprob_abs_diff"]) == pytest.approx(sum(map(abs, flat)) / len(flat), rel=1e-6)
    assert float(m["logprob_abs_diff_max"]) == pytest.approx(max(map(abs, flat)), rel=1e-6)
    per_seq = [sum(r) for r in diffs if r]  # the empty row is no sequence
    assert metric_value(m["kl"]) == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-6)
    k3 = [math.exp(-d) - 1 + d for d in flat]
    assert metric_value(m["k3_kl"]) == pytest.approx(sum(k3) / len(k3), rel=1e-5)


def test_icepop_and_geometric_masking_drop_the_gradient_of_what_leaves_the_band():
    # IcePop (token level) and geometric-mean sequence masking: a dropped token gives no gradient, the loss is the
    # mean over the kept tokens, and masked_frac counts the dropped ones
    _, old, adv, mask = make([6, 4, 5], seed=13)
    sampled = old.clone()
    sampled[0, 2] = old[0, 2] - 2.0  # one token far off: ratio e^2 > 1.5, its sequence's geometric mean e^(1/3) in
    sampled[1, :4] = old[1, :4] + 0.3  # a whole sequence a little off: e^-0.3 < 0.8, each token and their mean
    row1 = [(1, t) for t in range(4)]
    for level, dropped in (("token", [(0, 2)] + row1), ("geometric", row1)):
        for mode in ("mask", "reject"):
            w, keep, m = rollout_is_weights(old, sampled, mask, level, mode, 1.5, 0.8)
            lp = old.clone().requires_grad_()  # PPO's ratio 1: nothing clipped, every kept token has a gradient
            loss, _ = policy_loss(lp, old, adv, keep, 0.2, 0.2, 3.0, "token-mean", weights=w)
            loss.backward()
            for i, t in dropped:
                assert keep[i, t] == 0 and lp.grad[i, t] == 0, (level, mode)
            assert float((lp.grad != 0).sum()) == float(mask.sum()) - len(dropped)
            assert metric_value(m["masked_frac"]) == pytest.approx(len(dropped) / float(mask.sum()))
            # mask (MIS, IcePop) weighs the kept tokens by their ratio, reject by 1
            row0 = math.exp(2.0 / 6) if level == "geometric" and mode == "mask" else 1.0
            assert w[0, :6].tolist() == pytest.approx([row0] * 6 if level == "geometric" else [1, 1, 0, 1, 1, 1])


# ---------------------------------------------------------------------------------------------- gspo

def ref_gspo_seq_losses(logp, old, adv, mask, lo, hi):
    out = []
    for i, toks in enumerate(rows(mask)):
        if not toks:
            out.append(0.0)
            continue
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in toks) / len(toks))
        a = sum(float(adv[i, t]) for t in toks) / len(toks)
        out.append(max(-a * s, -a * min(max(s, 1 - lo), 1 + hi)))
    return out


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_gspo_loss_matches_reference(agg):
    logp, old, adv, mask = make([6, 1, 3, 0, 5], seed=7)
    adv = adv + 0.5 * torch.randn(adv.shape, generator=torch.Generator().manual_seed(8))  # per-token advantages
    loss, m = gspo_loss(logp, old, adv, mask, 0.05, 0.08, agg_mode=agg)
    seq = ref_gspo_seq_losses(logp, old, adv, mask, 0.05, 0.08)
    lens = [len(t) for t in rows(mask)]
    if agg == "seq-mean-token-mean":
        want = sum(seq) / len(seq)  # the paper's mean over sequences
    elif agg == "token-mean":
        want = sum(s * n for s, n in zip(seq, lens)) / sum(lens)
    else:
        want = sum(s * n for s, n in zip(seq, lens)) / len(seq)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert metric_value(m["pg_loss"]) == pytest.approx(want, rel=1e-5)
    assert 0 < metric_value(m["pg_clipfrac"]) < 1  # some sequences are clipped at this tight range


def test_gspo_token_equals_gspo_with_one_advantage_per_sequence():
    logp, old, adv, mask = make([6, 2, 4, 1, 5], seed=9)
    grads = {}
    for name, fn in (("gspo", gspo_loss), ("gspo_token", gspo_token_loss)):
        lp = logp.clone().requires_grad_()
        loss, _ = fn(lp, old, adv, mask, 0.05, 0.08, agg_mode="seq-mean-token-mean")
        loss.backward()
        grads[name] = (float(loss.detach()), lp.grad)
    assert grads["gspo"][0] == pytest.approx(grads["gspo_token"][0], rel=1e-6)
    torch.testing.assert_close(grads["gspo"][1], grads["gspo_token"][1], rtol=1e-5, atol=1e-7)
    # GSPO's gradient: every token of an unclipped sequence gets -A s / |y|
    lp = logp.clone().requires_grad_()
    gspo_loss(lp, old, adv, mask, 10.0, 10.0, agg_mode="seq-mean-token-mean")[0].backward()
    for i, toks in enumerate(rows(mask)):
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in toks) / len(toks))
        for t in toks:
            assert float(lp.grad[i, t]) == pytest.approx(-float(adv[i, 0]) * s / len(toks) / 5, rel=1e-5)
    # with per-token advantages the token variant weighs each token by its own advantage, GSPO by the mean
    adv2 = adv + torch.randn(adv.shape, generator=torch.Generator().manual_seed(10))
    g = []
    for fn in (gspo_loss, gspo_token_loss):
        lp = logp.clone().requires_grad_()
        fn(lp, old, adv2, mask, 10.0, 10.0, agg_mode="seq-mean-token-mean")[0].backward()
        g.append(lp.grad)
    assert not torch.allclose(g[0], g[1], atol=1e-4)


def test_gspo_one_token_responses_are_vanilla_ppo():
    # one token per response: the sequence ratio is the token ratio
    logp, old, adv, mask = make([1, 1, 1, 1], seed=11)
    plain, _ = policy_loss(logp, old, adv, mask, 0.1, 0.15, None, "token-mean")
    for fn in (gspo_loss, gspo_token_loss):
        got, _ = fn(logp, old, adv, mask, 0.1, 0.15, agg_mode="token-mean")
        assert float(got) == pytest.approx(float(plain), rel=1e-6)


def test_gspo_masked_sequences_and_garbage_padding():
    logp, old, adv, mask = make([3, 0, 4], seed=12)
    logp[1], old[1] = 50.0, -50.0  # a masked row with a huge "ratio"
    logp[0, 5] = float("nan")  # padding garbage
    for fn in (gspo_loss, gspo_token_loss):
        lp = logp.clone().requires_grad_()
        loss, _ = fn(lp, old, adv, mask, 0.2, 0.2, agg_mode="seq-mean-token-mean")
        loss.backward()
        seq = ref_gspo_seq_losses(torch.nan_to_num(logp), old, adv, mask, 0.2, 0.2)
        assert float(loss.detach()) == pytest.approx(sum(seq) / 3, rel=1e-5)
        assert torch.isfinite(lp.grad).all() and float(lp.grad[1].abs().sum()) == 0.0


# ---------------------------------------------------------------------------------------------- overlong

def test_overlong_penalty_matches_reference():
    max_new, buf, factor = 10, 4, 0.5
    lengths = torch.arange(0, 11)

    def ref(n):  # verl's DAPO reward manager
        exceed = n - (max_new - buf)
        return min(-exceed / buf * factor, 0.0)

    got = overlong_penalty(lengths, max_new, buf, factor)
    assert got.tolist() == pytest.approx([ref(n) for n in range(11)])
    assert got[10] == pytest.approx(-factor)  # a response cut at max_new_tokens: the full penalty
    assert got[:7].abs().sum() == 0 and got[7] == pytest.approx(-0.125)
    assert overlong_penalty(torch.tensor([1, 1]), 1, 1).tolist() == [-1.0, -1.0]  # one-token limit
    with pytest.raises(ValueError, match="overlong"):
        overlong_penalty(lengths, 4, 5)


def test_overlong_config_checks_buffer_against_max_new_tokens():
    from shardrl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="reward.overlong_buffer.len"):
        load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=40",
                           "rollout.max_new_tokens=32"])
    cfg = load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32"])
    assert cfg.reward.overlong_buffer.len == 32
