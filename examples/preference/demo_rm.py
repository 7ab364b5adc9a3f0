"""A reward model learned from preference pairs, then RL scored by it alone, on the built-in demo (CPU, minutes):

1. pairs from the demo's task: for each of its 55 addition prompts, the right sum chosen over each wrong digit
   (495 pairs), a fifth of them held out; a Bradley-Terry reward model (`shardrl rm`, a new score head on the
   demo's warmed-up model) trains on the rest and is measured on the held-out pairs;
2. GRPO with that reward model as the only reward (`reward.model_path`) and, as the baseline of the same run,
   GRPO with the demo's rule-based reward: the same steps, seed and settings;
3. greedy accuracy on the demo's prompts, scored by the rule, before and after each.

    python examples/preference/demo_rm.py [--steps 200] [--out outputs/preference_demo]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_pairs(prompt_file: Path, out: Path, held_out: float = 0.2, seed: int = 0) -> tuple[int, int]:
    rng, train, val = random.Random(seed), [], []
    for line in open(prompt_file):
        row = json.loads(line)
        for wrong in range(10):
            if str(wrong) != row["ground_truth"]:
                pair = {"prompt": row["prompt"], "chosen": row["ground_truth"], "rejected": str(wrong)}
                (val if rng.random() < held_out else train).append(pair)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(train), len(val)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="GRPO steps of each RL run")
    parser.add_argument("--rm-steps", type=int, default=500)
    parser.add_argument("--out", default="outputs/preference_demo")
    args = parser.parse_args()
    from shardrl.cli import main as shardrl
    from shardrl.trainer.demo import DEMO_ASSETS, demo_overrides, prepare_demo_assets

    spec = importlib.util.spec_from_file_location("evaluate", HERE.parent / "smollm2" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = prepare_demo_assets(DEMO_ASSETS).resolve()
    prompts = str(assets / "val.jsonl")

    def accuracy(model) -> float:
        return round(evaluate.evaluate(str(model), prompts, max_new_tokens=4, max_prompt_length=16,
                                       backend="hf")["accuracy"], 4)

    t0 = time.perf_counter()
    report = {"pairs_train_held_out": write_pairs(assets / "train.jsonl", out)}
    common = [f"model.path={assets / 'model'}", "trainer.device=cpu", "trainer.logger=[jsonl]"]
    assert shardrl(["rm", *common, f"data.train_files=[{out / 'train_pairs.jsonl'}]",
                    f"data.val_files=[{out / 'val_pairs.jsonl'}]", "data.batch_size=32", "engine.param_dtype=float32",
                    "optim.lr=1e-3", "optim.weight_decay=0.0", "optim.lr_schedule=cosine", "optim.warmup_steps=20",
                    f"trainer.total_steps={args.rm_steps}", "trainer.val_freq=100", "trainer.export_hf=true",
                    f"trainer.output_dir={out / 'rm'}"]) == 0
    rm = [json.loads(line) for line in open(out / "rm" / "metrics.jsonl")]
    report["rm_held_out_accuracy"] = [[r["step"], round(r["val/accuracy"], 4)] for r in rm if "val/accuracy" in r]
    report["accuracy_before"] = accuracy(assets / "model")
    rl_common = demo_overrides(assets) + ["trainer.device=cpu", "trainer.logger=[jsonl]", "trainer.val_freq=0",
                                          f"trainer.total_steps={args.steps}", "trainer.export_hf=true"]
    runs = {"rule": [], "reward_model": [f"reward.model_path={out / 'rm' / 'hf_model'}",
                                         "reward.engine.param_dtype=float32", "reward.engine.use_dynamic_bsz=true"]}
    for name, extra in runs.items():
        assert shardrl(["train", *rl_common, *extra, f"trainer.output_dir={out / name}"]) == 0
        records = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        report[f"{name}_reward_every_{max(1, args.steps // 10)}"] = [
            round(r["reward/mean"], 3) for r in records[:: max(1, args.steps // 10)]]
        report[f"{name}_accuracy_after"] = accuracy(out / name / "hf_model")
    report["seconds"] = round(time.perf_counter() - t0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
