"""Where metrics go: a JSON line per step in `<run_dir>/metrics.jsonl`, a progress bar on the console,
and optionally the trackers of `trackers.py` (TensorBoard, wandb, MLflow, SwanLab, trackio). Only global rank 0
writes."""

from __future__ import annotations

import importlib
import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.metrics import read_metrics
from shardrl.trainer.trackers import TRACKERS

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, sinks: list[str], total_steps: int, start_step: int = 0,
                 project: str = "shardrl", experiment: str = "run", config: dict | None = None):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.sinks = set(sinks)
        self.records: list[dict] = []
        """Every step logged (on rank 0), whatever the sinks; with jsonl also a resumed run's earlier steps.
        summary.json and the reward curve are made from these."""
        self._bar = self._jsonl = None
        self._trackers = []
        self._generations = run_dir / "generations.jsonl"
        if not self.enabled:
            return
        if start_step == 0 and self._generations.exists():
            self._generations.unlink()  # like metrics.jsonl: a fresh run starts a fresh record, a resumed one
        elif self._generations.exists():  # rewrites the later steps
            _truncate_after(self._generations, start_step)
        check_sinks_installed(sinks)
        if "jsonl" in self.sinks:
            path = run_dir / "metrics.jsonl"
            if start_step == 0 and path.exists():
                path.unlink()  # a fresh run in this folder starts a fresh record
            elif path.exists():
                self.records = _truncate_after(path, start_step)  # a resumed run rewrites the later steps
            self._jsonl = open(path, "a", buffering=1)
        if "console" in self.sinks:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        for name, tracker in TRACKERS.items():
            if name in self.sinks:
                self._trackers.append(tracker.open(run_dir, project, experiment, config))

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Record step `step`'s metrics; `advance=False` for a record that is no training step (validation before
        the first) leaves the progress bar where it is."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self.records.append(record)
        if self._jsonl:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
            except OSError as e:  # a full disk: say which file (an open file's write names none)
                raise OSError(e.errno, e.strerror, self._jsonl.name) from None
        for tracker in self._trackers:
            tracker.log(step, record)
        if self._bar is not None:
            shown = {k.split("/")[-1] if k.startswith("reward/") else k: record[k]
                     for k in ("reward/mean", "val/reward_mean", "actor/loss", "timing/step_s") if k in record}
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self._bar.update(1 if advance else 0)

    def log_generations(self, step: int, samples: list[dict]) -> None:
        """Sample generations (dicts of prompt, response, reward, ground_truth, and a prompt's image names under
        `images`): one JSON line each in `generations.jsonl`, with the step, and a short block on the console."""
        if not self.enabled or not samples:
            return
        with open(self._generations, "a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}, default=str) + "\n")  # default: e.g. numpy values
        lines = [f"validation generations at step {step}:"]
        for i, s in enumerate(samples):
            lines += [f"[{i + 1}/{len(samples)}] reward {s['reward']:.4g}, ground truth {_short(s['ground_truth'])}",
                      f"  prompt:   {_short(s['prompt'])}", f"  response: {_short(s['response'])}"]
            if s.get("images"):
                lines.insert(-1, f"  images:   {_short(', '.join(s['images']))}")
        self.write("\n".join(lines))

    def write(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        for sink in (self._jsonl, self._bar, *self._trackers):
            if sink is not None:
                sink.close()
        self._trackers = []  # (closed once: a tracker's finish may not take a second call)


def check_sinks_installed(sinks: list[str]) -> None:
    """A `ConfigError` naming `trainer.logger` when a sink's package cannot be imported; call it before the
    model loads (importing is the check: a package that is there but broken fails too)."""
    from shardrl.config.load import ConfigError

    for sink in sinks:
        if sink not in TRACKERS:
            continue
        module, extra = TRACKERS[sink].module, TRACKERS[sink].extra
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"invalid config value trainer.logger={list(sinks)!r}: {sink!r} needs a package that "
                              f"cannot be imported here ({e}); pip install 'shardrl[{extra}]', or drop {sink!r} "
                              "from trainer.logger") from None


def _truncate_after(path: Path, step: int) -> list[dict]:
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _short(value, limit: int = 300) -> str:
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return repr(value)


def _plain(v):
    v = float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v
