"""A second reader's checks of shardrl.algos against reference math written out here (verl's core_algos formulas,
the papers where verl is silent). Each test pins a behaviour a hostile review suspected and cleared."""

import torch

from shardrl.algos import (
    AGG_MODES,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    kl_penalty,
    policy_loss,
    scores_to_token_rewards,
)
from shardrl.algos.losses import LOSS_MODES
from shardrl.metrics import accumulate, metric_value


def _mask(lengths, width):
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()  # (B, T)


def _verl_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return, before whitening: masked tokens carry the state over unchanged."""
    next_value = torch.zeros(values.shape[0])
    last = torch.zeros(values.shape[0])
    out = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = gae * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def test_gae_matches_verl_with_holes_and_trailing_padding():
    torch.manual_seed(0)
    mask = _mask([8, 5, 3, 1, 6], 8)
    mask[0, 2] = 0  # a tool-output hole inside a response
    mask[4, 2:4] = 0
    rewards = scores_to_token_rewards(torch.tensor([1.0, 0.0, 1.0, 0.5, 2.0]), mask)
    values = torch.randn(5, 8)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    ref_adv, ref_ret = _verl_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(adv * mask, ref_adv * mask, atol=1e-6)
    assert torch.allclose(ret * mask, ref_ret * mask, atol=1e-6)
    # the last real token bootstraps from 0: its advantage is r - V
    assert torch.isclose(adv[1, 4], rewards[1, 4] - values[1, 4])


def test_group_estimators_match_reference_math_incl_groups_of_one_and_equal_rewards():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 2.0])
    index = torch.tensor([7, 7, 7, 3, 3, 9])  # group 3: all equal, group 9: one sample
    mask = _mask([4, 3, 2, 4, 1, 2], 4)
    grpo, _ = compute_grpo(scores, mask, index)
    mean, std = scores[:3].mean(), scores[:3].std()  # unbiased, as torch.std and verl
    expected = torch.tensor([*((scores[:3] - mean) / (std + 1e-6)), 0.0, 0.0, 2.0 / (1 + 1e-6)])
    assert torch.allclose(grpo[:, 0], expected, atol=1e-6)
    assert torch.isfinite(grpo).all()
    rloo, _ = compute_rloo(scores, mask, index)
    assert torch.allclose(rloo[:, 0], torch.tensor([0.5, -1.0, 0.5, 0.0, 0.0, 2.0]))
    rpp, _ = compute_reinforce_plus_plus_baseline(scores, mask, index, whiten=False)
    assert torch.allclose(rpp[:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 2.0]), atol=1e-6)


def test_dual_clip_and_clip_higher_match_verl():
    logprob = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    old = torch.log(torch.tensor([[1 / 5.0, 1 / 1.25, 1 / 0.5, 1 / 1.35]]))  # ratios 5, 1.25, 0.5, 1.35
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(logprob, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    # token 0: A<0, ratio 5 -> max(5, 1.2) = 5, dual clip -> 3; token 1: A>0, 1.25 inside [0.8, 1.28] -> -1.25;
    # token 2: A<0, ratio 0.5 -> max(0.5, 0.8) = 0.8 (clipped); token 3: A>0, 1.35 -> -1.28 (clipped)
    assert torch.isclose(loss, torch.tensor((3.0 - 1.25 + 0.8 - 1.28) / 4), atol=1e-6)
    assert metric_value(metrics["pg_clipfrac"]) == 0.5
    assert metric_value(metrics["pg_clipfrac_lower"]) == 0.25


def test_every_loss_mode_and_metric_is_invariant_to_the_micro_batch_cut_with_weights():
    torch.manual_seed(1)
    mask = _mask([7, 5, 3, 1, 6, 0], 7)
    mask[0, 2] = 0
    logprob = torch.randn(6, 7) * 0.1 - 1
    old = logprob + torch.randn(6, 7) * 0.3
    adv, weights = torch.randn(6, 7), torch.rand(6, 7) * 2
    for name, mode in LOSS_MODES.items():
        fields = {f for f in mode.params.__dataclass_fields__}
        params = {k: v for k, v in dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0,
                                           tau_neg=1.05).items() if k in fields}
        for agg in AGG_MODES:
            x = logprob.clone().requires_grad_()
            full, full_metrics = mode.fn(x, old, adv, mask, **params, agg_mode=agg, weights=weights)
            full.backward()
            grad, x.grad = x.grad.clone(), None
            total, acc = 0.0, {}
            for piece in (slice(0, 1), slice(1, 4), slice(4, 6)):
                loss, metrics = mode.fn(x[piece], old[piece], adv[piece], mask[piece], **params, agg_mode=agg,
                                        num_global_tokens=mask.sum(), num_global_seqs=6, weights=weights[piece])
                loss.backward()
                total += float(loss.detach())
                for k, v in metrics.items():
                    acc[k] = accumulate(acc.get(k), v, torch.device("cpu"))
            assert abs(total - float(full.detach())) < 1e-6, (name, agg)
            assert torch.allclose(x.grad, grad, atol=1e-6), (name, agg)
            for k, v in full_metrics.items():
                assert abs(metric_value(acc[k]) - metric_value(v)) < 1e-6, (name, agg, k)


def test_kl_estimators_match_verl():
    logprob = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    d = logprob - ref
    assert torch.allclose(kl_penalty(logprob, ref, "k1"), d)
    assert torch.allclose(kl_penalty(logprob, ref, "abs"), d.abs())
    assert torch.allclose(kl_penalty(logprob, ref, "k2"), 0.5 * d ** 2)
    log_r = (ref - logprob).clamp(-20, 20)
    assert torch.allclose(kl_penalty(logprob, ref, "k3"), (log_r.exp() - log_r - 1).clamp(-10, 10))
    x = logprob.clone().requires_grad_()
    kl_penalty(x, ref, "k3+").sum().backward()
    assert torch.allclose(x.grad, d)  # k2's gradient, the value k3's
