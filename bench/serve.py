"""`shardrl serve` under concurrent clients against direct `generate` calls of the same work (issue 36's server
throughput): new tokens/s of C concurrent `openai` clients each sending R completions requests (one prompt each),
against the server's rollout called directly on as many prompts of the same shape and max_tokens in batches of the
server's `--max-batch`. The clients run in processes of their own (as real ones do), started together; the server's
HTTP front end runs in a process of its own (`--front-end process`, `shardrl serve`'s default) or in a thread of the
engine's. Every run (warm-up and timed, each side) has prompts of its own, so that none reads another's from the fast
rollout's prefix cache. On the fast backend the server batches continuously. `--warm-ups` served runs come before the
timed one: the server's steady state (its decode graphs of every (length, width) pair it meets captured).

    python bench/serve.py --shape 1.5b --clients 256 --requests 2 --out results.jsonl   # one H200
    python bench/serve.py --shape 1.5b --clients 256 --requests 2 --in-process   # + the batcher alone
    python bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --stream  # + streamed clients
    python bench/serve.py --shape tiny --clients 8 --requests 2 --prompt-len 16 --max-tokens 16 --backend fast  # CPU
    python bench/serve.py --clients 256 --requests 2 --backend sim --client raw --in-process  # no GPU: the path alone

The model is the Qwen2-1.5B shape of bench/e2e.py with random weights ("eos_hazard": each new token ends the reply
with probability 1/400, so replies have uneven lengths), written once under --root. Both sides sample at
temperature 1 with their own seeds, so their replies differ; tokens/s counts the tokens each actually made.
Both decode in `--max-batch` slots (`rollout.fast.max_batch`; before session 18's last commit the rollout's default, 64).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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


def model_folder(shape_name: str, root: str, prompt_len: int, max_tokens: int, cuda: bool):
    """(folder, config dict, tokenizer) of the bench's model of `shape_name` under `root`, written the first time."""
    import bench.e2e as e2e

    shape = dict(getattr(e2e, SHAPES[shape_name]))
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), prompt_len + max_tokens + 8)
    folder = Path(root) / f"model_{shape_name}"
    tok = e2e.build_tokenizer(shape["vocab_size"])
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        e2e.make_model(folder, shape, "eos_hazard", "cuda" if cuda else "cpu", tok)
        tok.save_pretrained(folder)
    return folder, shape, tok


def closed_loop(rollout, tokenizer, ids: list[list[int]], clients: int, requests: int, max_tokens: int,
                max_batch: int, max_model_len: int, overlap: bool = False) -> tuple[int, float, dict]:
    """The server's batcher without HTTP: `clients` coroutines of this process, each submitting `requests` prompts
    (token ids, client c's the c-th run of `requests` in `ids`) one after another, sampled as the server samples a
    completion at temperature 1. Returns (new tokens, seconds, the batcher's stats)."""
    from shardrl.rollout import SamplingParams
    from shardrl.rollout.serving.server import Batcher

    plain = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, seed=None)  # (as the server makes)

    async def run() -> tuple[int, float, dict]:
        alone = Batcher(rollout, tokenizer, max_batch, max_model_len, overlap=overlap)
        await alone.start()

        async def client(c: int) -> int:
            made = 0
            for r in range(requests):
                made += len((await alone.submit([ids[c * requests + r]], plain))[0]["token_ids"])
            return made

        t0 = time.perf_counter()
        made = sum(await asyncio.gather(*[client(c) for c in range(clients)]))
        took = time.perf_counter() - t0
        stats = dict(alone.stats)
        await asyncio.to_thread(alone.pause)  # (its stream ends before the loop does)
        await alone.stop()
        return made, took, stats

    return asyncio.run(run())


class StackSampler:
    """Every `every_s`, each other thread's innermost frame (file:line function), counted per thread name."""

    def __init__(self, every_s: float = 0.002):
        import collections
        import threading

        self.counts = collections.defaultdict(collections.Counter)
        self.every_s, self.running = every_s, True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import threading

        me = threading.get_ident()
        while self.running:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    code = frame.f_code
                    where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
                    self.counts[names.get(ident, str(ident))][where] += 1
            time.sleep(self.every_s)

    def stop(self) -> dict:
        self.running = False
        self.thread.join()
        return {name: counter.most_common(12) for name, counter in self.counts.items()}


class ArrivalTracer:
    """When each request of `prompts` (client c's r-th: index c * requests + r) reached the engine's batcher and
    when its answer left it (wall clock, the engine's process): how spread out the clients' first requests arrived,
    and each client's turnaround from an answer to its next request's arrival (the HTTP path's round trip)."""

    def __init__(self, batcher, prompts: list[str], tokenizer, requests: int):
        self.index = {tuple(tokenizer(x, add_special_tokens=False)["input_ids"][-16:]): i
                      for i, x in enumerate(prompts)}
        self.requests, self.came, self.went = requests, {}, {}
        submit = batcher.submit

        async def traced(prompts, *rest, **kwargs):
            i = self.index.get(tuple(prompts[0][-16:]))
            if i is not None:
                self.came[i] = time.time()
            try:
                return await submit(prompts, *rest, **kwargs)
            finally:
                if i is not None:
                    self.went[i] = time.time()

        batcher.submit = traced
        self.batcher, self.submit = batcher, submit
        # when the engine's process read each request from a front end's connection (`EngineService`)
        import multiprocessing.connection as connection

        self.recvd, self.front_sent, self.recv = {}, {}, connection.Connection.recv

        def recv(conn):
            batch = self.recv(conn)  # (a list of messages: frontend.py's `Outbox`)
            for message in batch if isinstance(batch, list) else []:
                if isinstance(message, tuple) and message and message[0] == "submit":
                    i = self.index.get(tuple(message[2][0][-16:]))
                    if i is not None:
                        self.recvd[i] = time.time()
                        self.front_sent[i] = message[5]
            return batch

        connection.Connection.recv = recv

    def restore(self) -> None:
        """The batcher's own submit and the library's own `Connection.recv` put back."""
        import multiprocessing.connection as connection

        self.batcher.submit, connection.Connection.recv = self.submit, self.recv

    def summary(self, span: dict) -> dict:
        """`span`: the clients' first start and last end (wall clock). The batcher's own submit is put back."""
        import statistics

        self.restore()
        if not self.came:
            return {}
        t0 = min(self.came.values())
        firsts = sorted(t - t0 for i, t in self.came.items() if i % self.requests == 0)
        turn = sorted(1000 * (self.came[i] - self.went[i - 1]) for i in self.came
                      if i % self.requests and i - 1 in self.went)
        out = dict(traced=len(self.came), first_wave_spread_s=round(firsts[-1], 3),
                   first_wave_half_s=round(firsts[len(firsts) // 2], 3),
                   last_answer_s=round(max(self.went.values()) - t0, 3),
                   first_arrival_after_start_s=round(t0 - span["start"], 3),
                   clients_end_after_last_answer_s=round(span["end"] - max(self.went.values()), 3))
        if turn:
            out.update(turnaround_ms_median=round(statistics.median(turn), 2),
                       turnaround_ms_p90=round(turn[int(0.9 * (len(turn) - 1))], 2),
                       turnaround_ms_max=round(turn[-1], 2))
        firsts_sent = [t for i, t in span.get("sent", {}).items() if i % self.requests == 0]
        if firsts_sent:  # (how spread the clients sent them: what the server cannot help)
            out.update(first_wave_sent_spread_s=round(max(firsts_sent) - min(firsts_sent), 3),
                       client_procs_late_s=round(span["late"], 3))
        out["hops"] = self.hops(span.get("sent", {}), span.get("got", {}))
        return out

    def hops(self, sent: dict, got: dict) -> dict:
        """Milliseconds (p50, p90, max) of each leg of a request, per wave (a client's r-th request): client to the
        engine's process (`up`: the client's send, HTTP, the front end, the engine connection; a thread front end:
        to the batcher), of it the front end's part (`front_end`: from the client's send to the front end's send to
        the engine) and the connection's (`link`: to the engine's reading it), the engine's own threads (`engine`:
        from its connection to the batcher), the answer's way back (`down`: from the batcher to the client's
        read)."""
        def q(xs):
            xs = sorted(1000 * x for x in xs)
            return [round(xs[int(f * (len(xs) - 1))], 1) for f in (0.5, 0.9, 1.0)] if xs else []

        recvd = self.recvd or self.came
        out = {}
        for r in range(self.requests):
            mine = [i for i in sent if i % self.requests == r and i in recvd and i in self.came]
            out[f"wave_{r}"] = dict(up=q(recvd[i] - sent[i] for i in mine),
                                    front_end=q(self.front_sent[i] - sent[i] for i in mine if i in self.front_sent),
                                    link=q(recvd[i] - self.front_sent[i] for i in mine if i in self.front_sent),
                                    engine=q(self.came[i] - recvd[i] for i in mine),
                                    down=q(got[i] - self.went[i] for i in mine if i in got and i in self.went))
        return out


def sequential_latency(url: str, prompts: list[str], n: int) -> dict:
    """Median and fastest milliseconds of `n` completions sent one after another by one `openai` client, for
    max_tokens 1 and 8 (the first 3 of each not counted)."""
    import statistics

    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    out = {}
    for max_tokens in (1, 8):
        took = []
        for i in range(n + 3):
            t0 = time.perf_counter()
            client.completions.create(model="m", prompt=prompts[i % len(prompts)], max_tokens=max_tokens,
                                      temperature=1.0)
            took.append(1000 * (time.perf_counter() - t0))
        out[f"max_tokens_{max_tokens}"] = dict(median=round(statistics.median(took[3:]), 2),
                                               min=round(min(took[3:]), 2))
    return out


def run_clients(args) -> None:
    """A client process: C concurrent `openai` clients, R requests each, from the wall-clock time --start-at (the
    processes start together); prints its tokens, its first request's and last answer's wall times as JSON."""
    # (no torch here: eight processes importing it at once on a busy host could miss the common start)
    prompts = prompts_of(args.prompt_set, args.clients * args.requests, args.prompt_len, args.vocab_size)
    mine = range(args.proc_index, args.clients, args.client_procs)  # (this process's clients)

    sent, got = {}, {}  # request -> wall time it was sent, its answer read (`ArrivalTracer.hops`)

    async def client(c: int, aclient) -> int:
        made = 0
        for r in range(args.requests):
            i = c * args.requests + r
            sent[i] = time.time()
            if args.stream:  # (server-sent events; the usage rides on the last chunk)
                usage = None
                async for chunk in await aclient.completions.create(
                        model="m", prompt=prompts[i], max_tokens=args.max_tokens, temperature=1.0, stream=True,
                        stream_options={"include_usage": True}):
                    usage = chunk.usage or usage
                got[i] = time.time()
                made += usage.completion_tokens
                continue
            res = await aclient.completions.create(model="m", prompt=prompts[i], max_tokens=args.max_tokens,
                                                   temperature=1.0)
            got[i] = time.time()
            made += res.usage.completion_tokens
        return made

    async def raw_client(c: int, conn=None) -> int:  # (HTTP written by hand: ~0.08 ms of a core a request, not ~1.5)
        from bench.front_end import completion_request, exchange

        reader, writer = conn or await connected(c)
        made = 0
        for r in range(args.requests):
            i = c * args.requests + r
            sent[i] = time.time()
            answer = await exchange(reader, writer, completion_request(host, prompts[i], args.max_tokens,
                                                                       args.stream))
            got[i] = time.time()
            if args.stream:  # (the events split apart; the usage event, the last before [DONE], read)
                events = answer.split(b"\n\n")
                assert events[-2] == b"data: [DONE]", events[-2:]
                made += json.loads(events[-3][6:])["usage"]["completion_tokens"]
                continue
            made += json.loads(answer)["usage"]["completion_tokens"]
        writer.close()
        return made

    host, port = args.clients_of.split("//")[1].split("/")[0].split(":")

    async def connected(c: int):
        """Client c's connection (raw), opened, and with --warm-clients used once (a /v1/models GET)."""
        from bench.front_end import exchange

        conn = await asyncio.open_connection(host, int(port))
        if args.warm_clients:
            await exchange(*conn, f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        return conn

    async def everyone() -> tuple[int, float]:
        """(tokens, wall time of the common start). With --warm-clients, each client has opened its connection and
        been answered once (`/v1/models`) before it: the timed part starts as a long-lived client's next call does."""
        async def at_start() -> float:
            await asyncio.sleep(max(0.0, args.start_at - time.time()))
            return time.time()

        if args.client == "raw":  # (cold: each client connects in the timed part)
            conns = await asyncio.gather(*[connected(c) for c in mine]) if args.warm_clients else [None] * len(mine)
            t0 = await at_start()
            return sum(await asyncio.gather(*[raw_client(c, conn) for c, conn in zip(mine, conns)])), t0
        aclient = openai.AsyncOpenAI(base_url=args.clients_of, api_key="unused", max_retries=0, timeout=3600)
        if args.warm_clients:  # (as many pooled connections as clients; the completions resource loaded)
            await asyncio.gather(*[aclient.models.list() for _ in mine])
            aclient.completions
        t0 = await at_start()
        return sum(await asyncio.gather(*[client(c, aclient) for c in mine])), t0

    if args.client == "openai":
        import openai  # (before the common start)
    tokens, t0 = asyncio.run(everyone())
    print(json.dumps(dict(tokens=tokens, start=t0, end=time.time(), late=t0 - args.start_at, sent=sent, got=got)),
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--backend", default=None, choices=["fast", "hf", "sim"],
                   help="sim: no model, a stand-in with the fast rollout's timing on one H100 (bench/sim_rollout.py): "
                        "the server's path timed on a machine without a GPU")
    p.add_argument("--sim", default="", metavar="K=V,...",
                   help="the stand-in's settings (bench/sim_rollout.py's SimRollout arguments), e.g. step_ms=3.3")
    p.add_argument("--root", default="/tmp/serve_bench")
    p.add_argument("--out", default=None)
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's thread switch interval while the server runs (default: the server's "
                        "SWITCH_INTERVAL_S, 0.05 ms; Python's own is 5 ms): how long the generation thread may wait "
                        "for the interpreter lock while the HTTP thread holds it")
    p.add_argument("--clients-of", default=None, help=argparse.SUPPRESS)  # (the client process: the server's URL)
    p.add_argument("--prompt-set", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--proc-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the clients are spread over (one asyncio `openai` client can spend ~1 ms "
                        "of its own CPU a request: with hundreds of clients in one process, the clients are the limit)")
    p.add_argument("--client", default="openai", choices=["openai", "raw"],
                   help="the clients: `openai.AsyncOpenAI` (what users run), or keep-alive HTTP written by hand "
                        "(bench/front_end.py's, ~20x less of a core a request: the server alone)")
    p.add_argument("--warm-clients", action="store_true",
                   help="each client opens its connection and is answered once (GET /v1/models) before the common "
                        "start, as the long-lived client of an agent loop is (without: the timed part includes each "
                        "client's connecting and the `openai` client's first-call set-up)")
    p.add_argument("--flash-below", type=int, default=None,
                   help="the prefill's SDPA on flash below this many tokens a chunk (`DecoderBlock.flash_below`)")
    p.add_argument("--front-end", default="process", choices=["process", "thread"],
                   help="the server's HTTP front end: a process of its own (`shardrl serve`'s default) or a thread of "
                        "the engine's process")
    p.add_argument("--front-ends", type=int, default=1,
                   help="front-end processes sharing the port (`shardrl serve --front-ends`; with --front-end process)")
    p.add_argument("--warm-ups", type=int, default=2,
                   help="served runs before the timed one (each on prompts of its own): the first compiles and "
                        "captures what the workload meets first, later ones the decode graphs of the (length, width) "
                        "pairs an arrival order of their own meets (a server's steady state)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's stream admits after it launches the decode steps (`Batcher(overlap=True)`, "
                        "the default since session 29)")
    p.add_argument("--sample-stacks", action="store_true",
                   help="sample every thread's innermost frame every 2 ms while the clients run (what holds the "
                        "interpreter besides the generation thread)")
    p.add_argument("--latency-requests", type=int, default=0, metavar="N",
                   help="also time N completions sent one after another by one client (max_tokens 1 and 8, after the "
                        "warm-ups): a request's latency through the server, as an agent's turn meets it")
    p.add_argument("--stream", action="store_true",
                   help="also time the clients with `stream=true` (server-sent events, usage in the last chunk; "
                        "the raw client splits the events and reads the usage's), after a streamed warm-up, in the same server: streamed_tokens_per_s "
                        "and stream_ratio (streamed over plain)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the server's `Batcher(stream_interval=)`: a streamed reply's tokens go out once this many "
                        "have come (1: at every host sync)")
    p.add_argument("--in-process", action="store_true",
                   help="also time the server's batcher without HTTP: the clients as coroutines calling "
                        "`Batcher.submit` with token ids in this process (what a front end in another process "
                        "could reach at best)")
    args = p.parse_args()
    if args.clients_of:
        return run_clients(args)

    import torch

    from bench.front_end import cpu_s, last_json_lines
    from shardrl.config.schema import load_config
    from shardrl.rollout import SamplingParams
    from shardrl.rollout.serving.command import ServerProcess, ServerThread, build_app, build_engine

    if args.switch_interval_ms is not None:
        import shardrl.rollout.serving.batcher as server_module

        server_module.SWITCH_INTERVAL_S = args.switch_interval_ms / 1000
    cuda = torch.cuda.is_available() and args.backend != "sim"
    if args.backend == "sim":  # (no model: the shape's tokenizer alone, in front of the stand-in)
        import bench.e2e as e2e
        from bench.sim_rollout import SimRollout
        from shardrl.rollout.serving.server import Batcher

        shape = dict(getattr(e2e, SHAPES[args.shape]))
        tok = e2e.build_tokenizer(shape["vocab_size"])
        sim_settings = {k: float(v) for k, v in (kv.split("=") for kv in args.sim.split(",") if kv)}
        context = args.prompt_len + args.max_tokens + 8
        engine = (Batcher(SimRollout(args.max_batch, **sim_settings), tok, args.max_batch, context,
                          stream_interval=args.stream_interval), "m", context, 256)
    else:
        folder, shape, tok = model_folder(args.shape, args.root, args.prompt_len, args.max_tokens, cuda)
        # the rollout's slots = the server's max_batch, so that the direct calls decode in as many as the stream
        overrides = [f"model.path={folder}", f"rollout.fast.max_batch={args.max_batch}"] + (
            [f"rollout.backend={args.backend}"] if args.backend else [])
        engine = build_engine(load_config(None, overrides), served_name="m", max_batch=args.max_batch,
                              stream_interval=args.stream_interval)
    n_requests = args.clients * args.requests

    def prompt_set(k: int) -> list[str]:
        return prompts_of(k, n_requests, args.prompt_len, shape["vocab_size"])

    # the timed run's requests traced from before the server starts: its connections' reader threads then read
    # through the tracer's `recv` from their first message (one installed later would miss the list each reader
    # was already waiting on)
    tracer = ArrivalTracer(engine[0], prompt_set(1), tok, args.requests)
    server = (ServerProcess(*engine, front_ends=args.front_ends) if args.front_end == "process"
              else ServerThread(build_app(*engine)))
    batcher = server.batcher
    batcher.overlap = args.overlap
    if args.flash_below is not None:
        batcher.rollout._block.flash_below = args.flash_below
    def profile(rollout) -> dict:
        """Where the last generate call's time went, and how full its slots were (fast backend)."""
        st = dict(getattr(rollout, "last_stats", {}) or {})
        if not st.get("decode_steps"):
            return {}
        keep = {k: round(v, 3) for k, v in st.items() if k.endswith("_s")}
        if "wall_start" in st and span:  # where the clients' span was not the stream's (before it, after it)
            keep.update(started_after_s=round(st["wall_start"] - span["start"], 3),
                        ended_before_s=round(span["end"] - st["wall_end"], 3))
        keep.update(decode_steps=st["decode_steps"], syncs=st["syncs"], num_slots=st["num_slots"],
                    admissions=st.get("admissions"), captures=st.get("captures"),
                    occupancy=round(st["row_steps"] / (st["decode_steps"] * st["num_slots"]), 3),
                    ms_per_step=round(1000 * st["decode_s"] / st["decode_steps"], 2))
        return keep

    def all_clients(k: int, stream: bool = False) -> tuple[int, float]:
        """(new tokens, seconds from the first request to the last answer) of the clients on prompt set k, run in
        processes of their own as real clients are (in this one they would take the interpreter's lock from the
        server and its generation thread), started together."""
        start_at = time.time() + 5.0  # (each process imports openai first)
        cmds = [[sys.executable, os.path.abspath(__file__), "--clients-of", server.url, "--prompt-set", str(k),
                 "--shape", args.shape, "--clients", str(args.clients), "--requests", str(args.requests),
                 "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                 "--client-procs", str(args.client_procs), "--proc-index", str(i), "--start-at", str(start_at),
                 "--client", args.client, "--vocab-size", str(shape["vocab_size"])]
                + (["--warm-clients"] if args.warm_clients else []) + (["--stream"] if stream else [])
                for i in range(args.client_procs)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for cmd in cmds]
        res = last_json_lines(procs, "a client process")
        span.update(start=min(r["start"] for r in res), end=max(r["end"] for r in res),
                    late=max(r["late"] for r in res),
                    sent={int(i): t for r in res for i, t in r["sent"].items()},
                    got={int(i): t for r in res for i, t in r["got"].items()})
        return sum(r["tokens"] for r in res), span["end"] - span["start"]

    warm_captures, span = [], {}
    for k in range(args.warm_ups):  # compiles, CUDA graphs
        all_clients(-1 - k)
        batcher.pause()  # (the stream ends: its stats are the run's)
        batcher.unpause()
        warm_captures.append((getattr(batcher.rollout, "last_stats", None) or {}).get("captures"))
    latency = sequential_latency(server.url, prompt_set(6), args.latency_requests) if args.latency_requests else {}
    before = dict(batcher.stats)
    sampler = StackSampler() if args.sample_stacks else None
    front_pids = list(getattr(server, "pids", []))
    cpu0 = [cpu_s(pid) for pid in front_pids], time.process_time()
    try:
        served_tokens, served_s = all_clients(1)
    finally:
        tracer.restore()
    # cores each front end and the engine's process kept busy while the clients ran (1.0: a core all the time)
    cores = dict(front_ends=[round((cpu_s(pid) - c) / served_s, 2) for pid, c in zip(front_pids, cpu0[0])],
                 engine=round((time.process_time() - cpu0[1]) / served_s, 2))
    arrivals = tracer.summary(span)
    stacks = sampler.stop() if sampler else None
    batches = batcher.stats["batches"] - before["batches"]
    streams = batcher.stats["streams"] - before["streams"]
    streamed = {}
    if args.stream:  # (a streamed warm-up, then the timed streamed run: the same server, prompts of their own)
        def stream_ended() -> dict:  # the running stream's profile (it ends: the next run's starts afresh)
            batcher.pause()
            stats = profile(batcher.rollout)
            batcher.unpause()
            return stats

        served_stats = stream_ended()  # (the plain run's)
        all_clients(8, stream=True)
        stream_ended()
        cpu1 = [cpu_s(pid) for pid in front_pids], time.process_time()
        # (its arrivals too; installed now, the connections' `recv` hops miss the first list each reader waits on)
        stream_tracer = ArrivalTracer(batcher, prompt_set(7), tok, args.requests)
        try:
            streamed_tokens, streamed_s = all_clients(7, stream=True)
        finally:
            stream_tracer.restore()
        stream_span = dict(span)  # (the next run's replaces it)
        streamed_cores = dict(
            front_ends=[round((cpu_s(pid) - c) / streamed_s, 2) for pid, c in zip(front_pids, cpu1[0])],
            engine=round((time.process_time() - cpu1[1]) / streamed_s, 2))
        streamed_stats = stream_ended()
        again_tokens, again_s = all_clients(9)  # (plain once more: how much two plain runs differ by themselves)
        rate, again = streamed_tokens / streamed_s, again_tokens / again_s
        streamed = dict(streamed_s=round(streamed_s, 3), streamed_tokens_per_s=round(rate),
                        plain_again_tokens_per_s=round(again),
                        stream_ratio=round(rate / (served_tokens / served_s), 3),
                        stream_ratio_after=round(rate / again, 3),  # (the steadier baseline: both warm)
                        streamed_profile=streamed_stats, streamed_cores=streamed_cores,
                        streamed_arrivals=stream_tracer.summary(stream_span))
    switch_ms = round(sys.getswitchinterval() * 1000, 3)  # (while the server ran)
    batcher.pause()  # (a stream's idle wait ends first: the rollout is the direct calls' next)
    if not args.stream:
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

    def batcher_alone(prompts) -> tuple[int, float]:
        ids = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
        made, took, stats = closed_loop(rollout, tok, ids, args.clients, args.requests, args.max_tokens,
                                        args.max_batch, batcher.max_model_len, args.overlap)
        alone_streams.append(stats)
        return made, took

    alone, alone_streams = {}, []
    if args.in_process:
        batcher_alone(prompt_set(4))
        alone_tokens, alone_s = batcher_alone(prompt_set(5))
        alone = dict(in_process_s=round(alone_s, 3), in_process_tokens_per_s=round(alone_tokens / alone_s),
                     in_process_profile=profile(rollout), in_process_stats=alone_streams[-1])

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
               served_profile=served_stats, direct_profile=direct_stats, client_procs=args.client_procs,
               client=args.client, warm_clients=args.warm_clients, **alone,
               switch_interval_ms=switch_ms, front_end=args.front_end, front_ends=args.front_ends,
               stream_interval=args.stream_interval,
               # (uvicorn's loop and parser where these are installed: a front end without is slower)
               uvloop=importlib.util.find_spec("uvloop") is not None,
               httptools=importlib.util.find_spec("httptools") is not None,
               warm_up_captures=warm_captures,
               overlap=args.overlap, arrivals=arrivals, served_cores=cores,
               **streamed, **({"sim": sim_settings} if args.backend == "sim" else {}),
               **({"latency_ms": latency} if latency else {}), **({"stacks": stacks} if stacks else {}))
    if alone:
        rec["in_process_ratio"] = round(rec["in_process_tokens_per_s"] / rec["direct_tokens_per_s"], 3)
    print(json.dumps(rec), flush=True)
    append_jsonl(args.out, [rec])


if __name__ == "__main__":
    main()
