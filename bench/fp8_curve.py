"""FP8 rollouts against unquantized ones in a learning run (issue 62 item 1's learning curve): the built-in demo
(or the reasoning-gym example, `--task reasoning_gym`) from its own start, the same steps, seeds and lr, the fast
rollout in every variant, which differ only in the rollout's weights and the correction:

    full        rollout.quantization=none: the rollout's weights are the trainer's (fp32 on the CPU, bf16 on CUDA)
    fp8         rollout.quantization=fp8 (per-channel E4M3 weights, dequantized for each matmul), with the
                correction FP8 turns on by default (algorithm.rollout_is null: TIS on the token weights)
    fp8_no_is   FP8 as above with the correction off (algorithm.rollout_is=false)

One JSON line a run (--out appends them): the mean reward of the first and last `--window` steps and over all
steps, the mean sampler-vs-trainer mismatch (`rollout/logprob_abs_diff`), the last validation reward; then one
summary line a variant over its seeds.

    python bench/fp8_curve.py --steps 200 --seeds 0,1,2 --out /tmp/fp8_curve.jsonl     # the demo, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.curves import emit, run_curve, summary  # noqa: E402

VARIANTS = {
    "full": ["rollout.quantization=none"],
    "fp8": ["rollout.quantization=fp8"],
    "fp8_no_is": ["rollout.quantization=fp8", "algorithm.rollout_is=false"],
}


def task_overrides(task: str, root: Path) -> list[str]:
    """The task's own settings with its model made under `root` (reused when there)."""
    if task == "demo":
        from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

        return demo_overrides(prepare_demo_assets(root / "demo_assets"))
    from shardrl.trainer.reasoning_gym_example import example_overrides, prepare_example_assets

    return example_overrides(prepare_example_assets(root / "reasoning_gym_assets"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["demo", "reasoning_gym"], default="demo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--val-freq", type=int, default=50)
    p.add_argument("--root", default=None, help="run folders go here (default: a temporary folder)")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; the variants: {', '.join(VARIANTS)}")
    root = Path(args.root or tempfile.mkdtemp(prefix="fp8_curve_"))
    base = task_overrides(args.task, root)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.variants.split(","):
            overrides = [*base, "rollout.backend=fast", f"trainer.total_steps={args.steps}",
                         f"trainer.val_freq={args.val_freq}", f"rollout.seed={seed}", f"data.seed={seed}",
                         *VARIANTS[name]]
            run, metrics = run_curve(overrides, root / f"{args.task}_{name}_s{seed}_{args.steps}", args.window,
                                     f"{name} seed {seed}")
            diffs = [m["rollout/logprob_abs_diff"] for m in metrics if "rollout/logprob_abs_diff" in m]
            val = [(m["step"], m["val/reward_mean"]) for m in metrics if "val/reward_mean" in m]
            row = {"bench": "fp8_curve", "task": args.task, "variant": name, "seed": seed, **run,
                   "logprob_abs_diff_mean": statistics.fmean(diffs) if diffs else None,
                   "val_reward": val}
            rows.append(row)
            emit(row, args.out)
    for name in args.variants.split(","):
        mine = [r for r in rows if r["variant"] == name]
        line = summary(mine, bench="fp8_curve", task=args.task, variant=name)
        line["logprob_abs_diff_mean"] = statistics.fmean(r["logprob_abs_diff_mean"] or 0.0 for r in mine)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
