"""Choices a run makes once at start-up, from the machine and the config: the defaults that depend on the
device (`rollout.backend`, `*.engine.compile` and `rollout.free_cache_engine` left null). Each returns what it
chose and a line saying why, for the log. What a step does is `shardrl.plan.step_plan`'s.
"""

from __future__ import annotations

import copy

import torch

from shardrl.config.schema import Config, ConfigError
from shardrl.plan.compiling import compile_choice
from shardrl.plan.layout import format_size

ENGINE_SECTIONS = ("actor", "ref", "teacher", "critic", "reward")


KEEP_CACHE_FRACTION = 0.80
"""`rollout.free_cache_engine` left null keeps the rollout's cache through the update when the ledger's update
peak plus the cache is at most this share of the GPU's memory. The margin is the ledger's error against measured
peaks (bench/RESULTS.md, "Current figures: Memory ledger"): counting a compiled update's activations as compiled
layers keep them, it predicts the compiled update 6-12% under the measured peak (one H100, 2026-12-08: the update
holds more than its layers' saved tensors), so the kept cache must fit in 80%, not 85% as when the eager count
over-predicted it."""


def resolve_device_defaults(cfg: Config, hf_config=None,
                            memory_gib: tuple[float, float] | None = None) -> tuple[Config, list[str]]:
    """A copy of `cfg` with the device-dependent nulls filled in, and one line per choice.

    On CUDA: `rollout.backend` = fast when the fast rollout supports the policy's `hf_config` (hf otherwise,
    or when `hf_config` is None). On CPU: hf, or fast under actor.router_replay.mode=R3.
    `<section>.engine.compile` = true on CUDA with FSDP2 for a policy of `compiling.COMPILE_MIN_PARAMS` or more
    (`compile_choice`), false otherwise. `rollout.free_cache_engine`: false when `memory_gib` = (the memory
    ledger's update peak plus the rollout's cache, the GPU's size; `memory.update_and_cache_gib`) says the first
    is at most `KEEP_CACHE_FRACTION` of the second; true on CPU or without `memory_gib`."""
    cfg = copy.deepcopy(cfg)
    cuda = torch.cuda.is_available()
    where = "CUDA" if cuda else "CPU"
    lines = []
    ro = cfg.rollout
    if ro.backend is None:
        reason = f"on {where}"
        ro.backend = "hf"
        r3 = cfg.actor.router_replay.mode == "R3"
        if r3 and not cuda:
            reason = "on CPU, as router replay R3 needs the routing the fast rollout records"
        if (cuda or r3) and hf_config is not None:
            from shardrl.models.families import check_supported

            try:
                check_supported(hf_config)
                ro.backend = "fast"
            except ValueError as e:
                reason = f"on CUDA, as the fast rollout cannot run this model ({e})"
        if ro.backend == "hf" and (keys := ro.fast_only_keys()):
            raise ConfigError(f"rollout.{keys[0]} applies to backend=fast only, and rollout.backend=null chose hf "
                              f"{reason}; set rollout.backend=fast or drop rollout.{keys[0]}")
        lines.append(f"rollout.backend={ro.backend} (null: by device, {reason})")
    if ro.backend == "fast" and ro.quantization == "fp8":
        check_fp8_rollout(ro, hf_config, cuda)
    for section in ENGINE_SECTIONS:
        engine = getattr(cfg, section).engine
        if engine.compile is None:
            engine.compile, why = compile_choice(engine, hf_config, cuda)
            lines.append(f"{section}.engine.compile={str(engine.compile).lower()} (null: {why}; "
                         "see EngineConfig.compile)")
    if ro.free_cache_engine is None:
        ro.free_cache_engine, why = free_cache_choice(memory_gib, cuda)
        lines.append(f"rollout.free_cache_engine={str(ro.free_cache_engine).lower()} (null: {why})")
    return cfg, lines


def check_fp8_rollout(ro, hf_config, cuda: bool) -> None:
    """Refuses, before any model is built, an FP8 rollout (`ro`: the rollout section) this run cannot build: block
    scales that do not tile the policy's (`hf_config`) linear layers, FP8 activations without a GPU of compute
    capability 8.9 or more."""
    from shardrl.models.fp8 import check_dynamic_activations, scale_shape

    try:
        if ro.fp8.block_size and hf_config is not None:
            from shardrl.plan.memory import fp8_linear_shapes

            for shape in dict.fromkeys(fp8_linear_shapes(hf_config)):
                scale_shape(shape, ro.fp8.block_size)
        if ro.fp8.activations == "dynamic":
            check_dynamic_activations(torch.device("cuda" if cuda else "cpu"))
    except ValueError as e:
        raise ConfigError(f"rollout.quantization=fp8: {e}") from None


def free_cache_choice(memory_gib: tuple[float, float] | None, cuda: bool) -> tuple[bool, str]:
    """`rollout.free_cache_engine` left null, and why: `memory_gib` as `resolve_device_defaults` takes it."""
    if not cuda:
        return True, "not on CUDA"
    if memory_gib is None:
        return True, "the run's memory is not known here"
    need, gpu = memory_gib
    verdict = "fits in" if need <= KEEP_CACHE_FRACTION * gpu else "exceeds"
    return need > KEEP_CACHE_FRACTION * gpu, (f"the ledger's update peak plus the rollout's cache, "
                                              f"{format_size(need)}, {verdict} {KEEP_CACHE_FRACTION:.0%} of the GPU's "
                                              f"{format_size(gpu, 0)}")


def memory_gib(cfg: Config, layout, hf_config, device: torch.device, say=None) -> tuple[float, float] | None:
    """(the memory ledger's update peak plus the rollout's cache, this GPU's size) in GiB, for
    `resolve_device_defaults`; None on CPU, when `rollout.free_cache_engine` is set, or for a model the ledger
    cannot size (and `say` a line why)."""
    from shardrl.plan.layout import GIB
    from shardrl.plan.memory import phase_ledger, update_and_cache_gib

    if device.type != "cuda" or cfg.rollout.free_cache_engine is not None:
        return None
    try:
        need = update_and_cache_gib(phase_ledger(cfg, layout, hf_config))
    except (ValueError, AttributeError, KeyError) as e:
        if say is not None:
            say(f"the memory ledger cannot size this model ({e}); the rollout frees its cache for training")
        return None
    return need, torch.cuda.get_device_properties(device).total_memory / GIB


def lora_sync_choice(cfg: Config, layout, hf_config, device: torch.device,
                     gpu_gib: float | None = None) -> tuple[str, str]:
    """`rollout.lora_sync` left null (with model.lora), and why. full where nothing else applies (the hf backend,
    which `rollout.backend` left null takes on CPU and for models the fast rollout cannot run; rollout ranks of
    their own). Else merged (the plain model's decode step, measured faster: bench/RESULTS.md, "LoRA") where the
    memory ledger's peak with the rollout's own merged copy is at most `KEEP_CACHE_FRACTION` of this GPU, and
    unmerged (the rollout reads the actor's base: the model held once) where it is not. Settled before
    `memory_gib`, so that the cache's choice counts the copy. `gpu_gib`: the GPU's size where `device` is not
    this machine's (`shardrl plan --gpu-mem-gib`)."""
    from shardrl.plan.layout import GIB
    from shardrl.plan.memory import phase_ledger

    if cfg.async_rl.rollout_ranks > 0:
        return "full", "the rollout ranks of their own receive the merged model whole"
    backend = cfg.rollout.backend
    if backend is None:  # as resolve_device_defaults will resolve it
        backend = "hf"
        if device.type == "cuda":
            from shardrl.models.families import check_supported

            try:
                check_supported(hf_config)
                backend = "fast"
            except ValueError:
                pass
    if backend != "fast":
        return "full", f"the {backend} rollout loads the merged model whole"
    if device.type != "cuda":
        return "unmerged", "not on CUDA"
    merged = copy.deepcopy(cfg)
    merged.rollout.lora_sync = "merged"
    try:
        peak = phase_ledger(merged, layout, hf_config)["peak_gib"]
    except (ValueError, AttributeError, KeyError) as e:
        return "unmerged", f"the memory ledger cannot size this model ({e})"
    gpu = gpu_gib if gpu_gib is not None else torch.cuda.get_device_properties(device).total_memory / GIB
    if peak <= KEEP_CACHE_FRACTION * gpu:
        return "merged", (f"the ledger's peak with a merged copy, {format_size(peak)}, fits in "
                          f"{KEEP_CACHE_FRACTION:.0%} of the GPU's {format_size(gpu, 0)}")
    return "unmerged", (f"the ledger's peak with a merged copy, {format_size(peak)}, exceeds "
                        f"{KEEP_CACHE_FRACTION:.0%} of the GPU's {format_size(gpu, 0)}: the rollout reads the actor's "
                        "base")
