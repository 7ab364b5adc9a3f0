"""Pairwise preference losses: DPO's sigmoid loss and its variants as TRL's DPOTrainer names them, SimPO
(`PREFERENCE_LOSSES`), and the Bradley-Terry loss of a reward model. Small pure functions of per-pair tensors `(P,)`.

A preference loss takes the policy's summed log-probs of the chosen and rejected completions (`pc`, `pr`), the
reference's (`rc`, `rr`; None for a reference-free loss) and the completions' token counts (`nc`, `nr`), and
returns per-pair losses, the implicit rewards and the log-probs TRL logs (rewards/*, logps/*), as TRL computes them.
With the log-ratios c = pc - rc, r = pr - rr, d = c - r, eps the label smoothing, and every reward beta * (p - r)
but simpo's:
- sigmoid (DPO, Rafailov et al. 2023; with conservative DPO's label smoothing eps, 0 by default, as TRL before 1.0
  and its CPO trainer; TRL 1.x's sigmoid ignores label_smoothing, the same loss at eps = 0):
  loss = -(1 - eps) log s(beta d) - eps log s(-beta d);
- ipo (Azar et al. 2023, eq. 17, on log-ratios per completion token as TRL and the authors do):
  h = c / nc - r / nr, loss = (h - 1 / (2 beta))^2;
- hinge (SLiC, Zhao et al. 2023): relu(1 - beta d);
- robust (rDPO, Chowdhury et al. 2024; eps the share of flipped labels):
  (-(1 - eps) log s(beta d) + eps log s(-beta d)) / (1 - 2 eps);
- exo_pair (EXO, Ji et al. 2024, eq. 16; eps > 0): s(beta d) (log s(beta d) - log(1 - eps))
  + s(-beta d) (log s(-beta d) - log eps);
- nca_pair (Chen et al. 2024): -log s(beta c) - log s(-beta c) / 2 - log s(-beta r) / 2;
- bco_pair (Jung et al. 2024, as TRL 1.x: no running reward shift): -log s(beta c) - log s(-beta r);
- sppo_hard (Wu et al. 2024, hard probabilities): (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2;
- apo_zero, apo_down (D'Oosterlinck et al. 2024, eqs. 7 and 8): 1 - s(beta c) + s(beta r), and
  s(beta c) + 1 - s(beta d);
- sigmoid_norm (DPO on per-token log-ratios): -log s(beta (c / nc - r / nr));
- simpo (Meng et al. 2024), reference-free, on per-token mean log-probs a = p / n:
  z = beta * (ac - ar) - gamma, loss = -(1 - eps) log s(z) - eps log s(-z), reward = beta * a, logps a.
Left out of TRL's list: aot and aot_unpaired (they sort the pairs of a batch, so a pair's loss depends on how the
batch is cut into micro-batches) and discopop.
"""

from __future__ import annotations

import math
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


def _ratio_rewards(pc, pr, rc, rr, p: PreferenceParams):
    """(chosen rewards, rejected rewards, chosen logps, rejected logps) as every reference-based loss logs them."""
    return p.beta * (pc - rc).detach(), p.beta * (pr - rr).detach(), pc, pr


def hinge_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    d = (pc - rc) - (pr - rr)
    return torch.relu(1 - p.beta * d), *_ratio_rewards(pc, pr, rc, rr, p)


def robust_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    z, eps = p.beta * ((pc - rc) - (pr - rr)), p.label_smoothing
    loss = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    return loss, *_ratio_rewards(pc, pr, rc, rr, p)


def exo_pair_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    z, eps = p.beta * ((pc - rc) - (pr - rr)), p.label_smoothing
    loss = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    return loss, *_ratio_rewards(pc, pr, rc, rr, p)


def nca_pair_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    c, r = p.beta * (pc - rc), p.beta * (pr - rr)
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r), *_ratio_rewards(pc, pr, rc, rr, p)


def bco_pair_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    c, r = p.beta * (pc - rc), p.beta * (pr - rr)
    return -F.logsigmoid(c) - F.logsigmoid(-r), *_ratio_rewards(pc, pr, rc, rr, p)


def sppo_hard_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    loss = ((pc - rc) - 0.5 / p.beta) ** 2 + ((pr - rr) + 0.5 / p.beta) ** 2
    return loss, *_ratio_rewards(pc, pr, rc, rr, p)


def apo_zero_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    loss = 1 - torch.sigmoid(p.beta * (pc - rc)) + torch.sigmoid(p.beta * (pr - rr))
    return loss, *_ratio_rewards(pc, pr, rc, rr, p)


def apo_down_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    loss = torch.sigmoid(p.beta * (pc - rc)) + 1 - torch.sigmoid(p.beta * ((pc - rc) - (pr - rr)))
    return loss, *_ratio_rewards(pc, pr, rc, rr, p)


def sigmoid_norm_loss(pc, pr, rc, rr, nc, nr, p: PreferenceParams):
    h = (pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)
    return -F.logsigmoid(p.beta * h), *_ratio_rewards(pc, pr, rc, rr, p)


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
    "hinge": PreferenceLoss(hinge_loss, uses_ref=True),
    "robust": PreferenceLoss(robust_loss, uses_ref=True),
    "exo_pair": PreferenceLoss(exo_pair_loss, uses_ref=True),
    "nca_pair": PreferenceLoss(nca_pair_loss, uses_ref=True),
    "bco_pair": PreferenceLoss(bco_pair_loss, uses_ref=True),
    "sppo_hard": PreferenceLoss(sppo_hard_loss, uses_ref=True),
    "apo_zero": PreferenceLoss(apo_zero_loss, uses_ref=True),
    "apo_down": PreferenceLoss(apo_down_loss, uses_ref=True),
    "sigmoid_norm": PreferenceLoss(sigmoid_norm_loss, uses_ref=True),
    "simpo": PreferenceLoss(simpo_loss, uses_ref=False),
}


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-row losses and implicit rewards `(B,)` (Ethayarajh et al. 2024, eq. 7, as TRL's KTOTrainer): with
    the log-ratio z = logps - ref_logps and `kl` the batch's (detached) KL estimate, a desirable row's loss is
    desirable_weight * (1 - s(beta (z - kl))), an undesirable one's undesirable_weight * (1 - s(beta (kl - z)));
    the reward is beta * z."""
    ratio = logps - ref_logps
    losses = torch.where(desirable.bool(), desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, beta * ratio.detach()


def chosen_nll(log_probs: torch.Tensor, loss_mask: torch.Tensor, num_chosen_tokens) -> torch.Tensor:
    """RPO's NLL term (Pang et al. 2024; TRL's `rpo_alpha`, now its "sft" loss type): the sum of -log p over the
    chosen completions' tokens of rows laid out chosen, rejected, ... (`log_probs`, `loss_mask` (2P, T)), divided by
    `num_chosen_tokens`, the chosen tokens of the whole global batch (a token mean however the batch is cut)."""
    return -masked_sum(log_probs[0::2], loss_mask[0::2]) / num_chosen_tokens


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
