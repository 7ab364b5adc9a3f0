"""`shardrl serve` under concurrent clients against direct `generate` calls of the same work (issue 36's server
throughput): new tokens/s of C concurrent `openai` clients each sending R completions requests (one prompt each),
against the server's rollout called directly on as many prompts of the same shape and max_tokens in batches of the
server's `--max-batch`. The clients run in a process of their own (as real ones do). Every run (warm-up and timed, each side) has prompts of its own, so that none reads
another's from the fast rollout's prefix cache. On the fast backend the server batches continuously.

    python bench/serve.py --shape 1.5b --clients 256 --requests 2 --out results.jsonl   # one H200
    python bench/serve.py --shape tiny --clients 8 --requests 2 --prompt-len 16 --max-tokens 16   # CPU check

The model is the Qwen2-1.5B shape of bench/e2e.py with random weights ("eos_hazard": each new token ends the reply
with probability 1/400, so replies have uneven lengths), written once under --root. Both sides sample at
temperature 1 with their own seeds, so their replies differ; tokens/s counts the tokens each actually made.
Both decode in `--max-batch` slots (`rollout.max_batch`; before session 18's last commit the rollout's default, 64).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402

SHAPES = {"tiny": "TINY", "1.5b": "QWEN2_1P5B"}


def prompts_of(k: int, n_requests: int, prompt_len: int, vocab_size: int) -> list[str]:
    """Prompts of their own for each run (no run reads another's from the fast rollout's prefix cache)."""
    return [" ".join(f"w{4 + (31 * i + 7 * j + 13 * k) % (vocab_size - 4)}" for j in range(prompt_len))
            for i in range(n_requests * k, n_requests * (k + 1))]


def run_clients(args) -> None:
    """The client process: C concurrent `openai` clients, R requests each; prints (tokens, seconds) as JSON."""
    import openai

    import bench.e2e as e2e

    vocab_size = getattr(e2e, SHAPES[args.shape])["vocab_size"]
    prompts = prompts_of(args.prompt_set, args.clients * args.requests, args.prompt_len, vocab_size)

    async def client(c: int, aclient) -> int:
        made = 0
        for r in range(args.requests):
            res = await aclient.completions.create(model="m", prompt=prompts[c * args.requests + r],
                                                   max_tokens=args.max_tokens, temperature=1.0)
            made += res.usage.completion_tokens
        return made

    async def everyone() -> int:
        aclient = openai.AsyncOpenAI(base_url=args.clients_of, api_key="unused", max_retries=0, timeout=3600)
        return sum(await asyncio.gather(*[client(c, aclient) for c in range(args.clients)]))

    t0 = time.perf_counter()
    tokens = asyncio.run(everyone())
    print(json.dumps(dict(tokens=tokens, seconds=time.perf_counter() - t0)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--backend", default=None, choices=["fast", "hf"])
    p.add_argument("--root", default="/tmp/serve_bench")
    p.add_argument("--out", default=None)
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's thread switch interval while the server runs (default: the server's "
                        "SWITCH_INTERVAL_S, 0.05 ms; Python's own is 5 ms): how long the generation thread may wait "
                        "for the interpreter lock while the HTTP thread holds it")
    p.add_argument("--clients-of", default=None, help=argparse.SUPPRESS)  # (the client process: the server's URL)
    p.add_argument("--prompt-set", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.clients_of:
        return run_clients(args)

    import torch

    import bench.e2e as e2e
    from shardrl.config import load_config
    from shardrl.rollout import SamplingParams
    from shardrl.serve import ServerThread as Server, build_server

    if args.switch_interval_ms is not None:
        import shardrl.rollout.server as server_module

        server_module.SWITCH_INTERVAL_S = args.switch_interval_ms / 1000
    cuda = torch.cuda.is_available()
    shape = dict(getattr(e2e, SHAPES[args.shape]))
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0),
                                           args.prompt_len + args.max_tokens + 8)
    folder = Path(args.root) / f"model_{args.shape}"
    tok = e2e.build_tokenizer(shape["vocab_size"])
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        e2e.make_model(folder, shape, "eos_hazard", "cuda" if cuda else "cpu", tok)
        tok.save_pretrained(folder)
    # the rollout's slots = the server's max_batch, so that the direct calls decode in as many as the stream
    overrides = [f"model.path={folder}", f"rollout.max_batch={args.max_batch}"] + (
        [f"rollout.backend={args.backend}"] if args.backend else [])
    server = Server(build_server(load_config(None, overrides), served_name="m", max_batch=args.max_batch))
    batcher = server.batcher
    n_requests = args.clients * args.requests
    def profile(rollout) -> dict:
        """Where the last generate call's time went, and how full its slots were (fast backend)."""
        st = dict(getattr(rollout, "last_stats", {}) or {})
        if not st.get("decode_steps"):
            return {}
        keep = {k: round(v, 3) for k, v in st.items() if k.endswith("_s")}
        keep.update(decode_steps=st["decode_steps"], syncs=st["syncs"], num_slots=st["num_slots"],
                    occupancy=round(st["row_steps"] / (st["decode_steps"] * st["num_slots"]), 3),
                    ms_per_step=round(1000 * st["decode_s"] / st["decode_steps"], 2))
        return keep

    def prompt_set(k: int) -> list[str]:
        return prompts_of(k, n_requests, args.prompt_len, shape["vocab_size"])

    def all_clients(k: int) -> tuple[int, float]:
        """(new tokens, seconds) of the clients on prompt set k, run in a process of their own as real clients
        are (in this one they would take the interpreter's lock from the server and its generation thread)."""
        cmd = [sys.executable, os.path.abspath(__file__), "--clients-of", server.url, "--prompt-set", str(k),
               "--shape", args.shape, "--clients", str(args.clients), "--requests", str(args.requests),
               "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        return res["tokens"], res["seconds"]

    all_clients(0)  # warm-up: compile, CUDA graphs
    before = dict(batcher.stats)
    served_tokens, served_s = all_clients(1)
    batches = batcher.stats["batches"] - before["batches"]
    streams = batcher.stats["streams"] - before["streams"]
    switch_ms = round(sys.getswitchinterval() * 1000, 3)  # (while the server ran)
    batcher.pause()  # (a stream's idle wait ends first: the rollout is the direct calls' next)
    served_stats = profile(batcher.rollout)  # (the stream's, now ended: one stream ran the whole timed part)
    server.stop()

    rollout = batcher.rollout
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=1)
    def direct(prompts) -> int:
        ids = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
        made = 0
        direct_stats.clear()
        for start in range(0, n_requests, args.max_batch):
            chunk = torch.tensor(ids[start:start + args.max_batch])
            out = rollout.generate(chunk, torch.ones_like(chunk), sampling)
            made += int(out.response_mask.sum())
            for k, v in profile(rollout).items():  # (summed over the calls; the ratios of the last)
                direct_stats[k] = v if k in ("occupancy", "ms_per_step", "num_slots") else direct_stats.get(k, 0) + v
        if cuda:
            torch.cuda.synchronize()
        return made

    direct_stats: dict = {}
    direct(prompt_set(2))
    t0 = time.perf_counter()
    direct_tokens = direct(prompt_set(3))
    direct_s = time.perf_counter() - t0
    rec = dict(bench="serve", shape=args.shape, backend=type(rollout).__name__, clients=args.clients,
               requests=n_requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens, max_batch=args.max_batch,
               served_s=round(served_s, 3), served_tokens_per_s=round(served_tokens / served_s),
               server_batches=batches, server_streams=streams, direct_s=round(direct_s, 3),
               direct_tokens_per_s=round(direct_tokens / direct_s),
               ratio=round((served_tokens / served_s) / (direct_tokens / direct_s), 3),
               served_profile=served_stats, direct_profile=direct_stats,
               switch_interval_ms=switch_ms)
    print(json.dumps(rec), flush=True)
    append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
