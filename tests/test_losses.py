"""Loss aggregation, PPO policy / value / entropy losses, and KL, against hand numbers and loops."""

import math

import pytest
import torch

from shardrl.algos import (
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_in_reward,
    entropy_loss,
    kl_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from shardrl.algos.aggregate import share_metric
from shardrl.metrics import metric_value

T64 = torch.float64


# ---------------------------------------------------------------- agg_loss

def ref_agg(loss, mask, mode, num_tokens=None, num_seqs=None):
    """Plain loops over samples and tokens."""
    B = len(loss)
    if mode == "token-mean":
        total = sum(loss[b][t] for b in range(B) for t in range(len(loss[b])) if mask[b][t])
        count = num_tokens if num_tokens is not None else sum(sum(row) for row in mask)
        return total / max(count, 1)
    per_seq = []
    for b in range(B):
        toks = [loss[b][t] for t in range(len(loss[b])) if mask[b][t]]
        if mode == "seq-mean-token-mean":
            per_seq.append(sum(toks) / len(toks) if toks else 0.0)
        else:
            per_seq.append(sum(toks))
    return sum(per_seq) / (num_seqs if num_seqs is not None else B)


def agg_batch():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g, dtype=T64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0],
                         [1, 0, 0, 0, 0], [1, 1, 0, 1, 0], [1, 1, 1, 1, 0]])
    loss[2, 0] = float("nan")  # garbage on padding must not leak
    loss[0, 4] = float("inf")
    return loss, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_loop(mode):
    loss, mask = agg_batch()
    out = agg_loss(loss, mask, mode)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(ref_agg(loss.tolist(), mask.tolist(), mode), rel=1e-12)
    # explicit global counts are used as given
    out = agg_loss(loss, mask, mode, num_global_tokens=40, num_global_seqs=10)
    assert out.item() == pytest.approx(ref_agg(loss.tolist(), mask.tolist(), mode, 40, 10), rel=1e-12)


def test_agg_loss_hand_numbers():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_split_invariance(mode):
    """Micro-batches (any rows, any order, across 'ranks') with the global counts sum to the whole."""
    loss, mask = agg_batch()
    whole = agg_loss(loss, mask, mode)
    num_tokens, num_seqs = int(mask.sum()), mask.shape[0]
    splits = [
        [[0, 1, 2, 3, 4, 5]],
        [[0], [1], [2], [3], [4], [5]],
        [[0, 1, 2], [3, 4, 5]],
        [[5, 2], [0, 3, 1], [4]],
        [[2], [4, 0, 5, 1, 3]],  # a micro-batch of only an empty sequence
    ]
    for split in splits:
        pieces = [agg_loss(loss[rows], mask[rows], mode, num_global_tokens=num_tokens,
                           num_global_seqs=num_seqs) for rows in split]
        assert torch.stack(pieces).sum().item() == pytest.approx(whole.item(), rel=1e-12), split
    # without the global counts, token-mean of a split is NOT the whole (the reason the counts exist)
    if mode == "token-mean":
        a, b = [0, 1, 2], [3, 4, 5]
        naive = agg_loss(loss[a], mask[a], mode) + agg_loss(loss[b], mask[b], mode)
        assert naive.item() != pytest.approx(whole.item())


def test_agg_loss_gradient_matches_across_splits():
    loss, mask = agg_batch()
    loss = torch.nan_to_num(loss).requires_grad_()
    agg_loss(loss, mask, "token-mean").backward()
    whole_grad = loss.grad.clone()
    loss.grad = None
    for rows in ([0, 4], [1, 2, 3, 5]):
        agg_loss(loss[rows], mask[rows], "token-mean", num_global_tokens=int(mask.sum())).backward()
    torch.testing.assert_close(loss.grad, whole_grad)


# ---------------------------------------------------------------- policy loss

def ref_policy_loss(logp, old, adv, mask, low, high, c):
    """Per token with explicit branches; returns (token-mean loss, clipfrac, clipfrac_lower, ppo_kl)."""
    total, n, clipped, lower, kl = 0.0, 0, 0, 0, 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            log_ratio = min(max(logp[b][t] - old[b][t], -20.0), 20.0)
            ratio = math.exp(log_ratio)
            a = adv[b][t]
            cr = min(max(ratio, 1 - low), 1 + high)
            pg = max(-a * ratio, -a * cr)
            if -a * cr > -a * ratio:
                clipped += 1
            if c is not None and a < 0 and pg > -a * c:
                pg = -a * c
                lower += 1
            total, n, kl = total + pg, n + 1, kl - log_ratio
    return total / n, clipped / n, lower / n, kl / n


def policy_case():
    """Two rows, 7 real tokens, each hitting a named branch (clip_low 0.2, clip_high 0.28, c 3)."""
    ratios = [[1.5, 0.5, 0.5, 1.2, 1.0], [1.25, 5.0, 0.9, 1.0, 1.0]]
    adv = [[1.0, 1.0, -1.0, -1.0, 100.0], [1.0, -1.0, -2.0, 100.0, 100.0]]
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    old = torch.full((2, 5), -1.0, dtype=T64)
    logp = old + torch.log(torch.tensor(ratios, dtype=T64))
    logp[0, 4] = -float("inf")  # padding garbage
    return logp, old, torch.tensor(adv, dtype=T64), mask


def test_policy_loss_branches_by_hand():
    logp, old, adv, mask = policy_case()
    # per token pg:
    #  A=+1 r=1.5 -> clipped at 1+0.28: -1.28         A=+1 r=0.5 -> unclipped (min side): -0.5
    #  A=-1 r=0.5 -> clipped at 1-0.2: 0.8            A=-1 r=1.2 -> within: 1.2
    #  A=+1 r=1.25 -> within clip-higher (a symmetric 0.2 would clip it): -1.25
    #  A=-1 r=5 -> PPO gives 5, dual-clip caps at c=3: 3      A=-2 r=0.9 -> within: 1.8
    pg = [-1.28, -0.5, 0.8, 1.2, -1.25, 3.0, 1.8]
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(sum(pg) / 7)
    assert [float(x) for x in metrics["pg_clipfrac"]] == [2.0, 7.0]  # (clipped tokens, real tokens)
    assert metric_value(metrics["pg_clipfrac"]) == pytest.approx(2 / 7)
    assert metric_value(metrics["pg_loss"]) == pytest.approx(loss.item())
    assert metric_value(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 7)
    kl = -sum(math.log(r) for r in [1.5, 0.5, 0.5, 1.2, 1.25, 5.0, 0.9]) / 7
    assert metric_value(metrics["ppo_kl"]) == pytest.approx(kl)

    # without dual-clip the A<0, r=5 token costs its full 5
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx((sum(pg) - 3.0 + 5.0) / 7)
    assert metric_value(metrics["pg_clipfrac_lower"]) == 0.0

    # symmetric clip 0.2 clips the r=1.25 token too
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((sum(pg) + 1.28 - 1.2 + 1.25 - 1.2) / 7)
    assert metric_value(metrics["pg_clipfrac"]) == pytest.approx(3 / 7)


def test_policy_loss_gradient_zero_on_clipped_tokens():
    logp, old, adv, mask = policy_case()
    logp = logp.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    loss.backward()
    grad = logp.grad
    # d(-A r)/d logp = -A r / N on active tokens; 0 where clipped, dual-clipped or padding
    expected = torch.tensor([[0.0, -0.5, 0.0, 1.2, 0.0], [-1.25, 0.0, 1.8, 0.0, 0.0]], dtype=T64) / 7
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("c", [None, 3.0, 1.5])
def test_policy_loss_matches_loop(c):
    g = torch.Generator().manual_seed(5)
    old = torch.randn(4, 9, generator=g, dtype=T64) - 2
    logp = old + 0.6 * torch.randn(4, 9, generator=g, dtype=T64)
    adv = 2 * torch.randn(4, 9, generator=g, dtype=T64)
    mask = (torch.arange(9) < torch.tensor([9, 4, 1, 6])[:, None]).long()
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=c)
    ref = ref_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, c)
    assert loss.item() == pytest.approx(ref[0], rel=1e-10)
    assert metric_value(m["pg_clipfrac"]) == pytest.approx(ref[1])
    assert metric_value(m["pg_clipfrac_lower"]) == pytest.approx(ref[2])
    assert metric_value(m["ppo_kl"]) == pytest.approx(ref[3], rel=1e-10)
    assert POLICY_LOSSES["vanilla"] is policy_loss
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=1.0)


def test_policy_loss_uses_agg_mode_and_global_counts():
    logp, old, adv, mask = policy_case()
    pg = torch.tensor([[-1.28, -0.5, 0.8, 1.2, 0.0], [-1.25, 3.0, 1.8, 0.0, 0.0]], dtype=T64)
    for mode in AGG_MODES:
        loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, agg_mode=mode,
                              num_global_tokens=20, num_global_seqs=5)
        expected = agg_loss(pg, mask, mode, num_global_tokens=20, num_global_seqs=5)
        assert loss.item() == pytest.approx(expected.item())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_metric_pairs_summed_over_pieces_are_the_whole_batch_metrics(mode):
    """Every metric is a (sum, count) pair: summed over any cut (here with a piece of only an empty row),
    sum / count is the metric of the whole batch, and a loss's pair gives the whole batch's loss."""
    g = torch.Generator().manual_seed(11)
    old = torch.randn(6, 7, generator=g, dtype=T64) - 2
    logp = old + 0.5 * torch.randn(6, 7, generator=g, dtype=T64)
    adv = torch.randn(6, 7, generator=g, dtype=T64)
    values, returns = torch.randn(6, 7, generator=g, dtype=T64), torch.randn(6, 7, generator=g, dtype=T64)
    mask = (torch.arange(7) < torch.tensor([7, 3, 0, 5, 1, 6])[:, None]).long()
    num_tokens, num_seqs = int(mask.sum()), 6

    def metrics(rows, whole=False):
        counts = {} if whole else dict(num_global_tokens=num_tokens, num_global_seqs=num_seqs)
        _, pm = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], 0.2, 0.2, 1.5, mode, **counts)
        _, vm = value_loss(values[rows], old[rows], returns[rows], mask[rows], 0.3, mode, **counts)
        ent = entropy_loss(-logp[rows], mask[rows], mode, **counts)
        return {**pm, **vm, "entropy": share_metric(ent, mask[rows], mode, **counts)}

    whole = {k: metric_value(v) for k, v in metrics(list(range(6)), whole=True).items()}
    assert 0 < whole["pg_clipfrac"] < 1 and 0 < whole["pg_clipfrac_lower"] < 1 and 0 < whole["vf_clipfrac"] < 1
    assert whole["entropy"] == pytest.approx(entropy_loss(-logp, mask, mode).item())
    for split in ([[0, 1, 2], [3, 4, 5]], [[5], [2], [0, 3], [1, 4]], [[2], [0, 1, 3, 4, 5]]):
        pieces = [metrics(rows) for rows in split]
        for k, want in whole.items():
            total = sum(float(p[k][0]) for p in pieces)
            count = sum(float(p[k][1]) for p in pieces)
            assert total / count == pytest.approx(want, rel=1e-12), (split, k)
        # the old contract (each piece's own mean, averaged over pieces) depends on the cut
        naive = sum(metric_value(p["pg_clipfrac"]) for p in pieces) / len(pieces)
        assert naive != pytest.approx(whole["pg_clipfrac"], rel=1e-6), split


def test_policy_loss_extreme_log_ratio_is_finite():
    logp = torch.tensor([[100.0, -100.0]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2)
    # log-ratio clamped to [-20, 20]: pg = max(e^20, 1.2) and max(-e^-20, -0.8)
    assert loss.item() == pytest.approx((math.exp(20) - math.exp(-20)) / 2, rel=1e-5)


# ---------------------------------------------------------------- value and entropy losses

def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.6, 0.0, 2.0, 5.0]], dtype=T64)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.0]], dtype=T64)
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # per token max(unclipped, clipped): max(0, 0.3^2), max(0.16, 0.16), max(0, 0.3^2), max(4, 0.7^2)
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 0.16 + 0.09 + 4.0) / 4)
    assert metric_value(m["vf_clipfrac"]) == pytest.approx(2 / 4)
    loss, m = value_loss(values, old, returns, mask, cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (0 + 0.16 + 0 + 4.0) / 4)
    loss, _ = value_loss(values, old, returns, mask, 0.2, agg_mode="seq-mean-token-sum", num_global_seqs=2)
    assert loss.item() == pytest.approx(0.5 * 4.34 / 2)


def test_entropy_loss():
    ent = torch.tensor([[1.0, 3.0, 9.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_loss(ent, mask).item() == pytest.approx(2.0)
    assert entropy_loss(ent, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert entropy_loss(ent, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)


# ---------------------------------------------------------------- KL

def test_kl_estimators_known_values():
    logp = torch.tensor([[math.log(0.5), 0.0, -1.0]], dtype=T64)
    ref = torch.tensor([[math.log(0.25), 0.0, -31.0]], dtype=T64)
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[ln2, 0.0, 30.0]], dtype=T64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"),
                               torch.tensor([[0.5 * ln2 ** 2, 0.0, 450.0]], dtype=T64))
    # k3: r - log r - 1 with r = ref/p: 0.5 + ln2 - 1 = 0.193147
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(0.5 + ln2 - 1) and k3[0, 1].item() == 0.0
    assert k3[0, 2].item() == 10.0  # exp(-30) + 30 - 1, clamped to 10 as in verl (k3 = low_var_kl)
    low = kl_penalty(logp, ref, "low_var_kl")
    assert low[0, 0].item() == pytest.approx(0.5 + ln2 - 1)
    assert low[0, 2].item() == 10.0  # clamped
    # big positive ref - logp: clamped to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0
    assert {"k1", "k2", "k3", "low_var_kl", "kl", "abs", "mse", "k3+"} <= set(KL_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(logp, ref, "k4")


def test_apply_kl_in_reward_matches_loop():
    g = torch.Generator().manual_seed(7)
    logp = torch.randn(3, 4, generator=g, dtype=T64)
    ref = torch.randn(3, 4, generator=g, dtype=T64)
    rewards = torch.randn(3, 4, generator=g, dtype=T64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    new, mean_kl = apply_kl_in_reward(rewards, logp, ref, mask, coef=0.1, kind="k1")
    expected, kls = rewards.tolist(), []
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                kl = logp[b, t].item() - ref[b, t].item()
                expected[b][t] -= 0.1 * kl
                kls.append(kl)
    torch.testing.assert_close(new, torch.tensor(expected, dtype=T64))
    assert mean_kl.item() == pytest.approx(sum(kls) / len(kls))


def test_kl_loss_is_aggregated_estimate():
    logp = torch.tensor([[math.log(0.5), 0.0, 7.0]], dtype=T64)
    ref = torch.tensor([[math.log(0.25), 0.0, 0.0]], dtype=T64)
    mask = torch.tensor([[1, 1, 0]])
    assert kl_loss(logp, ref, mask, "k3").item() == pytest.approx((0.5 + math.log(2) - 1) / 2)


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    v = ctl.value
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1, inside the clip
    assert ctl.value == pytest.approx(v * (1 - 0.1 * 100 / 10000))
    ctl.update(current_kl=0.0, n_steps=1000)  # error -1 clipped to -0.2
    assert ctl.value == pytest.approx(v * 0.999 * 0.98)

    restored = AdaptiveKLController(init_coef=1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctl.value, 6.0, 10000.0)
    with pytest.raises(ValueError):
        ctl.update(float("nan"), 1)

    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05
