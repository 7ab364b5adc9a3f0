"""LoRA on one GPU: the GRPO step of LoRA against full fine-tuning of the same shape, the adapter-only sync to
the fast rollout (unmerged over the trainer's own base against merged into a copy), and the memory ledger.

Shapes (random init on the GPU, `model.load_weights=random_shards`; a word-level tokenizer over the whole
vocabulary, as bench/e2e.py): Qwen2.5-7B (hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocab
152064) and Qwen2.5-32B (hidden 5120, 64 layers, 40 heads, 8 KV heads, MLP 27648, vocab 152064).

    python bench/lora.py sync --shape 7b --out results.jsonl            # the rollout side, in one process
    python bench/lora.py steps --cases 7b_full,7b_lora,32b_lora --out results.jsonl
    python bench/lora.py update --shape 7b --out results.jsonl           # train_batch alone, LoRA vs full, profiled

`sync`: an FSDP2 LoRA engine (rank 64, all linear layers, bf16 base) with random adapters, and three fast
rollouts of it: `full` (the merged model exported whole, what a sync costs without the adapter-only path),
`unmerged` and `merged` (`LoRASync`). Per rollout: the sync's median seconds (5 after a first), decode
throughput on the same prompts (prompts x n rows of prompt_len tokens, new tokens each, sampled at temperature
1, the median of 2 after a warm-up), GPU memory it adds, and the sampled tokens' log-probs against the engine's
own (`rollout/logprob_abs_diff`, as the trainer logs it).

`steps`: `shardrl train` runs of GRPO (no KL), `prompts` x n=8, 256 prompt tokens + 256 new, one optimizer
step per batch; the median step after the first and the peaks per phase from metrics.jsonl (torch's allocation
peak), the device's peak while the case ran (nvidia-smi, every 0.5 s: the same measure for a case that finishes
no step), with the ledger's prediction (`shardrl plan --json`) for the same overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402

SHAPES = {
    "7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
               tie_word_embeddings=False, rope_theta=1e6, initializer_range=0.02),
    "3b": dict(model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096,
               tie_word_embeddings=True, rope_theta=1e6, initializer_range=0.02),
    "32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=4096,
                tie_word_embeddings=False, rope_theta=1e6, initializer_range=0.02),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=False, initializer_range=0.02),
}
RANK, ALPHA = 64, 128
PROMPT_LEN, NEW_TOKENS, N = 256, 256, 8
LORA = [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.target_modules=all-linear"]
# case: (shape, prompts, overrides)
CASES = {
    # full fine-tuning: fp32 master weights and AdamW (16 bytes a parameter) need the CPU on one H200
    "7b_full": ("7b", 32, ["actor.engine.offload_params=true", "actor.engine.offload_optimizer=true"]),
    # full fine-tuning in bf16 throughout (weights, grads, AdamW state: 8 bytes a parameter) fits without offload
    "7b_full_bf16": ("7b", 32, ["model.dtype=bfloat16", "actor.engine.max_token_len_per_gpu=4096"]),
    "7b_lora": ("7b", 32, LORA),
    # offload against none on a shape whose fp32 master weights and AdamW (16 bytes a parameter, 49 GB) fit one
    # 80 GB GPU and, offloaded, the host's memory (the 7B's 122 GB of host state does not fit a 128 GiB host)
    "3b_full": ("3b", 32, ["actor.engine.max_token_len_per_gpu=4096"]),
    "3b_full_offload": ("3b", 32, ["actor.engine.offload_params=true", "actor.engine.offload_optimizer=true",
                                   "actor.engine.max_token_len_per_gpu=4096"]),
    # ... with the parameters kept gathered (bf16, on the GPU) over the micro-batches: each crosses the host link
    # once a pass, not once a micro-batch's forward and again its backward
    "3b_full_offload_acc": ("3b", 32, ["actor.engine.offload_params=true", "actor.engine.offload_optimizer=true",
                                       "actor.engine.max_token_len_per_gpu=4096",
                                       "actor.engine.accumulate_unsharded=true"]),
    "7b_lora_merged": ("7b", 32, LORA + ["rollout.lora_sync=merged"]),
    # the least memory: full fine-tuning's 4,096-token micro-batches, the rollout's cache freed for the update,
    # merged (a bf16 copy of the model in the rollout) or unmerged (the rollout reads the trainer's base)
    "7b_lora_lowmem": ("7b", 32, LORA + ["actor.engine.max_token_len_per_gpu=4096", "rollout.free_cache_engine=true"]),
    "7b_lora_unmerged": ("7b", 32, LORA + ["actor.engine.max_token_len_per_gpu=4096", "rollout.free_cache_engine=true",
                                           "rollout.lora_sync=unmerged"]),
    # ... and the update's activations recomputed in the backward (gradient checkpointing): its least memory
    "7b_lora_unmerged_gc": ("7b", 32, LORA + ["actor.engine.max_token_len_per_gpu=4096",
                                              "rollout.free_cache_engine=true", "rollout.lora_sync=unmerged",
                                              "model.gradient_checkpointing=true"]),
    # ... and the frozen base gathered a layer at a time in the update, not kept whole beside its shard (on one GPU
    # `accumulate_unsharded` would hold a second bf16 copy of it over the micro-batches)
    "7b_lora_least": ("7b", 32, LORA + ["actor.engine.max_token_len_per_gpu=4096", "rollout.free_cache_engine=true",
                                        "rollout.lora_sync=unmerged", "model.gradient_checkpointing=true",
                                        "actor.engine.accumulate_unsharded=false"]),
    # a second, gathered copy of the 65 GB base over the micro-batches would not fit: gather a layer at a time
    "32b_lora": ("32b", 16, LORA + ["rollout.fast.max_batch=64", "model.gradient_checkpointing=true",
                                    "actor.engine.accumulate_unsharded=false"]),
    "tiny_full": ("tiny", 4, []),
    "tiny_lora": ("tiny", 4, LORA),
    "tiny_lora_fast": ("tiny", 4, LORA + ["rollout.backend=fast"]),
}


def tokenizer_folder(root: Path, vocab_size: int) -> Path:
    from bench.e2e import build_tokenizer

    folder = root / f"tokenizer_{vocab_size}"
    if not (folder / "tokenizer.json").is_file():
        build_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def prompt_file(root: Path, vocab_size: int, prompts: int) -> Path:
    import random

    rng = random.Random(0)
    path = root / f"prompts_{vocab_size}_{prompts}.jsonl"
    rows = [{"prompt": " ".join(f"w{rng.randrange(4, vocab_size)}" for _ in range(PROMPT_LEN)), "answer": "0"}
            for _ in range(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- sync: the rollout side ----------------------------------------------------------------------------
def _sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync_device()
        t0 = time.perf_counter()
        fn()
        _sync_device()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_sync(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from shardrl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.lora import LORA_MARK
    from shardrl.rollout import FastRollout, SamplingParams
    from shardrl.trainer.generation import LoRASync, export_for_rollout
    from transformers import AutoTokenizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()  # (the CPU: a check of this script on the tiny shape)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if cuda:
        torch.cuda.set_device(0)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    shape = SHAPES[args.shape]
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(root, shape["vocab_size"]))
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear")
    engine = build_engine(ModelConfig(tiny=shape, load_weights="random_shards", lora=lora),
                          EngineConfig(param_dtype="bfloat16" if cuda else "float32"), OptimConfig())
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():  # random adapters (B = 0 at init would make the merge a copy)
        for n, p in engine.module.named_parameters():
            if LORA_MARK in n:
                p.to_local().normal_(0, 0.02 if ".lora_A." in n else 0.002, generator=g)
    prompts = [" ".join(f"w{(17 * i + 31 * j) % (shape['vocab_size'] - 4) + 4}" for j in range(PROMPT_LEN))
               for i in range(args.prompts)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    sampling = SamplingParams(temperature=1.0, n=N, max_new_tokens=args.new_tokens, seed=0)
    out = []
    for mode in args.modes.split(","):
        if cuda:
            torch.cuda.empty_cache()
        before = allocated()
        rollout = FastRollout(engine.hf_config, tok, device, dtype, lazy_weights=mode != "full")
        if mode == "full":
            do_sync = lambda: rollout.load_weights(export_for_rollout(engine, device))  # noqa: E731
        else:
            do_sync = LoRASync(engine, rollout, mode, dtype).sync
        first = _median_s(do_sync, 1)
        sync_s = _median_s(do_sync, 5)
        weights_gib = (allocated() - before) / 2**30
        res = rollout.generate(ids, mask, sampling)  # warm-up: compiles, captures graphs
        gen = []
        for _ in range(2):
            _sync_device()
            t0 = time.perf_counter()
            res = rollout.generate(ids, mask, sampling)
            _sync_device()
            gen.append(time.perf_counter() - t0)
        batch = res.to_batch().to("cpu")
        with torch.no_grad():
            logp = engine.infer_batch(batch)["log_probs"].cpu()
        m = batch["loss_mask"].bool()
        diff = (logp[m] - batch["sampled_log_probs"][m]).abs()
        tokens = int(batch["response_mask"].sum())
        rec = dict(bench="lora_sync", shape=args.shape, mode=mode, rank=RANK, first_sync_s=round(first, 4),
                   sync_s=round(sync_s, 5), rollout_gib=round(weights_gib, 3),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                   gen_s=round(statistics.median(gen), 3), tokens=tokens,
                   tokens_per_s=round(tokens / statistics.median(gen)), logprob_abs_diff=round(float(diff.mean()), 5),
                   logprob_abs_diff_max=round(float(diff.max()), 4))
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
        rollout.release()
        del rollout, do_sync
    dist.destroy_process_group()
    return out


# ---- update: the engine's train_batch alone, profiled ---------------------------------------------------
UPDATE_CASES = {  # name: (LoRA?, master dtype, max tokens per micro-batch)
    "lora": (True, "float32", 8192),
    "full_bf16": (False, "bfloat16", 4096),
}


def run_update(args) -> list[dict]:
    """One engine per case on `--shape`, `train_batch` of prompts x n full-length sequences (prompt_len +
    new_tokens) with a policy-gradient loss: the median of 3 timed calls after one, then one call under
    torch.profiler (its 15 costliest ops by device time, and CPU time where there is no GPU). Isolates the update
    from the rest of the step (bench/RESULTS.md, "LoRA": the 7B LoRA update was not faster than full
    fine-tuning's)."""
    import torch
    import torch.distributed as dist

    from shardrl.algos.aggregate import agg_loss
    from shardrl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import random_batch

    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    shape = SHAPES[args.shape]
    rows, length = args.prompts * N, PROMPT_LEN + args.new_tokens
    batch = random_batch(rows, length, shape["vocab_size"], seed=0, min_len=length, prompt_len=PROMPT_LEN)

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                        num_global_tokens=num_tokens, num_global_seqs=num_seqs), {}

    out = []
    for case in args.update_cases.split(","):
        lora, master, tokens = UPDATE_CASES[case]
        model = ModelConfig(tiny=shape, load_weights="random_shards", dtype=master,
                            lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear") if lora else LoRAConfig())
        engine = build_engine(model, EngineConfig(param_dtype="bfloat16" if cuda else "float32", use_dynamic_bsz=True,
                                                  max_token_len_per_gpu=tokens, compile=args.compile and cuda),
                              OptimConfig(lr=1e-6))
        engine.train_batch(batch, loss_fn)  # warm-up (compiles, allocates the optimizer state)
        seconds = _median_s(lambda: engine.train_batch(batch, loss_fn), 3)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.train_batch(batch, loss_fn)
            _sync_device()
        key = "device_time_total" if cuda else "cpu_time_total"
        ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:15]
        rec = dict(bench="lora_update", shape=args.shape, case=case, rows=rows, seq_len=length,
                   max_token_len=tokens, compile=bool(args.compile and cuda), seconds=round(seconds, 3),
                   tokens_per_s=round(rows * length / seconds),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                   top_ops=[(e.key, round(getattr(e, key, 0) / 1e3, 1), e.count) for e in ops])
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
        del engine
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()
    return out


# ---- steps: whole GRPO steps ---------------------------------------------------------------------------
def case_overrides(root: Path, case: str, steps: int) -> list[str]:
    from bench.e2e import grpo_overrides

    shape_name, prompts, extra = CASES[case]
    shape = SHAPES[shape_name]
    tiny = json.dumps(shape).replace(" ", "")
    return [f"model.tiny={tiny}", "model.load_weights=random_shards",
            f"model.tokenizer_path={tokenizer_folder(root, shape['vocab_size'])}",
            *grpo_overrides(prompt_file(root, shape["vocab_size"], prompts), prompts, N, PROMPT_LEN, NEW_TOKENS, steps,
                            case, max_token_len=8192),
            *extra]


def host_used_gib() -> float | None:
    """The host's memory in use (MemTotal - MemAvailable of /proc/meminfo), GiB; None where there is none."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
        return kib / 2**20
    except (OSError, KeyError, ValueError):
        return None


class DeviceMemory:
    """The GPU's memory in use as nvidia-smi reports it (every process: the allocator's cache and the CUDA context
    counted), sampled every `every_s` on a thread while a case runs: one measure for a case that finishes no step
    (whose metrics.jsonl holds no torch peak) and for one that does. `peak_gib` is the most seen less what was in
    use before the case started. The host's memory in use is sampled beside it (`host_peak_gib`, less what was in use
    before: offloaded state lives there)."""

    def __init__(self, every_s: float = 0.5):
        import threading

        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self.host_base, self.host_samples = host_used_gib(), []
        self.base = self._used()
        self._thread = threading.Thread(target=self._run, daemon=True) if self.base is not None else None
        if self._thread is not None:
            self._thread.start()

    @staticmethod
    def _used() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10)
            return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            used, host = self._used(), host_used_gib()
            if used is not None:
                self.samples.append(used)
            if host is not None:
                self.host_samples.append(host)

    def host_peak(self) -> float | None:
        if not self.host_samples or self.host_base is None:
            return None
        return round(max(self.host_samples) - self.host_base, 2)

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return round(max(self.samples) - self.base, 2) if self.samples else None


def run_steps(args) -> list[dict]:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for case in args.cases.split(","):
        run_dir = root / "runs" / case
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts afresh (as bench/e2e.py's)
        overrides = case_overrides(root, case, args.steps) + [f"trainer.output_dir={run_dir}"]
        import torch

        from shardrl.plan.offload import host_memory_gib

        gpu = ["--gpu-mem-gib", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"] \
            if torch.cuda.is_available() else []  # (so that the ledger counts a cache the run keeps)
        plan = subprocess.run([sys.executable, "-m", "shardrl.cli", "plan", "--json", *gpu, *overrides],
                              capture_output=True, text=True)
        ledger = None
        if plan.returncode == 0:
            memory = json.loads(plan.stdout)["memory"]
            ledger = {k: round(v["total_gib"], 2) for k, v in memory["phases"].items()}
        t0 = time.perf_counter()
        smi = DeviceMemory()
        try:
            proc = subprocess.run([sys.executable, "-m", "shardrl.cli", "train", *overrides], capture_output=True,
                                  text=True, timeout=args.case_timeout_s)
            error = proc.stderr[-3000:] if proc.returncode != 0 else None
            resolved = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if "(null:" in ln][:12]
        except subprocess.TimeoutExpired:  # the steps it finished are still read
            error, resolved = f"timed out after {args.case_timeout_s} s", []
        wall = time.perf_counter() - t0
        rec = dict(bench="lora_steps", case=case, ledger_gib=ledger, wall_s=round(wall, 1), resolved=resolved,
                   nvidia_smi_peak_gib=smi.stop(), host_peak_gib=smi.host_peak(), host_total_gib=host_memory_gib(),
                   plan_error=None if plan.returncode == 0 else plan.stderr[-1500:])
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        if error:
            rec["error"] = error
        timed = records[1:] or records

        def med(key):
            vals = [r[key] for r in timed if r.get(key) is not None]
            return round(statistics.median(vals), 4) if vals else None

        rec.update(steps=len(records), step_s=med("timing/step_s"), gen_s=med("timing/gen_s"),
                   update_s=med("timing/update_actor_s") or med("timing/update_s"),
                   old_log_prob_s=med("timing/old_log_prob_s"), update_weights_s=med("timing/update_weights_s"),
                   logprob_abs_diff=med("rollout/logprob_abs_diff"),
                   grad_norms=[round(r["actor/grad_norm"], 5) for r in records if "actor/grad_norm" in r],
                   step_times=[round(r["timing/step_s"], 2) for r in records],
                   # (a step's gradient is 0 where no group's rewards differ: GRPO's advantages are then all 0)
                   **{name: [None if r.get(key) is None else round(r[key], 4) for r in records]
                      for name, key in (("rewards", "reward/mean"), ("group_spread", "reward/group_spread_frac"),
                                        ("logprob_abs_diffs", "rollout/logprob_abs_diff"))})
        for phase in ("gen", "prep", "update"):
            vals = [r[f"memory/{phase}_peak_gib"] for r in records if r.get(f"memory/{phase}_peak_gib") is not None]
            rec[f"peak_{phase}_gib"] = round(max(vals), 2) if vals else None
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["sync", "steps", "update"])
    p.add_argument("--update-cases", default="lora,full_bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="update: engine.compile (on CUDA), as a run of a >= 0.5B model resolves it")
    p.add_argument("--root", default="/tmp/lora_bench")
    p.add_argument("--shape", default="7b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--modes", default="full,unmerged,merged")
    p.add_argument("--cases", default="7b_full,7b_lora,32b_lora")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--case-timeout-s", type=int, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    {"sync": run_sync, "steps": run_steps, "update": run_update}[args.part](args)


if __name__ == "__main__":
    main()
