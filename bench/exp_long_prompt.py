"""Session 23's experiment: where the long-prompt GRPO call of bench/prefix_reuse.py spends its time on one GPU, and
which cheap changes move it (issue 36's 1.5x target, reached without margin in session 22).

Parts (each prints JSON lines; `--parts` picks them):
    gemm      the decode step's GEMMs at 256 rows (Qwen2-1.5B shape: qkv, o, gate_up, down, the LM head), each over 28
              weight copies in a CUDA graph (the weights stream from HBM as in a step), under cuBLAS, cuBLASLt and
              Inductor's max-autotune; the prefill's causal attention under flash, cuDNN and efficient SDPA
    rollout   the long-prompt call (32 x 2,048 tokens, n = 8, 256 new) timed; the admission alone (max_new_tokens=1)
              at several prefill chunk sizes; sync_every varied; one full call and one admission profiled: kernel
              time by kind and the device's idle time (wall minus the union of kernel intervals)

    python bench/exp_long_prompt.py --parts gemm,rollout --out results.jsonl
    TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 python bench/exp_long_prompt.py --parts rollout --tag autotune
    python bench/exp_long_prompt.py --parts rollout --tag cublaslt --blas cublaslt
    python bench/exp_long_prompt.py --parts rollout --quick        # CPU smoke run, tiny model

(Session 23's GEMM and SDPA figures were timed by a median of 20 graph replays; the script now takes
`bench.profile_decode.graph_ms`, their mean.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.prefix_reuse import SHAPES, IdTokenizer  # noqa: E402
from bench.profile_decode import graph_ms  # noqa: E402

OUT: str | None = None


def emit(**row) -> None:
    print(json.dumps(row), flush=True)
    if OUT:
        append_jsonl(OUT, [{"bench": "exp_long_prompt", **row}])


def part_gemm(rows: int) -> None:
    dt, dev = torch.bfloat16, "cuda"
    shapes = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
              "lm_head": (1536, 151936)}
    for name, (k, n) in shapes.items():
        copies = 1 if name == "lm_head" else 28
        x = torch.randn(rows, k, device=dev, dtype=dt)
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        out = torch.empty(rows, n, device=dev, dtype=dt)
        flops, nbytes = 2 * rows * k * n * copies, (k * n * 2 + rows * (k + n) * 2) * copies
        res = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            res[lib] = graph_ms(lambda: [torch.mm(x, w.t(), out=out) for w in ws], reps=1)
        torch.backends.cuda.preferred_blas_library("cublas")
        mm = torch.compile(lambda a, b: a @ b.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.perf_counter()
        mm(x, ws[0])
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        res["max_autotune"] = graph_ms(lambda: [mm(x, w) for w in ws], reps=1)
        emit(part="gemm", shape=name, rows=rows, k=k, n=n, copies=copies, compile_s=round(compile_s, 1),
             **{f"{lib}_us": round(ms * 1e3 / copies, 2) for lib, ms in res.items()},
             **{f"{lib}_tflops": round(flops / (ms * 1e-3) / 1e12, 1) for lib, ms in res.items()},
             floor_us_788=round(2 * rows * k * n / 788e12 * 1e6, 2),
             floor_us_hbm=round(nbytes / copies / 4.8e12 * 1e6, 2))
    # the prefill's causal attention: 8 prompts of 2,048 tokens, 12 query heads over 2 K/V heads
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    u, length, h, hkv, d = 8, 2048, 12, 2, 128
    q = torch.randn(u, h, length, d, device=dev, dtype=dt)
    k, v = torch.randn(2, u, hkv, length, d, device=dev, dtype=dt)
    flops = 4 * u * h * length * length * d / 2
    ref = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))
            try:
                with sdpa_kernel([backend]):
                    fn = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)  # noqa
                    got = fn()
                    ms = graph_ms(fn, reps=1)
                ref = got if ref is None else ref
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                emit(part="sdpa", backend=backend.name, gqa=gqa, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                     rel_err=err)
            except Exception as e:  # a backend that refuses the shape
                emit(part="sdpa", backend=backend.name, gqa=gqa, error=str(e)[:200])


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "gemm"
    if "flash" in n or "fmha" in n or "cudnn" in n:
        return "sdpa"
    if any(s in n for s in ("_decode", "prefix", "_prefill", "merge", "combine", "_attend")):
        return "attention_triton"
    if "sample" in n:
        return "sampler"
    if n.startswith("triton_"):
        return "inductor"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def profiled(fn) -> dict:
    """Wall time, kernel time by kind, and the device's idle time (wall minus the union of kernel intervals) of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans, kinds, names = [], {}, {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + (end - start) / 1e3
        names[e.name[:80]] = names.get(e.name[:80], 0.0) + (end - start) / 1e3
    spans.sort()
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span_ms = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    gaps.sort(reverse=True)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:20]
    return dict(wall_ms=round(wall * 1e3, 1), kernel_span_ms=round(span_ms, 1), busy_ms=round(busy / 1e3, 1),
                idle_in_span_ms=round(span_ms - busy / 1e3, 1), gaps_over_50us=sum(g > 50 for g in gaps),
                gap_ms_over_50us=round(sum(g for g in gaps if g > 50) / 1e3, 1),
                biggest_gaps_ms=[round(g / 1e3, 2) for g in gaps[:8]],
                by_kind_ms={k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                top_kernels_ms=[(k, round(v, 1)) for k, v in top])


def part_rollout(args) -> None:
    import transformers

    from shardrl.rollout import FastRollout, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape])
    config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)
    tok = IdTokenizer(config.vocab_size)
    t0 = time.perf_counter()
    rollout = FastRollout(config, tok, device, dtype, max_batch=args.prompts * args.n,
                          max_seq_len=args.prompt_len * 2 + args.new_tokens * 2 + 128, block_size=args.block_size)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in rollout.model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call(new_tokens: int):
        ids = torch.randint(0, config.vocab_size - 2, (args.prompts, args.prompt_len), generator=gen).to(device)
        sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=new_tokens, seed=1)
        return lambda: rollout.generate(ids, torch.ones_like(ids), sp)

    def timed(new_tokens: int, repeats: int) -> dict:
        times = []
        for _ in range(repeats):
            fn = call(new_tokens)
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        st = rollout.last_stats
        return dict(seconds=round(statistics.median(times), 4), all=[round(t, 4) for t in times],
                    **{k: round(st[k], 4) for k in ("decode_s", "admit_s", "host_s")}, syncs=st["syncs"])

    call(args.new_tokens)()
    sync()
    emit(part="rollout", tag=args.tag, case="warm_up_s", seconds=round(time.perf_counter() - t0, 1))
    emit(part="rollout", tag=args.tag, case="full", **timed(args.new_tokens, args.repeats))
    emit(part="rollout", tag=args.tag, case="admission", prefill_tokens=rollout.prefill_tokens,
         **timed(1, args.repeats))
    if args.sweep:
        default = rollout.prefill_tokens
        for chunk in (8192, 32768, 65536):
            rollout.prefill_tokens = chunk
            call(1)()  # (a new chunk shape: compiled already, dynamic)
            emit(part="rollout", tag=args.tag, case="admission", prefill_tokens=chunk, **timed(1, args.repeats))
        rollout.prefill_tokens = default
        for every in (32, 64):
            rollout.sync_every = every
            emit(part="rollout", tag=args.tag, case="full", sync_every=every, **timed(args.new_tokens, args.repeats))
        rollout.sync_every = 16
    if device == "cuda" and args.profile:
        emit(part="profile", tag=args.tag, case="admission", **profiled(call(1)))
        emit(part="profile", tag=args.tag, case="full", **profiled(call(args.new_tokens)))
    emit(part="rollout", tag=args.tag, case="full_again", **timed(args.new_tokens, args.repeats))


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="gemm,rollout")
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="default")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--blas", default=None, help="cublas or cublaslt for every GEMM of the rollout part")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    OUT = args.out
    if args.quick:
        args.shape, args.prompts, args.n, args.prompt_len, args.new_tokens, args.block_size = "tiny", 4, 4, 96, 16, 16
        args.repeats = 1
    parts = args.parts.split(",")
    if args.blas and torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library(args.blas)
    if "gemm" in parts and torch.cuda.is_available():
        part_gemm(args.prompts * args.n)
    if "rollout" in parts:
        part_rollout(args)


if __name__ == "__main__":
    main()
