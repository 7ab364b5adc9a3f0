"""On-policy distillation against plain GRPO on the built-in demo (issue 60), on the CPU: the teacher is the demo's
model trained further (the demo's supervised warm-up run `--teacher-steps` steps instead of 20), the student the
demo's fresh start; all runs start from that same student, take the same number of steps with the same seeds and lr,
and differ only in the advantage: GRPO's from the verifier's 0/1 reward; OPD's per-token reverse KL to the teacher
(algorithm.adv_estimator=opd, reward_coef 0: the reward only logged), as it is (`opd`) or minus the group baseline
(`opd_group`, algorithm.opd.baseline=group); or both (`opd_mix`: the GRPO advantage plus 0.1 x the baselined
reverse KL); or toward the teacher's distribution (`opd_top_k`: the forward KL to the teacher's 8 likeliest tokens at
each response token, algorithm.opd.top_k=8, no advantage; `opd_top_k_rkl`: that plus `opd_group`'s advantage).
`--task product`: the products of digits (answers of up to two tokens) instead of the demo's sums;
`--task reverse`: reverse a string of 3 or 4 letters of "abc" (answers of 3 or 4 tokens: GRPO's 0/1 reward is sparse
there, OPD's per-token one is not).
Prints the teacher's and the student's expected reward (the probability of sampling the whole right answer), and
appends (--out) one JSON line per run: the mean reward of the first and the last `--window` steps and over all steps,
then one summary line per variant (mean and spread over the seeds).

    python bench/distill.py --steps 150 --seeds 0,1,2 --out /tmp/distill.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.curves import emit, run_curve, summary  # noqa: E402
from shardrl.trainer.demo import REVERSE, demo_overrides, prepare_demo_assets  # noqa: E402

VARIANTS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "opd": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=1.0", "algorithm.opd.reward_coef=0.0",
            "algorithm.opd.baseline=none"],
    "opd_group": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=1.0", "algorithm.opd.reward_coef=0.0",
                  "algorithm.opd.baseline=group"],
    "opd_mix": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=0.1", "algorithm.opd.reward_coef=1.0",
                "algorithm.opd.baseline=group"],
    "opd_top_k": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=0.0", "algorithm.opd.reward_coef=0.0",
                  "algorithm.opd.top_k=8"],
    "opd_top_k_rkl": ["algorithm.adv_estimator=opd", "algorithm.opd.kl_coef=1.0", "algorithm.opd.reward_coef=0.0",
                      "algorithm.opd.baseline=group", "algorithm.opd.top_k=8"],
}
TASKS = {"sum": "+", "product": "*", "reverse": REVERSE}
"""`--task`: the demo's task (`prepare_demo_assets(op=...)`)."""
TASK_OVERRIDES = {"reverse": ["rollout.max_new_tokens=5"]}
"""Room for the task's longest answer and EOS (the demo's 4 fits the sums and products)."""
SMALL = ["data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=8"]
"""A smaller step than the demo's 16 x 16 (CPU time), one optimizer step each."""


def expected_reward(assets: Path) -> float:
    """The model's expected reward on the task's prompts when sampling at temperature 1 (the runs' temperature):
    the mean over the prompts of the probability of the whole right answer and EOS."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(assets / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(assets / "model").eval()
    rows = [json.loads(line) for line in open(assets / "train.jsonl")]
    by_shape: dict[tuple[int, int], list[tuple[list[int], list[int]]]] = {}
    for row in rows:  # one batched forward per (prompt, answer) length: no padding to get wrong
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["ground_truth"]) + [tok.eos_token_id]
        by_shape.setdefault((len(prompt), len(answer)), []).append((prompt, answer))
    total = 0.0
    with torch.no_grad():
        for (p_len, a_len), pairs in by_shape.items():
            ids = torch.tensor([p + a for p, a in pairs])
            logp = model(input_ids=ids).logits.log_softmax(-1)[:, p_len - 1: p_len - 1 + a_len]
            total += float(logp.gather(-1, ids[:, p_len:, None]).sum((1, 2)).exp().sum())
    return total / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--teacher-steps", type=int, default=400, help="the teacher's supervised warm-up steps")
    parser.add_argument("--teacher-noise", type=float, default=0.0,
                        help="the share of answer tokens the teacher's warm-up feeds in replaced by a random one "
                             "(targets kept): a teacher that knows the right next token after a wrong one")
    parser.add_argument("--student-steps", type=int, default=20,
                        help="the student's supervised warm-up steps (the demo's 20)")
    parser.add_argument("--task", choices=sorted(TASKS), default="sum",
                        help="sum: the demo's (one answer token); product: products of digits (up to two); "
                             "reverse: reverse 3 or 4 letters (3 or 4 answer tokens, a sparse 0/1 reward)")
    parser.add_argument("--root", default=None, help="run folders go here (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="distill_"))
    op = TASKS[args.task]
    # the demo's own start (its 20 steps), unless --student-steps says otherwise
    student = prepare_demo_assets(root / f"student_{args.task}_{args.student_steps}", warmup_steps=args.student_steps,
                                  op=op)
    noise = f"_noise{args.teacher_noise:g}" if args.teacher_noise else ""
    teacher = prepare_demo_assets(root / f"teacher_{args.task}_{args.teacher_steps}{noise}",
                                  warmup_steps=args.teacher_steps, op=op, prefix_noise=args.teacher_noise)
    print(json.dumps({"bench": "distill", "task": args.task, "teacher_steps": args.teacher_steps,
                      "teacher_noise": args.teacher_noise, "student_steps": args.student_steps,
                      "teacher_reward": expected_reward(teacher), "student_reward": expected_reward(student)}),
          flush=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.variants.split(","):
            run_dir = root / f"{args.task}_{args.student_steps}{noise}_{name}_s{seed}_{args.steps}"
            overrides = [*demo_overrides(student), *SMALL, *TASK_OVERRIDES.get(args.task, []),
                         f"teacher.model_path={teacher / 'model'}", "teacher.engine.param_dtype=float32",
                         "trainer.val_freq=0", f"trainer.total_steps={args.steps}", f"rollout.seed={seed}",
                         f"data.seed={seed}", *VARIANTS[name]]
            run, metrics = run_curve(overrides, run_dir, args.window, f"{name} seed {seed}")
            row = {"bench": "distill", "task": args.task, "teacher_noise": args.teacher_noise, "variant": name,
                   "seed": seed, **run,
                   **({"reverse_kl_first": metrics[0]["distill/reverse_kl"],
                       "reverse_kl_last": metrics[-1]["distill/reverse_kl"]} if name.startswith("opd") else {})}
            rows.append(row)
            emit(row, args.out)
    for name in args.variants.split(","):
        mine = [r for r in rows if r["variant"] == name]
        print(json.dumps(summary(mine, bench="distill", task=args.task, variant=name)), flush=True)


if __name__ == "__main__":
    main()
