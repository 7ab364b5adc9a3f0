"""Choices a run makes once at start-up, from the machine and the config: the defaults that depend on the
device (`rollout.backend`, `*.engine.compile` left null) and whether the old log-probs need a pass of
their own (`actor.recompute_old_log_probs`). Each returns what it chose and a line saying why, for the log.
"""

from __future__ import annotations

import copy

import torch

from shardrl.config import Config, ConfigError

ENGINE_SECTIONS = ("actor", "ref", "critic", "reward")
COMPILE_MIN_PARAMS = 500_000_000
"""`engine.compile` left null is on, on CUDA, for a policy of this many matmul parameters and more: compiling
costs tens of seconds once and pays back on models whose steps take seconds (see `resolve_device_defaults`)."""


KEEP_CACHE_FRACTION = 0.85
"""`rollout.free_cache_engine` left null keeps the rollout's cache through the update when the ledger's update
peak plus the cache is at most this share of the GPU's memory (the ledger was within 15% of measured peaks)."""


def resolve_device_defaults(cfg: Config, hf_config=None,
                            memory_gib: tuple[float, float] | None = None) -> tuple[Config, list[str]]:
    """A copy of `cfg` with the device-dependent nulls filled in, and one line per choice.

    On CUDA: `rollout.backend` = fast when the fast rollout supports the policy's `hf_config` (hf otherwise,
    or when `hf_config` is None). On CPU: hf. `<section>.engine.compile` = true on CUDA with FSDP2 for a policy of
    `COMPILE_MIN_PARAMS` or more, false otherwise. `rollout.free_cache_engine`: false when `memory_gib` =
    (the memory ledger's update peak plus the rollout's cache, the GPU's size; `memory.update_and_cache_gib`)
    says the first is at most `KEEP_CACHE_FRACTION` of the second; true on CPU or without `memory_gib`."""
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
    size = None
    if hf_config is not None:
        from shardrl.trainer.perf import model_shape

        try:
            size = model_shape(hf_config).num_params
        except ValueError:  # a config without the usual names: no size, no compile
            size = None
    for section in ENGINE_SECTIONS:
        engine = getattr(cfg, section).engine
        if engine.compile is None:
            # on CUDA for models of COMPILE_MIN_PARAMS and more, with FSDP2 (bench/e2e.py, one H200, 1.5B, 512
            # samples: 8.9 s a step against 10.4 s, two slower steps first); off for small ones (the built-in
            # demo with compiled engines, dynamic micro-batch shapes, finished no step within 150 s) and on CPU
            engine.compile = bool(cuda and engine.strategy == "fsdp2" and size is not None
                                  and size >= COMPILE_MIN_PARAMS)
            if not cuda:
                why = "off on CPU"
            elif engine.strategy != "fsdp2":
                why = "FSDP1 does not compile"
            elif size is None:
                why = "on CUDA, but the model's size is unknown"
            else:
                why = f"on CUDA, the model's {size / 1e9:.2f}B matmul parameters {'>=' if engine.compile else '<'} " \
                      f"{COMPILE_MIN_PARAMS / 1e9:g}B"
            lines.append(f"{section}.engine.compile={str(engine.compile).lower()} (null: {why}; "
                         "see EngineConfig.compile)")
    if ro.free_cache_engine is None:
        ro.free_cache_engine, why = free_cache_choice(memory_gib, cuda)
        lines.append(f"rollout.free_cache_engine={str(ro.free_cache_engine).lower()} (null: {why})")
    return cfg, lines


def free_cache_choice(memory_gib: tuple[float, float] | None, cuda: bool) -> tuple[bool, str]:
    """`rollout.free_cache_engine` left null, and why: `memory_gib` as `resolve_device_defaults` takes it."""
    if not cuda:
        return True, "not on CUDA"
    if memory_gib is None:
        return True, "the run's memory is not known here"
    need, gpu = memory_gib
    verdict = "fits in" if need <= KEEP_CACHE_FRACTION * gpu else "exceeds"
    return need > KEEP_CACHE_FRACTION * gpu, (f"the ledger's update peak plus the rollout's cache, {need:.1f} GiB, "
                                              f"{verdict} {KEEP_CACHE_FRACTION:.0%} of the GPU's {gpu:.0f} GiB")


def old_log_probs_from_update(cfg: Config) -> tuple[bool, str]:
    """Whether the actor update may take its old log-probs from its own forward (detached), skipping the
    forward pass that computes them before the update; and why, in words.

    Exact when that forward is the pass the old log-probs would come from: the parameters the old pass
    would see are the ones the update's only optimizer step starts from (one mini-batch, one epoch; the
    engine's `train_batch` runs each micro-batch forward once), at the same temperature (the trainer passes
    the rollout's `logprob_temperature` to both), and without dropout (training runs in train mode). Nothing
    may read the old log-probs before the update: KL in the reward does (it shapes the advantages). The
    rollout correction's truncated weights (algorithm.rollout_is, mode truncate) are then computed in the loss
    from the same detached forward; mask mode is not, as it changes the token count the loss divides by."""
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
    if cfg.algorithm.rollout_is and cfg.algorithm.rollout_is_mode == "mask":
        blockers.append("algorithm.rollout_is_mode=mask drops tokens from the loss mask before the update, "
                        "and the loss is normalized by that mask's token count")
    if not cfg.model.disable_dropout:
        blockers.append("model.disable_dropout=false (the update's forward may draw dropout masks)")
    if blockers:
        return False, "recomputed before the update (actor.recompute_old_log_probs=auto): " + "; ".join(blockers)
    return True, ("taken from the update's own forward, detached (actor.recompute_old_log_probs=auto: one "
                  "mini-batch, one epoch, so the PPO ratio is exactly 1 there); no separate forward pass")
