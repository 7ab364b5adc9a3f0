"""The HTTP front end of `shardrl serve` in a process of its own (as vLLM's API server is): it parses requests,
applies the chat template, tokenizes, checks and answers them (`build_app`), and hands each request's token ids to
the engine (the rollout and its `Batcher`, in the serving process) over a local connection.

Why: in one process, the HTTP thread and the generation thread take turns on the interpreter lock. One H200,
Qwen2-1.5B shape, 256 clients (bench/serve.py, session 24): the batcher alone, its clients coroutines submitting
token ids, reached 0.98 of direct `generate` calls, the same batcher behind HTTP in its own process 0.38-0.61:
every admission's prefill (hundreds of kernel launches from Python) waited on the HTTP thread.

Messages (pickled, `multiprocessing.connection`): the front end sends ("submit", id, prompts, sampling, session,
wall time sent: bench/serve.py's `hops`, LoRA adapter or None, whether its client reads the tokens as they come) and
("cancel", id) for a request whose client left; the engine answers ("ok", id, outputs), ("dropped", id),
("stopped", id, message) or ("error", id, message), after ("part", id, k, tokens) for such a request: its output
k's tokens since the last. Each side sends what one
turn of its event loop produced as one list (`Outbox`): a burst of requests or of answers crosses in a few writes,
and the other side's reader takes the interpreter lock once a list, not once a message."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import urllib.request
from multiprocessing.connection import Client, Listener

from shardrl.rollout.base import SamplingParams
from shardrl.rollout.serving.app import ServeOptions, build_app, uvicorn_server
from shardrl.rollout.serving.batcher import ALIVE_EVERY_S, Batcher, Dropped, Stopped

log = logging.getLogger(__name__)


def no_delay(conn) -> None:
    """Sends `conn`'s (a `multiprocessing.connection` over TCP) small messages at once. With Nagle's algorithm on,
    a message written while an earlier one waits for its acknowledgement is held until that comes, and the reader
    acknowledges late (Linux: up to 40 ms): many requests in flight on one connection waited ~50 ms each."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # (the connection keeps its descriptor)


class Outbox:
    """Messages for `conn`, sent as one list per turn of `loop` (the only thread that adds to it), `most` at a time:
    the first message of a turn schedules the send after that turn's ready callbacks, which add theirs; a list of
    `most` goes at once (a burst of requests is handled in lockstep, each task a step a turn: without a cap, the
    first request of 256 would wait for the 256th's tokenizing). `failed(messages, error)` is called (on the loop)
    with what could not be sent: the whole list when the connection failed (OSError, EOFError), else (a message that
    cannot be pickled) each message that fails alone, the others sent one by one."""

    def __init__(self, conn, loop, failed=None, most: int = 16):
        self.conn, self.loop, self.failed, self.most, self.batch = conn, loop, failed, most, []

    def put(self, message) -> None:
        self.batch.append(message)
        if len(self.batch) == 1:
            self.loop.call_soon(self.flush)
        elif len(self.batch) >= self.most:
            self.flush()

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if not batch:  # (sent already: a full list)
            return
        try:
            self.conn.send(batch)
        except (OSError, EOFError) as e:
            self._failed(batch, e)
        except Exception:  # noqa: BLE001 (pickling: the list is not sent at all, so each goes alone)
            for message in batch:
                try:
                    self.conn.send([message])
                except Exception as e:  # noqa: BLE001
                    self._failed([message], e)

    def _failed(self, messages: list, error: Exception) -> None:
        if self.failed is not None:
            self.failed(messages, error)


class EngineService:
    """The engine's side: takes requests from front ends over local connections and runs them through `batcher`
    on an event loop of its own (a thread of this process); each answer goes back over its connection. A front end
    that goes away has its requests cancelled (their rows end at the stream's next sync)."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self.authkey = os.urandom(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address = self.listener.address
        self.conns: list = []
        self.served: list[int] = []  # requests taken, per front end (connection), in the order they connected
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="shardrl-engine-loop", daemon=True)
        self.loop_thread.start()
        try:
            asyncio.run_coroutine_threadsafe(batcher.start(), self.loop).result()
        except BaseException:  # (nothing left running: its loop's thread, its listener)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(timeout=10)
            if not self.loop.is_running():
                self.loop.close()
            self.listener.close()
            raise
        threading.Thread(target=self._accept, name="shardrl-engine-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AttributeError):  # closed (or a handshake that failed: the next one)
                if self.closed or self.listener._listener is None:  # (close() sets them)
                    return
                continue
            try:
                no_delay(conn)
            except OSError:  # (gone already)
                conn.close()
                continue
            self.conns.append(conn)
            self.served.append(0)
            threading.Thread(target=self._serve, args=(conn, len(self.conns) - 1), name="shardrl-engine-conn",
                             daemon=True).start()

    def _serve(self, conn, index: int) -> None:
        pending, cancelled = set(), set()
        book = threading.Lock()  # (pending and cancelled: this thread and the event loop's callbacks)

        def not_sent(answers: list, error: Exception) -> None:  # (on the loop)
            if isinstance(error, (OSError, EOFError)):  # (the front end went away: nobody reads them)
                return
            for message in answers:  # (an answer that cannot be pickled: its request still ends, with an error)
                log.error("request %d: its answer could not be sent: %r", message[1], error)
                try:
                    conn.send([("error", message[1], f"the answer could not be sent: {type(error).__name__}: {error}")])
                except Exception:  # noqa: BLE001 (gone meanwhile)
                    pass

        outbox = Outbox(conn, self.loop, not_sent)

        def answer(rid: int, task) -> None:  # (on the loop)
            with book:
                pending.discard(rid)
                cancelled.discard(rid)
            try:
                error = task.exception()
                if error is None:
                    outbox.put(("ok", rid, task.result()))
                elif isinstance(error, Dropped):
                    outbox.put(("dropped", rid))
                elif isinstance(error, Stopped):
                    outbox.put(("stopped", rid, str(error)))
                else:
                    outbox.put(("error", rid, f"{type(error).__name__}: {error}"))
            except BaseException as e:  # noqa: BLE001 (an answer that cannot be made: the request still ends)
                log.exception("request %d: its answer could not be made", rid)
                outbox.put(("error", rid, f"the answer could not be made: {type(e).__name__}: {e}"))

        def start(submits) -> None:  # (on the loop: one hand-over a list read)
            for rid, coro in submits:
                self.loop.create_task(coro).add_done_callback(lambda task, rid=rid: answer(rid, task))

        while True:
            try:
                batch = conn.recv()
            except (OSError, EOFError):
                with book:
                    cancelled.update(pending)  # (their clients went with it)
                return
            submits = []
            for message in batch:
                if message[0] == "cancel":
                    with book:
                        if message[1] in pending:  # (one answered meanwhile is forgotten: nothing to end)
                            cancelled.add(message[1])
                    continue
                rid, prompts, sampling, session = message[1:5]  # (then the front end's wall time of sending it)
                with book:
                    pending.add(rid)
                self.served[index] += 1

                async def alive(rid=rid) -> bool:
                    return rid not in cancelled

                alive.left = lambda rid=rid: rid in cancelled  # (asked by a generation thread: `server._left`)
                adapter = message[6] if len(message) > 6 else None  # (only where asked: stand-ins take none)
                kwargs = {"adapter": adapter} if adapter is not None else {}
                if len(message) > 7 and message[7]:  # (its client reads the tokens as they come)
                    kwargs["on_tokens"] = lambda k, tokens, rid=rid: outbox.put(("part", rid, k, tokens))
                submits.append((rid, self.batcher.submit(prompts, sampling, alive, session, **kwargs)))
            if submits:
                try:
                    if not self.loop.is_running():  # (stopped: the service is closing)
                        raise RuntimeError("the engine's loop stopped")
                    self.loop.call_soon_threadsafe(start, submits)
                except RuntimeError:  # (or closed)
                    for _, coro in submits:
                        coro.close()
                    return

    def stop_batcher(self) -> None:
        """Every open request answered (503: the server is stopping) and the running rows ended; the answers go out
        over the front ends' connections, which stay open."""
        if not self.closed and not getattr(self.batcher, "stopped", False) and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.batcher.stop(), self.loop).result(timeout=10)

    def close(self) -> None:
        """Stops taking requests; the front ends see their connections close (and stop). Idempotent."""
        if self.closed:
            return
        self.closed = True
        sock = getattr(getattr(self.listener, "_listener", None), "_socket", None)
        if sock is not None:  # (a close alone does not wake the thread blocked in accept: a shutdown does)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()
        for conn in self.conns:  # (shut down first: a close alone does not wake the thread reading it)
            try:
                sock = socket.socket(fileno=conn.fileno())
                sock.shutdown(socket.SHUT_RDWR)
                sock.detach()
            except OSError:
                pass
            conn.close()
        try:
            if not getattr(self.batcher, "stopped", False):
                asyncio.run_coroutine_threadsafe(self.batcher.stop(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(timeout=10)
            if not self.loop.is_running():
                self.loop.close()  # (its executor shut down without waiting: a generation still running ends alone)


class RemoteBatcher:
    """What `build_app` needs of a `Batcher` (submit, start, stop, the tokenizer), for an engine in another
    process (`EngineService` at `address`)."""

    def __init__(self, address, authkey: bytes, tokenizer):
        self.address, self.authkey, self.tokenizer = address, authkey, tokenizer
        self.stats: dict = {}
        self.ids = itertools.count()
        self.waiting: dict[int, asyncio.Future] = {}
        self.readers: dict[int, object] = {}  # request -> its on_tokens (a streamed reply's)
        self.closing = self.stopped = False

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.conn = Client(self.address, authkey=self.authkey)
        no_delay(self.conn)
        self.outbox = Outbox(self.conn, self.loop, self._not_sent)
        threading.Thread(target=self._read, name="shardrl-front-read", daemon=True).start()

    async def stop(self) -> None:
        self.stopped = self.closing = True
        for future in self.waiting.values():  # (the engine may answer them no more: said now, 503)
            if not future.done():
                future.set_exception(Stopped("the server stopped before this request was answered"))
        self.waiting.clear()
        self.conn.close()

    def _not_sent(self, messages: list, error: Exception) -> None:
        for message in messages:  # (cancels: nothing waits on them)
            future = self.waiting.pop(message[1], None) if message[0] == "submit" else None
            if future is not None and not future.done():
                future.set_exception(RuntimeError(f"the request could not reach the engine: {error!r}"))

    def _read(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except Exception as e:  # noqa: BLE001 (closed, or unreadable: either way nothing more comes)
                if self.closing:  # (stopped: its loop may be closed already)
                    return
                if not isinstance(e, (OSError, EOFError)):
                    log.exception("the engine's connection gave an unreadable message")
                self._on_loop(self._engine_gone)
                return
            if not self._on_loop(self._answer, batch):
                return

    def _on_loop(self, callback, *args) -> bool:
        """`callback(*args)` handed to the front end's loop; False if that loop has closed (the front end ended)."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:
            return False

    def _answer(self, batch: list) -> None:
        for message in batch:
            if message[0] == "part":
                reader = self.readers.get(message[1])
                if reader is not None:
                    reader(*message[2:])
                continue
            self.readers.pop(message[1], None)
            future = self.waiting.pop(message[1], None)
            if future is None or future.done():
                continue
            if message[0] == "ok":
                future.set_result(message[2])
            elif message[0] == "dropped":
                future.set_exception(Dropped())
            elif message[0] == "stopped":
                future.set_exception(Stopped(message[2]))
            else:
                future.set_exception(RuntimeError(message[2]))

    def _engine_gone(self) -> None:
        """The engine's process ended (or closed its side): the waiting requests fail and this front end stops
        (uvicorn ends on SIGTERM, as it would for Ctrl-C), freeing its port."""
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine process closed its connection"))
        self.waiting.clear()
        if not self.closing:
            log.error("the engine process closed its connection: this front end stops")
            os.kill(os.getpid(), signal.SIGTERM)

    def submit(self, prompts: list[list[int]], sampling: SamplingParams, alive=None, session: str | None = None,
               adapter: str | None = None, on_tokens=None):
        """The request sent to the engine at the call; the coroutine returned waits for its outputs (awaited as
        `Batcher.submit`'s is). A request refused here (the server stopping) raises at the call."""
        if self.stopped:
            raise Stopped("the server is stopping: it takes no more requests")
        rid = next(self.ids)
        future = self.waiting[rid] = self.loop.create_future()
        if on_tokens is not None:
            self.readers[rid] = on_tokens
        self.outbox.put(("submit", rid, prompts, sampling, session, time.time(), adapter, on_tokens is not None))
        return self._outputs(rid, future, alive)

    async def _outputs(self, rid: int, future: asyncio.Future, alive) -> list[dict]:
        gone = getattr(alive, "gone", None)  # (build_app's: the client's leaving, awaitable)
        try:
            while True:
                if gone is not None:
                    await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
                else:  # (an alive() that can only be asked: asked every ALIVE_EVERY_S)
                    await asyncio.wait({future}, timeout=ALIVE_EVERY_S)
                if future.done():
                    return future.result()
                if alive is not None and not await alive():
                    raise Dropped()
        except (Dropped, asyncio.CancelledError):
            if self.waiting.pop(rid, None) is not None:  # (still running there: its rows end)
                self.outbox.put(("cancel", rid))
            raise
        finally:
            self.readers.pop(rid, None)


def run_front_end(address, authkey: bytes, tokenizer, model_name: str, max_model_len: int, default_max_tokens: int,
                  sock: socket.socket, log_level: str, uvicorn_options: dict | None = None,
                  options: ServeOptions | None = None, lora_modules: list | None = None) -> None:
    """A front-end process: `build_app` on a `RemoteBatcher`, served by uvicorn on the listening socket `sock`
    (bound by the engine's process, `listening_sockets`); `lora_modules`: the engine batcher's adapters."""
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    remote = RemoteBatcher(address, authkey, tokenizer)
    remote.lora_modules = list(lora_modules or [])
    app = build_app(remote, model_name, max_model_len, default_max_tokens, options=options)
    uvicorn_server(uvicorn.Config(app, log_level=log_level, **(uvicorn_options or {}))).run(sockets=[sock])


def listening_sockets(host: str, port: int | None, n: int) -> list[socket.socket]:
    """`n` TCP sockets listening on host:port (a free port for None), or a clear error for a port taken. Several
    share the port through SO_REUSEPORT: the kernel spreads new connections over them evenly (one socket accepted
    by several processes is not: the first awake takes a burst whole), and the port is checked free first with a
    plain bind (which fails on any listener, so a second server cannot join the group)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bind(at: int, reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port whose last server just ended)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, at))
        except OSError as e:
            sock.close()
            hint = ("another server there? pick a free port with --port" if e.errno == errno.EADDRINUSE else
                    "is --host an address of this machine? 127.0.0.1 serves this machine alone, 0.0.0.0 every "
                    "network it is on")
            raise RuntimeError(f"cannot serve on {host}:{at}: {e.strerror or e} ({hint})") from None
        return sock

    if port and n > 1:
        bind(port, False).close()
    socks = [bind(port or 0, n > 1)]
    try:
        socks += [bind(socks[0].getsockname()[1], True) for _ in range(n - 1)]
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    for sock in socks:
        sock.listen(2048)
    return socks


class ServerProcess:
    """`batcher`'s rollout served as `model_name` by `front_ends` front-end processes (`run_front_end`) at host:port
    (a free loopback port by default; `url`: its /v1 base); the engine (`EngineService`) runs in this process. The
    same endpoint as `ServerThread` (`build_app`), without the interpreter lock shared with HTTP.

    Several front ends (as vLLM's API-server count): each parses, tokenizes and answers requests on a core of its
    own, on a socket of its own bound here to the shared port (`listening_sockets`), all feeding the one engine.
    One front end spends about 1 ms of its core a request (bench/front_end.py), so a single one caps a server near
    1,000 requests/s.
    `uvicorn_options`: more of `uvicorn.Config`'s settings (e.g. {"http": "h11", "loop": "asyncio"}); `options`:
    the server's own (`ServeOptions`)."""

    def __init__(self, batcher: Batcher, model_name: str, max_model_len: int, default_max_tokens: int = 256,
                 host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                 timeout_s: float = 120, front_ends: int = 1, uvicorn_options: dict | None = None,
                 options: ServeOptions | None = None):
        if front_ends < 1:
            raise ValueError(f"front_ends={front_ends}: serve with at least one front-end process")
        socks = listening_sockets(host, port, front_ends)
        port = socks[0].getsockname()[1]
        self.url = f"http://{host}:{port}/v1"
        self.engine, self.processes = None, []
        try:
            self.engine = EngineService(batcher)
            spawn = multiprocessing.get_context("spawn")
            self.processes = [spawn.Process(
                target=run_front_end, name=f"shardrl-front-end-{i}", daemon=True,
                args=(self.engine.address, self.engine.authkey, batcher.tokenizer, model_name, max_model_len,
                      default_max_tokens, sock, log_level, uvicorn_options, options,
                      getattr(batcher, "lora_modules", None))) for i, sock in enumerate(socks)]
            for process in self.processes:
                process.start()
        except BaseException:
            self.stop()
            raise
        finally:
            for sock in socks:  # (each front end holds its own: once it is gone, its share goes to the others)
                sock.close()
        try:
            self._wait_ready(host, port, front_ends, time.monotonic() + timeout_s, timeout_s)
        except BaseException:  # (Ctrl-C too: nothing is left running)
            self.stop()
            raise

    def _wait_ready(self, host: str, port: int, front_ends: int, deadline: float, timeout_s: float) -> None:
        """Until every front end has connected to the engine and one answers /v1/models."""
        connected = False
        while True:
            if not all(p.is_alive() for p in self.processes):
                raise RuntimeError(f"a front-end process exited ({self.exit_codes()}) before it served "
                                   f"{host}:{port} (its error is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the front ends on {host}:{port} did not answer within {timeout_s:g} s")
            connected = connected or len(self.engine.conns) >= front_ends  # (each connects as its app starts)
            if connected:
                try:
                    with urllib.request.urlopen(f"{self.url}/models", timeout=5):
                        return
                except OSError:
                    pass
            time.sleep(0.05)

    def exit_codes(self) -> str:
        """The exit codes of the front ends that have ended (after `stop`: as they were then)."""
        try:
            return ", ".join(f"{p.name}: {p.exitcode}" for p in self.processes if p.exitcode is not None)
        except ValueError:  # (closed by stop)
            return self.final_codes

    @property
    def batcher(self) -> Batcher:
        return self.engine.batcher

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait(self) -> None:
        """Until a front-end process ends (the others are stopped by `stop`)."""
        sentinels = {p.sentinel: p for p in self.processes if p.pid is not None}
        for ready in multiprocessing.connection.wait(list(sentinels)):
            sentinels[ready].join(5)  # (reaped: its exit code known)

    def stop(self) -> None:
        """Ends the front ends and the engine. Idempotent."""
        if getattr(self, "stopped", False):
            return
        self.stopped = True
        if self.engine is not None:  # (first: the front ends then answer their waiting clients, 503, and end)
            try:
                self.engine.stop_batcher()
            except Exception:  # noqa: BLE001 (the processes are ended all the same)
                log.exception("stopping the batcher failed")
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 30  # (one for all: uvicorn may still be waiting on requests)
        for process in self.processes:
            if process.pid is None:  # (never started)
                continue
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        self.final_codes = self.exit_codes()
        for process in self.processes:
            if process.pid is not None and not process.is_alive():
                process.close()  # (its sentinel pipes)
        if self.engine is not None:
            self.engine.close()
