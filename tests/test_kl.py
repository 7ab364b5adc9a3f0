"""KL estimator names and meanings as verl's `kl_penalty` has them, values and gradients worked out by hand."""

import math

import pytest
import torch

from shardrl.algos import KL_ESTIMATORS, kl_penalty
from shardrl.config.schema import load_config

T64 = torch.float64
# d = log p - log ref for three tokens: 0.5, -1.5, and -30 (ref far above the policy)
LOGP = [-1.0, -2.0, -30.0]
REF = [-1.5, -0.5, 0.0]


def by_hand(kind: str) -> tuple[list[float], list[float]]:
    """(value, d value / d logp) of one estimator per token, from plain floats."""
    values, grads = [], []
    for lp, rf in zip(LOGP, REF):
        d = lp - rf
        if kind == "k1":
            v, g = d, 1.0
        elif kind == "abs":
            v, g = abs(d), math.copysign(1.0, d)
        elif kind == "k2":
            v, g = 0.5 * d * d, d
        else:  # k3 = r - log r - 1, r = exp(-d); dv/dlogp = 1 - r; clamped to [-10, 10]
            x = min(max(-d, -20.0), 20.0)
            v = math.exp(x) - x - 1
            g = 1.0 - math.exp(x) if -10 < v < 10 else 0.0
            v = min(max(v, -10.0), 10.0)
        values.append(v)
        grads.append(g)
    return values, grads


def value_and_grad(kind: str) -> tuple[list[float], list[float]]:
    logp = torch.tensor(LOGP, dtype=T64, requires_grad=True)
    out = kl_penalty(logp, torch.tensor(REF, dtype=T64), kind)
    out.sum().backward()
    return out.detach().tolist(), logp.grad.tolist()


@pytest.mark.parametrize("names, meaning", [
    (("kl", "k1"), "k1"), (("abs",), "abs"), (("mse", "k2"), "k2"), (("low_var_kl", "k3"), "k3"),
])
def test_verl_names_have_verl_values_and_gradients(names, meaning):
    want_value, want_grad = by_hand(meaning)
    for name in names:
        value, grad = value_and_grad(name)
        assert value == pytest.approx(want_value, rel=1e-12, abs=1e-12), name
        assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-12), name
    if meaning == "k3":  # third token: exp(30) - 31 would be ~1e13; verl clamps it to 10, and so do we
        assert want_value[2] == 10.0 and want_value[0] == pytest.approx(math.exp(-0.5) + 0.5 - 1)


@pytest.mark.parametrize("name, meaning", [
    ("kl+", "k1"), ("k1+", "k1"), ("abs+", "abs"), ("mse+", "k2"), ("k2+", "k2"), ("low_var_kl+", "k3"),
    ("k3+", "k3"),
])
def test_plus_suffix_keeps_the_value_and_takes_the_gradient_of_k2(name, meaning):
    value, grad = value_and_grad(name)
    assert value == pytest.approx(by_hand(meaning)[0], rel=1e-12, abs=1e-12)
    assert grad == pytest.approx([lp - rf for lp, rf in zip(LOGP, REF)], rel=1e-12)  # d k2 / d logp = d


def test_every_verl_name_is_a_config_value_and_unknown_names_are_refused():
    names = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
    names += [n + "+" for n in names]
    assert set(KL_ESTIMATORS) == set(names)
    for name in names:
        cfg = load_config(None, [f"actor.kl_loss_type={name}", f"algorithm.kl_penalty={name}"])
        assert (cfg.actor.kl_loss_type, cfg.algorithm.kl_penalty) == (name, name)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match="actor.kl_loss_type"):
        load_config(None, ["actor.kl_loss_type=k3++"])
