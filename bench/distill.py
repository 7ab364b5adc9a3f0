"""On-policy distillation against plain GRPO on the built-in demo (issue 60), on the CPU: the teacher is the demo's
model trained further (the demo's supervised warm-up run `--teacher-steps` steps instead of 20), the student the
demo's fresh start; both runs start from that same student, take the same number of steps with the same seeds, and
differ only in the advantage: GRPO's from the verifier's 0/1 reward, or OPD's per-token reverse KL to the teacher
(algorithm.adv_estimator=opd, algorithm.opd.reward_coef=0: the reward is only logged). Prints and appends (--out)
one JSON line per run: the mean reward of the first and the last `--window` steps and over all steps, then one
summary line per variant.

    python bench/distill.py --steps 150 --seeds 0,1,2 --out /tmp/distill.jsonl
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
    "grpo": ["algorithm.adv_estimator=grpo"],
    "opd": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=1.0", "algorithm.opd.reward_coef=0.0"],
}
SMALL = ["data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=8"]
"""A smaller step than the demo's 16 x 16 (CPU time), one optimizer step each."""


def teacher_accuracy(model_dir: Path) -> float:
    """The share of the demo's sums whose greedy first answer token is the right digit."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    right = 0
    with torch.no_grad():
        for a, b in problems:
            ids = torch.tensor([tok.encode(f"{a}+{b}=")])
            right += int(model(input_ids=ids).logits[0, -1].argmax()) == tok.encode(str(a + b))[0]
    return right / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--teacher-steps", type=int, default=400, help="the teacher's supervised warm-up steps")
    parser.add_argument("--root", default=None, help="run folders go here (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    args = parser.parse_args()
    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

    root = Path(args.root or tempfile.mkdtemp(prefix="distill_"))
    student = prepare_demo_assets(root / "student")  # the demo's own start
    teacher = prepare_demo_assets(root / "teacher", warmup_steps=args.teacher_steps)
    accuracy = teacher_accuracy(teacher / "model")
    print(json.dumps({"bench": "distill", "teacher_steps": args.teacher_steps, "teacher_greedy_acc": accuracy,
                      "student_greedy_acc": teacher_accuracy(student / "model")}), flush=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.variants.split(","):
            run_dir = root / f"{name}_s{seed}_{args.steps}"
            cmd = [sys.executable, "-m", "shardrl.cli", "train", *demo_overrides(student), *SMALL,
                   f"teacher.model_path={teacher / 'model'}", "teacher.engine.param_dtype=float32",
                   f"trainer.output_dir={run_dir}", "trainer.val_freq=0", "trainer.logger=[jsonl]",
                   f"trainer.total_steps={args.steps}", f"rollout.seed={seed}", f"data.seed={seed}",
                   *VARIANTS[name]]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                sys.exit(f"{name} seed {seed} failed:\n{done.stderr[-3000:]}")
            wall = time.perf_counter() - t0
            metrics = [json.loads(line) for line in open(next(run_dir.rglob("metrics.jsonl")))]
            reward = [m["reward/mean"] for m in metrics]
            row = {"bench": "distill", "variant": name, "seed": seed, "steps": len(reward),
                   "reward_first": statistics.fmean(reward[: args.window]),
                   "reward_last": statistics.fmean(reward[-args.window:]),
                   "reward_all": statistics.fmean(reward),
                   **({"reverse_kl_first": metrics[0]["distill/reverse_kl"],
                       "reverse_kl_last": metrics[-1]["distill/reverse_kl"]} if name == "opd" else {}),
                   "wall_s": round(wall, 1), "curve": [round(r, 3) for r in reward]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for name in args.variants.split(","):
        mine = [r for r in rows if r["variant"] == name]
        print(json.dumps({"bench": "distill", "variant": name, "summary": True, "seeds": len(mine),
                          "reward_last_mean": statistics.fmean(r["reward_last"] for r in mine),
                          "reward_all_mean": statistics.fmean(r["reward_all"] for r in mine)}), flush=True)


if __name__ == "__main__":
    main()
