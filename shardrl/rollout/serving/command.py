"""`shardrl serve`: a config's model on an OpenAI-compatible endpoint (the server itself is
`shardrl.rollout.serving.app`; its front end in a process of its own, `shardrl.rollout.serving.frontend`)."""

from __future__ import annotations

import logging

import torch

from shardrl.rollout.serving.frontend import ServerProcess  # noqa: F401  (for callers)
from shardrl.rollout.serving.app import ServeOptions, ServerThread, build_app  # noqa: F401  (for callers)
from shardrl.rollout.serving.batcher import Batcher

log = logging.getLogger(__name__)


def build_server(cfg, served_name: str | None = None, max_batch: int | None = None, stream: bool | None = None,
                 options: ServeOptions | None = None, lora_modules: list | None = None):
    """The app of `build_engine`'s batcher (served in this process: `ServerThread`, or uvicorn)."""
    return build_app(*build_engine(cfg, served_name, max_batch, stream, lora_modules), options=options)


def build_engine(cfg, served_name: str | None = None, max_batch: int | None = None, stream: bool | None = None,
                 lora_modules: list | None = None, stream_interval: int = 1, default_max_tokens: int | None = None):
    """(batcher, served name, context length, default max_tokens): what serves a config's model (`model.path`, or
    `model.tiny` with `model.tokenizer_path`) on its rollout backend (`rollout.backend`; null: fast on CUDA where it
    supports the model, else hf) on this machine's GPU, or the CPU; the context length is the model's
    `max_position_embeddings`; a request without max_tokens gets `default_max_tokens` (None: `rollout.max_new_tokens`;
    `shardrl serve` passes its --default-max-tokens), at most what is left of the context. `stream`:
    continuous batching (`Batcher`; null: where the backend can). `lora_modules` (`lora_adapters.LoraModule`s):
    PEFT LoRA adapters over the model, each served under its own name (`shardrl serve --lora-modules`)."""
    from pathlib import Path

    from shardrl.engine.model import build_causal_lm, check_model_weights, load_hf_config
    from shardrl.models.config import text_config
    from shardrl.rollout import build_rollout
    from shardrl.tokenizer import load_tokenizer
    from shardrl.plan.defaults import resolve_device_defaults
    from shardrl.rollout.build import fast_rollout_kwargs, rollout_dtype, the_device

    hf_config = load_hf_config(cfg.model.path, cfg.model.tiny, override=cfg.model.override_config)
    if cfg.model.path:
        check_model_weights(cfg.model.path)
    cfg, choices = resolve_device_defaults(cfg, hf_config)
    for line in choices:
        log.info(line)
    tokenizer = load_tokenizer(cfg)
    device = the_device()
    ro, dtype = cfg.rollout, rollout_dtype(device)
    fast = fast_rollout_kwargs(ro) if ro.backend == "fast" else {}
    rollout = build_rollout(ro.backend, hf_config, tokenizer, device, dtype, micro_batch_size=ro.micro_batch_size,
                            **fast)  # the bare backend: a config's multi-turn or agent settings are the trainer's
    lm = build_causal_lm(hf_config, cfg.model.path, "cpu", dtype, seed=0)  # (seed 0: the engine's tiny init)
    rollout.load_weights(lm.named_parameters())  # (copied to the device: no second copy there)
    linears = {n: tuple(m.weight.shape) for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)}
    del lm
    name = served_name or (Path(cfg.model.path).name if cfg.model.path else "shardrl-tiny")
    adapters = None
    if lora_modules:
        from shardrl.rollout.lora_adapters import load_served_adapters

        adapters = load_served_adapters(rollout, list(lora_modules), linears, name)
    context = int(getattr(text_config(hf_config), "max_position_embeddings", 2048))
    batcher = Batcher(rollout, tokenizer, max_batch or cfg.rollout.fast.max_batch or 64, context, stream=stream,
                      adapters=adapters, stream_interval=stream_interval)
    return batcher, name, context, default_max_tokens or cfg.rollout.max_new_tokens
