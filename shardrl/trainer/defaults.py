"""Choices a run makes once at start-up, from the machine and the config: the defaults that depend on the
device (`rollout.backend`, `*.engine.compile` left null) and whether the old log-probs need a pass of
their own (`actor.recompute_old_log_probs`). Each returns what it chose and a line saying why, for the log.
"""

from __future__ import annotations

import copy

import torch

from shardrl.config import Config, ConfigError

ENGINE_SECTIONS = ("actor", "ref", "critic", "reward")


def resolve_device_defaults(cfg: Config, hf_config=None) -> tuple[Config, list[str]]:
    """A copy of `cfg` with the device-dependent nulls filled in, and one line per choice.

    On CUDA: `rollout.backend` = fast when the fast rollout supports the policy's `hf_config` (hf otherwise,
    or when `hf_config` is None). On CPU: hf. `<section>.engine.compile` = false on both (see below)."""
    cfg = copy.deepcopy(cfg)
    cuda = torch.cuda.is_available()
    where = "CUDA" if cuda else "CPU"
    lines = []
    ro = cfg.rollout
    if ro.backend is None:
        reason = f"on {where}"
        ro.backend = "hf"
        if cuda and hf_config is not None:
            from shardrl.rollout.families import check_supported

            try:
                check_supported(hf_config)
                ro.backend = "fast"
            except ValueError as e:
                reason = f"on CUDA, as the fast rollout cannot run this model ({e})"
        if ro.backend == "hf" and (keys := ro.fast_only_keys()):
            raise ConfigError(f"rollout.{keys[0]} applies to backend=fast only, and rollout.backend=null chose hf "
                              f"{reason}; set rollout.backend=fast or drop rollout.{keys[0]}")
        lines.append(f"rollout.backend={ro.backend} (null: by device, {reason})")
    for section in ENGINE_SECTIONS:
        engine = getattr(cfg, section).engine
        if engine.compile is None:
            # off on every device for now: on a cold H200 (2026-11-30) the built-in demo with compiled engines
            # (dynamic micro-batch shapes, recompiled per shape) finished no step within 150 s
            engine.compile = False
            lines.append(f"{section}.engine.compile=false (null: off on {where}; true pays off for large "
                         "models, see EngineConfig.compile)")
    return cfg, lines


def old_log_probs_from_update(cfg: Config) -> tuple[bool, str]:
    """Whether the actor update may take its old log-probs from its own forward (detached), skipping the
    forward pass that computes them before the update; and why, in words.

    Exact when that forward is the pass the old log-probs would come from: the parameters the old pass
    would see are the ones the update's only optimizer step starts from (one mini-batch, one epoch; the
    engine's `train_batch` runs each micro-batch forward once), at the same temperature (the trainer passes
    the rollout's `logprob_temperature` to both), and without dropout (training runs in train mode). Nothing
    may read the old log-probs before the update: KL in the reward does (it shapes the advantages)."""
    a = cfg.actor
    if a.recompute_old_log_probs == "always":
        return False, "actor.recompute_old_log_probs=always"
    blockers = []
    if a.ppo_mini_batch_size != cfg.data.train_batch_size:
        blockers.append(f"{cfg.data.train_batch_size // a.ppo_mini_batch_size} mini-batches per step "
                        f"(actor.ppo_mini_batch_size={a.ppo_mini_batch_size} < data.train_batch_size="
                        f"{cfg.data.train_batch_size})")
    if a.ppo_epochs != 1:
        blockers.append(f"actor.ppo_epochs={a.ppo_epochs}")
    if cfg.algorithm.use_kl_in_reward:
        blockers.append("algorithm.use_kl_in_reward reads them before the advantages")
    if cfg.algorithm.rollout_is:
        blockers.append("algorithm.rollout_is weighs the loss by them against the sampler's")
    if not cfg.model.disable_dropout:
        blockers.append("model.disable_dropout=false (the update's forward may draw dropout masks)")
    if blockers:
        return False, "recomputed before the update (actor.recompute_old_log_probs=auto): " + "; ".join(blockers)
    return True, ("taken from the update's own forward, detached (actor.recompute_old_log_probs=auto: one "
                  "mini-batch, one epoch, so the PPO ratio is exactly 1 there); no separate forward pass")
