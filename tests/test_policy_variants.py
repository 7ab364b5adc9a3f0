"""CISPO, SAPO, GMPO (geo_mean) and DPPO (dppo_tv, dppo_kl) against references written here token by token in
plain Python: the loss value and the gradient on each token (the gradient is the method: CISPO's stopped weight,
SAPO's gate slope, GMPO's 1/|y|, DPPO's mask). Their invariance to the micro-batch cut and the world size:
tests/test_loss_modes_invariance.py."""

from __future__ import annotations

import math

import pytest
import torch

from shardrl.algos import LOSS_MODES, POLICY_LOSSES
from shardrl.algos.policy_variants import cispo_loss, dppo_kl_loss, dppo_tv_loss, geo_mean_loss, sapo_loss
from shardrl.metrics import metric_value


def make(lengths, width=6, seed=0, spread=0.4):
    """(B, width) log-probs, old log-probs off them, per-token advantages of both signs, left-aligned mask."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = torch.zeros(b, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = -torch.rand(b, width, generator=g) * 2 - 0.05
    old = (logp + spread * torch.randn(b, width, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(b, width, generator=g)
    return logp.double(), old.double(), adv.double(), mask.double()


def rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


def run(fn, logp, old, adv, mask, *args, **kw):
    lp = logp.clone().requires_grad_()
    loss, metrics = fn(lp, old, adv, mask, *args, **kw)
    loss.backward()
    return float(loss.detach()), lp.grad, metrics


def token_mean(per_token, mask):
    toks = [(i, t) for i, r in enumerate(rows(mask)) for t in r]
    return sum(per_token(i, t) for i, t in toks) / len(toks), len(toks)


# ---------------------------------------------------------------------------------------------- CISPO

def test_cispo_matches_reference_and_its_weight_carries_no_gradient():
    logp, old, adv, mask = make([6, 1, 4, 0, 5], seed=1)
    lo, hi = 0.1, 0.15
    loss, grad, m = run(cispo_loss, logp, old, adv, mask, lo, hi)

    def w(i, t):
        return min(max(math.exp(float(logp[i, t] - old[i, t])), 1 - lo), 1 + hi)

    want, n = token_mean(lambda i, t: -w(i, t) * float(adv[i, t]) * float(logp[i, t]), mask)
    assert loss == pytest.approx(want, rel=1e-9)
    assert metric_value(m["pg_loss"]) == pytest.approx(want, rel=1e-9)
    # d loss / d log pi = -clip(r) A / N on every token, clipped or not: REINFORCE with a constant weight (without
    # the stop-gradient a token inside the range would get -(r log pi + r) A / N)
    for i, toks in enumerate(rows(mask)):
        for t in toks:
            assert float(grad[i, t]) == pytest.approx(-w(i, t) * float(adv[i, t]) / n, rel=1e-9)
    assert float(grad[mask == 0].abs().sum()) == 0
    clipped = sum(1 for i, r in enumerate(rows(mask)) for t in r
                  if not 1 - lo <= math.exp(float(logp[i, t] - old[i, t])) <= 1 + hi)
    assert 0 < clipped < n and metric_value(m["pg_clipfrac"]) == pytest.approx(clipped / n)


# ---------------------------------------------------------------------------------------------- SAPO

def test_sapo_matches_reference_gate_and_its_slope():
    logp, old, adv, mask = make([6, 1, 4, 0, 5], seed=2, spread=0.8)
    tp, tn = 1.0, 3.0

    def gate(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, grad, m = run(sapo_loss, logp, old, adv, mask, tp, tn, agg_mode=agg)
        per = {}
        for i, toks in enumerate(rows(mask)):
            for t in toks:
                r, a = math.exp(float(logp[i, t] - old[i, t])), float(adv[i, t])
                tau = tp if a > 0 else tn
                s = 1 / (1 + math.exp(-tau * (r - 1)))
                # the gate's derivative in log pi: 4 sigma (1 - sigma) r (its slope at r = 1 is PPO's, 1)
                per[i, t] = (-gate(r, tau) * a, -a * 4 * s * (1 - s) * r)
        lens = [len(r) for r in rows(mask)]
        if agg == "token-mean":
            n = sum(lens)
            want = sum(v[0] for v in per.values()) / n
            scale = {k: 1 / n for k in per}
        else:
            want = sum(v[0] / lens[i] for (i, _), v in per.items()) / len(lens)
            scale = {(i, t): 1 / lens[i] / len(lens) for i, t in per}
        assert loss == pytest.approx(want, rel=1e-9), agg
        for k, (_, g) in per.items():
            assert float(grad[k]) == pytest.approx(g * scale[k], rel=1e-8), (agg, k)
        assert metric_value(m["pg_clipfrac"]) == 0
    # at r = 1 the gate's value is 2 / tau and its gradient PPO's (-A per token)
    z = torch.zeros(1, 2, dtype=torch.float64)
    _, g, _ = run(sapo_loss, z, z, torch.tensor([[1.0, -2.0]], dtype=torch.float64), torch.ones(1, 2), 1.0, 1.05)
    assert g[0].tolist() == pytest.approx([-0.5, 1.0])  # token-mean over 2: -A / 2


# ---------------------------------------------------------------------------------------------- GMPO

def ref_geo_mean(logp, old, adv, mask, lo, hi):
    """Per sequence: (loss, its gradient on each of its tokens before the mean over sequences)."""
    out = []
    for i, toks in enumerate(rows(mask)):
        if not toks:
            out.append((0.0, {}))
            continue
        a = sum(float(adv[i, t]) for t in toks) / len(toks)
        logs, live = [], {}
        for t in toks:
            x, sgn = float(logp[i, t] - old[i, t]), math.copysign(1.0, float(adv[i, t])) if adv[i, t] else 0.0
            c = min(max(x, -lo), hi)
            # pessimistic: keep the clipped log-ratio only where it is lower in the advantage's direction
            keep_raw = sgn * x <= sgn * c
            logs.append(sgn * min(sgn * x, sgn * c))
            live[t] = sgn != 0 and (keep_raw or x == c)
        s = math.exp(sum(logs) / len(toks))
        out.append((-a * s, {t: (-a * s / len(toks) if live[t] else 0.0) for t in toks}))
    return out


def test_geo_mean_matches_reference():
    logp, old, adv, mask = make([6, 1, 4, 0, 5], seed=3, spread=0.5)
    adv = adv.sign() * (adv.abs() + 0.1)  # a sign on every token
    lo, hi = 0.2, 0.3
    loss, grad, m = run(geo_mean_loss, logp, old, adv, mask, lo, hi, agg_mode="seq-mean-token-mean")
    ref = ref_geo_mean(logp, old, adv, mask, lo, hi)
    assert loss == pytest.approx(sum(r[0] for r in ref) / len(ref), rel=1e-9)
    for i, (_, g) in enumerate(ref):
        for t, v in g.items():
            assert float(grad[i, t]) == pytest.approx(v / len(ref), rel=1e-8, abs=1e-12), (i, t)
    assert any(v == 0.0 for _, g in ref for v in g.values())  # some tokens are clipped: no gradient
    n = mask.sum()
    out = [(i, t) for i, r in enumerate(rows(mask)) for t in r
           if not -lo <= float(logp[i, t] - old[i, t]) <= hi]
    pos = sum(1 for i, t in out if adv[i, t] > 0)
    assert metric_value(m["pg_clipfrac"]) == pytest.approx(pos / float(n))
    assert metric_value(m["pg_clipfrac_lower"]) == pytest.approx((len(out) - pos) / float(n))


def test_geo_mean_of_one_token_sequences_is_ppo_with_log_space_clip():
    logp, old, adv, mask = make([1, 1, 1], seed=4)
    got, _, _ = run(geo_mean_loss, logp, old, adv, mask, 0.1, 0.1, agg_mode="seq-mean-token-mean")
    ppo, _ = POLICY_LOSSES["vanilla"](logp, old, adv, mask, 1 - math.exp(-0.1), math.exp(0.1) - 1, None)
    assert got == pytest.approx(float(ppo), rel=1e-9)


# ---------------------------------------------------------------------------------------------- DPPO

@pytest.mark.parametrize("variant", ["tv", "kl"])
def test_dppo_matches_reference(variant):
    logp, old, adv, mask = make([6, 1, 4, 0, 5], seed=5, spread=0.6)
    lo, hi, cap = (0.08, 0.12, 1.5) if variant == "tv" else (0.02, 0.03, 1.5)
    fn = dppo_tv_loss if variant == "tv" else dppo_kl_loss
    loss, grad, m = run(fn, logp, old, adv, mask, lo, hi, cap)

    def valid(i, t):
        p, q, a = math.exp(float(logp[i, t])), math.exp(float(old[i, t])), float(adv[i, t])
        if variant == "tv":
            return p - q <= hi if a > 0 else p - q >= -lo
        kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        return (kl <= hi or p <= q) if a > 0 else (kl <= lo or p >= q)

    def weight(i, t):
        return min(math.exp(float(logp[i, t] - old[i, t])), cap) * valid(i, t)

    want, n = token_mean(lambda i, t: -float(adv[i, t]) * weight(i, t) * float(logp[i, t]), mask)
    assert loss == pytest.approx(want, rel=1e-9)
    masked = sum(1 for i, r in enumerate(rows(mask)) for t in r if not valid(i, t))
    assert 0 < masked < n and metric_value(m["pg_clipfrac"]) == pytest.approx(masked / n)
    for i, toks in enumerate(rows(mask)):
        for t in toks:  # REINFORCE with a stopped, truncated weight; 0 on a masked token
            assert float(grad[i, t]) == pytest.approx(-float(adv[i, t]) * weight(i, t) / n, rel=1e-9, abs=1e-15)
    truncated = sum(1 for i, r in enumerate(rows(mask)) for t in r
                    if valid(i, t) and math.exp(float(logp[i, t] - old[i, t])) > cap)
    assert metric_value(m["pg_clipfrac_lower"]) == pytest.approx(truncated / n)


# ---------------------------------------------------------------------------------------------- all

@pytest.mark.parametrize("name", ["cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"])
def test_new_modes_ignore_padding_garbage(name):
    logp, old, adv, mask = make([3, 0, 4], seed=6)
    logp[1], old[1] = 50.0, -50.0
    logp[0, 5] = float("nan")
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05}
    params = {k: v for k, v in settings.items() if k in LOSS_MODES[name].params.__dataclass_fields__}
    clean, _, _ = run(LOSS_MODES[name].fn, torch.nan_to_num(logp) * mask - (1 - mask), old * mask - (1 - mask),
                      adv, mask, **params)
    got, grad, _ = run(LOSS_MODES[name].fn, logp, old, adv, mask, **params)
    assert got == pytest.approx(clean, rel=1e-9) and math.isfinite(got)
    assert torch.isfinite(grad).all() and float(grad[mask == 0].abs().sum()) == 0


def test_sapo_refuses_a_non_positive_temperature():
    logp, old, adv, mask = make([2])
    with pytest.raises(ValueError, match="tau_pos"):
        sapo_loss(logp, old, adv, mask, 0.0, 1.0)
