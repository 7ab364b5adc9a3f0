"""Where metrics go: a JSON line per step in `<run_dir>/metrics.jsonl`, a progress bar on the console,
and optionally TensorBoard and wandb. Only global rank 0 writes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def mean_over_ranks(metrics: dict[str, float], group=None) -> dict[str, float]:
    """Averages every metric over the ranks of `group` (one all-reduce for all keys)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    keys = sorted(metrics)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    values /= dist.get_world_size(group)
    return dict(zip(keys, values.tolist()))


class MetricsLogger:
    def __init__(self, run_dir: Path, sinks: list[str], total_steps: int, start_step: int = 0,
                 project: str = "shardrl", experiment: str = "run", config: dict | None = None):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.sinks = set(sinks)
        self._bar = self._tb = self._wandb = self._jsonl = None
        if not self.enabled:
            return
        if "jsonl" in self.sinks:
            path = run_dir / "metrics.jsonl"
            if start_step == 0 and path.exists():
                path.unlink()  # a fresh run in this folder starts a fresh record
            elif path.exists():
                _truncate_after(path, start_step)  # a resumed run rewrites the steps after its checkpoint
            self._jsonl = open(path, "a", buffering=1)
        if "console" in self.sinks:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if "tensorboard" in self.sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("trainer.logger has 'tensorboard' but it is not installed; "
                                 "pip install 'shardrl[tensorboard]'") from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("trainer.logger has 'wandb' but it is not installed; pip install 'shardrl[wandb]'") from e
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(record, step=step)
        if self._bar is not None:
            shown = {k.split("/")[-1] if k.startswith("reward/") else k: record[k]
                     for k in ("reward/mean", "val/reward_mean", "actor/loss", "timing/step_s") if k in record}
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self._bar.update(1)

    def write(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        for sink in (self._jsonl, self._bar, self._tb):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_after(path: Path, step: int) -> None:
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _plain(v):
    v = float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v
