"""DAPO's data-side pieces (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at
scale"); its loss-side ones are `actor.clip_ratio_high` (clip-higher) and `actor.loss_agg_mode=token-mean`.

- Dynamic sampling: a group whose responses all got the same reward has zero advantage under a group
  baseline, so it teaches nothing; the trainer drops such groups and generates more until the step has
  `data.train_batch_size` kept ones (`groups_to_keep` says which are, by verl's rule).
- Overlong reward shaping: a soft penalty, growing linearly over the last `buffer_len` tokens before the
  length limit, so a response cut at the limit is told so without the hard cliff of a zero reward.
"""

from __future__ import annotations

import torch


def groups_to_keep(values: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
    """For each sample `(N,)`, whether dynamic sampling keeps its group (the samples of one prompt,
    `prompt_index` `(N,)`): the group's `values` `(N,)` (its filter metric) are not all equal, or it has one
    sample (verl's rule: std > 0, or a single response). A NaN (a value missing) never counts as a spread."""
    _, group = torch.unique(prompt_index, return_inverse=True)  # (N,)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    v = values.double()
    high = torch.full((num_groups,), -torch.inf, dtype=v.dtype).scatter_reduce(0, group, v, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=v.dtype).scatter_reduce(0, group, v, "amin")
    size = torch.zeros(num_groups, dtype=torch.long).scatter_add(0, group, torch.ones_like(group))
    return ((high > low) | (size == 1))[group]


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """The reward added to each response of `lengths` `(N,)` tokens: 0 up to max_new_tokens - buffer_len
    tokens, then falling linearly to -penalty_factor at max_new_tokens (a response cut at the limit)."""
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer length {buffer_len} must be in [1, max_new_tokens={max_new_tokens}]; "
                         "lower reward.overlong_buffer.len or raise rollout.max_new_tokens")
    exceed = lengths.double() - (max_new_tokens - buffer_len)  # (N,)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0).to(torch.float32)
