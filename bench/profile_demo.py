"""Where the built-in demo's step time goes (a 2-layer model: the host's work is all there is): runs the demo
for a few steps in this process under cProfile and prints the step times and the functions that took the
most time, on the device given (cuda or cpu).

    python bench/profile_demo.py --device cuda --steps 30 --out results.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--extra", default="", help="extra overrides, space separated")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run
    from shardrl.trainer.rl import RLTrainer

    run_dir = Path(tempfile.mkdtemp(prefix="profile_demo_"))
    overrides = resolve_overrides(None, [f"trainer.total_steps={args.steps}", "trainer.val_freq=0",
                                         f"trainer.output_dir={run_dir / 'run'}", "trainer.logger=[jsonl]",
                                         f"trainer.device={args.device}", *args.extra.split()])
    prof = cProfile.Profile()
    plain_step, calls = RLTrainer.train_step, [0]

    def profiled_step(self):  # the steps after the first three (warm-up: allocations, graphs, caches)
        calls[0] += 1
        if calls[0] <= 3:
            return plain_step(self)
        prof.enable()
        try:
            return plain_step(self)
        finally:
            prof.disable()

    RLTrainer.train_step = profiled_step
    run(None, overrides)
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = records[3:]  # after the warm-up steps
    rec = dict(bench="profile_demo", device=args.device, extra=args.extra, steps=len(records))
    for key in ("timing/step_s", "timing/gen_s", "timing/prep_s", "timing/update_s"):
        rec[key.split("/")[1]] = round(statistics.median(r[key] for r in timed), 4)
    print(json.dumps(rec))
    append_jsonl(args.out, [rec])
    for sort in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(args.top)
        print(f"==== by {sort} (the {len(records) - 3} steps after the first three)")
        print("\n".join(line[:200] for line in s.getvalue().splitlines()[:args.top + 12]))


if __name__ == "__main__":
    main()
