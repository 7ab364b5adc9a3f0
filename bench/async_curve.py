"""The built-in demo's reward curve, synchronous against asynchronous (issue 18: learning must not degrade
beyond noise), on the CPU: two processes each, colocated (both generate and train in turn) against one
training + one rollout rank at staleness 1, 2 and 2 with partial rollouts, several seeds (the rollout's
sampling seed and the prompt order). Prints and appends (--out) one JSON line per run: the mean reward of
the first and the last `--window` steps, and the step rate.

    python bench/async_curve.py --steps 150 --seeds 0,1 --out /tmp/async_curve.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "sync": [],
    "async1": ["async_rl.rollout_ranks=1", "async_rl.max_staleness=1", "algorithm.rollout_is=true"],
    "async2": ["async_rl.rollout_ranks=1", "async_rl.max_staleness=2", "algorithm.rollout_is=true"],
    "async2_partial": ["async_rl.rollout_ranks=1", "async_rl.max_staleness=2", "algorithm.rollout_is=true",
                       "async_rl.partial_rollout=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--root", default=None, help="run folders go here (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    args = parser.parse_args()
    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

    root = Path(args.root or tempfile.mkdtemp(prefix="async_curve_"))
    assets = prepare_demo_assets(root / "assets")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.variants.split(","):
            run_dir = root / f"{name}_s{seed}"
            cmd = [sys.executable, "-m", "shardrl.cli", "train", "--nproc-per-node", "2", *demo_overrides(assets),
                   f"trainer.output_dir={run_dir}", "trainer.val_freq=0", "trainer.logger=[jsonl]",
                   f"trainer.total_steps={args.steps}", f"rollout.seed={seed}", f"data.seed={seed}",
                   *VARIANTS[name]]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            metrics = [json.loads(line) for line in open(next(run_dir.rglob("metrics.jsonl")))]
            reward = [m["reward/mean"] for m in metrics]
            row = {"bench": "async_curve", "variant": name, "seed": seed, "steps": len(reward),
                   "reward_first": statistics.fmean(reward[: args.window]),
                   "reward_last": statistics.fmean(reward[-args.window:]),
                   "wall_s": round(wall, 1),
                   "step_s": statistics.fmean(m["timing/step_s"] for m in metrics[2:]),
                   "curve": [round(r, 3) for r in reward]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for name in args.variants.split(","):
        last = [r["reward_last"] for r in rows if r["variant"] == name]
        print(f"{name:16s} last-{args.window} mean reward over seeds: {statistics.fmean(last):.3f} "
              f"(runs: {', '.join(f'{x:.3f}' for x in last)})")


if __name__ == "__main__":
    main()
