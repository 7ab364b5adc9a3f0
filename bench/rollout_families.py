"""Rollout throughput per model family on one GPU: the fast engine against HF `generate` and against the
family's own floor, one JSON line per family.

Models: random init, bf16, shaped like the small checkpoints people post-train (one per family):
    qwen2         Qwen2-1.5B        (bench/rollout.py's model; the rows of bench/RESULTS.md)
    qwen3         Qwen3-1.7B        q/k RMSNorm, head_dim 128
    llama         Llama-3.2-1B      llama3 rope scaling, head_dim 64
    mistral       a 1.5B Mistral    sliding_window 4096 (Mistral-7B-v0.1's; does not bind at 512 tokens)
    gemma2        Gemma-2-2B        soft-caps (attention 50, final 30), every other layer a 4096 window,
                                    head_dim 256; HF runs it with eager attention (it has no SDPA path)
    gemma3_text   Gemma-3-1B        q/k norm, 5 of 6 layers a 512 window, local and global rope, 1 KV head

Case: batch 256 prompts of 256 random tokens -> 256 new tokens each, sampled at temperature 1 without EOS
(every row runs to its limit). Per family:
    fast        FastRollout with its CUDA defaults (graphs, Triton attention and sampler, compiled layer
                parts): a warm-up generate of 2 new tokens (compilation, graph capture), then the timed one
    floor       as bench/profile_decode.py's `rollout_floor`, for this family: its GEMMs alone in CUDA graphs
                (prefill in `prefill_tokens` chunks, then one batch-256 step per new token with the LM head)
                plus reading each step's live K/V once at --bandwidth, a sliding-window layer only its window.
                fraction_of_floor = fast new tokens/s / floor new tokens/s (measured: bench/RESULTS.md,
                "Current figures: Model families")
    hf          HF generate, DynamicCache, after a warm-up of 2 new tokens, on --hf-new-tokens new tokens
                (default 64, not 256: at batch 256 HF takes seconds per 256 tokens and family, bench/RESULTS.md,
                "Current figures: Fast rollout"; its tokens/s
                at 64 is if anything higher than at 256, whose contexts are longer), so vs_hf is conservative
    drift       the trainer's health metric on 16 of the fast responses (bench/rollout.py): |sampler log-prob
                - training engine's recomputation|, mean and max

    python bench/rollout_families.py --out results.jsonl          # all six, < 5 min on one H200
    python bench/rollout_families.py --families gemma2,gemma3_text
    python bench/rollout_families.py --quick                      # tiny shapes on the CPU: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` as a package
from bench import append_jsonl  # noqa: E402
from bench.rollout import HBM_BYTES_PER_S  # noqa: E402
from bench.rollout import QWEN2_1P5B, IdTokenizer, sampler_vs_engine_log_probs, timed  # noqa: E402

SHAPES = {
    "qwen2": QWEN2_1P5B,
    "qwen3": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6),
    "llama": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  max_position_embeddings=131072, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "mistral": dict(model_type="mistral", vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                    num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                        max_position_embeddings=32768, tie_word_embeddings=True),
}
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2)


def build_config(name: str, quick: bool):
    import transformers

    shape = dict(SHAPES[name])
    if quick:
        shape.update({k: v for k, v in QUICK.items() if k in shape or k in ("head_dim",)})
        if name == "mistral":
            shape["sliding_window"] = 8
    return transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)


def attn_implementation(config) -> str:
    return "eager" if config.model_type == "gemma2" else "sdpa"


def family_floor(rollout, config, b: int, prompt_len: int, new_tokens: int, dtype, bandwidth: float) -> dict:
    """bench/profile_decode.py's `rollout_floor` for any family: the GEMMs (q/k/v, o, gate/up, down per
    layer; the LM head per step) timed in CUDA graphs, plus each step's live K/V read once; a layer with a
    window reads at most `window` entries."""
    from bench.profile_decode import graph_ms
    from shardrl.models.families import head_dim_of, layer_windows

    dev, d = torch.device("cuda"), head_dim_of(config)
    model = rollout.model
    layers, head = model.model.layers, model.lm_head

    def gemms(x, x_attn, x_inter):
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            F.linear(x, a.qkv_weight, a.qkv_bias)
            F.linear(x_attn, a.o_proj.weight)
            F.linear(x, m.gate_up_weight)
            F.linear(x_inter, m.down_proj.weight)

    def inputs(n):
        return (torch.randn(n, config.hidden_size, device=dev, dtype=dtype),
                torch.randn(n, config.num_attention_heads * d, device=dev, dtype=dtype),
                torch.randn(n, config.intermediate_size, device=dev, dtype=dtype))

    chunk = min(b, max(1, rollout.prefill_tokens // prompt_len)) * prompt_len
    prefill_in, decode_in = inputs(chunk), inputs(b)
    prefill_ms = graph_ms(lambda: gemms(*prefill_in), reps=1, iters=5) * (b * prompt_len / chunk)
    step_ms = graph_ms(lambda: (gemms(*decode_in), head(decode_in[0])), reps=4, iters=10)
    per_entry = 2 * config.num_key_value_heads * d * (torch.finfo(dtype).bits // 8)  # K and V, one layer
    windows = layer_windows(config)
    kv_bytes = sum(b * min(prompt_len + t, w or prompt_len + t) * per_entry
                   for t in range(1, new_tokens) for w in windows)
    kv_read_s = kv_bytes / bandwidth
    gemm_s = prefill_ms / 1e3 + (new_tokens - 1) * step_ms / 1e3
    floor_s = gemm_s + kv_read_s
    return dict(floor_prefill_gemm_s=prefill_ms / 1e3, floor_step_gemm_ms=step_ms, floor_kv_read_s=kv_read_s,
                floor_s=floor_s, floor_tokens_per_s=b * new_tokens / floor_s)


def run_fast(hf_model, config, prompts, new_tokens: int, device, dtype) -> tuple[dict, object]:
    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.fast.rollout import FastRollout

    b = prompts.shape[0]
    # the cache sized for the timed run from the start: the warm-up (2 new tokens) captures its graphs
    rollout = FastRollout(config, IdTokenizer(), device, dtype, micro_batch_size=b, max_batch=b,
                          max_seq_len=prompts.shape[1] + new_tokens)
    rollout.load_weights(hf_model.named_parameters())
    ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    _, warmup_s = timed(lambda: rollout.generate(ids, mask, sampling, max_new_tokens=[2] * b), device)
    out, seconds = timed(lambda: rollout.generate(ids, mask, sampling), device)
    tokens = int(out.response_mask.sum())
    return dict(fast_tokens=tokens, fast_s=seconds, fast_warmup_s=warmup_s, fast_tokens_per_s=tokens / seconds,
                attention=type(rollout._block.attention).__name__, fast_graphs=len(rollout._graphs)), (rollout, out)


def run_hf(hf_model, prompts, new_tokens: int, device) -> dict:
    from transformers import GenerationConfig

    ids = prompts.to(device)

    def generate(n: int):
        cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                               min_new_tokens=n, eos_token_id=None, pad_token_id=0, use_cache=True)
        return hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

    torch.manual_seed(0)
    _, warmup_s = timed(lambda: generate(2), device)
    out, seconds = timed(lambda: generate(new_tokens), device)
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return dict(hf_new_tokens=new_tokens, hf_s=seconds, hf_warmup_s=warmup_s, hf_tokens_per_s=tokens / seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hf-new-tokens", type=int, default=64, help="new tokens of the HF row (module doc)")
    parser.add_argument("--bandwidth", type=float, default=HBM_BYTES_PER_S, help="bytes/s of the memory")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF row")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (no floor): a smoke run")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()

    import transformers

    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.hf_new_tokens = 4, 12, 8, 4
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # every family compiles the same layer functions again (its own shapes): past dynamo's recompile limit
    # (8 per function) the later families would run them eager
    import torch._dynamo as dynamo

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, 64)
    start = time.perf_counter()
    for name in args.families.split(","):
        family_start = time.perf_counter()
        config = build_config(name, args.quick)
        with torch.device(device):
            torch.manual_seed(0)
            hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                     attn_implementation=attn_implementation(config))
        hf_model.eval().requires_grad_(False)
        prompts = torch.randint(1, config.vocab_size, (args.batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(1))
        res = dict(bench="rollout_families", family=name, model_type=config.model_type,
                   params_b=sum(p.numel() for p in hf_model.parameters()) / 1e9, batch=args.batch,
                   prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        fast, (rollout, out) = run_fast(hf_model, config, prompts, args.new_tokens, device, dtype)
        res.update(fast)
        if device.type == "cuda":
            res.update(family_floor(rollout, config, args.batch, args.prompt_len, args.new_tokens, dtype,
                                    args.bandwidth))
            res["fraction_of_floor"] = res["fast_tokens_per_s"] / res["floor_tokens_per_s"]
        res.update(sampler_vs_engine_log_probs(hf_model, out))
        rollout.release(weights=True)
        del rollout, out
        if not args.no_hf:
            res.update(run_hf(hf_model, prompts, args.hf_new_tokens, device))
            res["fast_vs_hf"] = res["fast_tokens_per_s"] / res["hf_tokens_per_s"]
        res.update(family_s=time.perf_counter() - family_start, elapsed_s=time.perf_counter() - start,
                   device=str(device), dtype=str(dtype))
        res = {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in res.items()}
        print(json.dumps(res), flush=True)
        append_jsonl(args.out, [res])
        del hf_model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
