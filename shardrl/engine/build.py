"""`build_engine`: the backend named by the config's `strategy`, built on the run's mesh.

Backends register themselves in `shardrl.engine.base` (`register_engine`) when imported; this module
imports them, so it sits above every backend and the base sits below them all.
"""

from __future__ import annotations

import shardrl.engine.fsdp1  # noqa: F401  (registers "fsdp")
import shardrl.engine.fsdp2  # noqa: F401  (registers "fsdp2")
from shardrl.distributed import MeshLayout
from shardrl.engine.base import _ENGINES, Engine
from shardrl.engine.model import HEADS


def build_engine(model_cfg, engine_cfg, optim_cfg=None, head: str = "lm", total_steps: int | None = None,
                 mesh: MeshLayout | None = None) -> Engine:
    """The engine named by `engine_cfg.strategy`; `optim_cfg=None` makes a forward-only engine.

    `head`: "lm" (a policy: per-token log-probs), "value" (a critic: a new value head on the decoder) or
    "score" (a reward model: a sequence-classification model's score at each sequence's last token).
    `mesh`: the run's mesh for this engine's layout (`shardrl.distributed.ParallelDims.mesh_for`); None
    builds one (a standalone engine, e.g. in a test)."""
    if engine_cfg.strategy not in _ENGINES:
        raise ValueError(f"unknown strategy {engine_cfg.strategy!r}; choose one of {sorted(_ENGINES)}")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
    return _ENGINES[engine_cfg.strategy](model_cfg, engine_cfg, optim_cfg, head, total_steps, mesh)
