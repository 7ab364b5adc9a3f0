"""A rollout from a config: the backend `rollout.backend` with its settings, wrapped in the multi-turn loop or
the agent's episodes when the config asks for them. The trainer's generation and `shardrl serve` both build
theirs here, so serving a model imports no trainer."""

from __future__ import annotations

import dataclasses
import torch

from shardrl.config.schema import Config
from shardrl.rollout import Rollout, build_rollout
from shardrl.rollout.episodes.interactions import build_interaction
from shardrl.rollout.episodes.multiturn import MultiTurnRollout


def fast_rollout_kwargs(ro) -> dict:
    """The fast backend's settings from `rollout.fast` and its quantization (the trainer's and `shardrl serve`'s)."""
    return {**dataclasses.asdict(ro.fast), "quantization": ro.quantization, "fp8_block_size": ro.fp8.block_size,
            "fp8_activations": ro.fp8.activations}


def rollout_dtype(device: torch.device) -> torch.dtype:
    """What the rollout computes in: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def the_device() -> torch.device:
    """This process's device: its current GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rollout_from_config(cfg: Config, hf_config, tokenizer, device: torch.device, colocated: bool = False) -> Rollout:
    """The run's rollout (`rollout.backend`, wrapped in the multi-turn loop when `rollout.multi_turn.enable`, in
    the agent's episodes when `rollout.agent.entrypoint`). `colocated`: generation shares the trainer's GPUs;
    with LoRA's adapter-only sync the fast rollout then takes no memory for weights until the first sync (which
    may share the trainer's base)."""
    ro = cfg.rollout
    fast_kwargs = fast_rollout_kwargs(ro) if ro.backend == "fast" else {}
    if fast_kwargs:
        fast_kwargs["record_routing"] = cfg.actor.router_replay.mode == "R3"
    if fast_kwargs and colocated and cfg.model.lora.rank > 0 and ro.lora_sync != "full":
        fast_kwargs["lazy_weights"] = True
    rollout = build_rollout(ro.backend, hf_config, tokenizer, device, rollout_dtype(device),
                            micro_batch_size=ro.micro_batch_size, **fast_kwargs)
    if ro.multi_turn.enable:  # the agent loop drives the backend's generate in rounds, tools in between
        return MultiTurnRollout.from_config(rollout, tokenizer, ro.multi_turn, build_interaction(ro.multi_turn))
    if ro.runs_agent():  # the user's (or an environment's) episodes call an endpoint on the backend
        from shardrl.rollout.episodes.agent import AgentRollout

        return AgentRollout.from_config(rollout, tokenizer, ro, hf_config)
    return rollout
