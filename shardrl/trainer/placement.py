"""Disaggregated placement: the started world split into training ranks (first) and rollout ranks (the last
`async_rl.rollout_ranks`), each side with a default process group of its own, and the channels between them.
The asynchronous loop (`shardrl.trainer.async_rl`) runs on top of it.

Channels (all built from the launcher's store, besides the two default groups):
- `bridge`: gloo over the whole world, point-to-point, batches from rollout ranks to training ranks (sent
  without waiting, so a rollout rank can be up to max_staleness + 1 batches ahead).
- weight group: gloo (headers; NCCL for the buffers on GPU) over training rank 0 and the rollout ranks,
  `shardrl.rollout.weight_sync.WeightChannel`; the start (step, loader state) goes over it too.
A rank whose side stops (an error, Ctrl-C) closes its channels; the other side's pending receive fails
with a "stopped" error instead of waiting for the timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle

import torch
import torch.distributed as dist

from shardrl.config.schema import Config

_SIZE_TAG, _DATA_TAG = 11, 12
_STOPPED_KEY = "shardrl_async/stopped"
PUSHED_KEY = "shardrl_async/pushed"  # weight pushes started by the training ranks (a counter)



class PeerStopped(RuntimeError):
    """The other side (training or rollout ranks) stopped: an error or Ctrl-C there."""


@dataclasses.dataclass
class WorldSplit:
    """This rank's side of a disaggregated run and the channels between the sides."""

    global_rank: int
    world_size: int
    num_train: int
    store: object
    backend: str
    timeout: datetime.timedelta
    bridge: object = None
    weight_ctrl: object = None
    weight_data: object = None

    @property
    def num_rollout(self) -> int:
        return self.world_size - self.num_train

    @property
    def is_rollout(self) -> bool:
        return self.global_rank >= self.num_train

    @property
    def side_rank(self) -> int:
        return self.global_rank - self.num_train if self.is_rollout else self.global_rank

    def peer_stopped(self) -> bool:
        try:
            return self.store.check([_STOPPED_KEY])
        except RuntimeError:  # the store's host (global rank 0, or the launcher) is gone
            return True

    def close(self, restore_world: bool, failed: bool = False) -> None:
        """Drops the channels and this side's default group; `restore_world` starts a default group over the
        whole world again (a caller that started one gets it back; every rank must then be here). `failed`
        first tells the other side, whose pending receives then fail as `PeerStopped`."""
        if failed:
            try:
                self.store.set(_STOPPED_KEY, f"{'rollout' if self.is_rollout else 'training'} rank {self.global_rank}")
            except RuntimeError:
                pass  # the store is gone already: so is the other side
        self.bridge = self.weight_ctrl = self.weight_data = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if restore_world:
            dist.init_process_group(self.backend, store=dist.PrefixStore("shardrl_async/world", self.store),
                                    rank=self.global_rank, world_size=self.world_size, timeout=self.timeout)


def check_rollout_ranks(num_rollout: int, world: int) -> None:
    """ValueError unless `num_rollout` rollout ranks leave at least one training rank in `world`."""
    if world < 2:
        raise ValueError(f"async_rl.rollout_ranks={num_rollout} needs at least 2 processes (rollout ranks and "
                         f"training ranks), and this run has {world}: start it with --nproc-per-node 2 or more, or set "
                         "async_rl.rollout_ranks=0 for a colocated run")
    if not 1 <= num_rollout < world:
        raise ValueError(f"async_rl.rollout_ranks={num_rollout} must leave training ranks in a world of {world} "
                         f"processes: choose 1..{world - 1}, or start at least rollout_ranks + 1 processes")


def split_world(cfg: Config, timeout_s: float = 600.0) -> WorldSplit:
    """Splits the started world into the training ranks (first) and the rollout ranks (last
    `async_rl.rollout_ranks`): on return the default group holds only this rank's side, so every part of
    the trainer (meshes, checkpoints, the run folder) works on the training ranks alone, unchanged."""
    from torch.distributed.distributed_c10d import _get_default_store

    rank, world = dist.get_rank(), dist.get_world_size()
    num_rollout = cfg.async_rl.rollout_ranks
    check_rollout_ranks(num_rollout, world)
    store = _get_default_store()
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"  # as init_distributed's
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.barrier()  # every rank holds the store before the world group goes
    dist.destroy_process_group()
    split = WorldSplit(rank, world, world - num_rollout, store, backend, timeout)
    side = "rollout" if split.is_rollout else "train"
    size = split.num_rollout if split.is_rollout else split.num_train
    dist.init_process_group(backend, store=dist.PrefixStore(f"shardrl_async/{side}", store),
                            rank=split.side_rank, world_size=size, timeout=timeout)
    split.bridge = dist.ProcessGroupGloo(dist.PrefixStore("shardrl_async/bridge", store), rank, world, timeout)
    if rank == 0 or split.is_rollout:
        weight_rank = split.side_rank + 1 if split.is_rollout else 0
        split.weight_ctrl = dist.ProcessGroupGloo(dist.PrefixStore("shardrl_async/weights", store), weight_rank,
                                                  num_rollout + 1, timeout)
        split.weight_data = split.weight_ctrl
        if torch.cuda.is_available():
            split.weight_data = dist.ProcessGroupNCCL(dist.PrefixStore("shardrl_async/weights_nccl", store),
                                                      weight_rank, num_rollout + 1)
    return split


def send_object(pg, obj, dst: int) -> list:
    """Starts sending `obj` (pickled) to global rank `dst`; returns what must stay alive until waited."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [pg.send([size], dst, _SIZE_TAG), pg.send([data], dst, _DATA_TAG), size, data]


def recv_object(pg, src: int):
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, _SIZE_TAG).wait()
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    pg.recv([data], src, _DATA_TAG).wait()
    return pickle.loads(data.numpy().tobytes())


def stopped_if_broken(split: WorldSplit, fn, other: str):
    """`fn()`, a channel operation; when it fails because the other side stopped (it said so in the store
    before closing its channels, or the store went with it), `PeerStopped`; any other error as it is."""
    try:
        return fn()
    except RuntimeError as e:
        if isinstance(e, PeerStopped) or not split.peer_stopped():
            raise
        raise PeerStopped(f"the {other} ranks stopped (their own error says why); stopping too ({e})") from e
