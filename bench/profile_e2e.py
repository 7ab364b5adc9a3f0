"""Where the whole GRPO step's time goes on the GPU: one step of a `bench/e2e.py` case, run in this process under
`torch.profiler`, cut into its phases (generation, preparation, update) and, per phase, the GPU's busy time
(the union of its kernels and copies), its idle gaps, and the kernels by kind and by name. The step times of the
unprofiled steps are printed beside the profiled one's (the profiler's own cost).

    python bench/profile_e2e.py --cases fixed_64,fixed_512 --out results.jsonl
    python bench/profile_e2e.py --quick --cases fixed_64      # the tiny shape on the CPU: that it runs

One JSON line per case (also appended to --out); the Chrome trace of each profiled step is kept under
--root/traces/ (`--keep-trace`).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import os
import re
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.e2e import CASES, QUICK_CASES, prepare, shardrl_overrides  # noqa: E402

PHASES = ("gen", "prep", "update")
KINDS = (  # first match wins (FlashAttention's kernels name cutlass types: attention before gemm)
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|cascade", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|s\d+gemm|matmul", re.I)),
    ("triton", re.compile(r"^triton_|triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched|cat_", re.I)),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
    ("reduce", re.compile(r"reduce|norm|softmax|sum_|max_|argmax|topk|sort|scan|cumsum", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|index|gather|scatter", re.I)),
)


def kind_of(name: str) -> str:
    return next((k for k, pat in KINDS if pat.search(name)), "other")


def union_us(intervals: list[tuple[float, float]], spans: list | None = None) -> tuple[float, list[float]]:
    """The covered length of `intervals` (start, end) and the gaps between covered stretches (their (start, end)
    appended to `spans` where given)."""
    covered, gaps, end = 0.0, [], None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                gaps.append(a - end)
                if spans is not None:
                    spans.append((end, a))
            covered += b - a
            end = b
        elif b > end:
            covered += b - end
            end = b
    return covered, gaps


def host_in_gaps(events: list[dict], gaps: list[tuple[float, float]], top: int) -> dict[str, float]:
    """What the host ran while the GPU idled: per name of a host event (`rollout.*` marks, ATen ops: nested ones each
    count), its ms inside `gaps`."""
    if not gaps:
        return {}
    gaps = sorted(gaps)
    starts = [a for a, _ in gaps]
    spent = defaultdict(float)
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(gaps) and gaps[i][0] < b:
            lo, hi = max(a, gaps[i][0]), min(b, gaps[i][1])
            if hi > lo:
                spent[e["name"]] += hi - lo
            i += 1
    return {n[:100]: round(v / 1e3, 2) for n, v in sorted(spent.items(), key=lambda kv: -kv[1])[:top]}


def phase_breakdown(trace: dict, top: int) -> dict:
    """Per phase of the trace's `phase:*` annotations: wall, GPU busy, idle gaps, kernels by kind and by name."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    marks = {e["name"].split(":", 1)[1]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("phase:")
             and e.get("cat") != "gpu_user_annotation"}
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
            and not str(e.get("name", "")).startswith("phase:")]
    out = {}
    for phase, (t0, t1) in sorted(marks.items(), key=lambda kv: kv[1][0]):
        inside = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1), e) for e in gpu
                  if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
        spans = []
        busy, gaps = union_us([(a, b) for a, b, _ in inside], spans)
        long_gaps = [(a, b) for a, b in spans if b - a > 1000]  # (over 1 ms: the host's, not a launch's latency)
        in_phase = [e for e in host if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
        by_kind, by_name, count = defaultdict(float), defaultdict(lambda: [0.0, 0]), len(inside)
        for a, b, e in inside:
            name = e["name"] if e.get("cat") == "kernel" else e.get("cat")
            by_kind[kind_of(name)] += b - a
            by_name[name][0] += b - a
            by_name[name][1] += 1
        wall = t1 - t0
        gaps.sort(reverse=True)
        out[phase] = dict(
            wall_ms=round(wall / 1e3, 2), gpu_busy_ms=round(busy / 1e3, 2),
            gpu_busy_frac=round(busy / wall, 4) if wall else None, gpu_events=count,
            gaps_over_50us_ms=round(sum(g for g in gaps if g > 50) / 1e3, 2),
            gaps_over_50us=sum(1 for g in gaps if g > 50), largest_gaps_ms=[round(g / 1e3, 2) for g in gaps[:8]],
            gaps_over_1ms_ms=round(sum(b - a for a, b in long_gaps) / 1e3, 2), gaps_over_1ms=len(long_gaps),
            host_in_gaps_over_1ms_ms=host_in_gaps(in_phase, long_gaps, top),
            # the host's own time in the phase (nested events each count): where a phase runs no kernel (prep)
            host_ms=host_in_gaps(in_phase, [(t0, t1)], top),
            by_kind_ms={k: round(v / 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            top=[dict(name=n[:120], ms=round(v[0] / 1e3, 2), calls=v[1])
                 for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]])
    return out


def profile_case(root: Path, case: str, cases: dict, steps: int, profile_step: int, extra: list[str],
                 top: int, keep_trace: bool, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run
    from shardrl.trainer import rl as rl_mod
    from shardrl.trainer.rl import RLTrainer

    run_dir = root / "runs" / f"profile_{case}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = shardrl_overrides(root, case, cases, steps, extra) + [
        f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]", f"trainer.device={device}"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    trace_path = root / "traces" / f"{case}.json"
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    plain_step, plain_update, plain_prepare, calls = RLTrainer.train_step, RLTrainer._update, rl_mod.prepare, [0]

    def marked(name, fn):
        def wrapper(*args, **kwargs):
            with record_function(f"phase:{name}"):
                return fn(*args, **kwargs)
        return wrapper

    def profiled_step(self):
        calls[0] += 1
        if calls[0] != profile_step:
            return plain_step(self)
        source_batch = self.source.batch
        self.source.batch = marked("gen", source_batch)
        rl_mod.prepare = marked("prep", plain_prepare)
        RLTrainer._update = marked("update", plain_update)
        try:
            with profile(activities=activities) as prof:
                metrics = plain_step(self)
                if device == "cuda":
                    torch.cuda.synchronize()
            prof.export_chrome_trace(str(trace_path))
            return metrics
        finally:
            self.source.batch, rl_mod.prepare, RLTrainer._update = source_batch, plain_prepare, plain_update

    RLTrainer.train_step = profiled_step
    try:
        run(None, resolve_overrides(None, overrides))
    finally:
        RLTrainer.train_step = plain_step
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    others = [r for i, r in enumerate(records, 1) if i != profile_step and i > 1]
    profiled = records[profile_step - 1]
    trace = json.loads(trace_path.read_text())
    rec = dict(bench="profile_e2e", case=case, device=device, extra=" ".join(extra), profile_step=profile_step,
               step_s_profiled=round(profiled["timing/step_s"], 4),
               step_s_others=round(statistics.median(r["timing/step_s"] for r in others), 4) if others else None,
               **{f"{p}_s_others": round(statistics.median(r[f"timing/{p}_s"] for r in others), 4)
                  for p in PHASES if others},
               phases=phase_breakdown(trace, top))
    if keep_trace:
        with gzip.open(str(trace_path) + ".gz", "wt") as f:
            json.dump(trace, f)
    trace_path.unlink()
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/e2e")
    p.add_argument("--cases", default="fixed_64,fixed_512,var_512")
    p.add_argument("--steps", type=int, default=4, help="steps per case; the profiled one is --profile-step")
    p.add_argument("--profile-step", type=int, default=3, help="which step (1-based) runs under the profiler")
    p.add_argument("--extra", default="", help="extra shardrl overrides, space separated")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--keep-trace", action="store_true")
    p.add_argument("--quick", action="store_true", help="the tiny shape (CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 1 <= args.profile_step <= args.steps:
        p.error(f"--profile-step must be within 1..--steps ({args.steps}), got {args.profile_step}")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29519"))
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    cases = QUICK_CASES if args.quick else CASES
    prepare(root, args.quick, device)
    for case in args.cases.split(","):
        rec = profile_case(root, case, cases, args.steps, args.profile_step, args.extra.split(), args.top,
                           args.keep_trace, device)
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
