"""Advantage estimators: pure functions of tensors, looked up by name in ADVANTAGE_ESTIMATORS.

Every estimator returns `(advantages, returns)`, both `(B, T)` over response tokens, 0 on padding.
Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) take one scalar score per sample `(B,)` and an
`index` `(B,)` of group ids (samples of one prompt share an id; groups need not be contiguous); their
returns equal their advantages. Token-level estimators (GAE, REINFORCE++) take `token_rewards`
`(B, T)`; `scores_to_token_rewards` makes those from scores.

Whitening here is over this call's batch; the engine keeps a GRPO group on one rank, so group
statistics are exact, but batch-wide whitening (GAE, REINFORCE++) is per rank.
"""

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from shardrl.algos.masked import masked_whiten


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put a per-sample value `(B,)` on every real token `(B, T)`; padding gets 0."""
    zero = torch.zeros((), dtype=per_sample.dtype, device=per_sample.device)
    return torch.where(mask.bool(), per_sample.unsqueeze(-1), zero)  # (B, T)


def _group_stats(scores: torch.Tensor, index: torch.Tensor):
    """Per-sample group size, group sum and unbiased group std (like torch.std), each `(B,)`."""
    ids, group = torch.unique(index, return_inverse=True)  # (G,), (B,) ids 0..G-1
    num_groups = ids.numel()
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, group, torch.ones_like(scores))  # (G,)
    sums = torch.zeros_like(counts).index_add_(0, group, scores)  # (G,)
    means = sums / counts  # (G,)
    sq_dev = (scores - means[group]) ** 2  # (B,)
    sq_dev_sums = torch.zeros_like(counts).index_add_(0, group, sq_dev)  # (G,)
    stds = torch.sqrt(sq_dev_sums / (counts - 1).clamp(min=1))  # (G,)
    return counts[group], sums[group], stds[group]


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's score `(B,)` on its last real token; everything else 0 -> `(B, T)`."""
    positions = torch.arange(mask.shape[-1], device=mask.device)  # (T,)
    last = torch.where(mask.bool(), positions, 0).max(dim=-1).values  # (B,)
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)  # (B, T)
    rewards.scatter_(1, last.unsqueeze(-1), scores.unsqueeze(-1))
    return torch.where(mask.bool(), rewards, 0.0)  # a row with no real token gets nothing


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
):
    """Generalized advantage estimation over real tokens.

    The reverse scan steps over padding (and over masked holes, e.g. tool-output tokens in a
    multi-turn response) without changing its carried state, so the next value after the last real
    token is 0 and a hole is skipped as if absent. returns = advantages + values (before whitening).
    """
    valid = mask.bool()  # (B, T)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    last_gae = torch.zeros_like(values[:, 0])  # (B,)
    advantages = torch.zeros_like(values)  # (B, T)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        gae_t = delta + gamma * lam * last_gae  # (B,)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        last_gae = torch.where(valid[:, t], gae_t, last_gae)
        advantages[:, t] = last_gae
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    returns = torch.where(valid, advantages + values, zero)  # (B, T)
    advantages = masked_whiten(advantages, mask) if whiten else torch.where(valid, advantages, zero)
    return advantages, returns


def compute_grpo(
    scores: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
):
    """GRPO: (s - group mean) / (group std + eps); `norm_by_std=False` drops the division (Dr.GRPO).

    As in verl, a group of one sample uses mean 0 and std 1, so its advantage is its score / (1 + eps).
    """
    counts, sums, stds = _group_stats(scores, index)  # (B,) each
    single = counts == 1  # (B,)
    means = torch.where(single, 0.0, sums / counts)  # (B,)
    stds = torch.where(single, 1.0, stds)  # (B,)
    adv = scores - means  # (B,)
    if norm_by_std:
        adv = adv / (stds + eps)
    adv = _broadcast(adv, mask)  # (B, T)
    return adv, adv


def compute_rloo(scores: torch.Tensor, mask: torch.Tensor, index: torch.Tensor):
    """REINFORCE leave-one-out: s_i minus the mean of the other samples of its group.

    A group of one has no others: its advantage is its score.
    """
    counts, sums, _ = _group_stats(scores, index)  # (B,) each
    others_mean = (sums - scores) / (counts - 1).clamp(min=1)  # (B,)
    adv = torch.where(counts == 1, scores, scores - others_mean)  # (B,)
    adv = _broadcast(adv, mask)  # (B, T)
    return adv, adv


def compute_reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, whiten: bool = True):
    """REINFORCE++: discounted return-to-go per token, whitened over all real tokens of the batch.

    Masked tokens are skipped as if absent, as GAE skips them: the return carries over a hole (e.g. a tool
    turn inside a multi-turn response) unchanged and undiscounted, so a model turn before a tool call gets
    the outcome reward of the conversation, discounted by the model tokens after it only. Trailing padding
    carries nothing (nothing real follows it); masked tokens get return 0.
    """
    valid = mask.bool()  # (B, T)
    running = torch.zeros_like(token_rewards[:, 0])  # (B,)
    returns = torch.zeros_like(token_rewards)  # (B, T)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return (masked_whiten(returns, mask) if whiten else returns), returns


def compute_reinforce_plus_plus_baseline(scores: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
                                         whiten: bool = True):
    """REINFORCE++-baseline: subtract the group mean (0 for a group of one), broadcast over tokens,
    then whiten over all real tokens of the batch."""
    counts, sums, _ = _group_stats(scores, index)  # (B,) each
    adv = torch.where(counts == 1, scores, scores - sums / counts)  # (B,)
    adv = _broadcast(adv, mask)  # (B, T)
    adv = masked_whiten(adv, mask) if whiten else adv
    return adv, adv


def _group_position_baseline(values: torch.Tensor, valid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each real token's leave-one-out baseline `(B, T)`: the mean of `values` at the same response position over
    the other samples of its group that reach it (0 where none does). It does not depend on the token itself, so
    subtracting it leaves the policy gradient's expectation as it was and only lowers its variance."""
    _, group = torch.unique(index, return_inverse=True)  # (B,)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    real = valid.to(values.dtype)
    sums = values.new_zeros(num_groups, values.shape[1]).index_add_(0, group, values * real)  # (G, T)
    counts = values.new_zeros(num_groups, values.shape[1]).index_add_(0, group, real)  # (G, T)
    others = (counts[group] - real).clamp(min=1)  # (B, T)
    return torch.where(valid & (counts[group] > 1), (sums[group] - values * real) / others, 0.0)


def compute_opd(scores: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, old_log_probs: torch.Tensor,
                teacher_log_probs: torch.Tensor, kl_coef: float = 1.0, reward_coef: float = 0.0,
                norm_by_std: bool = True, baseline: str = "none"):
    """On-policy distillation: each sampled token's advantage is its reverse-KL reward
    -kl_coef * (log p_student - log p_teacher) `(B, T)`, plus `reward_coef` times the verifier's GRPO advantage
    (skipped at 0). Per token, not summed to the end: each token is pushed toward the teacher by its own log-ratio
    (the per-token estimator of verl's and Thinking Machines' OPD); the student's log-probs are the old ones.
    `baseline="group"`: the reverse-KL reward minus `_group_position_baseline` (the other samples of the prompt at
    the same position), before the verifier's term."""
    valid = mask.bool()
    adv = torch.where(valid, -kl_coef * (old_log_probs - teacher_log_probs), 0.0)  # (B, T)
    if baseline == "group":
        adv = adv - _group_position_baseline(adv, valid, index)
    if reward_coef:
        adv = adv + reward_coef * compute_grpo(scores, mask, index, norm_by_std)[0]
    return adv, adv


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs from the step, declared once (the step plan reads this).

    Calling it calls `fn`. `compute(inputs)` passes `fn` the entries of `inputs` its parameters name
    (`token_rewards`, `scores`, `values`, `mask`, `index`, `gamma`, `lam`, `norm_by_std`, ...) and `whiten=False`
    when it takes `whiten`: batch-wide whitening is the caller's, over every rank's tokens."""

    fn: Callable
    needs_critic: bool = False
    """Takes `values`: the step builds a critic and trains it on `returns`."""
    group_baseline: bool = False
    """Compares the responses to one prompt (a group of one: no baseline; dynamic sampling keeps informative groups)."""
    whiten: bool = False
    """The advantages are whitened over the whole batch of all data-parallel ranks after `fn`."""
    returns_are_advantages: bool = False
    """The returns are the (whitened) advantages."""
    needs_teacher: bool = False
    """Takes `teacher_log_probs` (and `old_log_probs`): the step builds the teacher and runs it before this."""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def compute(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        params = inspect.signature(self.fn).parameters
        kwargs = {name: inputs[name] for name in params if name in inputs}
        if "whiten" in params:
            kwargs["whiten"] = False
        return self.fn(**kwargs)


ADVANTAGE_ESTIMATORS = {
    "gae": Estimator(compute_gae, needs_critic=True, whiten=True),
    "grpo": Estimator(compute_grpo, group_baseline=True, returns_are_advantages=True),
    "rloo": Estimator(compute_rloo, group_baseline=True, returns_are_advantages=True),
    "reinforce_plus_plus": Estimator(compute_reinforce_plus_plus, whiten=True),
    "reinforce_plus_plus_baseline": Estimator(compute_reinforce_plus_plus_baseline, group_baseline=True, whiten=True,
                                              returns_are_advantages=True),
    "opd": Estimator(compute_opd, needs_teacher=True, returns_are_advantages=True),
}
"""Advantage estimators by `algorithm.adv_estimator`; a new one is a function and a line here."""
