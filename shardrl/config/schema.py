"""The config schema: typed dataclasses, one per part of a run, kept by section in the modules beside this one
(`engine`, `rollout`, `algorithm`, `rl`, `command`, `offline`); the loader lives in `shardrl.config.load`, the
rules between fields in `shardrl.config.checks`, the trainers in `shardrl.config.registry`. This module gathers
their names.

    cfg = load_config("run.yaml", ["actor.optim.lr=1e-5", "rollout.n=8"])

Batch sizes follow docs/design.md: `data.train_batch_size` and `*.ppo_mini_batch_size` count prompts and
are global; per-rank sizes are derived from them and the world size elsewhere. Each section's
`validate(prefix)` rejects values that cannot work whatever the world size; checks that need the
world size run when the run is laid out.
"""

from __future__ import annotations

from shardrl.config.algorithm import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    CriticConfig,
    FilterGroupsConfig,
    RefConfig,
    RouterReplayConfig,
)
from shardrl.config.command import KEY_ALIASES, CommandConfig, TrainerConfig
from shardrl.config.engine import EngineConfig, LoRAConfig, ModelConfig, OptimConfig
from shardrl.config.load import (
    ConfigError,
    apply_override,
    config_keys,
    config_to_dict,
    from_dict,
    save_config,
    validate_config,
)
from shardrl.config.offline import (
    DPOConfig,
    DPOSettings,
    KTOConfig,
    KTOSettings,
    OfflineDataConfig,
    PreferenceDataConfig,
    RMConfig,
    RMSettings,
    SFTConfig,
    SFTDataConfig,
    UnpairedDataConfig,
)
from shardrl.config.registry import COMMAND_CONFIGS, TRAINERS, load_config
from shardrl.config.rl import Config, DataConfig, OverlongBufferConfig, RewardConfig
from shardrl.config.rollout import AgentConfig, MultiTurnConfig, RolloutConfig, ValSamplingConfig

__all__ = [
    "ActorConfig", "AgentConfig", "AlgorithmConfig", "AsyncConfig", "COMMAND_CONFIGS", "CommandConfig", "Config",
    "ConfigError", "CriticConfig", "DPOConfig", "DPOSettings", "DataConfig", "EngineConfig", "FilterGroupsConfig",
    "KEY_ALIASES", "KTOConfig", "KTOSettings", "LoRAConfig", "ModelConfig", "MultiTurnConfig", "OfflineDataConfig", "OptimConfig",
    "OverlongBufferConfig", "PreferenceDataConfig", "RMConfig", "RMSettings", "RefConfig", "RewardConfig",
    "RolloutConfig", "RouterReplayConfig", "SFTConfig", "SFTDataConfig", "TRAINERS", "TrainerConfig",
    "UnpairedDataConfig", "ValSamplingConfig", "apply_override", "config_keys", "config_to_dict", "from_dict", "load_config",
    "save_config", "validate_config",
]
