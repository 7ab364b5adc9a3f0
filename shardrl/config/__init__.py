"""A run's settings: typed dataclasses (the schema), filled from YAML and `key=value` overrides, checked, and
saved with the run. Loading and checking a config imports no torch.

    from shardrl.config import load_config
    cfg = load_config("run.yaml", ["actor.optim.lr=1e-5"])
"""

from shardrl.config.load import ConfigError, save_config
from shardrl.config.offline import DPOConfig, KTOConfig, RMConfig, SFTConfig
from shardrl.config.registry import TRAINERS, load_config
from shardrl.config.rl import Config

__all__ = ["Config", "ConfigError", "DPOConfig", "KTOConfig", "RMConfig", "SFTConfig", "TRAINERS", "load_config", "save_config"]
