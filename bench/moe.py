"""Mixtures of experts on one GPU: the engine's update with grouped expert products against HF's eager expert loop,
the fast rollout's MoE decode against HF `generate`, and router replay's effect on the sampler/trainer mismatch.

Shapes (random init on the GPU, `model.load_weights=random_shards`; a word-level tokenizer over the vocabulary, as
bench/e2e.py): OLMoE-1B-7B (hidden 2048, 16 layers, 16 heads, 64 experts, top-8, expert MLP 1024, vocab 50304;
6.9B parameters, 1.3B active) and Qwen3-30B-A3B (hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, 128
experts, top-8, expert MLP 768, vocab 151936; 30.5B parameters, 3.3B active: with LoRA, so that it fits one GPU);
for the decode, Qwen3-MoE layers at OLMoE's size (`qwen3_moe_7b`: the fast rollout has no OLMoE).

    python bench/moe.py update --shape olmoe --out results.jsonl     # train_batch: grouped_mm vs HF's eager loop
    python bench/moe.py rollout --shape qwen3_moe_7b --out results.jsonl  # decode at batch 256: fast vs HF generate
    python bench/moe.py replay --shape tiny_qwen3_moe                # logprob_abs_diff with R2 off and on

`update`: one FSDP2 engine per experts implementation, `train_batch` of prompts x n sequences of prompt_len +
new_tokens with a policy-gradient loss, the median of 3 calls after a warm-up; tokens/s and MFU on the active
parameters (`shardrl.plan.perf.model_shape`, forward + backward = 3 forwards; with LoRA the weight gradients of the
frozen base are not computed, and the FLOPs are still counted as 3 forwards, the convention of the MFU figures).
`rollout`: the fast rollout and HF's rollout on the same weights and prompts (256 rows), new tokens/s, against the
floor of one decode step reading every expert's weights once (all are hit at this batch) and the KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.lora import _median_s  # noqa: E402
from shardrl.plan.perf import H200_BF16_MEASURED_TFLOPS as H200_MEASURED  # noqa: E402
from shardrl.plan.perf import H200_BF16_SPEC_TFLOPS as H200_SPEC  # noqa: E402

SHAPES = {
    "olmoe": dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                  num_experts_per_tok=8, max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.02, pad_token_id=1, eos_token_id=50279),
    "qwen3_30b_a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                          rope_theta=1e6, initializer_range=0.02),
    # Qwen3-MoE's layers at OLMoE-1B-7B's size (the fast rollout has decoded OLMoE itself only since session 20)
    "qwen3_moe_7b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=8192,
                         moe_intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                         rope_theta=1e6, initializer_range=0.02),
    "tiny_qwen3_moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                           max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.02),
    "tiny_olmoe": dict(model_type="olmoe", vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.02,
                       pad_token_id=1, eos_token_id=2),
}
LORA_SHAPES = {"qwen3_30b_a3b"}  # trained with LoRA (rank 64, attention and dense layers: experts stay frozen)
PROMPT_LEN, NEW_TOKENS, N = 256, 256, 8
H200_HBM_TB_S = 4.8  # an H200's memory bandwidth, for the decode floor


def _init(port: str):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    return cuda


def _engine(shape_name: str, experts: str, cuda: bool, tokens: int, optim: bool = True, compile: bool = False):
    from shardrl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    lora = LoRAConfig(rank=64, alpha=128, target_modules="all-linear") if shape_name in LORA_SHAPES else LoRAConfig()
    model = ModelConfig(tiny=SHAPES[shape_name], load_weights="random_shards", experts_implementation=experts,
                        dtype="bfloat16" if cuda else "float32", lora=lora)
    # with LoRA the frozen base is not gathered whole over the micro-batches: a second 61 GB copy of Qwen3-30B-A3B
    return build_engine(model, EngineConfig(param_dtype="bfloat16" if cuda else "float32", use_dynamic_bsz=True,
                                            max_token_len_per_gpu=tokens, compile=compile,
                                            accumulate_unsharded=False if lora.rank else None),
                        OptimConfig(lr=1e-6) if optim else None)


def run_update(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from shardrl.algos.aggregate import agg_loss
    from shardrl.engine.model import load_hf_config
    from shardrl.plan.perf import forward_flops, model_shape
    from shardrl.testing import random_batch

    cuda = _init("29521")
    shape = SHAPES[args.shape]
    rows, length = args.prompts * N, PROMPT_LEN + args.new_tokens
    batch = random_batch(rows, length, shape["vocab_size"], seed=0, min_len=length, prompt_len=PROMPT_LEN)
    flops = 3 * forward_flops(model_shape(load_hf_config(None, shape)), torch.full((rows,), length))

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                        num_global_tokens=num_tokens, num_global_seqs=num_seqs), {}

    out = []
    for experts in args.experts.split(","):
        compiled = experts.endswith("+compile")  # e.g. grouped_mm+compile: the engine's blocks compiled
        experts = experts.removesuffix("+compile")
        engine = _engine(args.shape, experts, cuda, args.max_tokens, compile=compiled and cuda)
        engine.train_batch(batch, loss_fn)  # warm-up (the optimizer state is allocated)
        seconds = _median_s(lambda: engine.train_batch(batch, loss_fn), args.steps)
        tflops = flops / seconds / 1e12
        rec = dict(bench="moe_update", shape=args.shape, experts=experts, compile=compiled and cuda, lora=args.shape in LORA_SHAPES, rows=rows,
                   seq_len=length, max_token_len=args.max_tokens, seconds=round(seconds, 3),
                   tokens_per_s=round(rows * length / seconds), tflop_per_s_active=round(tflops, 1),
                   mfu_measured=round(tflops / H200_MEASURED, 4) if cuda else None,
                   mfu_spec=round(tflops / H200_SPEC, 4) if cuda else None,
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
        del engine
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()
    return out


def run_rollout(args) -> list[dict]:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from bench.lora import tokenizer_folder
    from shardrl.rollout import FastRollout, HFRollout, SamplingParams
    from shardrl.trainer.generation import export_for_rollout

    cuda = _init("29522")
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    shape = SHAPES[args.shape]
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(root, shape["vocab_size"]))
    engine = _engine(args.shape, "auto", cuda, 8192, optim=False)
    prompts = [" ".join(f"w{(17 * i + 31 * j) % (shape['vocab_size'] - 4) + 4}" for j in range(PROMPT_LEN))
               for i in range(args.prompts)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    sampling = SamplingParams(temperature=1.0, n=N, max_new_tokens=args.new_tokens, seed=0)
    c = engine.hf_config
    weight_bytes = sum(p.numel() for p in engine.module.parameters()) * 2
    kv_bytes = (c.num_hidden_layers * 2 * c.num_key_value_heads * (getattr(c, "head_dim", None)
                or c.hidden_size // c.num_attention_heads) * 2)  # per cached token
    out = []
    for backend in args.backends.split(","):
        rollout = (FastRollout(c, tok, device, dtype) if backend == "fast"
                   else HFRollout(c, tok, device, dtype))
        rollout.load_weights(export_for_rollout(engine, device))
        fast = backend == "fast"
        # warm-up: the fast rollout's graphs for every batch size it meets; HF's (no graphs) on a few tokens
        rollout.generate(ids, mask, sampling if fast else SamplingParams(temperature=1.0, n=N, max_new_tokens=8))
        results = []
        seconds = _median_s(lambda: results.append(rollout.generate(ids, mask, sampling)), 2 if fast else 1)
        res = results[-1]
        tokens = int(res.response_mask.sum())
        rows = ids.shape[0] * N
        # the floor: each decode step reads every weight once and the cache so far (mean length prompt + new/2)
        step_floor = (weight_bytes + rows * kv_bytes * (PROMPT_LEN + args.new_tokens / 2)) / (H200_HBM_TB_S * 1e12)
        rec = dict(bench="moe_rollout", shape=args.shape, backend=backend, rows=rows, new_tokens=args.new_tokens,
                   seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds),
                   floor_tokens_per_s=round(rows / step_floor) if cuda else None)
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
        if hasattr(rollout, "release"):
            rollout.release()
        del rollout
    dist.destroy_process_group()
    return out


def run_replay(args) -> list[dict]:
    """`shardrl train` GRPO runs of the shape (2 mini-batches a step, so the old-log-prob pass runs), one per
    actor.router_replay.mode of --modes (disabled, R2, R3): rollout/logprob_abs_diff and
    actor/router_replay_mismatch."""
    import subprocess

    from bench.e2e import grpo_overrides
    from bench.lora import prompt_file, tokenizer_folder

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    out = []
    for mode in args.modes.split(","):
        run_dir = root / "runs" / f"replay_{args.shape}_{mode}"
        overrides = [f"model.tiny={json.dumps(shape).replace(' ', '')}", "model.load_weights=random_shards",
                     f"model.tokenizer_path={tokenizer_folder(root, shape['vocab_size'])}",
                     *grpo_overrides(prompt_file(root, shape["vocab_size"], args.prompts), args.prompts, N, PROMPT_LEN,
                                     args.new_tokens, args.steps, f"replay_{mode}"),
                     f"actor.ppo_mini_batch_size={args.prompts // 2}", "actor.optim.lr=1e-5",
                     f"actor.router_replay.mode={mode}", f"trainer.output_dir={run_dir}", *args.extra.split()]
        proc = subprocess.run([sys.executable, "-m", "shardrl.cli", "train", *overrides], capture_output=True, text=True)
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        rec = dict(bench="moe_replay", shape=args.shape, mode=mode, steps=len(records),
                   error=proc.stderr[-2000:] if proc.returncode else None,
                   logprob_abs_diff=[r.get("rollout/logprob_abs_diff") for r in records],
                   mismatch=[r.get("actor/router_replay_mismatch") for r in records],
                   step_s=[round(r["timing/step_s"], 2) for r in records])
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])
        out.append(rec)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["update", "rollout", "replay"])
    p.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    p.add_argument("--experts", default="grouped_mm,eager",
                   help="update: experts implementations to compare; `+compile` compiles the engine's blocks")
    p.add_argument("--backends", default="fast,hf")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--max-tokens", type=int, default=8192, help="update: tokens per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="update: timed calls (the median); replay: GRPO steps")
    p.add_argument("--root", default="/tmp/moe_bench")
    p.add_argument("--extra", default="", help="replay: more overrides of the runs, space-separated")
    p.add_argument("--modes", default="disabled,R2", help="replay: the router_replay modes, one run each")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    {"update": run_update, "rollout": run_rollout, "replay": run_replay}[args.part](args)


if __name__ == "__main__":
    main()
