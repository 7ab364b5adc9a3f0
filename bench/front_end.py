"""The HTTP path of `shardrl serve` alone (no GPU needed): requests/s of 1..N front-end processes
(`ServerProcess(front_ends=N)`) in front of an engine that answers at once (`InstantEngine`: each request gets
`--max-tokens` tokens back without generating), under a light load generator (keep-alive HTTP/1.1 written by hand, a
few tens of µs a request, in processes of its own), and what each side spends of a core a request: the front ends
(parse, validate, tokenize, answer), the engine's process (the connection's thread and its event loop) and, for the
`openai` rows, the `openai` client itself (what bench/serve.py's client processes pay); then the cores used while
`--waiting` requests wait for answers an engine holds back.

    python bench/front_end.py --front-ends 1,2 --out results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402


class InstantEngine:
    """What `EngineService` needs of a `Batcher`, answering every request at once with `max_new_tokens` tokens."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stats = tokenizer, {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def submit(self, prompts, sampling, alive=None, session=None) -> list[dict]:
        k = sampling.max_new_tokens
        return [dict(prompt_token_ids=p, token_ids=[7] * k, text="w" * k, log_probs=[-0.5] * k,
                     finish_reason="length") for p in prompts for _ in range(sampling.n)]


class HoldingEngine(InstantEngine):
    """Answers each request after `hold_s` (requests that wait, as they do while a GPU generates)."""

    hold_s = 3.0

    async def submit(self, prompts, sampling, alive=None, session=None) -> list[dict]:
        await asyncio.sleep(self.hold_s)
        return await super().submit(prompts, sampling)


def waiting_cost(tokenizer, n: int, args) -> dict:
    """Cores the front end and the engine's process use while `n` requests wait for their answers (the clients'
    connections watched for leaving, not polled: 0 at any n)."""
    from shardrl.rollout.serving.command import ServerProcess

    server = ServerProcess(HoldingEngine(tokenizer), "m", 1 << 16,
                           uvicorn_options=dict(http="h11", loop="asyncio") if args.plain else None)
    try:
        start_at = time.time() + 3.0
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--load-of", server.url.split("//")[1].split(
            "/")[0], "--connections", str(n), "--prompt-words", str(args.prompt_words), "--max-tokens", "1",
            "--start-at", str(start_at), "--until", str(start_at + 0.5)], stdout=subprocess.PIPE, text=True)
        time.sleep(max(0.0, start_at - time.time()) + 1.0)  # (sent; their answers come 3 s after each)
        fe0, engine0, t0 = cpu_s(server.pids[0]), time.process_time(), time.time()
        time.sleep(1.5)
        took = time.time() - t0
        rec = dict(bench="front_end_waiting", waiting=n, front_end_cores=round((cpu_s(server.pids[0]) - fe0) / took, 3),
                   engine_cores=round((time.process_time() - engine0) / took, 3))
        proc.communicate()
        return rec
    finally:
        server.stop()


def prompt_of(i: int, words: int) -> str:
    return " ".join(f"w{4 + (31 * i + 7 * j) % 4000}" for j in range(words))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def completion_request(host: str, prompt: str, max_tokens: int, stream: bool = False) -> bytes:
    """A /v1/completions POST (HTTP/1.1, keep-alive), as bytes to write (`stream`: server-sent events, the usage in
    the last chunk)."""
    more = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
    body = json.dumps(dict(model="m", prompt=prompt, max_tokens=max_tokens, temperature=1.0, **more)).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def exchange(reader, writer, request: bytes) -> bytes:
    """Writes `request` on a keep-alive connection and reads its 200 answer's body (an error status raises)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    lines = [line.lower() for line in head.split(b"\r\n")]
    if b"transfer-encoding: chunked" in lines:  # (a streamed reply: its chunks until the empty one)
        body = []
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readexactly(2)
        return b"".join(body)
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:"))
    return await reader.readexactly(length)


def last_json_lines(procs, what: str) -> list[dict]:
    """Each process's last line of output, as JSON, once it has ended (one that failed: an error naming `what`)."""
    outs = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{what} failed ({proc.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def raw_load(args) -> None:
    """A load process: --connections keep-alive connections, each sending completions requests one after another
    until --until (wall clock); prints its requests and CPU seconds as JSON."""
    host, port = args.load_of.split(":")
    bodies = [completion_request(host, prompt_of(args.proc_index * 1000 + i, args.prompt_words), args.max_tokens)
              for i in range(64)]

    async def connection(c: int) -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        done = 0
        while time.time() < args.until:
            await exchange(reader, writer, bodies[(c + done) % len(bodies)])
            done += 1
        writer.close()
        return done

    async def everyone() -> int:
        return sum(await asyncio.gather(*[connection(c) for c in range(args.connections)]))

    time.sleep(max(0.0, args.start_at - time.time()))
    c0 = time.process_time()
    n = asyncio.run(everyone())
    print(json.dumps(dict(requests=n, cpu_s=time.process_time() - c0)), flush=True)


def openai_load(args) -> None:
    """A load process of `openai.AsyncOpenAI` clients (one client, --connections coroutines each sending requests
    one after another until --until); prints its requests and CPU seconds as JSON."""
    import openai

    async def everyone() -> int:
        client = openai.AsyncOpenAI(base_url=f"http://{args.load_of}/v1", api_key="unused", max_retries=0)

        async def one(c: int) -> int:
            done = 0
            while time.time() < args.until:
                await client.completions.create(model="m", prompt=prompt_of(c + done, args.prompt_words),
                                                max_tokens=args.max_tokens, temperature=1.0)
                done += 1
            return done

        return sum(await asyncio.gather(*[one(c) for c in range(args.connections)]))

    time.sleep(max(0.0, args.start_at - time.time()))
    c0 = time.process_time()
    n = asyncio.run(everyone())
    print(json.dumps(dict(requests=n, cpu_s=time.process_time() - c0)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--front-ends", default="1,2", help="front-end process counts to time, comma-separated")
    p.add_argument("--load-procs", type=int, default=2, help="load-generator processes")
    p.add_argument("--connections", type=int, default=32, help="connections (or openai coroutines) per load process")
    p.add_argument("--prompt-words", type=int, default=256, help="words a prompt (each about one token)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens an answer carries back")
    p.add_argument("--seconds", type=float, default=5.0, help="how long each row's load runs")
    p.add_argument("--clients", default="raw,openai", help="load generators to time: raw, openai")
    p.add_argument("--plain", action="store_true",
                   help="the front ends on uvicorn's pure-Python HTTP parser and asyncio's loop (h11, asyncio), as "
                        "without httptools and uvloop installed")
    p.add_argument("--waiting", default="256", help="also the cores used while this many requests wait (comma-"
                   "separated counts; empty: none)")
    p.add_argument("--out", default=None)
    p.add_argument("--load-of", default=None, help=argparse.SUPPRESS)  # (a load process: host:port)
    p.add_argument("--kind", default="raw", help=argparse.SUPPRESS)
    p.add_argument("--proc-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.load_of:
        return (openai_load if args.kind == "openai" else raw_load)(args)

    import bench.e2e as e2e
    from shardrl.rollout.serving.command import ServerProcess

    tokenizer = e2e.build_tokenizer(4096 + 8)
    recs = []
    for front_ends in [int(x) for x in args.front_ends.split(",")]:
        server = ServerProcess(InstantEngine(tokenizer), "m", 1 << 16, front_ends=front_ends,
                               uvicorn_options=dict(http="h11", loop="asyncio") if args.plain else None)
        address = server.url.split("//")[1].split("/")[0]
        try:
            for kind in args.clients.split(","):
                start_at = time.time() + 3.0  # (the load processes import first)
                until = start_at + args.seconds
                cmds = [[sys.executable, os.path.abspath(__file__), "--load-of", address, "--kind", kind,
                         "--connections", str(args.connections), "--prompt-words", str(args.prompt_words),
                         "--max-tokens", str(args.max_tokens), "--proc-index", str(i), "--start-at", str(start_at),
                         "--until", str(until)] for i in range(args.load_procs)]
                procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for cmd in cmds]
                time.sleep(max(0.0, start_at - time.time()))
                fe0 = sum(cpu_s(pid) for pid in server.pids)
                engine0 = time.process_time()
                outs = last_json_lines(procs, "a load process")
                took = time.time() - start_at
                fe = sum(cpu_s(pid) for pid in server.pids) - fe0
                engine = time.process_time() - engine0
                n = sum(o["requests"] for o in outs)
                rec = dict(bench="front_end", front_ends=front_ends, client=kind, plain=args.plain, load_procs=args.load_procs,
                           connections=args.connections * args.load_procs, prompt_words=args.prompt_words,
                           max_tokens=args.max_tokens, requests=n, seconds=round(took, 2),
                           requests_per_s=round(n / took), front_end_ms_per_request=round(1000 * fe / n, 3),
                           engine_ms_per_request=round(1000 * engine / n, 3),
                           client_ms_per_request=round(1000 * sum(o["cpu_s"] for o in outs) / n, 3),
                           served_per_front_end=list(server.engine.served), cores=os.cpu_count())
                server.engine.served[:] = [0] * len(server.engine.served)
                print(json.dumps(rec), flush=True)
                recs.append(rec)
        finally:
            server.stop()
    for n in [int(x) for x in args.waiting.split(",") if x]:
        recs.append(waiting_cost(tokenizer, n, args))
        print(json.dumps(recs[-1]), flush=True)
    append_jsonl(args.out, recs)


if __name__ == "__main__":
    main()
