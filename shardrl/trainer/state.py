"""The trainer's own state beside the engines': `TrainState`, saved in the run's checkpoints under fixed keys.

- global (one copy, rank 0's, valid at any world size): `step`, `loader` (its position counts global prompts),
  `kl_ctrl` (it follows global numbers);
- per data-parallel rank, under `dp_rank_{r}` (written by the first rank of its sp group), as torchtitan keeps
  its dataloaders: the same parts plus that rank's mini-batch `shuffle_gen`, and the `dp_size` it was saved at.
A resume at the same dp layout continues each rank's streams exactly; at another, each rank's shuffle stream
restarts from `data.seed`, the step and its dp rank.
"""

from __future__ import annotations

import torch

from shardrl.algos import AdaptiveKLController, FixedKLController
from shardrl.data.prompts import PromptLoader


class TrainState:
    def __init__(self, cfg, loader: PromptLoader, dp_rank: int, dp_size: int, sp_rank: int = 0):
        algo = cfg.algorithm
        self.kl_ctrl = (AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon) if algo.kl_target
                        else FixedKLController(algo.kl_coef))
        self.seed, self.loader = cfg.data.seed, loader
        self.dp_rank, self.dp_size, self.sp_rank = dp_rank, dp_size, sp_rank
        self.step = 0
        self.shuffle_gen = torch.Generator().manual_seed(self.shuffle_seed(0))

    def shuffle_seed(self, step: int) -> int:
        """Seed of this dp rank's mini-batch shuffle stream for a run that starts at `step` (0: a fresh run)."""
        return self.seed + 1000 * self.dp_rank + 1_000_003 * step

    def _parts(self) -> dict:
        return {"loader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}

    def state_dict(self) -> dict:
        """The global parts (rank 0's is saved)."""
        return {"step": self.step, **self._parts()}

    def rank_state_dicts(self) -> dict:
        """This rank's own parts under its fixed key; {} on a rank whose sp group's first rank saves them."""
        if self.sp_rank != 0:
            return {}
        return {f"dp_rank_{self.dp_rank}": {"dp_size": self.dp_size, **self._parts(),
                                            "shuffle_gen": self.shuffle_gen.get_state()}}

    def load(self, ckpt) -> str | None:
        """Restores from a loaded checkpoint (`checkpoint.LoadedCheckpoint`); a line for the log when this dp
        rank's own streams could not be restored (another dp layout)."""
        self.step = int(ckpt.extra["step"])
        mine = ckpt.rank_extra(f"dp_rank_{self.dp_rank}")
        note = None
        if mine is not None and mine["dp_size"] == self.dp_size:
            state = mine  # the same dp layout: each dp rank continues exactly where it stopped
        else:  # no saved stream for this dp rank: the global state, and a shuffle stream from the seed
            state = dict(ckpt.extra, shuffle_gen=None)
            note = (f"checkpoint {ckpt.path} was saved with another data-parallel layout; each rank's shuffle "
                    f"stream restarts from data.seed, step {self.step} and its dp rank")
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if state["shuffle_gen"] is not None:
            self.shuffle_gen.set_state(state["shuffle_gen"])
        else:
            self.shuffle_gen.manual_seed(self.shuffle_seed(self.step))
        return note


def resolve_total_epochs(trainer_cfg, num_rows: int, batch_size: int) -> str:
    """Set `trainer.total_steps` from `trainer.total_epochs` (consumed: set to None, so the run folder's config
    says the steps) and `num_rows` rows of `batch_size` a step, or keep a given total_steps that comes first (verl's
    rule); the line that says so."""
    per_epoch = num_rows // batch_size  # an epoch's last, short batch is dropped
    if per_epoch < 1:
        raise ValueError(f"trainer.total_epochs={trainer_cfg.total_epochs}: the training set has {num_rows} rows, "
                         f"fewer than one batch of {batch_size}")
    epochs, steps = trainer_cfg.total_epochs, trainer_cfg.total_epochs * per_epoch
    given = trainer_cfg.total_steps
    trainer_cfg.total_steps, trainer_cfg.total_epochs = (steps if given is None else min(given, steps)), None
    first = "" if given is None or given >= steps else f", stopped first by trainer.total_steps={given}"
    return (f"trainer.total_epochs={epochs}: {trainer_cfg.total_steps} steps ({per_epoch} a pass over {num_rows} "
            f"rows, {batch_size} a step{first})")
