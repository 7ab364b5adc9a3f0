"""Learning curves of `shardrl train` runs on the CPU-sized built-in tasks, shared by bench/distill.py and
bench/fp8_curve.py: one run as a subprocess, its metrics read back into one JSON row, and a summary line a variant
over its seeds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import append_jsonl


def run_curve(overrides: list[str], run_dir: Path, window: int, label: str) -> tuple[dict, list[dict]]:
    """`shardrl train` with `overrides` into `run_dir`, logging to jsonl; (row, metrics): the row holds the mean
    reward of the first and the last `window` steps and over all steps, the wall time and the reward curve."""
    cmd = [sys.executable, "-m", "shardrl.cli", "train", *overrides, f"trainer.output_dir={run_dir}",
           "trainer.logger=[jsonl]"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in open(next(run_dir.rglob("metrics.jsonl")))]
    reward = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    row = {"steps": len(reward), "reward_first": statistics.fmean(reward[:window]),
           "reward_last": statistics.fmean(reward[-window:]), "reward_all": statistics.fmean(reward),
           "wall_s": round(wall, 1), "curve": [round(r, 3) for r in reward]}
    return row, metrics


def summary(rows: list[dict], **tags) -> dict:
    """One variant's rows over its seeds: the last window's mean reward (mean, spread, range) and the mean over all
    steps."""
    last = [r["reward_last"] for r in rows]
    return {**tags, "summary": True, "seeds": len(rows), "reward_last_mean": statistics.fmean(last),
            "reward_last_std": statistics.stdev(last) if len(last) > 1 else 0.0,
            "reward_last_min": min(last), "reward_last_max": max(last),
            "reward_all_mean": statistics.fmean(r["reward_all"] for r in rows)}


def emit(row: dict, out: str | None) -> None:
    """Print a row (without its curve) and append it whole to `out`."""
    print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    append_jsonl(out, [row])
