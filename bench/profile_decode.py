"""Where a fast-rollout decode step spends its time, on one GPU (bench/rollout.py's model and batch 256).

Prints the time of a graph-replayed step at a few cache lengths (attention sdpa or triton, the layer's parts
compiled or not), the top CUDA kernels of decode steps run without graphs (the defaults), and each part of
a step timed alone: decode attention in several formulations, the layer GEMMs, the LM head and the sampler.
One JSON line per timing (also appended to --out).

    python bench/profile_decode.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.rollout import QWEN2_1P5B, IdTokenizer  # noqa: E402


def cuda_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def read_bytes_per_s(gib: float = 2.0) -> float:
    """This GPU's memory read bandwidth, measured: a sum over a `gib` GiB tensor reads each byte once (the bytes
    over the fastest of 5 timings of 10 sums). The floors' K/V read runs at it (4.3e12 on the H200s of
    sessions 1-30, `bench.rollout.HBM_BYTES_PER_S`)."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    ms = min(cuda_ms(lambda: x.sum(dtype=torch.float32), iters=10) for _ in range(5))
    nbytes = x.numel() * x.element_size()
    del x
    return nbytes / (ms / 1e3)


def graph_ms(fn, reps: int = 28, iters: int = 20) -> float:
    """Time of one `fn` call inside a CUDA graph of `reps` calls (as a decode step runs them: no launch
    gaps, consecutive calls of the same kernel)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return cuda_ms(graph.replay, iters) / reps


def attention_variants(b: int, hkv: int, g: int, d: int, seq: int, max_seq: int, dtype) -> dict:
    """Per-layer decode attention at batch b; positions uniform in [seq/2, seq) (the Triton kernel reads up
    to them, the others read `seq` positions)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardrl.rollout.fast.decode_kernel import decode_attention
    from shardrl.rollout.fast.attention import write_kv

    kv = torch.randn(2, b, hkv, max_seq, d, device="cuda", dtype=dtype)
    keys, values = kv[0][:, :, :seq], kv[1][:, :, :seq]
    q = torch.randn(b, hkv, g, d, device="cuda", dtype=dtype)
    k_new, v_new = torch.randn(2, b, hkv, d, device="cuda", dtype=dtype)
    slots = torch.arange(b, device="cuda")
    lengths = torch.randint(seq // 2, seq, (b,), device="cuda")
    mask = (torch.arange(seq, device="cuda") <= lengths[:, None])[:, None, None, :]
    additive = torch.zeros(mask.shape, device="cuda", dtype=dtype).masked_fill(~mask, float("-inf"))

    def manual():
        s = torch.matmul(q, keys.transpose(-1, -2)) * d**-0.5
        p = torch.softmax(s.float().masked_fill(~mask, float("-inf")), -1).to(dtype)
        return torch.matmul(p, values)

    def restricted(backend, m):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=m)
        return run

    variants = {"triton (attention=triton)": lambda: decode_attention(q, kv, lengths),
                "triton_block32": lambda: decode_attention(q, kv, lengths, block_n=32),
                "triton_block128": lambda: decode_attention(q, kv, lengths, block_n=128),
                "triton_fused_write (+ the K/V write)": lambda: decode_attention(q, kv, lengths, k_new, v_new),
                "triton_split2": lambda: decode_attention(q, kv, lengths, splits=2),
                "triton_split4": lambda: decode_attention(q, kv, lengths, splits=4),
                "triton_split4_fused_write": lambda: decode_attention(q, kv, lengths, k_new, v_new, splits=4),
                "triton_warps8": lambda: decode_attention(q, kv, lengths, num_warps=8),
                "triton_stages3": lambda: decode_attention(q, kv, lengths, num_stages=3),
                "triton_block128_stages3": lambda: decode_attention(q, kv, lengths, block_n=128, num_stages=3),
                "index_copy_write (the unfused K/V write)": lambda: write_kv(k_new, v_new, kv, slots, lengths),
                "sdpa_bool_mask": lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask),
                "sdpa_additive_mask (attention=sdpa)":
                    lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=additive),
                "efficient_bool": restricted(SDPBackend.EFFICIENT_ATTENTION, mask),
                "math_bool": restricted(SDPBackend.MATH, mask),
                "cudnn_additive": restricted(SDPBackend.CUDNN_ATTENTION, additive),
                "manual_matmul": manual}
    out = {}
    for name, fn in variants.items():
        try:
            out[name] = round(graph_ms(fn), 4)
        except Exception as e:  # a backend that refuses these shapes (or capture)
            out[name] = f"{type(e).__name__}: {str(e)[:120]}"
    out["kv_read_ideal_ms"] = round(2 * keys.numel() * keys.element_size() / 4.3e12 * 1e3, 4)
    live = 2 * (lengths + 1).sum().item() * hkv * d * keys.element_size()
    out["kv_read_live_ideal_ms"] = round(live / 4.3e12 * 1e3, 4)  # only each slot's entries up to its position
    return out


def rollout_floor(rollout, c, b: int, prompt_len: int, new_tokens: int, dtype) -> dict:
    """A lower bound on one fixed-shape rollout (b prompts of prompt_len, new_tokens each) on this GPU: the
    model's GEMMs alone, timed here in CUDA graphs (prefill in `prefill_tokens` chunks, then one batch-b
    step per new token: all layers and the LM head), plus reading each step's live K/V once at 4.3 TB/s.
    No attention math, norms, rotary, sampling or cache writes: a real engine is slower."""
    dev = torch.device("cuda")
    layers = rollout.model.model.layers
    head = rollout.model.lm_head

    def gemms(x):
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            F.linear(x, a.qkv_weight, a.qkv_bias)
            F.linear(x, a.o_proj.weight)
            h = F.linear(x, m.gate_up_weight)
            F.linear(h[:, : c.intermediate_size], m.down_proj.weight)

    chunk = min(b, max(1, rollout.prefill_tokens // prompt_len)) * prompt_len
    prefill_x = torch.randn(chunk, c.hidden_size, device=dev, dtype=dtype)
    decode_x = torch.randn(b, c.hidden_size, device=dev, dtype=dtype)
    prefill_ms = graph_ms(lambda: gemms(prefill_x), reps=1, iters=5) * (b * prompt_len / chunk)
    step_ms = graph_ms(lambda: (gemms(decode_x), head(decode_x)), reps=4, iters=10)
    kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    kv_bytes_per_token *= torch.finfo(dtype).bits // 8
    kv_read_s = sum(b * (prompt_len + t) * kv_bytes_per_token for t in range(1, new_tokens)) / 4.3e12
    gemm_s = prefill_ms / 1e3 + (new_tokens - 1) * step_ms / 1e3
    flops = 2 * b * ((prompt_len + new_tokens - 1) * sum(p.numel() for p in layers.parameters())
                     + (new_tokens - 1) * head.weight.numel())
    return dict(prefill_gemm_s=round(prefill_ms / 1e3, 4), decode_step_gemm_ms=round(step_ms, 4),
                gemm_s=round(gemm_s, 4), gemm_tflops=round(flops / gemm_s / 1e12, 1), kv_read_s=round(kv_read_s, 4),
                floor_s=round(gemm_s + kv_read_s, 4), floor_tokens_per_s=round(b * new_tokens / (gemm_s + kv_read_s)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoConfig

    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.fast.rollout import SAMPLE, FastRollout, sample_tokens
    from shardrl.rollout.fast.attention import TritonDecodeAttention

    records = []

    def emit(**rec):
        rec = {"bench": "profile_decode", **rec}
        records.append(rec)
        print(json.dumps(rec), flush=True)

    dtype, dev = torch.bfloat16, torch.device("cuda")
    config = AutoConfig.for_model(**QWEN2_1P5B)
    b = args.batch
    ids = torch.randint(1, config.vocab_size, (b, args.prompt_len), device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def at(st, position: int):  # every slot live at `position`, with room for the steps timed after (< 48)
        st.lengths.fill_(position)
        st.done.fill_(False)
        st.num_generated.zero_()

    configs = (("sdpa", False), ("sdpa", True), ("triton", False), ("triton", True), ("triton_unfused_write", True),
               ("triton_torch_sampler", True))
    for attention, compile in configs:
        unfused = attention == "triton_unfused_write"
        rollout = FastRollout(config, IdTokenizer(), dev, dtype, micro_batch_size=b, max_batch=b,
                              attention="sdpa" if attention == "sdpa" else "triton", compile=compile,
                              sampler="torch" if attention == "triton_torch_sampler" else "auto")
        if unfused:  # K/V written by two indexed copies before the kernel (the default writes them in it)
            rollout._block.attention = TritonDecodeAttention(fuse_kv_write=False)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
        rollout.generate(ids, torch.ones_like(ids), sampling)
        st, max_seq = rollout._state, rollout._state.max_seq
        for seq_len in sorted({max_seq // 2, 3 * max_seq // 4, max_seq}):
            at(st, seq_len - 48)
            graph_len = seq_len if attention == "sdpa" else max_seq  # triton: one graph, reads up to the positions
            emit(what="graph_step_ms", attention=attention, compile=compile, seq_len=seq_len,
                 ms=round(cuda_ms(lambda: rollout._run_step(SAMPLE, graph_len, gen), 30), 4))
        if attention == "triton" and compile:
            eager = rollout  # profiled below (the defaults)
        else:
            rollout.release(weights=True)

    rollout = eager
    st, max_seq = rollout._state, rollout._state.max_seq
    from torch.profiler import ProfilerActivity, profile

    at(st, max_seq - 48)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            rollout._steps.step(st, SAMPLE, max_seq, st.num_slots)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    emit(what="eager_step_kernels_ms", attention="triton", compile=True, seq_len=max_seq,
         top={e.key[:60]: round(e.device_time_total / 3 / 1e3, 4) for e in kernels})

    c = config
    d = c.hidden_size // c.num_attention_heads
    g = c.num_attention_heads // c.num_key_value_heads
    for seq_len in (max_seq // 2, max_seq):
        emit(what="attention_ms_per_layer", seq_len=seq_len,
             **attention_variants(b, c.num_key_value_heads, g, d, seq_len, max_seq, dtype))

    layer = rollout.model.model.layers[0]
    x = torch.randn(b, c.hidden_size, device=dev, dtype=dtype)
    a, m = layer.self_attn, layer.mlp
    gemms = {"qkv": lambda: F.linear(x, a.qkv_weight, a.qkv_bias), "o": lambda: F.linear(x, a.o_proj.weight),
             "gate_up": lambda: F.linear(x, m.gate_up_weight),
             "down": lambda: F.linear(torch.empty(b, c.intermediate_size, device=dev, dtype=dtype), m.down_proj.weight)}
    emit(what="layer_gemm_ms", **{k: round(cuda_ms(f), 4) for k, f in gemms.items()})
    head = rollout.model.lm_head
    emit(what="lm_head_ms", ms=round(cuda_ms(lambda: head(x)), 4))
    logits = head(x)
    noise = torch.empty(b, c.vocab_size, device=dev).exponential_()
    one = torch.ones((), device=dev)
    compiled = torch.compile(sample_tokens)
    from shardrl.rollout.fast.sample_kernel import fused_sample

    seed = torch.zeros(1, dtype=torch.long, device=dev)
    fused = {f"fused_splits{s}_block{k}_ms": round(graph_ms(lambda: fused_sample(logits, False, one, seed, s, k), 4), 4)
             for s in (8, 16, 32, 64) for k in (1024, 2048)}
    emit(what="sampler_ms", mode=SAMPLE,
         ms=round(graph_ms(lambda: sample_tokens(logits, SAMPLE, noise, one, None, None), 4), 4),
         compiled_ms=round(graph_ms(lambda: compiled(logits, SAMPLE, noise, one, None, None), 4), 4),
         noise_ms=round(cuda_ms(lambda: noise.exponential_(generator=gen)), 4), **fused)
    emit(what="rollout_floor", **rollout_floor(rollout, c, b, args.prompt_len, args.new_tokens, dtype))
    append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
