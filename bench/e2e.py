"""The whole GRPO step, shardrl against TRL's `GRPOTrainer`, on the same model, prompts, group size, lengths
and batch, in one call on the GPU machine; with the floor of each case on this GPU.

    python bench/e2e.py --root /tmp/e2e --out results.jsonl                  # every case, both systems
    python bench/e2e.py --cases fixed_512 --systems shardrl --gpus 2 ...     # shardrl alone on two GPUs
    python bench/e2e.py --quick --root /tmp/e2e_cpu                          # a tiny shape on the CPU (a check)
    python bench/e2e.py --cases var_512 --systems shardrl --gpus 2 --tag async1 \
        --extra "async_rl.rollout_ranks=1 async_rl.max_staleness=1 algorithm.rollout_is=true"  # 1 GPU trains, 1 generates

Cases (`CASES`): prompts x group size n, prompt tokens -> new tokens. `fixed_*`: a randomly initialised model
of the Qwen2-1.5B shape, whose responses never end early (every response has max_new tokens). `var_512`: the
same shape with its output head untied and built so that every generated token is EOS with probability
`EOS_HAZARD` and otherwise uniform over the vocabulary (`make_model`), so responses end at a spread of
lengths (geometric, mean about 370, 8% reach the 1024 limit), identically for both systems.

Both systems: GRPO, no KL, one optimizer step per rollout (one mini-batch, one epoch), temperature 1, the same
reward (`compute_score`, a cheap rule on the response text), lr 1e-6. shardrl: the config a user would write
(`shardrl_overrides`): fp32 master weights, bf16 compute, fast rollout, dynamic micro-batches. TRL: a bf16
model (bf16 weights, grads and AdamW state), HF `generate`, `per_device_train_batch_size` x
`gradient_accumulation_steps` = the step's samples.

Each system runs in a process of its own (a clean GPU for the memory figures). One JSON line per run: median
step time over the steps after the first (warm-up), per phase, peak GPU memory per phase (PyTorch's
allocator, `max_memory_allocated`), tokens/s per GPU; and per case the floor (`floor`): the training FLOPs
(forward + backward, model FLOPs of `shardrl.plan.perf`) at the measured 788 TFLOP/s per GPU, plus
generation's floor (`bench/profile_decode.py`'s GEMMs in CUDA graphs + reading the live K/V once at the GPU's read
bandwidth, measured in the run: `read_bytes_per_s`; sessions 1-39 took the H200's 4.3 TB/s on every GPU),
for the response lengths the run produced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.rollout import QWEN2_1P5B as _ROLLOUT_SHAPE  # noqa: E402
from shardrl.plan.perf import H200_BF16_MEASURED_TFLOPS as MEASURED_TFLOPS  # noqa: E402

QWEN2_1P5B = {k: v for k, v in _ROLLOUT_SHAPE.items() if k != "model_type"}  # the rollout benchmark's shape
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
# name: (prompts, n, prompt tokens, max new tokens, model)
CASES = {
    "fixed_64": (8, 8, 256, 256, "random"),
    "fixed_512": (64, 8, 256, 256, "random"),
    "var_512": (64, 8, 256, 1024, "eos_hazard"),
}
QUICK_CASES = {
    "fixed_64": (2, 4, 16, 16, "random"),
    "fixed_512": (4, 4, 16, 16, "random"),
    "var_512": (4, 4, 16, 64, "eos_hazard"),
}
EOS_HAZARD = 1 / 400
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The benchmark's reward (shardrl's signature; TRL's wrapper below): words in the response mod 5, over 4.
    Cheap, and it varies within a group, so GRPO's advantages are not all zero."""
    return (len(solution_str.split()) % 5) / 4


def trl_reward(completions, **kwargs) -> list[float]:
    return [compute_score("e2e", c, None) for c in completions]


# ---- assets -------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` ids: specials, then "w4" ... ; text "w5 w17" is ids [5, 17]
    exactly, so a prompt of k words is k tokens for both systems, and every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False)


def make_model(folder: Path, shape: dict, kind: str, device: str, tokenizer) -> None:
    """A random Qwen2 model saved as a HF folder (bf16 on CUDA). kind "eos_hazard": hidden dimension 0 of the
    residual stream is a constant C for every token (embedding column 0 = C; no layer reads or writes it), so
    after the final RMSNorm it is ~sqrt(hidden) and every other dimension ~0; the (untied) head's column 0 then
    gives EOS a logit of log(p (V-4) / (1-p)) and the other specials -30, every other logit ~0: each new
    token is EOS with probability p = EOS_HAZARD, else uniform."""
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(shape, tie_word_embeddings=shape["tie_word_embeddings"] and kind != "eos_hazard")
    config = transformers.Qwen2Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if kind == "eos_hazard":
        with torch.no_grad():
            c, h, v = 100.0, shape["hidden_size"], shape["vocab_size"]
            model.model.embed_tokens.weight[:, 0] = c
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                            layer.mlp.gate_proj, layer.mlp.up_proj):
                    lin.weight[:, 0] = 0
                layer.self_attn.o_proj.weight[0, :] = 0
                layer.mlp.down_proj.weight[0, :] = 0
            head = model.lm_head.weight
            head[:, 0] = 0
            p = EOS_HAZARD
            head[2, 0] = math.log(p * (v - 4) / (1 - p)) / math.sqrt(h)
            head[[0, 1, 3], 0] = -30 / math.sqrt(h)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prepare(root: Path, quick: bool, device: str) -> dict:
    import random

    shape = TINY if quick else QWEN2_1P5B
    tok = build_tokenizer(shape["vocab_size"])
    for kind in ("random", "eos_hazard"):
        make_model(root / f"model_{kind}", shape, kind, device, tok)
    rng = random.Random(0)
    cases = QUICK_CASES if quick else CASES
    longest = max(c[2] for c in cases.values())
    most = max(c[0] for c in cases.values())
    prompts = [" ".join(f"w{rng.randrange(len(SPECIAL), shape['vocab_size'])}" for _ in range(longest))
               for _ in range(most)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "e2e"}) + "\n" for p in prompts))
    return dict(shape=shape, data=data)


def case_prompts(root: Path, prompts: int, prompt_len: int) -> Path:
    """The case's prompt file: the first `prompts` prompts, each cut to `prompt_len` words (= tokens)."""
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()][:prompts]
    path = root / f"prompts_{prompts}x{prompt_len}.jsonl"
    path.write_text("".join(json.dumps(dict(r, prompt=" ".join(r["prompt"].split()[:prompt_len]))) + "\n"
                            for r in rows))
    return path


# ---- shardrl ------------------------------------------------------------------------------------------
def grpo_overrides(train_file: Path, prompts: int, n: int, prompt_len: int, new: int, steps: int, name: str,
                   max_token_len: int = 16384) -> list[str]:
    """The benchmark's GRPO run (also bench/lora.py's): `prompts` x `n` a step, one optimizer step per batch,
    temperature 1, lr 1e-6, dynamic micro-batches of `max_token_len` tokens, `compute_score`, no validation or
    checkpoints; the model comes from the caller."""
    return [
        f"data.train_files=[{train_file}]",
        f"data.max_prompt_length={prompt_len}", "data.truncation=error",
        f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", "actor.ppo_epochs=1",
        f"rollout.n={n}", f"rollout.max_new_tokens={new}", "rollout.temperature=1.0",
        "actor.optim.lr=1e-6", "actor.engine.use_dynamic_bsz=true", f"actor.engine.max_token_len_per_gpu={max_token_len}",
        "algorithm.adv_estimator=grpo",
        f"reward.function_path={os.path.abspath(__file__)}", "reward.function_name=compute_score",
        f"trainer.total_steps={steps}", "trainer.logger=[console,jsonl]", "trainer.val_freq=0",
        "trainer.save_freq=0", f"trainer.experiment_name={name}",
    ]


def shardrl_overrides(root: Path, case: str, cases: dict, steps: int, extra: list[str]) -> list[str]:
    prompts, n, prompt_len, new, kind = cases[case]
    return [f"model.path={root / f'model_{kind}'}",
            *grpo_overrides(case_prompts(root, prompts, prompt_len), prompts, n, prompt_len, new, steps, case),
            *extra]


def run_shardrl(root: Path, case: str, cases: dict, steps: int, gpus: int, extra: list[str], tag: str) -> dict:
    import yaml

    run_dir = root / "runs" / f"{case}_{tag}"
    cfg_path = root / f"{case}_{tag}.yaml"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts afresh
    overrides = shardrl_overrides(root, case, cases, steps, extra) + [f"trainer.output_dir={run_dir}"]
    cfg_path.write_text(yaml.safe_dump({}))
    cmd = [sys.executable, "-m", "shardrl.cli", "train", str(cfg_path), "--nproc-per-node", str(gpus), *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return dict(system="shardrl", case=case, gpus=gpus, tag=tag, error=proc.stderr[-3000:])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize_shardrl(metrics, case, gpus, tag, wall)


def summarize_shardrl(records: list[dict], case: str, gpus: int, tag: str, wall: float) -> dict:
    timed = records[1:] or records

    def med(key):
        vals = [r[key] for r in timed if r.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    out = dict(system="shardrl", case=case, gpus=gpus, tag=tag, steps=len(records), wall_s=round(wall, 1),
               step_s=med("timing/step_s"), gen_s=med("timing/gen_s"), prep_s=med("timing/prep_s"),
               reward_s=med("timing/reward_s"),  # (of prep_s: the scoring; the rest is advantages and the like)
               update_s=med("timing/update_s"), tokens_per_s_per_gpu=med("perf/tokens_per_s_per_gpu"),
               mfu_measured=med("perf/mfu_measured"), response_length_mean=med("response/length_mean"),
               response_length_max=med("response/length_max"), response_length_min=med("response/length_min"),
               step_times=[round(r["timing/step_s"], 3) for r in records],
               # async_rl runs (`--extra "async_rl.rollout_ranks=1 ..."`): the time each side waited for the
               # other, the policy lag, and the weight stream to the rollout ranks per step
               staleness=med("async/staleness"), trainer_idle_frac=med("async/trainer_idle_frac"),
               rollout_idle_frac=med("async/rollout_idle_frac"), partial_frac=med("async/partial_frac"),
               token_staleness=med("async/token_staleness_mean"),
               **_weight_sync_medians([r for r in timed if r.get("weight_sync/bytes")]),  # the steps that pushed
               reward_mean=[round(r["reward/mean"], 4) for r in records])
    for phase in ("gen", "prep", "update"):
        vals = [r.get(f"memory/{phase}_peak_gib") for r in records if r.get(f"memory/{phase}_peak_gib") is not None]
        out[f"peak_{phase}_gib"] = round(max(vals), 3) if vals else None
        out[f"peak_{phase}_gib_per_step"] = [round(v, 3) for v in vals]
    if len(records) >= 20:  # drift: the first ten steps after the warm-up against the last ten
        first, last = records[1:11], records[-10:]
        out["drift"] = {k: (round(statistics.mean(r[k] for r in first), 4), round(statistics.mean(r[k] for r in last), 4))
                        for k in ("timing/step_s", "memory/update_peak_gib", "memory/gen_peak_gib")
                        if all(r.get(k) is not None for r in first + last)}
    return out


def _weight_sync_medians(pushed: list[dict]) -> dict:
    def med(key):
        return round(statistics.median(r[key] for r in pushed), 4) if pushed else None

    return dict(weight_sync_s=med("timing/weight_sync_s"), weight_sync_bytes=med("weight_sync/bytes"),
                weight_sync_gb_per_s=med("weight_sync/gb_per_s"))


# ---- TRL ----------------------------------------------------------------------------------------------
def trl_grpo_args(output_dir, prompts: int, n: int, new: int, steps: int, lr: float, cuda: bool, seed: int = 0,
                  mini_batch_prompts: int | None = None, per_device: int | None = None, **more) -> dict:
    """GRPOConfig's arguments for the GRPO run shardrl makes of the same numbers (`grpo_overrides`; also
    bench/learn.py's): `prompts` x `n` samples generated a step (TRL's generation batch), one optimizer step per
    `mini_batch_prompts` x n of them (shardrl's actor.ppo_mini_batch_size; default all: one a step), accumulated
    over micro-batches of `per_device` samples (default 16, 8 past 256 new tokens); `steps` rollout steps (TRL's
    max_steps counts optimizer steps); no KL (beta 0); the loss a token-mean over each optimizer step's tokens
    (loss_type "dapo", TRL's default: shardrl's actor.loss_agg_mode=token-mean); temperature 1 without top-p or
    top-k; bf16 autocast on CUDA; no gradient checkpointing, shuffling of the prompts, checkpoints or reports.
    `more` sets or overrides any other GRPOConfig field."""
    mini = mini_batch_prompts or prompts
    if prompts % mini:
        raise ValueError(f"mini_batch_prompts={mini} must divide prompts={prompts} (as actor.ppo_mini_batch_size "
                         "must divide data.train_batch_size)")
    samples = mini * n
    per_device = per_device or min(samples, 16 if new <= 256 else 8)
    if samples % per_device:
        raise ValueError(f"per_device={per_device} must divide an optimizer step's {samples} samples")
    accumulation, updates = samples // per_device, prompts // mini
    return dict(output_dir=str(output_dir), per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation, steps_per_generation=accumulation * updates,
                num_generations=n, max_completion_length=new, temperature=1.0, top_p=1.0, beta=0.0,
                loss_type="dapo", learning_rate=lr, bf16=cuda, max_steps=steps * updates, logging_steps=1,
                report_to=[], save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False, seed=seed,
                use_cpu=not cuda, dataloader_num_workers=0) | more


def run_trl(root: Path, case: str, cases: dict, steps: int, quick: bool) -> dict:
    """TRL's GRPOTrainer in this process (call it in a process of its own: `--trl-worker`)."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    prompts, n, prompt_len, new, kind = cases[case]
    cuda = torch.cuda.is_available()
    folder = root / f"model_{kind}"
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)  # as saved (see shardrl's load_tokenizer)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa")
    rows = [json.loads(line) for line in case_prompts(root, prompts, prompt_len).read_text().splitlines()]
    # enough rows for every step (TRL samples num_generations copies of each prompt)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows] * (steps + 1))
    samples = prompts * n
    args = GRPOConfig(**trl_grpo_args(root / "trl_out" / case, prompts, n, new, steps, 1e-6, cuda))
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=args, train_dataset=dataset,
                          processing_class=tok)
    return dict(system="trl", case=case, gpus=1, **timed_trl_train(trainer, cuda, samples, prompt_len))


def timed_trl_train(trainer, cuda: bool, samples: int, prompt_len: int) -> dict:
    """Runs `trainer.train()` (a GRPOTrainer) timing each step and its generation (`_generate_and_score_completions`,
    scoring included), and returns the medians over the steps after the first (warm-up), the response lengths,
    tokens/s (`samples` x `prompt_len` prompt tokens + the responses' a step) and the peak GPU memory of each phase.
    Also bench/vl_e2e.py's."""
    import torch
    import transformers

    phases: dict[str, list[float]] = {"gen": [], "step": []}
    lengths: list[list[int]] = []
    peaks: dict[str, list[float]] = {"gen": [], "update": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def peak():
        if not cuda:
            return None
        value = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return value

    inner = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        sync()
        t = time.perf_counter()
        peak()
        out = inner(*a, **k)
        sync()
        phases["gen"].append(time.perf_counter() - t)
        peaks["gen"].append(peak())
        lengths.append(out["completion_mask"].sum(1).tolist())
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            phases["step"].append(time.perf_counter() - self.t)
            peaks["update"].append(peak())

    trainer.add_callback(StepTimer())
    trainer.train()
    steps_done = len(phases["step"])
    timed = slice(1, None) if steps_done > 1 else slice(None)
    step_s = statistics.median(phases["step"][timed])
    gen_s = statistics.median(phases["gen"][timed])
    all_lengths = [x for ls in lengths[timed] for x in ls]
    tokens = samples * prompt_len + sum(all_lengths) / max(1, len(lengths[timed]))
    return dict(steps=steps_done, step_s=round(step_s, 4), gen_s=round(gen_s, 4),
                update_s=round(step_s - gen_s, 4), tokens_per_s_per_gpu=round(tokens / step_s, 1),
                response_length_mean=round(statistics.mean(all_lengths), 1), response_length_max=max(all_lengths),
                response_length_min=min(all_lengths), step_times=[round(x, 3) for x in phases["step"]],
                peak_gen_gib=max(peaks["gen"]) if cuda else None, peak_update_gib=max(peaks["update"]) if cuda else None,
                trl_version=__import__("trl").__version__)


# ---- floor --------------------------------------------------------------------------------------------
def floor(root: Path, case: str, cases: dict, response_lengths: list[int], gpus: int) -> dict:
    """The case's floor on this GPU for responses of `response_lengths` (one per sample; the run's own),
    per GPU when `gpus` share the batch: training FLOPs at MEASURED_TFLOPS, plus generation's GEMMs (timed
    in CUDA graphs at the live batch of each decode step) and one read of the live K/V per step."""
    import torch
    import torch.nn.functional as F
    import transformers

    from bench.profile_decode import graph_ms, read_bytes_per_s
    from shardrl.plan.perf import forward_flops, model_shape

    prompts, n, prompt_len, new, kind = cases[case]
    c = transformers.AutoConfig.from_pretrained(root / f"model_{kind}")
    lens = torch.tensor(sorted(response_lengths, reverse=True), dtype=torch.float64)
    seq = lens + prompt_len
    # the head where a response token is scored (as the engine and generation run it; `shardrl.plan.perf`)
    train_s = 3 * forward_flops(model_shape(c), seq, lens) / (MEASURED_TFLOPS * 1e12) / gpus
    train_all_s = 3 * forward_flops(model_shape(c), seq) / (MEASURED_TFLOPS * 1e12) / gpus  # sessions 4-6's
    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    w_qkv = torch.randn(h + 2 * kv, h, device=dev, dtype=dtype)
    w_o = torch.randn(h, h, device=dev, dtype=dtype)
    w_gu = torch.randn(2 * inter, h, device=dev, dtype=dtype)
    w_d = torch.randn(h, inter, device=dev, dtype=dtype)
    w_head = torch.randn(c.vocab_size, h, device=dev, dtype=dtype)

    def gemms(x, with_head):
        for _ in range(layers):  # one layer's weights stand for all (the same GEMM shapes)
            F.linear(x, w_qkv)
            F.linear(x, w_o)
            F.linear(F.linear(x, w_gu)[:, :inter], w_d)
        if with_head:
            F.linear(x, w_head)

    per_gpu = len(lens) // gpus  # each GPU generates its share
    chunk = min(16384, per_gpu * prompt_len)
    prefill_x = torch.randn(chunk, h, device=dev, dtype=dtype)
    prefill_ms = graph_ms(lambda: gemms(prefill_x, False), reps=1, iters=3)
    prefill_s = prefill_ms / 1e3 * per_gpu * prompt_len / chunk
    step_ms = {}
    for b in sorted({1, 8, 32, 64, 128, 256, 512, per_gpu} | set()):
        if b <= per_gpu:
            x = torch.randn(b, h, device=dev, dtype=dtype)
            step_ms[b] = graph_ms(lambda x=x: gemms(x, True), reps=2, iters=5)
    sizes = sorted(step_ms)

    def step_at(b):  # piecewise linear in the live batch
        for lo, hi in zip(sizes, sizes[1:]):
            if b <= hi:
                return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (b - lo) / (hi - lo)
        return step_ms[sizes[-1]]

    kv_bytes = 2 * layers * kv * 2
    bandwidth = read_bytes_per_s()  # this GPU's (an H100's is not an H200's)
    my = lens[::gpus]  # this GPU's share (the lengths interleaved)
    decode_s = kv_s = 0.0
    for t in range(1, int(my.max())):
        live = my[my > t]
        if len(live) == 0:
            break
        decode_s += step_at(len(live)) / 1e3
        kv_s += float((prompt_len + t) * len(live)) * kv_bytes / bandwidth
    gen_s = prefill_s + decode_s + kv_s
    return dict(case=case, gpus=gpus, floor_train_s=round(train_s, 4), floor_gen_s=round(gen_s, 4),
                floor_train_head_on_prompts_too_s=round(train_all_s, 4),
                floor_gen_prefill_s=round(prefill_s, 4), floor_gen_decode_gemm_s=round(decode_s, 4),
                floor_gen_kv_read_s=round(kv_s, 4), floor_s=round(train_s + gen_s, 4),
                read_bytes_per_s=round(bandwidth / 1e12, 3) * 1e12,
                decode_step_gemm_ms={str(k): round(v, 4) for k, v in step_ms.items()})


# ---- driver -------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/e2e")
    p.add_argument("--cases", default="fixed_64,fixed_512,var_512")
    p.add_argument("--systems", default="shardrl,trl")
    p.add_argument("--gpus", default="1", help="comma list: GPU counts for shardrl (TRL always runs on one)")
    p.add_argument("--steps", type=int, default=4, help="shardrl steps per case (the first is warm-up)")
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument("--tag", default="default")
    p.add_argument("--extra", default="", help="extra shardrl overrides, space separated")
    p.add_argument("--quick", action="store_true", help="a tiny shape (CPU check)")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    cases = QUICK_CASES if args.quick else CASES
    if args.trl_worker:
        print("RESULT " + json.dumps(run_trl(root, args.trl_worker, cases, args.trl_steps, args.quick)))
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prepare(root, args.quick, device)

    def emit(rec):
        rec = dict(rec, bench="e2e", quick=args.quick)
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])

    for case in args.cases.split(","):
        for system in args.systems.split(","):
            if system == "shardrl":
                for gpus in map(int, args.gpus.split(",")):
                    rec = run_shardrl(root, case, cases, args.steps, gpus, args.extra.split(), args.tag)
                    emit(rec)
                    if device == "cuda" and not args.no_floor and "error" not in rec:
                        emit(dict(floor(root, case, cases, expected_lengths(cases[case]), gpus),
                                  what="floor", tag=args.tag))
            elif system == "trl":
                cmd = [sys.executable, __file__, "--root", str(root), "--trl-worker", case,
                       "--trl-steps", str(args.trl_steps)] + (["--quick"] if args.quick else [])
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                emit(json.loads(line[7:]) if line else dict(system="trl", case=case, error=proc.stderr[-3000:]))


def expected_lengths(case: tuple) -> list[int]:
    """Response lengths of a case as its model draws them: every response max_new tokens for the random model;
    for the EOS-hazard model, the quantiles (i + 0.5) / N of the geometric length (EOS with probability p at
    each token, the EOS counted), capped at max_new: the same for both systems, whatever one run drew."""
    prompts, n, _, new, kind = case
    count = prompts * n
    if kind != "eos_hazard":
        return [new] * count
    p = EOS_HAZARD
    return [min(new, math.ceil(math.log(1 - (i + 0.5) / count) / math.log(1 - p))) for i in range(count)]


if __name__ == "__main__":
    main()
