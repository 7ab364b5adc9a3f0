"""The sharded training engine: one contract (`Engine`), backends registered by name."""

from shardrl.engine.base import Engine, LossFn, register_engine
from shardrl.engine.build import build_engine

__all__ = ["Engine", "LossFn", "build_engine", "register_engine"]
