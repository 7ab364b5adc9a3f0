"""The one runner of shardrl's benchmarks: named sets of steps, each step a script of `bench/` (or pytest) run in a
process group of its own under a time limit, its JSON lines collected under one output folder.

    python -m bench.run --list                                  # the sets and their steps
    python -m bench.run check --out /tmp/bench_out              # a quick GPU sanity check (a few minutes)
    python -m bench.run rollout server --out $OUT               # several sets, one after another
    python -m bench.run rollout --only decode_profile           # one step of a set
    python -m bench.run whole-step --detach --out /tmp/b        # started in the background (a device call that
    python -m bench.run --wait 540 --out /tmp/b                 # ends does not end it); then wait for it

Output folder (`--out`, default `bench_out`):
    results.jsonl   every benchmark's JSON lines, each tagged with its `set` and `step`
    steps.jsonl     one line a step: its command, exit status, seconds, and whether its time limit stopped it
    logs/STEP.log   each step's output
    DONE            written when the sets have finished (what `--wait` looks for)

A step's script appends its JSON lines to the file given by `--out` (scripts that only print them have theirs read
from their output); a pytest step becomes one line of pass/fail/skip counts. One step failing or running out of
time does not stop the steps after it. The figures that matter are recorded in bench/RESULTS.md with the date,
hardware, command and commit.

Some steps need what a bare GPU machine lacks: the `server` set the `openai` client and the HTTP front end's
wheels (bench/pack_server_wheels.sh packs them under .whl/oai; `--wheels .whl/oai` installs them first); the
whole-step comparison against TRL needs TRL on PYTHONPATH (`python bench/e2e.py --systems trl`, not in a set); the
`learn` set needs TRL and the packages it imports that a bare machine lacks (trl, datasets, dill, multiprocess,
xxhash, fsspec, pandas, ...: `SKIP="torch transformers accelerate peft tokenizers safetensors huggingface-hub numpy"
bash bench/pack_server_wheels.sh trl trl datasets` packs them under .whl/trl, `--wheels .whl/trl` installs them;
peft is a shardrl dependency; datasets 5.2 wants huggingface-hub >= 1.31) and the SmolLM2 GGUF's parts and the gguf
wheel (`bash examples/smollm2/gpu_run.sh pack`, carried under .whl); the `vl` set's TRL step needs the same TRL
wheels (`--wheels .whl/trl`; without them its line says to install TRL and the other steps run).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

PY = sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    limit_s: int
    out_flag: bool = True  # the script takes `--out FILE`; otherwise its printed JSON lines are read
    pytest: bool = False
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None  # run in another tree (an older commit's, for a baseline in the same run); its own code


def bench(name: str, script: str, *args: str, limit_s: int, out_flag: bool = True, env=(), cwd=None) -> Step:
    return Step(name, (PY, f"bench/{script}", *args), limit_s, out_flag=out_flag, env=tuple(env), cwd=cwd)


def pytest_step(name: str, *args: str, limit_s: int) -> Step:
    argv = (PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore", *args)
    return Step(name, argv, limit_s, out_flag=False, pytest=True)


E2E_ROOT = "/tmp/bench_e2e"  # the e2e models, written once by `whole_step_prepare`; other sets reuse them
E2E = ("--root", E2E_ROOT, "--systems", "shardrl")
# a baseline tree for figures against an older commit in the same run: `git archive -o .whl/base.tar COMMIT`, carried
# (BASE_TAR names another), unpacked here by the step `base_tree`
BASE_TREE = "/tmp/bench_base_tree"
BASE_TREE_STEP = Step("base_tree", ("bash", "bench/base_tree.sh", BASE_TREE), 60, out_flag=False)
ASYNC = "async_rl.rollout_ranks=1 algorithm.rollout_is=true"
SERVE = ("--shape", "1.5b", "--clients", "256", "--requests", "2", "--client-procs", "8")
# the first learn step makes prepare.py's folder from the GGUF `learn_join_gguf` joined
LEARN = ("--root", "/tmp/bench_learn", "--data", "/tmp/bench_learn/assets", "--gguf", "/tmp/smollm2.gguf")
MOE_REPLAY = ("--extra", "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192")
VL = ("--root", "/tmp/bench_vl")  # the model folder and image prompts, written once by `vl_prepare`
VL_STEPS = (
    bench("vl_prepare", "vl_e2e.py", *VL, "--parts", "none", limit_s=300),
    bench("vl_shardrl", "vl_e2e.py", *VL, "--parts", "shardrl", limit_s=420),
    bench("vl_rollout", "vl_e2e.py", *VL, "--parts", "rollout", limit_s=300),
    bench("vl_trl", "vl_e2e.py", *VL, "--parts", "trl", limit_s=480),
)

SETS: dict[str, tuple[str, list[Step]]] = {
    "check": ("a quick GPU sanity check: the device, the fast rollout's CUDA tests, tiny runs of the whole step and "
              "the rollout benchmark (one GPU, a few minutes)", [
        pytest_step("rollout_cuda_tests", "-m", "cuda", "tests/test_rollout_fast.py", limit_s=300),
        bench("whole_step_tiny", "e2e.py", "--quick", "--root", "/tmp/bench_e2e_quick", "--systems", "shardrl",
              "--no-floor", limit_s=240),
        bench("rollout_tiny", "rollout.py", "--quick", limit_s=120),
    ]),
    "cuda-tests": ("every CUDA-marked test (one GPU; the two-GPU ones skip there)", [
        pytest_step("cuda_tests", "-m", "cuda", "--durations=15", "--continue-on-collection-errors", "tests/",
                    limit_s=560),
    ]),
    "whole-step": ("the whole GRPO step on one GPU, every case (bench/e2e.py), and where the demo's step goes "
                   "(bench/profile_e2e.py on the GPU; bench/profile_demo.py, GPU and CPU)", [
        bench("whole_step_prepare", "e2e.py", "--root", E2E_ROOT, "--systems", "none", limit_s=240),
        bench("whole_step_1gpu", "e2e.py", *E2E, "--gpus", "1", "--steps", "5", limit_s=560),
        bench("whole_step_profile", "profile_e2e.py", "--root", E2E_ROOT, limit_s=420),
        bench("demo_profile_cuda", "profile_demo.py", "--device", "cuda", "--steps", "30", limit_s=150),
        bench("demo_profile_cpu", "profile_demo.py", "--device", "cpu", "--steps", "30", limit_s=100),
    ]),
    "whole-step-2gpu": ("the whole step on two GPUs: colocated, offload, and asynchronous 1 + 1 against it (var_512)", [
        bench("whole_step_prepare", "e2e.py", "--root", E2E_ROOT, "--systems", "none", limit_s=240),
        bench("whole_step_2gpu", "e2e.py", *E2E, "--gpus", "2", "--cases", "fixed_512,var_512", "--steps", "6",
              limit_s=400),
        bench("whole_step_2gpu_offload", "e2e.py", *E2E, "--gpus", "2", "--cases", "fixed_512", "--steps", "3",
              "--tag", "offload", "--extra", "actor.engine.offload_params=true actor.engine.offload_optimizer=true",
              limit_s=200),
        bench("async_2gpu", "e2e.py", *E2E, "--gpus", "2", "--cases", "var_512", "--steps", "6", "--no-floor",
              "--tag", "async2", "--extra", f"{ASYNC} async_rl.max_staleness=2", limit_s=220),
        bench("async_2gpu_partial", "e2e.py", *E2E, "--gpus", "2", "--cases", "var_512", "--steps", "6",
              "--no-floor", "--tag", "async2_partial",
              "--extra", f"{ASYNC} async_rl.max_staleness=2 async_rl.partial_rollout=true", limit_s=220),
    ]),
    "engine": ("the training engine on one GPU: the update against a plain FSDP2 loop, the log-prob head, weight "
               "export and offload, start-up, the sft step", [
        bench("engine_1gpu", "engine.py", "--world", "1", "--steps", "3",
              "--rows", "plain_4,fsdp2_4,fsdp2_4_compile,fsdp2_8_compile,fsdp2_rlvar_compile", limit_s=400),
        bench("update_profile", "profile_step.py", "--rows", "fsdp2_8_compile,fsdp2_rlvar_compile", out_flag=False,
              limit_s=300),
        bench("logprob_head", "logprob.py", limit_s=120),
        bench("state_1gpu", "state.py", "--world", "1", "--strategies", "fsdp2", limit_s=200),
        bench("startup_1gpu", "startup.py", "--cases", "1.5b:1", limit_s=240),
        bench("sft_step", "sft.py", limit_s=240),
    ]),
    "engine-2gpu": ("the engine on two GPUs: full sharding against HSDP, weight export, sharded start-up, Ulysses", [
        bench("engine_2gpu", "engine.py", "--world", "2", "--steps", "3",
              "--rows", "fsdp2_8,hsdp1_8,fsdp2_8_compile,hsdp1_8_compile", limit_s=300),
        bench("state_2gpu", "state.py", "--world", "2", "--strategies", "fsdp2,fsdp", limit_s=200),
        bench("startup_2gpu", "startup.py", "--cases", "1.5b:2,7b:2", limit_s=300),
        bench("ulysses_2gpu", "ulysses.py", "--world", "2", "--sp", "1,2", limit_s=360),
    ]),
    "rollout": ("the fast rollout on one GPU against HF generate, its decode step's parts, FP8 against bf16, the model "
                "families, the multi-turn loop and the long-prompt GRPO call", [
        bench("rollout_fixed_mixed", "rollout.py", "--cases", "fixed_64,mixed", "--hf-warm-once",
              "--rows", "hf_dynamic,fast", limit_s=420),
        bench("rollout_fixed_256", "rollout.py", "--cases", "fixed_256", "--rows", "hf_dynamic,fast", limit_s=300),
        bench("rollout_tail", "rollout.py", "--cases", "tail_512", "--rows", "fast_no_compact,fast", limit_s=240),
        bench("fp8_rollout", "fp8.py", limit_s=400),
        bench("decode_profile", "profile_decode.py", limit_s=400),
        bench("families", "rollout_families.py", limit_s=330),
        bench("multiturn", "multiturn.py", "--backend", "fast", "--shape", "0.5b", "--prompts", "128", "--n", "4",
              "--tool-latency-s", "0.2", out_flag=False, limit_s=200),
        bench("long_prompts", "prefix_reuse.py", "--trees", "new=.", "--shape", "1.5b", "--prompts", "32",
              "--n", "8", "--prompt-len", "2048", "--new-tokens", "256", limit_s=300),
    ]),
    "server": ("`shardrl serve` under 256 openai clients against direct calls, and the HTTP front end alone "
               "(needs the wheels of bench/pack_server_wheels.sh: --wheels .whl/oai)", [
        bench("serve", "serve.py", *SERVE, "--in-process", limit_s=200),
        bench("serve_warm_clients", "serve.py", *SERVE, "--warm-clients", limit_s=150),
        bench("serve_stream", "serve.py", *SERVE, "--warm-clients", "--stream", limit_s=240),
        bench("serve_stream_raw", "serve.py", *SERVE, "--warm-clients", "--stream", "--client", "raw",
              limit_s=240),
        bench("serve_sim", "serve.py", *SERVE, "--client", "raw", "--backend", "sim", "--in-process", limit_s=120),
        bench("front_end", "front_end.py", "--front-ends", "1,2,4", "--load-procs", "4", limit_s=120),
    ]),
    "lora": ("LoRA on one GPU: the adapter-only sync, the 7B step against full fine-tuning in bf16", [
        bench("lora_sync", "lora.py", "sync", "--shape", "7b", limit_s=200),
        bench("lora_steps", "lora.py", "steps", "--cases", "7b_lora,7b_lora_unmerged_gc,7b_full_bf16",
              "--steps", "3", limit_s=560),
    ]),
    "moe": ("mixtures of experts on one GPU: the update (grouped against HF's eager experts), the decode against HF "
            "generate, router replay", [
        bench("moe_update_olmoe", "moe.py", "update", "--shape", "olmoe", "--experts", "grouped_mm+compile,eager",
              limit_s=300),
        bench("moe_update_qwen3", "moe.py", "update", "--shape", "qwen3_30b_a3b", "--experts", "grouped_mm+compile",
              limit_s=300),
        bench("moe_rollout", "moe.py", "rollout", "--shape", "olmoe", limit_s=300),
        bench("moe_replay", "moe.py", "replay", "--shape", "olmoe", "--steps", "3", "--modes", "R3,disabled",
              *MOE_REPLAY, limit_s=300),
    ]),
    "learning": ("reward curves: the rollout-mismatch correction on one GPU, asynchronous against colocated on the "
                 "CPU (bench/async_curve.py: long)", [
        bench("rollout_mismatch", "rollout_mismatch.py", "--steps", "80", "--root", "/tmp/bench_mismatch",
              out_flag=False, limit_s=300),
        bench("async_curve", "async_curve.py", "--steps", "150", "--seeds", "0,1", limit_s=3600),
    ]),
    "learn": ("time to accuracy on SmolLM2-135M-Instruct (examples/smollm2), shardrl against TRL's GRPOTrainer, "
              "full and LoRA (bench/learn.py; one GPU, about an hour; needs the GGUF parts and wheels, see above)", [
        Step("learn_join_gguf", ("bash", "examples/smollm2/gpu_run.sh", "join"), limit_s=120, out_flag=False),
        bench("learn_shardrl", "learn.py", *LEARN, "--systems", "shardrl", limit_s=900),
        bench("learn_trl", "learn.py", *LEARN, "--systems", "trl", limit_s=3000),
        bench("learn_shardrl_lora", "learn.py", *LEARN, "--systems", "shardrl", "--lora", limit_s=900),
        bench("learn_trl_lora", "learn.py", *LEARN, "--systems", "trl", "--lora", limit_s=3000),
    ]),
    "vl": ("a vision-language model of Qwen2.5-VL-3B's shape (random init, 256 image tokens a prompt): the whole GRPO "
           "step, shardrl against TRL's GRPOTrainer on the same folder and images, and the fast rollout against HF "
           "generate with the images (bench/vl_e2e.py; one GPU, about 15 minutes; the TRL step needs TRL carried, "
           "as the learn set: --wheels .whl/trl)", [
        *VL_STEPS,
    ]),
    "distill": ("on-policy distillation against plain GRPO on the CPU, from the demo's start with the demo's model "
                "trained further as the teacher, several seeds (bench/distill.py)", [
        bench("distill", "distill.py", "--steps", "150", "--seeds", "0,1,2", "--window", "20",
              limit_s=1800),
        bench("distill_product", "distill.py", "--task", "product", "--steps", "150", "--seeds", "0,1,2",
              "--window", "20", limit_s=1800),
        bench("distill_reverse", "distill.py", "--task", "reverse", "--steps", "150", "--seeds", "0,1,2",
              "--window", "20", "--variants", "grpo,opd_group,opd_mix,opd_top_k", limit_s=1800),
    ]),
    "owed": ("the one-GPU figures issue 62 still owes (session 44 ran the rest): the whole step, every case, where "
             "the default now keeps fixed_64's cache on an 80 GB card (the ledger counts the compiled update); every "
             "CUDA test (the server's need the wheels of bench/pack_server_wheels.sh: --wheels .whl/oai); the whole "
             "step with the allocator's expandable segments; the decode attention's splits at narrow widths", [
        bench("whole_step_prepare", "e2e.py", "--root", E2E_ROOT, "--systems", "none", limit_s=240),
        bench("whole_step_1gpu", "e2e.py", *E2E, "--gpus", "1", "--steps", "5", limit_s=560),
        pytest_step("cuda_tests", "-m", "cuda", "--durations=15", "--continue-on-collection-errors", "tests/",
                    limit_s=560),
        # the allocator's expandable segments: a colocated run frees the rollout's cache and the allocator's cached
        # blocks (`release()`'s empty_cache) every step, and the update then allocates its segments anew
        bench("whole_step_expandable", "e2e.py", *E2E, "--gpus", "1", "--steps", "5", "--tag", "expandable",
              "--no-floor", env=[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")], limit_s=560),
        # the decode attention at var_512's narrow tail (32 and 64 slots, long contexts): whether splitting a slot's
        # entries over programs (`splits`) pays where slots x KV heads leave most of 132 SMs idle
        bench("decode_narrow_32", "profile_decode.py", "--batch", "32", "--prompt-len", "256", "--new-tokens", "1024",
              limit_s=240),
        bench("decode_narrow_64", "profile_decode.py", "--batch", "64", "--prompt-len", "256", "--new-tokens", "1024",
              limit_s=240),
    ]),
    "smoke": ("every benchmark's CPU smoke run (tiny models; no GPU): that the scripts still run", [
        bench("whole_step_tiny", "e2e.py", "--quick", "--root", "/tmp/bench_e2e_quick", "--systems", "shardrl",
              "--no-floor", limit_s=300),
        bench("whole_step_profile_tiny", "profile_e2e.py", "--quick", "--root", "/tmp/bench_e2e_quick", limit_s=200),
        bench("rollout_tiny", "rollout.py", "--quick", limit_s=200),
        bench("assemble_tiny", "assemble.py", "--rows", "64", "--max-len", "128", "--repeats", "1", limit_s=120),
        bench("fp8_tiny", "fp8.py", "--quick", limit_s=200),
        bench("fp8_curve_tiny", "fp8_curve.py", "--steps", "4", "--seeds", "0", "--window", "2", "--val-freq", "2",
              limit_s=200),
        bench("multiturn_tiny", "multiturn.py", "--quick", out_flag=False, limit_s=200),
        bench("long_prompts_tiny", "prefix_reuse.py", "--quick", limit_s=200),
        bench("vl_tiny", "vl_e2e.py", "--quick", "--root", "/tmp/bench_vl_quick", limit_s=200),
        bench("serve_sim", "serve.py", "--backend", "sim", "--clients", "6", "--requests", "2", "--client", "raw",
              "--in-process", limit_s=200),
    ]),
}


def run_step(step: Step, set_name: str, out: str) -> dict:
    """Runs one step in a process group of its own; ends the group (spawned ranks and compile workers too) at its
    time limit or when the step returns. Appends the step's JSON lines, tagged, to out/results.jsonl."""
    os.makedirs(f"{out}/logs", exist_ok=True)
    raw = os.path.abspath(f"{out}/logs/{step.name}.jsonl")  # (absolute: a step may run in another tree)
    if os.path.exists(raw):
        os.remove(raw)
    argv = list(step.argv) + (["--out", raw] if step.out_flag else [])
    tree = os.path.abspath(step.cwd) if step.cwd else os.getcwd()  # the tree whose code the step runs
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (tree, os.environ.get("PYTHONPATH", "")) if p), **dict(step.env))
    log_path = f"{out}/logs/{step.name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=tree)
        timed_out = False
        try:
            rc = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                rc = None
        _signal_group(proc.pid, signal.SIGKILL)
        if rc is None:
            rc = proc.wait()
    seconds = round(time.monotonic() - start, 1)
    records = _read_json_lines(raw if step.out_flag else log_path)
    if step.pytest:
        records = [dict(_pytest_counts(log_path), rc=rc)]
    with open(f"{out}/results.jsonl", "a") as f:
        f.writelines(json.dumps({"set": set_name, "step": step.name, **r}) + "\n" for r in records)
    return {"set": set_name, "step": step.name, "rc": rc, "seconds": seconds, "timed_out": timed_out,
            "results": len(records), "argv": argv[1:]}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_json_lines(path: str) -> list[dict]:
    records = []
    if not os.path.exists(path):
        return records
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    return records


def _pytest_counts(log_path: str) -> dict:
    """The counts of pytest's last summary line (`3 passed, 1 skipped in 12.3s`), and the failed tests' ids."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    counts = {}
    summary = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b.* in ", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary[-1] if summary else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    counts["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return counts


def run_sets(names: list[str], out: str, only: list[str] | None = None) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    done = f"{out}/DONE"
    if os.path.exists(done):
        os.remove(done)
    summaries = []
    for name in names:
        for step in SETS[name][1]:
            if only and step.name not in only:
                continue
            print(f"== {name}/{step.name} start {time.strftime('%H:%M:%S')}", flush=True)
            summary = run_step(step, name, out)
            summaries.append(summary)
            with open(f"{out}/steps.jsonl", "a") as f:
                f.write(json.dumps(summary) + "\n")
            print(f"== {name}/{step.name} rc={summary['rc']} {summary['seconds']} s"
                  f"{' (time limit)' if summary['timed_out'] else ''}, {summary['results']} results", flush=True)
    with open(done, "w") as f:
        f.write(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    return summaries


def wait_for(out: str, seconds: float) -> bool:
    """Waits until the detached sets are done or `seconds` pass; prints what they wrote so far."""
    end = time.monotonic() + seconds
    while not os.path.exists(f"{out}/DONE") and time.monotonic() < end:
        time.sleep(5)
    finished = os.path.exists(f"{out}/DONE")
    print("ALL DONE" if finished else "STILL RUNNING")
    for path in (f"{out}/steps.jsonl", f"{out}/results.jsonl"):
        if os.path.exists(path):
            print(f"---- {path}")
            with open(path) as f:
                for line in f:
                    print(line.rstrip()[:400])
    return finished


def collect_wheels(folders: str) -> list[str]:
    """The wheels of a comma list of folders, each file name once (a wheel in two folders is installed once); two
    versions of one package, which would stop pip, are refused."""
    wheels: dict[str, str] = {}
    versions: dict[str, str] = {}
    for folder in folders.split(","):
        found = sorted(glob.glob(f"{folder}/*.whl"))
        if not found:
            raise SystemExit(f"no wheels under {folder} (bench/pack_server_wheels.sh makes them)")
        for path in found:
            name, version = os.path.basename(path).split("-")[:2]
            if versions.setdefault(name.lower(), version) != version:
                raise SystemExit(f"{name} {versions[name.lower()]} and {version} are both in {folders}: keep one")
            wheels.setdefault(os.path.basename(path), path)
    return list(wheels.values())


def install_wheels(folders: str) -> None:
    """pip-installs the wheels of a comma list of folders (no index, no dependencies: the folders hold them)."""
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    *collect_wheels(folders)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sets", nargs="*", help="the sets to run, in order (--list names them)")
    p.add_argument("--out", default="bench_out", help="the output folder")
    p.add_argument("--only", default="", help="comma list: run only these steps of the sets")
    p.add_argument("--list", action="store_true", help="print the sets and their steps' commands")
    p.add_argument("--detach", action="store_true", help="start the sets in the background and return")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="wait for detached sets writing to --out, then print their results")
    p.add_argument("--wheels", default=None,
                   help="folders of wheels to pip-install first, comma-separated (e.g. .whl/oai,.whl/rg)")
    args = p.parse_args(argv)
    if args.list:
        for name, (about, steps) in SETS.items():
            print(f"{name}: {about}")
            for step in steps:
                print(f"    {step.name} ({step.limit_s} s): {' '.join(step.argv[1:])}")
        return 0
    if args.wait is not None:
        return 0 if wait_for(args.out, args.wait) else 1
    unknown = [name for name in args.sets if name not in SETS]
    if unknown or not args.sets:
        p.error(f"unknown sets {unknown}; the sets: {', '.join(SETS)}" if unknown else "name a set (--list)")
    only = [s for s in args.only.split(",") if s]
    steps = {step.name for name in args.sets for step in SETS[name][1]}
    if set(only) - steps:
        p.error(f"no such steps in {args.sets}: {sorted(set(only) - steps)}")
    if args.wheels:
        install_wheels(args.wheels)
    if args.detach:
        os.makedirs(args.out, exist_ok=True)
        if os.path.exists(f"{args.out}/DONE"):
            os.remove(f"{args.out}/DONE")  # before `--wait` can look: a warm machine keeps the last run's
        cmd = [PY, "-m", "bench.run", *args.sets, "--out", args.out] + (["--only", args.only] if only else [])
        with open(f"{args.out}/runner.log", "a") as log:
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        print(f"started in the background: {' '.join(args.sets)} -> {args.out} (python -m bench.run --wait S "
              f"--out {args.out})")
        return 0
    summaries = run_sets(args.sets, args.out, only)
    return 0 if all(s["rc"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
