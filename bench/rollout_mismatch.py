"""Rollout-training mismatch on one GPU: the built-in demo with the fast rollout in bf16 (the trainer computes
in fp32), trained twice from the same start, without and with the mismatch correction (algorithm.rollout_is,
token-level truncation at 2 by default). One JSON line per run: the mismatch metrics (mean |log-prob
difference| and its max, KL of sampler to trainer per sequence, k3 per token; with the correction also the
mean weight and the truncated/masked fractions) averaged over the steps, and the reward curve (means of
consecutive blocks of steps), the last validation reward, and the wall time. The rollout is not compiled
(`rollout.fast.compile=false`: no compile time at start-up; for the demo's tiny model it made no difference to the step,
bench/RESULTS.md, "Current figures: Demo and host overhead").

    python bench/rollout_mismatch.py --steps 80 --root /tmp/mismatch           # both runs, < 4 min on an H200
    python bench/rollout_mismatch.py --steps 4 --root /tmp/mismatch_cpu --cpu    # a check on the CPU (no mismatch)

Extra `key=value` overrides after `--` go to both runs, e.g. `-- algorithm.rollout_is_level=geometric
algorithm.rollout_is_mode=mask` (the corrected run's settings come last and win for the correction's keys).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

VARIANTS = {"off": [], "on": ["algorithm.rollout_is=true"]}
KEYS = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/kl", "rollout/k3_kl",
        "rollout_is/weight_mean", "rollout_is/truncated_frac", "rollout_is/masked_frac")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--root", default="/tmp/rollout_mismatch")
    p.add_argument("--blocks", type=int, default=5, help="points of the reward curve")
    p.add_argument("--cpu", action="store_true", help="trainer.device=cpu (hf rollout, fp32: no mismatch)")
    p.add_argument("--variants", default="off,on")
    p.add_argument("extra", nargs="*")
    args = p.parse_args()

    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets
    from shardrl.launch.rank import run

    root = Path(args.root)
    assets = prepare_demo_assets(root / "assets")
    common = demo_overrides(assets) + [
        f"trainer.total_steps={args.steps}", f"trainer.val_freq={args.steps}", "trainer.logger=[jsonl]",
        "trainer.log_val_generations=0", *(["trainer.device=cpu"] if args.cpu else ["rollout.backend=fast", "rollout.fast.compile=false"])]
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        run_dir = run(None, common + [f"trainer.output_dir={root / name}", *args.extra, *VARIANTS[name]])
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        rewards = [r["reward/mean"] for r in records]
        size = max(1, len(rewards) // args.blocks)
        curve = [round(sum(rewards[i:i + size]) / len(rewards[i:i + size]), 4) for i in range(0, len(rewards), size)]
        mismatch = {k: round(sum(r[k] for r in records if k in r) / len(records), 6)
                    for k in KEYS if any(k in r for r in records)}
        val = [r["val/reward_mean"] for r in records if r.get("val/reward_mean") is not None]
        seconds = round(time.perf_counter() - t0, 1)
        print(json.dumps({"run": f"rollout_is_{name}", "steps": len(records), "seconds": seconds,
                          "reward_first10": round(sum(rewards[:10]) / len(rewards[:10]), 4),
                          "reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 4),
                          "reward_curve": curve, "val_last": val[-1] if val else None, **mismatch,
                          "rollout_backend": "hf" if args.cpu else "fast"}), flush=True)


if __name__ == "__main__":
    main()
