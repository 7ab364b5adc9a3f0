"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, lr: float, betas, eps: float, weight_decay: float,
                    fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; `fused`: one kernel for all parameters (on a CUDA device, or torch's vectorized CPU kernel for
    parameters offloaded to the host)."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=fused or None)


def lr_lambda(step: int, warmup_steps: int, total_steps: int | None, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base LR after `step` optimizer steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not total_steps:
        return 1.0
    if schedule == "cosine":
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}; choose 'constant' or 'cosine'")


def build_lr_scheduler(optimizer, warmup_steps: int, warmup_ratio: float, total_steps: int | None,
                       schedule: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    if warmup_ratio > 0:
        if not total_steps:
            raise ValueError("optim.warmup_ratio needs optim.total_steps (or trainer.total_steps) to be set")
        warmup_steps = int(warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup_steps, total_steps, schedule, min_lr_ratio)
    )


def continue_lr_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, base_lrs: list[float]) -> None:
    """After a resume restored `scheduler`'s step and the optimizer's LR: this run's schedule (`base_lrs`, its
    length and shape) at that step, as a fresh run of these settings would have it. The restored LR is the saving
    run's: with trainer.total_steps raised, a cosine schedule's end (min_lr_ratio) for one step, then this one's."""
    step = scheduler.last_epoch
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
