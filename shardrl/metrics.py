"""The one metric type of shardrl, its one reduction over ranks, and the file a run logs them to.

A metric is a value that knows how it combines over pieces of a batch (micro-batches, ranks):
- `SumCount(total, count)`: total / count over all pieces (a token mean, a loss share, a fraction);
- `Sum(value)`: the sum over pieces (tokens of the whole batch, failures);
- `Max(value)`, `Min(value)`: the extremes;
- a plain number: the mean over ranks (right when every rank holds the same number or an equal share).
Loss functions and algorithms return them (their fields may be 0-dim tensors, summed on the device with no host
sync), the engine adds micro-batches up, and `reduce_metrics` turns a dict of them into floats over a process
group with one all-reduce (and one more for the extremes). They are tuples, so `total, count = m` works.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from shardrl.distributed import collective_device

log = logging.getLogger(__name__)


class SumCount(NamedTuple):
    """A metric whose value over pieces is the sum of `total` over the sum of `count` (e.g. a token mean)."""

    total: float | torch.Tensor
    count: float | torch.Tensor


class Sum(NamedTuple):
    """A metric whose value over pieces is the sum of every piece's (e.g. the tokens of the whole batch)."""

    value: float | torch.Tensor

    def __float__(self) -> float:
        return float(self.value)


class Max(NamedTuple):
    """A metric whose value over pieces is the largest piece's."""

    value: float | torch.Tensor

    def __float__(self) -> float:
        return float(self.value)


class Min(NamedTuple):
    """A metric whose value over pieces is the smallest piece's."""

    value: float | torch.Tensor

    def __float__(self) -> float:
        return float(self.value)


def row_means(values: dict[str, torch.Tensor]) -> dict[str, SumCount]:
    """Each `(N,)` tensor's mean over its rows, as a (sum, count) pair (a per-pair or per-sequence metric)."""
    return {k: SumCount(v.detach().double().sum(), torch.tensor(float(len(v)), dtype=torch.float64, device=v.device))
            for k, v in values.items()}


def accumulate(acc, metric, device: torch.device, real: bool = True):
    """`metric` added to `acc` (None: nothing yet), of the same kind, as float64 tensors on `device` (no host
    sync). `real=False` adds nothing but names the key (an empty piece, such as a placeholder micro-batch that
    a rank without samples runs so that every rank names the same keys)."""
    def f64(x):
        return torch.as_tensor(x).detach().to(device, torch.float64)

    if acc is None:  # the empty value of the metric's kind
        zero = torch.zeros((), dtype=torch.float64, device=device)
        acc = (type(metric)(zero - math.inf) if isinstance(metric, Max) else type(metric)(zero + math.inf)
               if isinstance(metric, Min) else Sum(zero) if isinstance(metric, Sum) else SumCount(zero, zero))
    if not real:
        return acc
    if isinstance(metric, (Max, Min)):
        return type(metric)((torch.maximum if isinstance(metric, Max) else torch.minimum)(acc.value, f64(metric.value)))
    if isinstance(metric, Sum):
        return Sum(acc.value + f64(metric.value))
    if not (isinstance(metric, tuple) and len(metric) == 2):
        raise TypeError(f"a metric must be a SumCount, Sum, Max or Min (or a (sum, count) pair), got {type(metric)}")
    return SumCount(acc[0] + f64(metric[0]), acc[1] + f64(metric[1]))


def metric_value(metric) -> float:
    """One piece's own value (no ranks): a SumCount (or any (sum, count) pair) is sum / count (0 when nothing was
    counted), the others their value."""
    if isinstance(metric, (Sum, Max, Min)):
        return float(metric.value)
    if isinstance(metric, tuple):
        total, count = (float(x) for x in metric)
        return total / count if count > 0 else 0.0
    return float(metric)


def reduce_metrics(metrics: dict, group=None, same_keys: bool = False) -> dict[str, float]:
    """One float per metric over the ranks of `group` (see the module docstring; a plain (sum, count) tuple
    counts as a SumCount). One all-reduce of float64 for the sums, one for the extremes if any.

    The ranks may name different keys (a reward function's own key where a rank holds none of its dataset's
    samples, a statistic of tokens where a rank holds none): the names are gathered first and a key a rank lacks
    counts as its empty piece there (a plain number is then the mean over the ranks that name it).
    `same_keys=True` (every rank names the same keys, as the engine's micro-batches do) skips that gather."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1 and not same_keys:
        metrics = _with_every_rank_keys(metrics, group, world)
    places = {}  # key -> ("sum" | "max", position in that vector)
    summed, maxed = [], []
    for k in sorted(metrics):
        v = metrics[k]
        if isinstance(v, (Max, Min)):  # a minimum is the negated maximum of the negated values
            places[k] = ("max", len(maxed))
            maxed.append(-_f64(v.value) if isinstance(v, Min) else _f64(v.value))
        elif isinstance(v, Sum):
            places[k] = ("sum", len(summed))
            summed.append(_f64(v.value))
        elif isinstance(v, tuple):
            places[k] = ("sum", len(summed))
            summed += [_f64(v[0]), _f64(v[1])]
        else:
            places[k] = ("sum", len(summed))
            summed.append(_f64(v))
    summed = _all_reduce(summed, dist.ReduceOp.SUM, group, world)
    maxed = _all_reduce(maxed, dist.ReduceOp.MAX, group, world)
    out = {}
    for k, (vector, i) in places.items():
        v = metrics[k]
        if vector == "max":
            out[k] = -maxed[i] if isinstance(v, Min) else maxed[i]
        elif isinstance(v, Sum):
            out[k] = summed[i]
        elif isinstance(v, tuple):
            out[k] = summed[i] / summed[i + 1] if summed[i + 1] > 0 else 0.0
        else:
            out[k] = summed[i] / world
    return out


def _kind(metric) -> str:
    return type(metric).__name__ if isinstance(metric, (Sum, Max, Min)) else \
        "SumCount" if isinstance(metric, tuple) else "mean"


def _with_every_rank_keys(metrics: dict, group, world: int) -> dict:
    """`metrics` with every key some rank of `group` names (one gather of the names, and of each one's kind); a
    key this rank lacks is its kind's empty piece. A ValueError where ranks disagree on a key's kind."""
    named = [None] * world
    dist.all_gather_object(named, sorted((k, _kind(v)) for k, v in metrics.items()), group=group)
    kinds: dict[str, set] = {}
    for pairs in named:
        for k, kind in pairs:
            kinds.setdefault(k, set()).add(kind)
    if all(pairs == named[0] for pairs in named):
        return metrics
    out = {}
    for k, found in kinds.items():
        if len(found) > 1:
            raise ValueError(f"metric {k!r} is reduced as {' and as '.join(sorted(found))} on different ranks")
        kind, v = found.pop(), metrics.get(k)
        if kind == "mean":  # the mean over the ranks that name it
            out[k] = SumCount(0.0, 0.0) if v is None else SumCount(_f64(v), 1.0)
        elif v is not None:
            out[k] = v
        else:
            out[k] = {"Sum": Sum(0.0), "Max": Max(-math.inf), "Min": Min(math.inf)}.get(kind, SumCount(0.0, 0.0))
    return out


def _f64(x) -> torch.Tensor:
    return x.detach().to(torch.float64).reshape(()) if isinstance(x, torch.Tensor) else torch.tensor(
        float(x), dtype=torch.float64)


def _all_reduce(values: list[torch.Tensor], op, group, world: int) -> list[float]:
    """`values` reduced over `group` as one float64 vector; one host sync. Values on a GPU (the engine's) are
    reduced there (NCCL); values on the CPU (the trainer's) over gloo when the group has it, so that no scalar
    is copied to the GPU one at a time."""
    if not values:
        return []
    on_device = next((v.device for v in values if v.device.type != "cpu"), None)
    device = on_device or torch.device("cpu")
    if world > 1 and (on_device is not None or "gloo" not in str(dist.get_backend(group))):
        device = collective_device(group)
    vector = torch.stack([v.to(device) for v in values])
    if world > 1:
        dist.all_reduce(vector, op=op, group=group)
    return vector.tolist()


def read_metrics(path: Path) -> list[dict]:
    """The records of a run's `metrics.jsonl`, one JSON object per line. A last line cut short (a crash or a
    full disk mid-write) is dropped with a warning; any other line that is not a JSON object is a ValueError
    naming the file and the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise OSError(e.errno, f"cannot read {path}: {e.strerror}", str(path)) from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            if number == len(lines):  # no newline after it: the write was cut short
                log.warning("%s: dropped its last line, %d characters cut short (%s)", path, len(line), e)
                break
            raise ValueError(f"{path}: line {number} is not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {number} is not a JSON object")
        records.append(record)
    return records
