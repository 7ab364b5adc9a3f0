"""Training-engine throughput and memory on GPUs, against a plain FSDP2 loop in the same run.

Model: Qwen2-1.5B-shaped, random init (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960,
vocab 151936), sequences of 2048 tokens, bf16 compute, fp32 master weights and AdamW.

Baseline ("plain"): the HF model, `fully_shard` per decoder layer and root, `model(ids, labels=ids).loss`,
`torch.optim.AdamW`, one micro-batch per step. Engine rows: `shardrl` FSDP2/FSDP1 `train_batch` with a
token-mean NLL loss over the same tokens.

    python bench/engine.py --world 1 --rows plain_4,fsdp2_4 [--out results.jsonl]

Prints one JSON line per row: tokens/s, model TFLOP/s (6·N·tokens + causal attention), MFU against the
788 TFLOP/s bf16 matrix rate measured on these H200s, peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

QWEN2_1P5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
SEQ_LEN = 2048
PEAK_TFLOPS = 788.0

# name -> (kind, sequences per step, micro-batch size, gradient checkpointing, extra engine kwargs)
ROWS = {
    "plain_4": ("plain", 4, 4, False, {}),
    "plain_16_ckpt": ("plain", 16, 16, True, {}),
    "fsdp2_4": ("fsdp2", 4, 4, False, {}),
    "fsdp2_8": ("fsdp2", 8, 4, False, {}),
    "fsdp2_16": ("fsdp2", 16, 4, False, {}),
    "fsdp2_16_ckpt": ("fsdp2", 16, 16, True, {}),
    "fsdp2_32_ckpt": ("fsdp2", 32, 16, True, {}),
    "fsdp2_16_compile": ("fsdp2", 16, 4, False, {"compile": True}),
    "fsdp2_4_compile": ("fsdp2", 4, 4, False, {"compile": True}),
    "fsdp2_4_z2_compile": ("fsdp2", 4, 4, False, {"compile": True, "reshard_after_forward": False}),
    "fsdp2_8_compile": ("fsdp2", 8, 8, False, {"compile": True}),
    "fsdp2_8_z2_compile": ("fsdp2", 8, 8, False, {"compile": True, "reshard_after_forward": False}),
    # HSDP with shards of one GPU: on 2 GPUs each holds the whole model (replicated; gradients all-reduced)
    "hsdp1_8": ("fsdp2", 8, 4, False, {"fsdp_size": 1}),
    "hsdp1_8_compile": ("fsdp2", 8, 8, False, {"compile": True, "fsdp_size": 1}),
    "fsdp2_32_ckpt_compile": ("fsdp2", 32, 16, True, {"compile": True}),
    "fsdp2_4_padded": ("fsdp2", 4, 4, False, {"model.use_remove_padding": False}),
    "fsdp2_16_padded_compile": ("fsdp2", 16, 4, False, {"model.use_remove_padding": False, "compile": True}),
    # ragged: sequence i has 2048 - 64*i real tokens (right-padded), as RL batches do; packing then uses
    # the varlen kernel, and the plain loop pads and masks
    "plain_4_ragged": ("plain", 4, 4, False, {"ragged": True}),
    "fsdp2_4_ragged": ("fsdp2", 4, 4, False, {"ragged": True}),
    "fsdp2_4_ragged_compile": ("fsdp2", 4, 4, False, {"ragged": True, "compile": True}),
    "fsdp2_4_ragged_padded_compile": ("fsdp2", 4, 4, False, {"ragged": True, "compile": True,
                                                             "model.use_remove_padding": False}),
    # RL batches: the first half of each sequence a prompt, the second a response (`response_mask`), the loss
    # on the response; the head scores the responses only (the engine's default for such a batch), or, in the
    # `_fullhead` row, every token (the engine before it read `response_mask`; the same loss and gradients)
    "fsdp2_rl_8_compile": ("fsdp2", 16, 8, False, {"compile": True, "rl": "responses"}),
    "fsdp2_rl_8_fullhead_compile": ("fsdp2", 16, 8, False, {"compile": True, "rl": "all"}),
    # bench/e2e.py's var_512 update: 512 prompts of 256 tokens, responses ending with probability 1/400 a token
    # (cut at 1024), dynamic micro-batches of up to 16384 tokens
    "fsdp2_rlvar_compile": ("fsdp2", 512, 1, False, {"compile": True, "rl": "var", "use_dynamic_bsz": True,
                                                      "max_token_len_per_gpu": 16384}),
    # the same, the gradients reduced (and params resharded) after every micro-batch: the engine before
    # accumulate_unsharded (which one GPU now resolves to on)
    "fsdp2_rlvar_sync_compile": ("fsdp2", 512, 1, False, {"compile": True, "rl": "var", "use_dynamic_bsz": True,
                                                           "max_token_len_per_gpu": 16384,
                                                           "accumulate_unsharded": False}),
    # bench/e2e.py's fixed_512 update: 512 samples of 256 + 256 tokens, dynamic micro-batches of 16384 tokens
    "fsdp2_rlfixed_compile": ("fsdp2", 512, 1, False, {"compile": True, "rl": "fixed", "use_dynamic_bsz": True,
                                                        "max_token_len_per_gpu": 16384}),
    # var_512's update as bench/e2e.py runs it: the entropy computed too (`actor/entropy`); the head's passes over
    # the logits as Triton kernels (the default) or as compiled torch (`head_compiled`, the engine before them);
    # micro-batches of up to 32768 tokens (`_32k`)
    "fsdp2_rlvar_ent_compile": ("fsdp2", 512, 1, False, {"compile": True, "rl": "var", "use_dynamic_bsz": True,
                                                          "max_token_len_per_gpu": 16384, "entropy": True}),
    "fsdp2_rlvar_ent_headcompiled_compile": ("fsdp2", 512, 1, False, {
        "compile": True, "rl": "var", "use_dynamic_bsz": True, "max_token_len_per_gpu": 16384, "entropy": True,
        "head_compiled": True}),
    "fsdp2_rlvar_ent_32k_compile": ("fsdp2", 512, 1, False, {"compile": True, "rl": "var", "use_dynamic_bsz": True,
                                                              "max_token_len_per_gpu": 32768, "entropy": True}),
    "fsdp1_4": ("fsdp", 4, 4, False, {}),
    "fsdp1_16": ("fsdp", 16, 4, False, {}),
}


def model_flops_per_token(cfg: dict, seq_len: int) -> float:
    h, layers, v, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    matmul_params = layers * (h * h * 2 + h * kv * 2 + 3 * h * ffn) + h * v  # embedding lookup is free
    attention = layers * 2 * 2 * h * seq_len / 2  # QK^T and AV, causal half
    return 6 * matmul_params + 3 * attention


def ragged_mask(seqs: int) -> torch.Tensor:
    lengths = SEQ_LEN - 64 * (torch.arange(seqs, device="cuda") % 8)
    return (torch.arange(SEQ_LEN, device="cuda")[None] < lengths[:, None]).long()  # (seqs, SEQ_LEN)


def plain_step_fn(world: int, seqs: int, micro: int, ckpt: bool, ragged: bool = False):
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = transformers.AutoConfig.for_model(**QWEN2_1P5B)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        model.model.rotary_emb.inv_freq.copy_(model.model.rotary_emb.original_inv_freq.to("cuda")
                                               if hasattr(model.model.rotary_emb, "original_inv_freq") else
                                               model.model.rotary_emb.inv_freq)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator(device="cuda").manual_seed(0)

    def step():
        ids = torch.randint(0, QWEN2_1P5B["vocab_size"], (seqs, SEQ_LEN), device="cuda", generator=g)
        mask = ragged_mask(seqs) if ragged else torch.ones_like(ids)
        labels = ids.masked_fill(mask == 0, -100)
        for mb, am, lb in zip(ids.split(micro), mask.split(micro), labels.split(micro)):
            loss = model(input_ids=mb, attention_mask=am, labels=lb).loss * (mb.shape[0] / seqs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine_step_fn(strategy: str, world: int, seqs: int, micro: int, ckpt: bool, extra: dict):
    from shardrl.batch import Batch
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    import shardrl.engine.logprob as logprob

    ragged, rl, entropy = extra.get("ragged", False), extra.get("rl"), extra.get("entropy", False)
    logprob.TRITON_HEAD = not extra.get("head_compiled", False)
    model_kw = {k.split(".", 1)[1]: v for k, v in extra.items() if k.startswith("model.")}
    engine_kw = {k: v for k, v in extra.items()
                 if not k.startswith("model.") and k not in ("ragged", "rl", "entropy", "head_compiled")}
    model_cfg = ModelConfig(tiny=QWEN2_1P5B, gradient_checkpointing=ckpt, **model_kw)
    engine_cfg = EngineConfig(strategy=strategy, param_dtype="bfloat16", micro_batch_size_per_gpu=micro, **engine_kw)
    engine = build_engine(model_cfg, engine_cfg, OptimConfig(lr=1e-5))
    g = torch.Generator(device="cuda").manual_seed(0)

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        return -(outputs["log_probs"] * mb["loss_mask"]).sum() / num_tokens, {}

    def step():
        if rl == "var":
            return engine.train_batch(var_batch(seqs), loss_fn, with_entropy=entropy)
        if rl == "fixed":
            return engine.train_batch(var_batch(seqs, new=256, fixed=True), loss_fn, with_entropy=entropy)
        ids = torch.randint(0, QWEN2_1P5B["vocab_size"], (seqs, SEQ_LEN), device="cuda", generator=g)
        mask = ragged_mask(seqs) if ragged else torch.ones_like(ids)
        loss_mask = mask.clone()
        loss_mask[:, 0] = 0
        tensors = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
        if rl:
            loss_mask[:, : SEQ_LEN // 2] = 0
            if rl == "responses":
                tensors["response_mask"] = mask[:, SEQ_LEN // 2:]
        engine.train_batch(Batch(tensors), loss_fn)

    return step


def var_batch(seqs: int, prompt: int = 256, new: int = 1024, fixed: bool = False):
    """`seqs` RL samples as bench/e2e.py's var_512 makes them: a prompt of `prompt` tokens, then a response
    that ends with probability 1/400 at each token, cut at `new` (the same lengths every call); `fixed`: every
    response `new` tokens long (fixed_512's batch with new=256)."""
    from shardrl.batch import Batch

    g = torch.Generator().manual_seed(0)
    lengths = (torch.empty(seqs).exponential_(1 / 400, generator=g).long() + 1).clamp(max=new)
    if fixed:
        lengths = torch.full((seqs,), new)
    ids = torch.randint(0, QWEN2_1P5B["vocab_size"], (seqs, prompt + new), generator=g)
    response_mask = (torch.arange(new)[None] < lengths[:, None]).long()
    mask = torch.cat([torch.ones(seqs, prompt, dtype=torch.long), response_mask], 1)
    loss_mask = torch.cat([torch.zeros(seqs, prompt, dtype=torch.long), response_mask], 1)
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask,
                  "response_mask": response_mask}).to("cuda")


def run_row(name: str, world: int, warmup: int, steps: int):
    import torch.distributed as dist

    kind, seqs, micro, ckpt, extra = ROWS[name]
    per_rank = seqs  # sequences per rank per step (each rank gets its own batch)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    step = plain_step_fn(world, per_rank, micro, ckpt, extra.get("ragged", False)) if kind == "plain" else engine_step_fn(
        kind, world, per_rank, micro, ckpt, extra)
    build_s = time.perf_counter() - t_build
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if extra.get("ragged"):
        real_per_step = int(ragged_mask(per_rank).sum())
    elif extra.get("rl") == "var":
        real_per_step = int(var_batch(per_rank)["attention_mask"].sum())
    elif extra.get("rl") == "fixed":
        real_per_step = int(var_batch(per_rank, new=256, fixed=True)["attention_mask"].sum())
    else:
        real_per_step = per_rank * SEQ_LEN
    tokens = real_per_step * steps * world  # real (unpadded) tokens
    tok_s = tokens / elapsed
    tflops = tok_s * model_flops_per_token(QWEN2_1P5B, SEQ_LEN) / 1e12 / world
    peak = torch.cuda.max_memory_allocated() / 2**30
    peak_t = torch.tensor([peak], device="cuda")
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    return dict(row=name, kind=kind, world=world, seqs_per_rank=per_rank, micro=micro, ckpt=ckpt, **extra,
                tokens_per_s=round(tok_s), tflops_per_gpu=round(tflops, 1), mfu=round(tflops / PEAK_TFLOPS, 3),
                peak_gib=round(float(peak_t), 1), step_s=round(elapsed / steps, 3), build_s=round(build_s, 1))


def run_rows(names: list[str], world: int, warmup: int, steps: int):
    import gc

    results = []
    for name in names:
        try:
            res = run_row(name, world, warmup, steps)
        except torch.OutOfMemoryError as e:
            res = dict(row=name, world=world, error=f"OOM: {str(e)[:120]}")
        except Exception as e:  # a row that fails is reported, the others still run
            res = dict(row=name, world=world, error=f"{type(e).__name__}: {str(e)[:300]}")
        gc.collect()
        torch.cuda.empty_cache()
        if torch.distributed.get_rank() == 0:
            print(json.dumps(res), flush=True)
        results.append(res)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rows", default="plain_4,fsdp2_4")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardrl.testing import run_distributed

    results = run_distributed(run_rows, args.world, args.rows.split(","), args.world, args.warmup, args.steps)
    from bench import append_jsonl

    append_jsonl(args.out, results)


if __name__ == "__main__":
    main()
