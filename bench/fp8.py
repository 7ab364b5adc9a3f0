"""FP8 rollouts against bf16 on one GPU, in the same run (`rollout.quantization=fp8`, `shardrl.rollout.fast.fp8`).

Model: Qwen2-1.5B-shaped (bench/rollout.py's QWEN2_1P5B), random init, bf16. Prompts: random ids, --prompt-len tokens,
--new-tokens each, no EOS, temperature 1; B = --batch rows in one batch.

Rows (the fast rollout with its CUDA defaults each):
    bf16          rollout.quantization=none: the baseline
    fp8           per-channel E4M3 weights, weight-only (dequantized for each matmul)
    fp8_dynamic   per-channel E4M3 weights and per-token E4M3 activations through torch._scaled_mm (compute
                  capability >= 8.9; a line saying why where it cannot run)
    fp8_block     128 x 128 block scales, weight-only

Each row: one warm-up generate (graphs, compilation), then a timed one. Reported: new tokens/s end to end and of the
decode alone (prefill timed by a run of one new token), decode against the bf16 row, the weight sync (load_weights
from the trainer's bf16 GPU tensors: for FP8 the quantization), the rollout's weight bytes, peak memory, and the
mismatch `rollout/logprob_abs_diff` (mean, max) of the sampler against the bf16 training engine's recomputation
(bench/rollout.py's `sampler_vs_engine_log_probs`) on 16 responses.

    python bench/fp8.py                       # the 1.5B shape on the GPU (a few minutes)
    python bench/fp8.py --rows bf16,fp8_dynamic --batch 256
    python bench/fp8.py --quick               # tiny model on the CPU: a smoke run (dynamic is skipped there)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` as a package

from bench.rollout import QWEN2_1P5B, TINY, IdTokenizer, report, sampler_vs_engine_log_probs, timed  # noqa: E402

ROWS = {"bf16": dict(quantization="none"), "fp8": dict(quantization="fp8"),
        "fp8_dynamic": dict(quantization="fp8", fp8_activations="dynamic"),
        "fp8_block": dict(quantization="fp8", fp8_block_size=128)}


def weight_bytes(model) -> int:
    """What the rollout's model holds: parameters (a tied head once) and the FP8 scales."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return held + sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))


def run_row(row: str, hf_model, config, prompts, args, device, dtype) -> dict:
    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.fast.rollout import FastRollout

    batch = prompts.shape[0]
    kwargs = dict(ROWS[row])
    if args.quick and kwargs.get("fp8_block_size"):
        kwargs["fp8_block_size"] = 32  # (the tiny shape's sides are multiples of 32)
    try:
        rollout = FastRollout(config, IdTokenizer(), device, dtype, micro_batch_size=batch, max_batch=batch,
                              seq_bucket=args.seq_bucket, **kwargs)
    except ValueError as e:  # e.g. dynamic activations on a GPU without FP8 matmuls, or on the CPU
        return dict(skipped=str(e))
    # the weight sync, as the trainer's: bf16 tensors on the GPU, copied (and quantized) in place; the second is timed
    rollout.load_weights(hf_model.named_parameters())
    _, load_s = timed(lambda: rollout.load_weights(hf_model.named_parameters()), device)
    ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    limits = torch.full((batch,), args.new_tokens)
    generate = lambda lim: rollout.generate(ids, mask, sampling, max_new_tokens=lim)  # noqa: E731
    timed(lambda: generate(limits), device)  # warm-up: graphs, compilation
    out, total_s = timed(lambda: generate(limits), device)
    generate(torch.ones_like(limits))
    _, prefill_s = timed(lambda: generate(torch.ones_like(limits)), device)
    tokens = int(out.response_mask.sum())
    decode_s = max(total_s - prefill_s, 1e-9)
    res = dict(tokens=tokens, seconds=total_s, tokens_per_s=tokens / total_s, prefill_s=prefill_s, decode_s=decode_s,
               decode_tokens_per_s=(tokens - batch) / decode_s, weight_sync_s=load_s,
               weight_gib=weight_bytes(rollout.model) / 2**30, **sampler_vs_engine_log_probs(hf_model, out))
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    rollout.release()
    del rollout
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="bf16,fp8,fp8_dynamic,fp8_block")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--seq-bucket", type=int, default=128)
    parser.add_argument("--init-std", type=float, default=None,
                        help="weight init std (HF default 0.02: near-flat logits); larger gives a more confident model")
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequences, CPU: a smoke run")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")

    import transformers

    shape = dict(TINY if args.quick else QWEN2_1P5B)
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.seq_bucket = 4, 16, 16, 16
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.init_std is not None:
        shape["initializer_range"] = args.init_std
    config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device(device):
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    hf_model.eval().requires_grad_(False)
    prompts = torch.randint(1, config.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    baseline = None
    for row in args.rows.split(","):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        res = run_row(row, hf_model, config, prompts, args, device, dtype)
        if row == "bf16" and "skipped" not in res:
            baseline = res
        if baseline is not None and "skipped" not in res:
            res["decode_vs_bf16"] = res["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
            res["weight_gib_vs_bf16"] = res["weight_gib"] / baseline["weight_gib"]
        report(dict(bench="fp8_rollout", row=row, batch=args.batch, prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens, **res, device=gpu, dtype=str(dtype)), args.out)


if __name__ == "__main__":
    main()
