"""Time to accuracy on a real model: the SmolLM2-135M-Instruct word-problem example (examples/smollm2/) trained by
shardrl and by TRL's `GRPOTrainer` on the same data, reward and settings, held-out greedy accuracy against training
seconds for both, every `eval_every` steps; several seeds; full fine-tuning or LoRA on both sides.

    python examples/smollm2/prepare.py                                   # once: outputs/smollm2/{model,*.jsonl}
    python bench/learn.py --out results.jsonl                            # GPU: both systems, seed 0
    python bench/learn.py --systems trl --seeds 0,1 --lora --out r.jsonl # TRL alone, two seeds, LoRA
    python bench/learn.py --quick --root /tmp/learn_cpu                  # a tiny run on the CPU (a check)

What both sides share (`SETUPS`, one `Setup` from which `shardrl_overrides` and `trl_args` are both made; the TRL
side through bench/e2e.py's `trl_grpo_args`, the whole-step comparison's mapping):
- data: outputs/smollm2's train.jsonl shuffled once per seed into a file both read in order (shardrl
  data.shuffle=false, TRL shuffle_dataset=false), `prompts` a step (64), the same prompts at the same step; both
  drop an epoch's last short batch. The chat template applied by each to the same conversation.
- GRPO: `n` responses a prompt (8), advantages (r - group mean) / (group std + eps) (unbiased std), no KL (shardrl's
  default: actor.use_kl_loss=false; TRL beta=0), PPO clip 0.2 both ways, one epoch, `prompts / mini_prompts`
  optimizer steps a rollout step (64 / 16 = 4) over the shuffled samples, old log-probs from the policy that
  sampled; the loss a token-mean over each optimizer step's tokens (shardrl's default loss_agg_mode=token-mean;
  TRL loss_type="dapo", its default, set explicitly).
- reward: the built-in gsm8k scorer ("#### n", shardrl.rewards.manager), called by TRL through `gsm8k_reward`.
- sampling: temperature 1, no top-p/top-k, at most `max_new` (128) new tokens, prompts of at most 128 tokens.
- optimizer: AdamW (0.9, 0.999), eps 1e-8, weight decay 0, grad-norm clip 1.0, lr 2e-6 (LoRA 5e-5, rank 32,
  alpha 32, all linear layers but the head, no dropout: bench/RESULTS.md's measured LoRA run), linear warm-up
  over 3 optimizer steps, then constant.
- precision on CUDA: fp32 master weights, bf16 compute (shardrl param_dtype=bfloat16; TRL an fp32 model under
  bf16 autocast, bf16=True). LoRA: the frozen base in bf16, the adapters fp32 (shardrl's LoRA; TRL a bf16 model
  with peft's fp32 adapters). CPU (`--quick`): fp32 throughout on both.
- held-out accuracy: greedy, the first `val_limit` problems of val.jsonl (200; 16 quick), scored by the gsm8k
  scorer, the same generation as examples/smollm2/evaluate.py (the fast rollout, bf16 on CUDA): shardrl's own
  validation (trainer.val_freq, val_before_train) for shardrl, `evaluate.HeldOut` on the trainer's weights (a
  LoRA model's adapters merged in fp32) for TRL, at step 0 and every `eval_every` rollout steps and the last.
- seconds: training only, the sum of each rollout step's own time (generation, scoring, the update): shardrl's
  timing/step_s, which its trainer measures apart from validation (timing/testing_s); TRL's from each optimizer
  step's `on_step_begin` to its `on_step_end` (a rollout step = `prompts / mini_prompts` of them), the held-out
  evaluation run after that end with the clock stopped. Start-up (model load, the rollout's build and CUDA graphs)
  is outside on both; each record also has the process's whole wall-clock (`process_s`).

Differences left:
- TRL generates with transformers' `generate` (dynamic KV cache, under bf16 autocast; no vLLM on the device
  machine), its fastest setting there; shardrl with its fast rollout (static KV cache, CUDA graphs, bf16 weights
  synced each step). TRL's micro-batches hold `trl_per_device` samples (64 of an optimizer step's 128), shardrl
  packs dynamic micro-batches of up to 32768 tokens (examples/smollm2/gpu.yaml).
- Warm-up: HF's schedule gives the first optimizer step LR 0 (multipliers 0, 1/3, 2/3, 1), shardrl's 1/3, 2/3, 1.
- Loss normalisation: shardrl divides by the exact token count of each optimizer step's mini-batch; TRL's "dapo"
  by the rollout batch's tokens / (optimizer steps a rollout step), the mean mini-batch's.
- shardrl's dual-clip bound for negative advantages (clip_ratio_c=3) has no TRL counterpart; TRL's advantage eps
  is 1e-4, shardrl's 1e-6. TRL's weight decay skips biases and norms (0 here, so no difference).
- Sampling seeds: each side's own generator from the seed (same prompts, different draws).
- Held-out generation for shardrl uses its trainer's rollout (same backend, dtype and greedy decoding as
  `HeldOut`, whose 200 rows may batch differently: bf16 numerics can flip a near-tie token).

One JSON line a run (system, seed, lora): the curve [{step, train_s, accuracy, has_answer_marker}], the train
reward and response length per step, `seconds_to` (training seconds to the first held-out accuracy at or above
each of THRESHOLDS), process_s. Device needs (bench/run.py's `learn` set): trl and datasets with what they import
and the device lacks (dill, multiprocess, xxhash, fsspec, ...; peft is a shardrl dependency).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.e2e import trl_grpo_args  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
THRESHOLDS = (0.2, 0.4, 0.5, 0.6)


@dataclasses.dataclass(frozen=True)
class Setup:
    prompts: int          # prompts a rollout step
    n: int                # responses a prompt (the GRPO group)
    max_new: int          # new tokens a response at most
    steps: int            # rollout steps
    eval_every: int       # held-out accuracy every this many rollout steps
    mini_prompts: int     # prompts an optimizer step (shardrl's actor.ppo_mini_batch_size)
    val_limit: int | None  # held-out problems (None: all 200)
    trl_per_device: int   # TRL's micro-batch, samples
    max_prompt: int = 128
    lr: float = 2e-6
    lora_lr: float = 5e-5
    lora_rank: int = 32
    lora_alpha: float = 32.0
    warmup: int = 3       # optimizer steps
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    clip_ratio: float = 0.2
    temperature: float = 1.0


SETUPS = {
    "gpu": Setup(prompts=64, n=8, max_new=128, steps=60, eval_every=5, mini_prompts=16, val_limit=None,
                 trl_per_device=64),
    # the CPU check: 2 optimizer steps a rollout step (so the mini-batch mapping runs), one micro-batch each
    "quick": Setup(prompts=2, n=4, max_new=24, steps=4, eval_every=2, mini_prompts=1, val_limit=16,
                   trl_per_device=4, warmup=1),
}


# ---- data ---------------------------------------------------------------------------------------------
def prepare_data(root: Path, data: Path, seed: int, setup: Setup) -> tuple[Path, Path]:
    """The seed's training file (train.jsonl shuffled by `seed`) and the held-out file (val.jsonl's first
    `val_limit` rows), under `root`; both systems read these."""
    if not (data / "model" / "config.json").is_file():
        raise SystemExit(f"no model under {data}/model: run `python examples/smollm2/prepare.py --out {data}` "
                         "first (examples/smollm2/README.md)")
    rows = (data / "train.jsonl").read_text().splitlines()
    random.Random(seed).shuffle(rows)
    train = root / f"train_seed{seed}.jsonl"
    train.write_text("\n".join(rows) + "\n")
    val_rows = (data / "val.jsonl").read_text().splitlines()[:setup.val_limit]
    val = root / f"val_{len(val_rows)}.jsonl"
    val.write_text("\n".join(val_rows) + "\n")
    return train, val


# ---- shardrl ------------------------------------------------------------------------------------------
def shardrl_overrides(setup: Setup, model: Path, train: Path, val: Path, seed: int, lora: bool, cuda: bool,
                      run_dir: Path) -> list[str]:
    """examples/smollm2/gpu.yaml's run with every shared setting said (the values both sides use)."""
    s = setup
    out = [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"data.max_prompt_length={s.max_prompt}", "data.truncation=error", f"data.train_batch_size={s.prompts}",
        "data.shuffle=false", "rollout.backend=fast", f"rollout.n={s.n}", f"rollout.temperature={s.temperature}",
        "rollout.top_p=1.0", "rollout.top_k=0", f"rollout.max_new_tokens={s.max_new}", f"rollout.seed={seed}",
        f"actor.ppo_mini_batch_size={s.mini_prompts}", "actor.ppo_epochs=1", "actor.loss_agg_mode=token-mean",
        f"actor.clip_ratio_low={s.clip_ratio}", f"actor.clip_ratio_high={s.clip_ratio}", "actor.use_kl_loss=false",
        f"actor.optim.lr={s.lora_lr if lora else s.lr}", f"actor.optim.betas=[{s.betas[0]},{s.betas[1]}]",
        f"actor.optim.eps={s.eps}", f"actor.optim.weight_decay={s.weight_decay}",
        f"actor.optim.warmup_steps={s.warmup}", "actor.optim.lr_schedule=constant",
        f"actor.optim.clip_grad={s.clip_grad}", "algorithm.adv_estimator=grpo",
        f"trainer.total_steps={s.steps}", f"trainer.val_freq={s.eval_every}", "trainer.val_before_train=true",
        "trainer.save_freq=0", "trainer.logger=[console,jsonl]", f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={run_dir.name}",
    ]
    if lora:
        out += [f"model.lora.rank={s.lora_rank}", f"model.lora.alpha={s.lora_alpha}", "model.lora.dropout=0.0",
                "model.lora.target_modules=all-linear"]
    if not cuda:
        out += ["trainer.device=cpu", "actor.engine.param_dtype=float32"]
    return out


def run_shardrl(root: Path, model: Path, train: Path, val: Path, seed: int, lora: bool, setup: Setup,
                cuda: bool) -> dict:
    run_dir = root / "runs" / f"shardrl_seed{seed}{'_lora' if lora else ''}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardrl.cli", "train", str(REPO / "examples/smollm2/gpu.yaml"),
           *shardrl_overrides(setup, model, train, val, seed, lora, cuda, run_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    process_s = time.perf_counter() - start
    head = dict(system="shardrl", seed=seed, lora=lora, process_s=round(process_s, 1))
    if proc.returncode != 0:
        return dict(head, error=proc.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return dict(head, **shardrl_curve(records))


def shardrl_curve(records: list[dict]) -> dict:
    """The held-out curve against training seconds (the running sum of timing/step_s) from metrics.jsonl."""
    curve, train_s = [], 0.0
    for r in sorted(records, key=lambda r: r["step"]):
        train_s += r.get("timing/step_s", 0.0)
        if r.get("val/reward_mean") is not None:
            curve.append(dict(step=r["step"], train_s=round(train_s, 2), accuracy=round(r["val/reward_mean"], 4)))
    steps = [r for r in records if "reward/mean" in r]
    return dict(curve=curve, train_s=round(train_s, 2), seconds_to=seconds_to(curve),
                reward_mean=[round(r["reward/mean"], 4) for r in steps],
                response_length_mean=[round(r.get("response/length_mean", 0.0), 1) for r in steps],
                step_s=[round(r["timing/step_s"], 3) for r in steps])


def seconds_to(curve: list[dict]) -> dict:
    return {str(t): next((p["train_s"] for p in curve if p["accuracy"] >= t), None) for t in THRESHOLDS}


# ---- TRL ----------------------------------------------------------------------------------------------
def trl_args(setup: Setup, output_dir: Path, seed: int, lora: bool, cuda: bool) -> dict:
    """GRPOConfig's arguments: e2e's mapping of the shared GRPO numbers, then the optimizer and schedule."""
    s = setup
    updates = s.prompts // s.mini_prompts
    return trl_grpo_args(
        output_dir, s.prompts, s.n, s.max_new, s.steps, s.lora_lr if lora else s.lr, cuda, seed=seed,
        mini_batch_prompts=s.mini_prompts, per_device=s.trl_per_device, top_k=0, epsilon=s.clip_ratio,
        scale_rewards="group", num_iterations=1, adam_beta1=s.betas[0], adam_beta2=s.betas[1], adam_epsilon=s.eps,
        weight_decay=s.weight_decay, max_grad_norm=s.clip_grad, warmup_steps=s.warmup,
        lr_scheduler_type="constant_with_warmup", logging_steps=updates, disable_tqdm=True, eval_strategy="no")


_REWARDS = None


def gsm8k_reward(completions, data_source, ground_truth, **kwargs) -> list[float]:
    """TRL's reward function: shardrl's built-in scorer of each row's data_source (gsm8k: "#### n")."""
    global _REWARDS
    from shardrl.rewards.manager import RewardManager

    _REWARDS = _REWARDS or RewardManager()
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
    items = [{"data_source": s, "response_text": t, "extra": {"ground_truth": g}}
             for s, t, g in zip(data_source, texts, ground_truth)]
    return _REWARDS.score(items)[0].tolist()


def hf_weights(model):
    """(HF name, tensor) pairs of `model` as a plain HF model: a peft model's adapters merged into their base
    weights in fp32, peft's name prefixes dropped."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return [(n, p.detach()) for n, p in model.named_parameters()]
    inner = model.base_model.model
    out = []
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(module.get_delta_weight(a).float() for a in module.active_adapters)
            out.append((f"{name}.weight", module.base_layer.weight.detach().float() + delta))
    merged = {n for n, _ in out}
    for name, p in inner.named_parameters():
        plain = name.replace(".base_layer.", ".")
        if "lora_" not in name and plain not in merged:
            out.append((plain, p.detach()))
    return out


def load_held_out():
    spec = importlib.util.spec_from_file_location("smollm2_evaluate", REPO / "examples/smollm2/evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HeldOut


def run_trl(root: Path, model_path: Path, train: Path, val: Path, seed: int, lora: bool, setup: Setup) -> dict:
    """TRL's GRPOTrainer in this process (call it in a process of its own: `--trl-worker`)."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    s, updates = setup, setup.prompts // setup.mini_prompts
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    dtype = torch.bfloat16 if cuda and lora else torch.float32  # LoRA: a bf16 base; full: fp32 under autocast
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                           "ground_truth": str(r["ground_truth"])} for r in rows])
    args = GRPOConfig(**trl_args(s, root / "trl_out" / f"seed{seed}", seed, lora, cuda))
    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=args, train_dataset=dataset,
                          processing_class=tok, peft_config=peft_config)
    held_out = load_held_out()(model.config, tok, str(val), s.max_new, s.max_prompt)
    curve: list[dict] = []
    clock = {"train_s": 0.0}
    progress = root / f"trl_curve_seed{seed}{'_lora' if lora else ''}.jsonl"
    progress.unlink(missing_ok=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def evaluate(step: int, model) -> None:
        was_training = model.training
        model.eval()
        result = held_out(hf_weights(model))
        model.train(was_training)
        curve.append(dict(step=step, train_s=round(clock["train_s"], 2), accuracy=round(result["accuracy"], 4),
                          has_answer_marker=round(result["has_answer_marker"], 4)))
        append_jsonl(str(progress), [curve[-1]])  # (what a run cut short by a time limit still leaves)

    class HeldOutClock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            evaluate(0, model)

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            clock["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync()
            clock["train_s"] += time.perf_counter() - clock["t"]
            step, within = divmod(state.global_step, updates)
            if within == 0 and (step % s.eval_every == 0 or step == s.steps):
                evaluate(step, model)

    trainer.add_callback(HeldOutClock())
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    return dict(system="trl", seed=seed, lora=lora, process_s=round(time.perf_counter() - start, 1), curve=curve,
                train_s=round(clock["train_s"], 2), seconds_to=seconds_to(curve),
                reward_mean=[round(r["reward"], 4) for r in logs],
                response_length_mean=[round(r.get("completions/mean_length", 0.0), 1) for r in logs],
                trl_version=__import__("trl").__version__)


# ---- driver -------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/bench_learn", help="run folders and the per-seed data files")
    p.add_argument("--data", default=str(REPO / "outputs/smollm2"), help="prepare.py's folder (model/, *.jsonl)")
    p.add_argument("--gguf", default=None, help="a SmolLM2 GGUF: make --data from it first when it is not there")
    p.add_argument("--systems", default="shardrl,trl")
    p.add_argument("--seeds", default="0", help="comma list")
    p.add_argument("--lora", action="store_true", help="LoRA on both sides (rank, alpha, lr of `Setup`)")
    p.add_argument("--quick", action="store_true", help="the tiny CPU setup (SETUPS['quick'])")
    p.add_argument("--steps", type=int, default=None, help="rollout steps (default: the setup's)")
    p.add_argument("--out", default=None)
    p.add_argument("--trl-worker", type=int, default=None, help=argparse.SUPPRESS)  # the seed
    args = p.parse_args()
    setup = SETUPS["quick" if args.quick else "gpu"]
    if args.steps:
        setup = dataclasses.replace(setup, steps=args.steps)
    root, data = Path(args.root), Path(args.data)
    root.mkdir(parents=True, exist_ok=True)
    if args.trl_worker is not None:
        train, val = prepare_data(root, data, args.trl_worker, setup)
        result = run_trl(root, data / "model", train, val, args.trl_worker, args.lora, setup)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.gguf and not (data / "model" / "config.json").is_file():
        site = "/tmp/site"  # where examples/gpu_run_common.sh's `gguf_join` installs the gguf package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH"), site])))
        subprocess.run([sys.executable, str(REPO / "examples/smollm2/prepare.py"), "--gguf", args.gguf, "--out",
                        str(data)], check=True, env=env)
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    for seed in map(int, args.seeds.split(",")):
        train, val = prepare_data(root, data, seed, setup)
        for system in args.systems.split(","):
            if system == "shardrl":
                rec = run_shardrl(root, data / "model", train, val, seed, args.lora, setup, cuda)
            elif system == "trl":
                cmd = [sys.executable, __file__, "--root", str(root), "--data", str(data), "--trl-worker", str(seed),
                       *(["--lora"] if args.lora else []), *(["--quick"] if args.quick else []),
                       *(["--steps", str(args.steps)] if args.steps else [])]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                rec = json.loads(line[7:]) if line else dict(system="trl", seed=seed, lora=args.lora,
                                                               error=proc.stderr[-3000:])
            else:
                raise SystemExit(f"unknown system {system!r}: shardrl or trl")
            rec = dict(rec, bench="learn", quick=args.quick, device=device, setup=dataclasses.asdict(setup))
            print(json.dumps(rec), flush=True)
            append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
