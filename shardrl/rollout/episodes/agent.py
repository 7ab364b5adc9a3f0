"""Agent episodes: the user's own async code runs each episode and calls the policy through an OpenAI-compatible
endpoint served from the run's rollout (`shardrl.rollout.serving.app`, on loopback, in this process); the trajectory
the trainer trains on is assembled from what the endpoint sampled, token for token.

    # my_agent.py
    async def run(sample, client):             # sample: {"prompt", "data_source", "extra"}; client: openai.AsyncOpenAI
        messages = list(sample["prompt"])
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
        ...                                    # tools, parsing, more calls: anything
        return 1.0 if ok else 0.0              # the reward (None: the reward function scores the last reply)

`rollout.agent.entrypoint=my_agent.py:run`. Each prompt row runs `rollout.n` episodes, at most
`rollout.agent.max_concurrency` at once. The endpoint samples with the run's temperature, top-p and top-k whatever
a call asks (the trainer's log-probs assume them), at most `rollout.max_new_tokens` a call. An agent framework takes
the client itself, or builds its own from `client.base_url` and `client.api_key` (the key names the episode, so
that client's calls are recorded too); chat completions, completions and /v1/responses calls, streamed or not, all
count (examples/agent_frameworks/).

Assembly (token-exact): an episode's first call gives the trajectory's prompt (its prompt ids) and its first reply
(the sampled ids, trained, with the sampler's log-probs). Each later call's prompt must begin with the trajectory
so far, as a chat template renders an ongoing conversation: what it adds (tool output, the user's next turn, the
template's markers) is appended untrained, then the call's reply, trained. A call whose prompt does not extend the
trajectory (the agent rewrote its history) starts the trajectory afresh from that call (the earlier replies are
context only, untrained; counted in `agent/prefix_breaks`). The trajectory after the prompt holds at most
`rollout.agent.max_response_tokens`: the endpoint gives a call at most what is left and refuses one past it
(`Routes.episode_budget`), and the assembled trajectory is cut there too.

Failures: an episode that raises (sys.exit included), runs past `rollout.agent.timeout_s`, returns something other
than a finite number or None (or None where other episodes of the step return numbers), or never calls the model is
scored `rollout.agent.failure_reward` (its trajectory: what it sampled, or the row's prompt and an empty reply),
counted (`agent/errors_mean`, `agent/timeouts_mean`) and logged with its place in the agent's file (`agent.py:12`:
where it raised, or where it was waiting when it timed out); a step whose every episode failed stops the run with
the first error (a `ValueError`: one `error:` line; the trainer's scorer decides it on every rank's count).

Episodes share one event loop, the same for every step of the run (agents' libraries keep clients bound to the
loop they were first used on); what an episode leaves running is cancelled at the step's end. One that blocks it (time.sleep, a synchronous HTTP client, subprocess.run) stalls
them all and no timeout can fire until it returns (the log says so once the loop has stalled past the timeout);
await async calls, or use asyncio.to_thread (a thread's call still running when its episode times out is left to
finish: the step does not wait for it).

The endpoint samples without a seed: concurrent episodes' calls share batches whose makeup depends on timing, and
a seeded call is generated alone (`serving.batcher`), so an agent run is not reproducible from rollout.seed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
import uuid
from pathlib import Path

import torch

from shardrl.config.userfile import import_user_file
from shardrl.rollout.base import Rollout, RolloutOutput, SamplingParams, assemble_output
from shardrl.rollout.episodes.base import EpisodeRollout
from shardrl.rollout.episodes.multiturn import MultiTurnOutput

log = logging.getLogger(__name__)
MODEL_NAME = "policy"


def load_entrypoint(spec: str):
    """`path.py:function` -> the async function."""
    path, colon, name = spec.rpartition(":")
    if not colon or not path or not name:
        raise ValueError(f"rollout.agent.entrypoint={spec!r}: name the file and its async function as "
                         "path/to/agent.py:function (e.g. my_agent.py:run)")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"rollout.agent.entrypoint={spec!r}: no file {path!r}")
    module = import_user_file(path, f"rollout.agent.entrypoint={spec!r}: the agent file", "shardrl_agent_")
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"rollout.agent.entrypoint={spec!r}: {path} defines no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent.entrypoint={spec!r}: {name} must be an async function "
                         "(async def run(sample, client))")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        try:  # (a decorator's own signature: one that passes more arguments to the function it wraps)
            own = inspect.signature(fn, follow_wrapped=False)
            own.bind(None, None)
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in own.parameters.values()):
                raise TypeError  # (a generic wrapper tells nothing: the wrapped function's signature stands)
        except TypeError:
            raise ValueError(f"rollout.agent.entrypoint={spec!r}: {name} cannot be called as {name}(sample, client) "
                             f"({e}); define it as async def {name}(sample, client)") from None
    return fn


def episode_reward(result) -> tuple[float | None, str | None]:
    """(reward, error) of what an episode returned: a finite real number (numpy's too) or None, else an error."""
    if result is None:
        return None, None
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        return None, f"the agent returned {type(result).__name__}, not a number or None"
    try:
        reward = float(result)
    except (OverflowError, ValueError):
        return None, f"the agent returned {result!r:.40}, which is no float"
    if not math.isfinite(reward):
        return None, f"the agent returned {reward}: a reward must be finite"
    return reward, None


def agent_place(fn, exc: BaseException | None = None) -> str:
    """`file:line` in the agent's file (`fn`: the entrypoint): of the deepest frame there of `exc`'s traceback (where
    the episode raised, or where it waited when its timeout cancelled it), else of the function's definition; an
    environment's episodes (`verifiers_env.environment_episode`) name the environment."""
    if (place := getattr(fn, "episode_place", None)) is not None:
        return place
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    lines = [f.lineno for f in frames if f.filename == code.co_filename]
    return f"{code.co_filename}:{lines[-1] if lines else code.co_firstlineno}"


class _EpisodeStop(Exception):
    """An episode's sys.exit or its own CancelledError, as an error of that episode."""


class _CallThreads(concurrent.futures.ThreadPoolExecutor):
    """The episodes' loop's default executor (`asyncio.to_thread`, `run_in_executor(None, ...)`): each call in a
    daemon thread of its own, and a shutdown that does not wait for them. A call whose episode timed out keeps
    running in its thread until it returns, but the step does not wait for it (asyncio.run would, however long
    it blocks), nor does the process at its exit."""

    def __init__(self):
        super().__init__(thread_name_prefix="shardrl-agent-call")
        self.running: set[threading.Thread] = set()
        self.guard = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()

        def call() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as exc:  # noqa: BLE001 (handed to the awaiting episode)
                        future.set_exception(exc)
            finally:
                with self.guard:
                    self.running.discard(threading.current_thread())

        thread = threading.Thread(target=call, name="shardrl-agent-call", daemon=True)
        with self.guard:
            self.running.add(thread)
        try:
            thread.start()
        except BaseException:
            with self.guard:
                self.running.discard(thread)
            raise
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self.guard:  # (said once: the step's end asks, and the loop's close again)
            left, self.said = (0 if getattr(self, "said", False) else len(self.running)), True
        if left:
            log.warning("%d blocking call(s) of agent episodes that ended (asyncio.to_thread, run_in_executor) are "
                        "still running in threads; the step goes on without them", left)


class LoopWatch:
    """While it is entered, a thread that says once (an error in the log) when the event loop has not run for
    `timeout_s`: an episode is blocking it (time.sleep, a synchronous HTTP client, subprocess.run), and no
    episode's timeout can fire until it returns."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.loop, self.timeout_s, self.beat = loop, timeout_s, time.monotonic()
        self.done = threading.Event()

    def __enter__(self) -> LoopWatch:
        self.ticker = self.loop.create_task(self._tick())
        threading.Thread(target=self._watch, name="shardrl-agent-loop-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.ticker.cancel()

    async def _tick(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(min(1.0, self.timeout_s / 4))

    def _watch(self) -> None:
        while not self.done.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self.beat
            if stalled > self.timeout_s:
                log.error("an agent episode has blocked the event loop for %.0f s (a blocking call in async code: "
                          "time.sleep, a synchronous HTTP client, subprocess.run): no episode's timeout "
                          "(rollout.agent.timeout_s=%g) can fire until it returns; await async calls instead, or "
                          "run blocking ones with asyncio.to_thread", stalled, self.timeout_s)
                return


@dataclasses.dataclass
class AgentOutput(MultiTurnOutput):
    """A `MultiTurnOutput` of agent episodes: per row, a score fixed before the reward function (a failed
    episode's), and the episode's errors, timeouts, prefix breaks and model calls."""

    fixed_scores: list[float | None] = dataclasses.field(default_factory=list)
    counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    errors: list[str | None] = dataclasses.field(default_factory=list)
    """Per row: a failed episode's error and its place in the agent's file, else None."""

    def to_batch(self):
        batch = self.episode_batch()  # (no tool counts: an agent's calls are counted under agent/)
        if any(s is not None for s in self.fixed_scores):
            batch["fixed_score"] = list(self.fixed_scores)
        for key, values in self.counts.items():
            batch[f"agent_{key}"] = torch.tensor(values, dtype=torch.float32)
        batch["agent_error"] = list(self.errors)
        return batch


@dataclasses.dataclass
class _Episode:
    sample: dict
    key: str
    reward: float | None = None
    error: str | None = None
    timed_out: bool = False
    place: str | None = None  # where in the agent's file it failed

    def failure(self) -> str | None:
        """The error (a timeout's too) and where, or None for an episode that did not fail."""
        if self.error is None:
            return None
        return f"{self.place}: {self.error}" if self.place else self.error


class AgentRollout(EpisodeRollout):
    """Runs `entrypoint` episodes against an endpoint on `rollout` (see the module docstring); weights and
    memory calls go to `rollout`."""

    def __init__(self, rollout: Rollout, tokenizer, entrypoint, timeout_s: float = 300.0,
                 failure_reward: float = 0.0, max_concurrency: int = 256, max_response_tokens: int = 1024,
                 max_batch: int = 256, context: int | None = None, tool_call_parser: str = "auto"):
        super().__init__(rollout, tokenizer)
        self.tool_call_parser = tool_call_parser
        self.entrypoint = load_entrypoint(entrypoint) if isinstance(entrypoint, str) else entrypoint
        self.timeout_s, self.failure_reward = timeout_s, failure_reward
        self.max_concurrency, self.max_response_tokens = max_concurrency, max_response_tokens
        self.max_batch, self.context = max_batch, context
        self.server = None
        self.loop: asyncio.AbstractEventLoop | None = None  # (the episodes' loop: `_on_loop`)
        for name in ("httpx", "httpx2"):  # (the openai client's HTTP library logs every call at INFO: hundreds a
            quiet = logging.getLogger(name)  # step would bury the run's own lines; a level set by the user stays)
            if quiet.level == logging.NOTSET:
                quiet.setLevel(logging.WARNING)

    @classmethod
    def from_config(cls, rollout: Rollout, tokenizer, ro, hf_config) -> AgentRollout:
        from shardrl.models.config import text_config

        a = ro.agent
        entrypoint = a.entrypoint
        if ro.env:  # a verifiers environment's rollouts are the episodes
            from shardrl.data.verifiers import load_verifiers_env
            from shardrl.rollout.episodes.verifiers_env import environment_episode

            env = load_verifiers_env(ro.env, ro.env_args)
            entrypoint = environment_episode(env, MODEL_NAME, f"rollout.env={ro.env}")
        return cls(rollout, tokenizer, entrypoint, a.timeout_s, a.failure_reward, a.max_concurrency,
                   a.max_response_tokens, ro.fast.max_batch or 256,
                   int(getattr(text_config(hf_config), "max_position_embeddings", 4096)), a.tool_call_parser)

    @property
    def weight_hook(self):
        return self.rollout.weight_hook

    @weight_hook.setter
    def weight_hook(self, hook) -> None:  # (partial rollouts: the backend calls it while it generates)
        self.rollout.weight_hook = hook

    # ---- episodes --------------------------------------------------------------------------------
    def _endpoint(self, sampling: SamplingParams):
        """The loopback server on the rollout (started once); its policy sampling set for this call."""
        from shardrl.rollout.serving.app import ServeOptions, ServerThread, build_app
        from shardrl.rollout.serving.batcher import Batcher

        policy = dataclasses.replace(sampling, n=1, seed=None)  # per-batch draws: episodes of a prompt differ
        if self.server is None:
            batcher = Batcher(self.rollout, self.tokenizer, self.max_batch, self.context or 4096)
            app = build_app(batcher, MODEL_NAME, self.context or 4096, sampling.max_new_tokens, policy,
                            ServeOptions(tool_call_parser=self.tool_call_parser))
            self.server = ServerThread(app)
        self.server.app.state.policy = policy  # this call's: training's, or validation's
        self.server.app.state.episode_budget = self.max_response_tokens
        self.server.app.state.records.clear()  # (what episodes of an earlier call left)
        self.server.batcher.unpause()
        return self.server

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingParams,
                 samples: list[dict] | None = None) -> MultiTurnOutput:
        samples = self.episode_samples(prompt_ids, attention_mask, samples)
        num_prompts, n = prompt_ids.shape[0], sampling.n
        server = self._endpoint(sampling)
        episodes = [_Episode({"prompt": samples[b].get("prompt"), "data_source": samples[b].get("data_source"),
                              "extra": samples[b].get("extra")}, uuid.uuid4().hex)
                    for b in range(num_prompts) for _ in range(n)]
        # slots (and the fast rollout's K/V, slots x the stream's length) for the calls that can be in flight at
        # once, about one an episode: 256 slots of 4096 positions was 48 GB for SmolLM2-135M, past a CPU's memory
        server.batcher.max_batch = max(1, min(self.max_batch, self.max_concurrency, len(episodes)))
        self._on_loop(self._run_all(episodes, server.url))
        server.batcher.pause()  # (the backend free: the trainer moves weights next)
        unpin = getattr(self.rollout, "unpin_session", None)
        for e in episodes if unpin is not None else ():  # (the episodes are over: their K/V need not stay)
            unpin(e.key)
        records = server.app.state.records
        calls = [records.pop(e.key, []) for e in episodes]
        self._judge(episodes, calls)
        return self._assemble(prompt_ids, attention_mask, n, episodes, calls)

    def _on_loop(self, episodes) -> None:
        """Runs the step's `episodes` (a coroutine) on the episodes' event loop: one loop for the whole run, not one
        a step (asyncio.run), since agents' libraries keep clients bound to the loop they were first used on
        (langchain-openai caches its HTTP client process-wide: on the next step's new loop every call failed with
        'Event loop is closed'). What the episodes leave running is cancelled at the step's end, as asyncio.run
        cancels it, and their blocking calls' threads are left to finish (`_CallThreads`)."""
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
        threads = _CallThreads()
        self.loop.set_default_executor(threads)
        try:
            self.loop.run_until_complete(episodes)
        finally:
            left = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            threads.shutdown(wait=False)

    def _judge(self, episodes: list[_Episode], calls: list[list[dict]]) -> None:
        """The failures only the whole step shows (no call to the model; None where other episodes returned
        numbers: the agent scores this step, so a None is a bad return), then each failure logged: the first
        three, and how many more."""
        scored = any(e.reward is not None for e in episodes)
        for e, c in zip(episodes, calls):
            if e.failure() is not None:
                continue
            if not c:
                e.error, e.place = "the episode never called the model", agent_place(self.entrypoint)
            elif scored and e.reward is None:
                e.error, e.place = ("the agent returned None where other episodes of this step returned numbers; "
                                    "return a number from every episode (or None from every one: the reward "
                                    "function then scores them)"), agent_place(self.entrypoint)
        failures = [e.failure() for e in episodes if e.failure() is not None]
        for failure in failures[:3]:
            log.warning("agent episode failed at %s", failure)
        if len(failures) > 3:
            log.warning("%d more agent episodes failed this step (agent/errors_mean and agent/timeouts_mean count "
                        "them)", len(failures) - 3)

    async def _episode(self, sample: dict, client):
        """The agent's episode, with its sys.exit, a CancelledError and a TimeoutError of its own made episode errors
        (out of the episode's task, the first would stop the event loop, the second read as the step's cancellation,
        the third as the episode's timeout)."""
        try:
            return await self.entrypoint(sample, client)
        except SystemExit as exc:
            raise _EpisodeStop(f"the agent called sys.exit({exc.code!r})") from None
        except (TimeoutError, asyncio.TimeoutError) as exc:  # (the episode's own timeout cancels it: this is not it)
            said = f": {exc}" if str(exc) else ""
            raise _EpisodeStop(f"{type(exc).__name__} raised inside the agent (not the episode's timeout, "
                               f"rollout.agent.timeout_s){said}") from exc
        except asyncio.CancelledError:
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # (Python 3.11+)
            if cancelling is None or cancelling():  # (cancelled from outside: its timeout, or the step's end)
                raise
            raise _EpisodeStop("the agent raised CancelledError") from None
        except (Exception, KeyboardInterrupt, GeneratorExit):  # (Ctrl-C stops the run)
            raise
        except BaseException as exc:  # (a library's own BaseException subclass: this episode's error)
            raise _EpisodeStop(f"{type(exc).__name__} (a BaseException) raised inside the agent: {exc}") from None

    async def _run_all(self, episodes: list[_Episode], url: str) -> None:
        import openai

        from shardrl.rollout.serving.app import EPISODE_HEADER, EPISODE_KEY_PREFIX

        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=self.timeout_s)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(e: _Episode):
            async with gate:
                # (the key names the episode too: a framework's own client built from base_url and api_key)
                episode_client = client.with_options(api_key=EPISODE_KEY_PREFIX + e.key,
                                                     default_headers={EPISODE_HEADER: e.key})
                try:
                    result = await asyncio.wait_for(self._episode(e.sample, episode_client), self.timeout_s)
                except asyncio.TimeoutError as exc:  # (its cause: the cancellation, raised where the agent waited)
                    e.timed_out = True
                    e.error = f"timed out after {self.timeout_s:g} s (rollout.agent.timeout_s)"
                    e.place = agent_place(self.entrypoint, exc.__cause__)
                    return
                except Exception as exc:  # noqa: BLE001 (an episode's failure is scored, not raised)
                    stop = isinstance(exc, _EpisodeStop)  # (raised from the agent's own exception)
                    e.error = str(exc) if stop else f"{type(exc).__name__}: {exc}"
                    e.place = agent_place(self.entrypoint, (exc.__cause__ or exc.__context__) if stop else exc)
                    return
                e.reward, e.error = episode_reward(result)
                if e.error is not None:
                    e.place = agent_place(self.entrypoint)

        try:
            with LoopWatch(asyncio.get_running_loop(), self.timeout_s):
                await asyncio.gather(*[one(e) for e in episodes])
        finally:
            await client.close()

    def _assemble(self, prompt_ids, attention_mask, n: int, episodes: list[_Episode], calls: list[list[dict]]
                  ) -> MultiTurnOutput:
        stop_ids = set(getattr(self.rollout, "stop_ids", None) or [self.tokenizer.eos_token_id])
        prompts, responses, masks, texts, breaks, versions = [], [], [], [], [], []
        versioned = any("token_versions" in call for c in calls for call in c)  # partial rollouts
        for row, (e, c) in enumerate(zip(episodes, calls)):
            if not c:  # a failed episode without a call: the row's prompt, an empty reply
                b = row // n
                prompts.append(prompt_ids[b][attention_mask[b].bool()].tolist())
                responses.append(([], []))
                masks.append([])
                versions.append([])
                texts.append("")
                breaks.append(0)
                continue
            prompt, ids, logp, trained, version = list(c[0]["prompt_token_ids"]), [], [], [], []
            breaks.append(0)
            for call in c:
                context = prompt + ids
                p = list(call["prompt_token_ids"])
                if (p[:len(context)] != context and ids and trained[-1] and ids[-1] in stop_ids
                        and p[:len(context) - 1] == context[:-1]):
                    # the reply's end-of-turn token is not in the next prompt (a template that renders the turn's
                    # end otherwise): dropped, untrained, so that what follows sees exactly what the sampler saw
                    ids, logp, trained, version = ids[:-1], logp[:-1], trained[:-1], version[:-1]
                    context = context[:-1]
                if p[:len(context)] != context:  # the agent rewrote its history: start afresh from this call
                    if call is not c[0]:
                        breaks[-1] += 1
                    prompt, ids, logp, trained, version = p, [], [], [], []
                    context = p
                extra = p[len(context):]
                ids += extra + call["token_ids"]
                logp += [0.0] * len(extra) + call["log_probs"]
                trained += [0] * len(extra) + [1] * len(call["token_ids"])
                if versioned:  # what the prompt added was run by the weights of the reply after it
                    own = call.get("token_versions") or [call.get("policy_version") or 0] * len(call["token_ids"])
                    before = own[0] if own else (version[-1] if version else 0)  # (an empty reply: the last)
                    version += [before] * len(extra) + list(own)
            cut = self.max_response_tokens
            prompts.append(prompt)
            responses.append((ids[:cut], logp[:cut]))
            masks.append(trained[:cut])
            versions.append(version[:cut])
            texts.append(c[-1]["text"])
        width = max(map(len, prompts))
        p_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        p_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            p_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            p_mask[r, width - len(p):] = 1
        # one "prompt" per row (an episode's own first prompt): n=1 over the rows
        base = assemble_output(p_ids, p_mask, 1, [(torch.tensor(i, dtype=torch.long),
                                                    torch.tensor(lp, dtype=torch.float32)) for i, lp in responses],
                               texts, self.pad_id)
        model_mask = torch.zeros_like(base.response_mask)
        for r, m in enumerate(masks):
            model_mask[r, :len(m)] = torch.tensor(m, dtype=torch.long)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(RolloutOutput)}
        fields["prompt_index"] = torch.arange(len(episodes)) // n  # the row each episode came from
        failed = [e.failure() is not None for e in episodes]
        by_agent = any(e.reward is not None for e in episodes)  # (then every other one failed: `_judge`)
        scores = [self.failure_reward if f else e.reward for e, f in zip(episodes, failed)]
        counts = {"errors": [int(e.error is not None and not e.timed_out) for e in episodes],
                  "timeouts": [int(e.timed_out) for e in episodes], "prefix_breaks": breaks,
                  "calls": [len(c) for c in calls],
                  # (replies that looked like a tool call but did not parse: `serving.tool_calls`)
                  "tool_parse_failures": [sum(bool(call.get("tool_parse_failed")) for call in c) for c in calls]}
        if versioned:  # (N, R): each token's policy version, -1 on padding (as a partial rollout's token_version)
            fields["token_version"] = torch.full_like(base.response_ids, -1)
            for r, v in enumerate(versions):
                fields["token_version"][r, :len(v)] = torch.tensor(v, dtype=torch.long)
        return AgentOutput(**{**fields, "response_mask": model_mask}, response_attention_mask=base.response_mask,
                           interaction_scores=scores if by_agent else None,
                           fixed_scores=[] if by_agent else [self.failure_reward if f else None for f in failed],
                           counts=counts, errors=[e.failure() for e in episodes])
