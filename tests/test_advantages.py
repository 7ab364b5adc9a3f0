"""Advantage estimators against hand-computed numbers and plain-loop references."""

import math
import statistics

import pytest
import torch

from shardrl.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    masked_mean,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
)

T64 = torch.float64


# ---------------------------------------------------------------- references (plain Python loops)

def ref_whiten(mat, mask, eps=1e-8):
    vals = [mat[b][t] for b in range(len(mat)) for t in range(len(mat[b])) if mask[b][t]]
    mean = sum(vals) / len(vals)
    var = statistics.variance(vals)  # unbiased, like torch.var
    return [[(mat[b][t] - mean) / math.sqrt(var + eps) if mask[b][t] else 0.0
             for t in range(len(mat[b]))] for b in range(len(mat))]


def ref_gae(rewards, values, mask, gamma, lam):
    """Per sample: walk only the real tokens backwards, as if padding and holes were absent."""
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        next_v, gae = 0.0, 0.0
        for t in reversed([t for t in range(len(rewards[b])) if mask[b][t]]):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            gae = delta + gamma * lam * gae
            adv[b][t] = gae
            ret[b][t] = gae + values[b][t]
            next_v = values[b][t]
    return adv, ret


def ref_groups(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(scores, index, norm_by_std, eps):
    adv = [0.0] * len(scores)
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(vals), statistics.stdev(vals)
        for i in members:
            adv[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return adv


def ref_rloo(scores, index):
    adv = [0.0] * len(scores)
    for members in ref_groups(index).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            adv[i] = scores[i] - sum(others) / len(others) if others else scores[i]
    return adv


def broadcast(per_sample, mask):
    return [[per_sample[b] if mask[b][t] else 0.0 for t in range(len(mask[b]))] for b in range(len(mask))]


def random_batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).long()  # (B, T) right padding
    mask[0, 2] = 0  # a hole inside a response (e.g. tool output in a multi-turn rollout)
    mask[1, 0] = 1
    return g, mask


# ---------------------------------------------------------------- masked statistics

def test_masked_stats_ignore_padding_even_if_nan():
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # unbiased: (1 + 0 + 1) / 2
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 3.0], dtype=T64))
    w = masked_whiten(values, mask)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=T64))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0  # empty mask: 0, not NaN


# ---------------------------------------------------------------- scores -> token rewards

def test_scores_to_token_rewards_last_real_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 0, 1]])
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0, 1.0, 0], [2.0, 0, 0], [0, 0, 0], [0, 0, 4.0]])
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- GAE

def test_gae_hand_computed():
    # gamma 0.9, lam 0.8: t=1: delta = 1 - 0.5 = 0.5 -> A = 0.5; t=0: delta = 0.9*0.5 - 0.5 = -0.05,
    # A = -0.05 + 0.72 * 0.5 = 0.31. Returns = A + V = [0.81, 1.0]. Padding value 9 must be ignored.
    rewards = torch.tensor([[0.0, 1.0, 7.0]], dtype=T64)
    values = torch.tensor([[0.5, 0.5, 9.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.5, 0.0]], dtype=T64))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 1.0, 0.0]], dtype=T64))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop(gamma, lam):
    g, mask = random_batch(0)
    rewards = torch.randn(mask.shape, generator=g, dtype=T64)
    values = torch.randn(mask.shape, generator=g, dtype=T64)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)

    adv, ret = compute_gae(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=T64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=T64))

    adv_w, ret_w = compute_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv_w, torch.tensor(ref_whiten(ref_adv, mask.tolist()), dtype=T64))
    torch.testing.assert_close(ret_w, torch.tensor(ref_ret, dtype=T64))


# ---------------------------------------------------------------- GRPO

def test_grpo_two_groups_by_hand():
    # group 7 (non-contiguous): scores 1, 0, 1 -> mean 2/3, unbiased std sqrt(1/3);
    # group 3: 0, 1 -> mean 1/2, std sqrt(1/2); group 9: one sample -> mean 0, std 1.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0], dtype=T64)
    index = torch.tensor([7, 3, 7, 3, 7, 9])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = compute_grpo(scores, mask, index, eps=0.0)
    s3, s2 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    per_sample = [(1 / 3) / s3, -0.5 / s2, (-2 / 3) / s3, 0.5 / s2, (1 / 3) / s3, 5.0]
    assert per_sample[0] == pytest.approx(0.5773503) and per_sample[2] == pytest.approx(-1.1547005)
    expected = torch.tensor(broadcast(per_sample, mask.tolist()), dtype=T64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)

    adv_dr, _ = compute_grpo(scores, mask, index, norm_by_std=False)  # Dr.GRPO: no std division
    per_sample_dr = [1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 5.0]
    torch.testing.assert_close(adv_dr, torch.tensor(broadcast(per_sample_dr, mask.tolist()), dtype=T64))


def test_grpo_identical_scores_give_zero():
    adv, _ = compute_grpo(torch.ones(4), torch.ones(4, 3), torch.tensor([0, 0, 1, 1]))
    assert adv.abs().max().item() == 0.0


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(norm_by_std):
    g, mask = random_batch(1, B=10)
    scores = torch.randn(10, generator=g, dtype=T64)
    index = torch.tensor([4, 2, 4, 8, 2, 4, 1, 8, 2, 2])
    adv, _ = compute_grpo(scores, mask, index, norm_by_std=norm_by_std, eps=1e-6)
    ref = ref_grpo(scores.tolist(), index.tolist(), norm_by_std, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(broadcast(ref, mask.tolist()), dtype=T64))


# ---------------------------------------------------------------- RLOO

def test_rloo_by_hand_and_loop():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0], dtype=T64)
    index = torch.tensor([7, 3, 7, 3, 7, 9])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 1]])
    adv, ret = compute_rloo(scores, mask, index)
    per_sample = [0.5, -1.0, -1.0, 1.0, 0.5, 5.0]  # 1 - mean(0, 1); 0 - mean(1, 1); ...; lone sample
    torch.testing.assert_close(adv, torch.tensor(broadcast(per_sample, mask.tolist()), dtype=T64))
    torch.testing.assert_close(ret, adv)

    g, mask = random_batch(2, B=9)
    scores = torch.randn(9, generator=g, dtype=T64)
    index = torch.tensor([0, 1, 0, 2, 1, 0, 3, 2, 1])
    adv, _ = compute_rloo(scores, mask, index)
    ref = ref_rloo(scores.tolist(), index.tolist())
    torch.testing.assert_close(adv, torch.tensor(broadcast(ref, mask.tolist()), dtype=T64))


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_plus_plus_matches_loop():
    g, mask = random_batch(3)
    rewards = torch.randn(mask.shape, generator=g, dtype=T64)
    gamma = 0.9
    r, m = rewards.tolist(), mask.tolist()
    ref_ret = [[0.0] * len(row) for row in r]
    for b in range(len(r)):
        running = 0.0
        for t in reversed(range(len(r[b]))):
            running = r[b][t] + gamma * running if m[b][t] else running  # a hole is skipped as if absent
            ref_ret[b][t] = running if m[b][t] else 0.0
    adv, ret = compute_reinforce_plus_plus(rewards, mask, gamma)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=T64))
    torch.testing.assert_close(adv, torch.tensor(ref_whiten(ref_ret, m), dtype=T64))


def test_reinforce_plus_plus_hand_returns():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 1, 0]])
    _, ret = compute_reinforce_plus_plus(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0]], dtype=T64))


def test_reinforce_plus_plus_baseline_matches_loop():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0], dtype=T64)
    index = torch.tensor([7, 3, 7, 3, 7, 9])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    m = mask.tolist()
    centered = [1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 5.0]  # group mean removed; lone sample keeps its score
    expected = ref_whiten(broadcast(centered, m), m)
    adv, ret = compute_reinforce_plus_plus_baseline(scores, mask, index)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=T64))
    torch.testing.assert_close(ret, adv)
    assert masked_mean(adv, mask).item() == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------- registry

def test_registry_names_and_padding_zero():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opd"}
    g, mask = random_batch(4)
    scores = torch.randn(6, generator=g)
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    token_rewards = scores_to_token_rewards(scores, mask)
    values = torch.randn(mask.shape, generator=g)
    outs = [
        ADVANTAGE_ESTIMATORS["gae"](token_rewards, values, mask, 1.0, 0.95),
        ADVANTAGE_ESTIMATORS["grpo"](scores, mask, index),
        ADVANTAGE_ESTIMATORS["rloo"](scores, mask, index),
        ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](token_rewards, mask, 1.0),
        ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](scores, mask, index),
        ADVANTAGE_ESTIMATORS["opd"](scores, mask, index, torch.randn(mask.shape, generator=g),
                                    torch.randn(mask.shape, generator=g), 1.0, 0.5),
    ]
    for adv, ret in outs:
        assert adv.shape == ret.shape == mask.shape
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
