"""Session 24's experiment: why the server's stream admits slower per prompt token than direct calls (issue 36's
server throughput). Runs the server's batcher without HTTP (clients as coroutines submitting token ids, as
`bench/serve.py --in-process`) and direct `generate` calls on the Qwen2-1.5B shape, timing every admission
(`FastRollout._admit`) and its prefill with the device synchronized around them, and profiles one admission of each
(the ops by their own CPU and device time).

    python bench/exp_admit.py --out results.jsonl          # one H200
    python bench/exp_admit.py --shape tiny --clients 8 --prompt-len 16 --max-tokens 16   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.serve import closed_loop, model_folder, prompts_of  # noqa: E402

OUT: str | None = None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--root", default="/tmp/serve_bench")
    p.add_argument("--profile-at", type=int, default=5, help="which admission of the stream to profile")
    p.add_argument("--flash-below", default="0,16384",
                   help="the prefill's SDPA on flash below this many tokens a chunk (DecoderBlock.flash_below); each "
                        "value a case of its own")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    global OUT
    OUT = args.out

    from shardrl.config.schema import load_config
    from shardrl.rollout import SamplingParams
    from shardrl.rollout.serving.command import build_server

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    folder, shape, tok = model_folder(args.shape, args.root, args.prompt_len, args.max_tokens, cuda)
    app = build_server(load_config(None, [f"model.path={folder}", f"rollout.fast.max_batch={args.max_batch}",
                                          "rollout.backend=fast"]), served_name="m", max_batch=args.max_batch)
    rollout = app.state.batcher.rollout
    n_requests = args.clients * args.requests
    log: list[dict] = []
    state = dict(count=0, profile_at=-1, profiled=None)
    admit, prefill = rollout._admit, rollout.model.prefill

    def timed_prefill(ids, *a, **kw):
        sync()
        t0 = time.perf_counter()
        out = prefill(ids, *a, **kw)
        t1 = time.perf_counter()
        sync()
        log[-1]["prefills"].append(dict(shape=list(ids.shape), host_ms=round(1e3 * (t1 - t0), 2),
                                        ms=round(1e3 * (time.perf_counter() - t0), 2)))
        return out

    def timed_admit(admitted, *a):
        sync()
        log.append(dict(rows=len(admitted), prefills=[]))
        profiling = state["count"] == state["profile_at"]
        prof = None
        if profiling:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        t0 = time.perf_counter()
        out = admit(admitted, *a)
        t1 = time.perf_counter()
        sync()
        if prof is not None:
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            state["profiled"] = dict(
                rows=len(admitted),
                by_cpu=ka.table(sort_by="self_cpu_time_total", row_limit=25),
                by_device=ka.table(sort_by="self_cuda_time_total" if cuda else "cpu_time_total", row_limit=15))
        log[-1].update(tokens=out[0], host_ms=round(1e3 * (t1 - t0), 2), ms=round(1e3 * (time.perf_counter() - t0), 2))
        state["count"] += 1
        return out

    rollout._admit, rollout.model.prefill = timed_admit, timed_prefill
    ids_of = lambda k: [tok(x, add_special_tokens=False)["input_ids"]  # noqa: E731
                        for x in prompts_of(k, n_requests, args.prompt_len, shape["vocab_size"])]

    def stream(k: int) -> float:
        return closed_loop(rollout, tok, ids_of(k), args.clients, args.requests, args.max_tokens, args.max_batch,
                           4096)[1]

    def direct(k: int, batch: int) -> float:
        ids = ids_of(k)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=1)
        t0 = time.perf_counter()
        for start in range(0, n_requests, batch):
            chunk = torch.tensor(ids[start:start + batch])
            rollout.generate(chunk, torch.ones_like(chunk), sampling)
        sync()
        return time.perf_counter() - t0

    def summary(name: str, seconds: float) -> None:
        admits = list(log)
        rec = dict(bench="exp_admit", case=name, seconds=round(seconds, 3), admissions=len(admits),
                   admit_ms=round(sum(a["ms"] for a in admits), 1),
                   admit_host_ms=round(sum(a["host_ms"] for a in admits), 1),
                   prefill_ms=round(sum(p["ms"] for a in admits for p in a["prefills"]), 1),
                   tokens=sum(a["tokens"] for a in admits), each=admits, stats=getattr(rollout, "last_stats", None),
                   profiled=state["profiled"])
        print(json.dumps({k: v for k, v in rec.items() if k not in ("each", "profiled")}), flush=True)
        for a in admits:
            print("   ", json.dumps(a), flush=True)
        if state["profiled"]:
            print(state["profiled"]["by_cpu"], flush=True)
            print(state["profiled"]["by_device"], flush=True)
        append_jsonl(args.out, [rec])

    if cuda:
        sdpa_first_call()
    stream(0)  # warm-up (graphs)
    direct(1, args.max_batch)
    k = 2
    for below in [int(x) for x in args.flash_below.split(",")]:
        rollout._block.flash_below = below
        for name, run in (("stream", stream), ("direct", lambda k: direct(k, args.max_batch))):
            log.clear()
            state.update(count=0, profile_at=args.profile_at if name == "stream" and below == 0 else -1,
                         profiled=None)
            summary(f"{name}_flash_below_{below}", run(k))
            k += 1


def sdpa_first_call() -> None:
    """The first and later calls of causal SDPA (Qwen2-1.5B heads: 12 query, 2 K/V, 128 wide) at batch sizes not
    seen before, 256 tokens each, under cuDNN and flash: what a prefill of a new shape pays for a cuDNN plan."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        rows = []
        for u in (3, 5, 7, 9, 11, 13):
            q = torch.randn(u, 12, 256, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(u, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
            times = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                times.append(round(1e3 * (time.perf_counter() - t0), 3))
            rows.append(dict(u=u, first_ms=times[0], later_ms=times[1:]))
        rec = dict(bench="exp_admit", case=f"sdpa_first_call_{name}", rows=rows)
        print(json.dumps(rec), flush=True)
        append_jsonl(OUT, [rec])


if __name__ == "__main__":
    main()
