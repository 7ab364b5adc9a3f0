"""Streaming the trainer's weights to rollout ranks that do not train (disaggregated placement).

One sender (the first training rank, which holds every full tensor the engine's `export_weights` yields)
and the rollout ranks form a group of their own. The tensors go in buckets of about `bucket_bytes`: each
bucket is a header (the names, shapes and dtypes, pickled) broadcast on a CPU (gloo) group, then one flat
byte buffer broadcast on the data group (NCCL on GPU, the same gloo group on CPU). A receiver cuts the
buffer back into tensors (views, no copy) and hands each bucket to `Rollout.load_weights`, which copies in
place: at most one bucket is ever held beside the rollout's own weights.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

_START, _END = "__start__", "__end__"


@dataclass
class SyncStats:
    """One weight push, as the sender or a receiver saw it."""

    num_bytes: int = 0
    seconds: float = 0.0
    """From the moment every member is ready to the end: gathers, copies and transfers."""
    num_buckets: int = 0
    wait_s: float = 0.0
    """Time spent waiting for the other members to be ready (a rollout rank finishing a generate call)."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def _num_bytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def _layout(header: list) -> tuple[list[int], int]:
    """Byte offset of each tensor in a bucket's buffer (16-byte aligned, so a view of any dtype is valid)
    and the buffer's size."""
    offsets, end = [], 0
    for _, shape, dtype in header:
        offsets.append(end)
        end += -(-_num_bytes(shape, dtype) // 16) * 16
    return offsets, end


def _broadcast(pg, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()


def broadcast_object(pg, obj, root: int, is_root: bool) -> object:
    """A picklable object from `root` to every member of the gloo group `pg` (size, then bytes)."""
    size = torch.zeros(1, dtype=torch.int64)
    if is_root:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size[0] = data.numel()
    _broadcast(pg, size, root)
    if not is_root:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    _broadcast(pg, data, root)
    return obj if is_root else pickle.loads(data.numpy().tobytes())


class WeightChannel:
    """Bucketed weight broadcast from rank 0 of `ctrl_pg` (gloo) to its other members.

    `data_pg` carries the buffers (an NCCL group on GPU, where `device` is the GPU; on CPU pass the gloo
    group again). `send` and `receive` must be called the same number of times on every member.
    """

    def __init__(self, ctrl_pg, data_pg, rank: int, device: torch.device, bucket_bytes: int = 256 * 2**20):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        self.ctrl_pg, self.data_pg, self.rank, self.device = ctrl_pg, data_pg, rank, device
        self.bucket_bytes = bucket_bytes

    def _flush(self, bucket: list[tuple[str, torch.Tensor]], stats: SyncStats) -> None:
        header = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        broadcast_object(self.ctrl_pg, header, 0, True)
        offsets, total = _layout(header)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (_, t), start in zip(bucket, offsets):
            raw = t.detach().reshape(-1).view(torch.uint8)
            flat[start:start + raw.numel()].copy_(raw)
        _broadcast(self.data_pg, flat, 0)
        stats.num_bytes += flat.numel()
        stats.num_buckets += 1

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Rank 0: streams `weights` ((hf_name, full tensor) pairs) to the receivers, bucket by bucket."""
        assert self.rank == 0, "only rank 0 of the weight group sends"
        t_call = time.perf_counter()
        broadcast_object(self.ctrl_pg, _START, 0, True)  # returns once every receiver is here
        t0, stats = time.perf_counter(), SyncStats()
        stats.wait_s = t0 - t_call
        bucket, size = [], 0
        for name, tensor in weights:
            bucket.append((name, tensor.contiguous()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                self._flush(bucket, stats)
                bucket, size = [], 0
        if bucket:
            self._flush(bucket, stats)
        broadcast_object(self.ctrl_pg, _END, 0, True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def buckets(self, stats: SyncStats | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """A receiver: each bucket as (name, tensor) views of the received buffer, until the sender's end."""
        start = broadcast_object(self.ctrl_pg, None, 0, False)
        assert start == _START, f"weight stream out of step: {start!r}"
        while True:
            header = broadcast_object(self.ctrl_pg, None, 0, False)
            if header == _END:
                return
            offsets, total = _layout(header)
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            _broadcast(self.data_pg, flat, 0)
            out = [(name, flat[start:start + _num_bytes(shape, dtype)].view(dtype).view(shape))
                   for (name, shape, dtype), start in zip(header, offsets)]
            if stats is not None:
                stats.num_bytes += flat.numel()
                stats.num_buckets += 1
            yield out

    def receive(self, rollout) -> SyncStats:
        """A receiver: loads every bucket into `rollout` in place (`Rollout.load_weights`)."""
        t0, stats = time.perf_counter(), SyncStats()
        for bucket in self.buckets(stats):
            rollout.load_weights(bucket)
        stats.seconds = time.perf_counter() - t0
        return stats
