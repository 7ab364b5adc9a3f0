"""Pairwise preference losses: DPO's sigmoid loss, IPO and SimPO (`PREFERENCE_LOSSES`), and the Bradley-Terry
loss of a reward model. Small pure functions of per-pair tensors `(P,)`.

A preference loss takes the policy's summed log-probs of the chosen and rejected completions (`pc`, `pr`), the
reference's (`rc`, `rr`; None for a reference-free loss) and the completions' token counts (`nc`, `nr`), and
returns per-pair losses, the implicit rewards and the log-probs TRL logs (rewards/*, logps/*), as TRL computes them:
- sigmoid (DPO, Rafailov et al. 2023; with conservative DPO's label smoothing eps, 0 by default):
  z = beta * ((pc - rc) - (pr - rr)), loss = -(1 - eps) log s(z) - eps log s(-z), reward = beta * (p - r);
- ipo (Azar et al. 2023, eq. 17, on log-ratios per completion token as TRL and the authors do):
  h = (pc - rc) / nc - (pr - rr) / nr, loss = (h - 1 / (2 beta))^2, reward = beta * (p - r);
- simpo (Meng et al. 2024), reference-free, on per-token mean log-probs a = p / n:
  z = beta * (ac - ar) - gamma, loss = -(1 - eps) log s(z) - eps log s(-z), reward = beta * a, logps a.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from shardrl.algos.masked import masked_sum


@dataclass(frozen=True)
class PreferenceParams:
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


def _smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


def dpo_sigmoid_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    z = p.beta * ((pc - rc) - (pr - rr))
    return _smoothed_sigmoid(z, p.label_smoothing), p.beta * (pc - rc).detach(), p.beta * (pr - rr).detach(), pc, pr


def ipo_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    h = (pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)
    return (h - 1 / (2 * p.beta)) ** 2, p.beta * (pc - rc).detach(), p.beta * (pr - rr).detach(), pc, pr


def simpo_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    ac, ar = pc / nc.clamp(min=1), pr / nr.clamp(min=1)
    z = p.beta * (ac - ar) - p.simpo_gamma
    return _smoothed_sigmoid(z, p.label_smoothing), p.beta * ac.detach(), p.beta * ar.detach(), ac, ar


@dataclass(frozen=True)
class PreferenceLoss:
    fn: Callable
    """(pc, pr, rc, rr, nc, nr, params) -> (losses, chosen rewards, rejected rewards, chosen logps, rejected
    logps), each (P,)."""
    uses_ref: bool
    """Needs the reference policy's log-probs."""


PREFERENCE_LOSSES = {
    "sigmoid": PreferenceLoss(dpo_sigmoid_loss, uses_ref=True),
    "ipo": PreferenceLoss(ipo_loss, uses_ref=True),
    "simpo": PreferenceLoss(simpo_loss, uses_ref=False),
}


def sequence_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's log-prob of its masked tokens `(B,)`, the sum of per-token `log_probs` `(B, T)`."""
    return masked_sum(log_probs, mask, dim=-1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_coefficient: float = 0.0,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """A reward model's per-pair loss `(P,)`: -log s(r_c - r_r - margin) (TRL's per-pair `margin` column, 0
    without one), plus center_coefficient * (r_c + r_r)^2 (TRL's `center_rewards_coefficient`, which keeps the
    rewards near zero)."""
    loss = -F.logsigmoid(chosen - rejected - (0.0 if margin is None else margin.to(chosen.dtype)))
    return loss + center_coefficient * (chosen + rejected) ** 2 if center_coefficient else loss
