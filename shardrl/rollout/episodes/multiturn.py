"""Multi-turn rollouts with tools: the model acts, a tool answers, and only the model's tokens are trained.

`MultiTurnRollout` wraps any `Rollout` (hf or fast) and drives its `generate` in rounds:

    round k   every live conversation generates, from its whole context (prompt + all turns so far), until EOS,
              the tool-call end marker (a stop string), its per-turn limit (rollout.max_new_tokens) or what is
              left of its token budget (multi_turn.max_response_tokens)
    tools     the round's calls (parsed from each turn's text) run concurrently, in a thread pool (async tools on
              an event loop), each with a time limit
    append    each answer is rendered with `tool_turn_template` and tokenized once; its ids are appended to
              the conversation with loss mask 0; the next round starts. (A turn that ended with its end-of-turn
              token after a call already closed itself: the template's leading copy of that token is dropped.)

A conversation ends when a turn ends without a call (EOS, a user stop string, or its length limit), at the
turn limit (`max_turns` model turns: a call in the last turn is not run), or when the budget is spent.

KV cache: recomputed per turn. Each round is a fresh `generate` whose prefill re-reads the whole context;
a conversation waiting on a tool holds no slot (the fast engine's continuous batching fills the slots with
the round's other conversations). Prefill is far cheaper per token than decode, so this costs little until
contexts grow long; keeping the cache across turns is left for later. Tools run concurrently with each other
but, by default, not with generation: a round starts when the previous round's slowest tool has answered (its
time limit bounds the wait). With `overlap_tools` (fast backend) there are no rounds: one streaming generate
(`FastRollout.generate_stream`) hands each row back as it ends, its tool runs while the other rows decode, and
its next turn joins the batch at the engine's next host sync; the tokens then depend on tool timing.

Threads: `Interaction.start` and `reward` run on the caller's thread, `step` on the tool pool's threads, several
at once (each conversation's state is its own; the interaction object is shared).

Token-exact bookkeeping: a conversation's response is the exact ids the sampler produced (never re-tokenized
text) followed by the exact ids of the inserted tool turn, and so on. Per response token:

    response_ids       the ids, model and tool tokens interleaved                     (N, R)
    response_mask      1 on the model's tokens only (the loss mask), 0 on tool turns and padding
    response_attention_mask  1 on every real token (the model's and the tools')
    sampled_log_probs  the sampler's log-probs on the model's tokens, 0 elsewhere

so a turn's tokens are scored by the engine in the context the sampler saw. The loss covers the model's
tokens only; advantages step over the tool-turn holes (`shardrl.algos.advantages`).

An interaction is the user's Python file (like a reward file), defining a class (default `Interaction`):

    class Interaction(shardrl.rollout.episodes.multiturn.Interaction):
        tools = [CalculatorTool()]
        def start(self, sample): return {"truth": sample["extra"]["ground_truth"]}   # per-sample state
        def step(self, state, call): ...               # a ToolCall -> the tool's answer (default: run the tool)
        def reward(self, state, response_text): ...    # the final reward (else the reward function scores)
        def parse_call(self, text): ...                # optional: a turn's text -> ToolCall, for other formats
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from shardrl.rollout.base import (Rollout, RolloutOutput, SamplingParams, assemble_output,
                                   cut_responses)
from shardrl.rollout.episodes.base import AGENT_COUNTS, EpisodeRollout
from shardrl.tools import (BUILTIN_TOOLS, CALL_END, CALL_START, DaemonThreadPool, Tool, ToolCall, call_tool,
                           parse_tool_call, parse_tool_calls, run_tool_calls)
from shardrl.config.userfile import import_user_file

CHATML_TOOL_TURN = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
"""Qwen2.5 / Hermes ChatML: close the assistant's turn (it stopped at the call's end marker, before its
end-of-turn token), the tool's answer as a user turn, then the next assistant turn's header."""


class Interaction:
    """Per-sample state, tools and final reward of a multi-turn rollout (subclass it in a user file)."""

    tools: list[Tool] = []

    def start(self, sample: dict) -> Any:
        """The state of one conversation; `sample` has data_source, extra (the row's other fields) and prompt_index."""
        return None

    def step(self, state: Any, call: ToolCall) -> str:
        """The answer to a well-formed `call` (a str; may be a coroutine). Default: run the tool named `call.name`."""
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            return f"error: no tool named {call.name!r}; the tools are {[t.name for t in self.tools]}"
        return call_tool(tool, call.arguments)

    def reward(self, state: Any, response_text: str) -> float | None:
        """The conversation's final reward from its state and final turn's text. Not overridden: the reward
        function scores the final turn's text."""
        return None


class BuiltinToolsInteraction(Interaction):
    """The interaction of `multi_turn.tools` without a user file: the named built-in tools, no state or reward."""

    def __init__(self, names: Iterable[str]):
        self.tools = [BUILTIN_TOOLS[name]() for name in names]


def load_interaction(path: str, name: str = "Interaction") -> Interaction:
    """The interaction `name` (a class or a function taking no arguments) of the user's Python file `path`."""
    if not os.path.isfile(path):
        raise ValueError(f"interaction file not found: {path!r} (rollout.multi_turn.interaction_path)")
    module = import_user_file(path, "interaction file", "shardrl_user_interaction_")
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ValueError(f"interaction file {path!r} defines no class or function {name!r} "
                         "(rollout.multi_turn.interaction_name)")
    if factory is Interaction:  # imported into the file, not defined there
        raise ValueError(f"{name!r} in {path!r} is shardrl's base class Interaction; set "
                         "rollout.multi_turn.interaction_name to the name of your subclass")
    interaction = factory()
    missing = [m for m in ("start", "step", "reward") if not callable(getattr(interaction, m, None))]
    if missing:
        raise ValueError(f"{name} in {path!r} gives an object without {missing}; subclass "
                         "shardrl.rollout.episodes.multiturn.Interaction")
    return interaction


@dataclass
class MultiTurnOutput(RolloutOutput):
    """A `RolloutOutput` whose responses hold tool turns: `response_mask` is the model's tokens (the loss mask),
    `response_attention_mask` every real token."""

    response_attention_mask: torch.Tensor | None = None  # (N, R)
    num_turns: list[int] = field(default_factory=list)  # model turns per conversation
    num_tool_calls: list[int] = field(default_factory=list)
    num_tool_errors: list[int] = field(default_factory=list)  # malformed calls, unknown tools, tool errors, timeouts
    interaction_scores: list[float | None] | None = None  # the interaction's final rewards, if it gives them

    def to_batch(self):
        batch = self.episode_batch()
        batch["num_turns"] = torch.tensor(self.num_turns, dtype=torch.float32)  # (N,)
        batch["num_tool_calls"] = torch.tensor(self.num_tool_calls, dtype=torch.float32)
        batch["num_tool_errors"] = torch.tensor(self.num_tool_errors, dtype=torch.float32)
        return batch

    def episode_batch(self):
        """The batch without the tool counts (an agent's output counts its own, `AgentOutput`)."""
        batch = super().to_batch()
        attention = self.response_attention_mask.to(self.prompt_mask.dtype)
        batch["attention_mask"] = torch.cat([self.prompt_mask, attention], dim=1)  # (N, P+R) tool tokens too
        if self.interaction_scores is not None:
            batch["interaction_score"] = list(self.interaction_scores)
        return batch


@dataclass
class _Conversation:
    prompt: list[int]
    state: Any
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 0
    num_calls: int = 0
    num_errors: int = 0
    last_text: str = ""
    closed_turn: str = ""  # the end-of-turn token's text when the latest model turn ended with one
    done: bool = False


class MultiTurnRollout(EpisodeRollout):
    """The agent loop over `rollout` (see the module docstring). `generate` takes `samples` (B dicts with
    data_source and extra) for the interaction's `start`; weights and memory calls go to `rollout`."""

    def __init__(self, rollout: Rollout, tokenizer, interaction: Interaction, max_turns: int = 4,
                 max_response_tokens: int = 512, tool_timeout_s: float = 10.0, max_tool_output_chars: int = 2000,
                 tool_turn_template: str = CHATML_TOOL_TURN, call_start: str = CALL_START, call_end: str = CALL_END,
                 num_tool_workers: int = 16, overlap_tools: bool = False, max_calls_per_turn: int = 1,
                 tool_answer_separator: str = "\n</tool_response>\n<tool_response>\n",
                 reward_text: str = "last_turn", tool_output_truncate_side: str = "left"):
        if max_turns < 0 or max_response_tokens < 1 or tool_timeout_s <= 0 or num_tool_workers < 1:
            raise ValueError("max_turns must be >= 0, max_response_tokens and num_tool_workers >= 1, "
                             "tool_timeout_s > 0")
        if max_turns == 0:  # no turn limit: a turn takes a token at least, so the budget bounds them
            max_turns = max_response_tokens
        if "{output}" not in tool_turn_template:
            raise ValueError(f"tool_turn_template {tool_turn_template!r} has no {{output}} placeholder")
        super().__init__(rollout, tokenizer)
        self.interaction = interaction
        self.max_turns, self.max_response_tokens = max_turns, max_response_tokens
        self.tool_timeout_s, self.max_tool_output_chars = tool_timeout_s, max_tool_output_chars
        self.tool_turn_template, self.call_start, self.call_end = tool_turn_template, call_start, call_end
        if overlap_tools and not hasattr(rollout, "generate_stream"):
            raise ValueError(f"multi_turn.overlap_tools needs a backend that takes rows while it decodes "
                             f"(rollout.backend=fast); {type(rollout).__name__} does not")
        self.overlap_tools = overlap_tools
        if max_calls_per_turn < 1 or (max_calls_per_turn > 1 and overlap_tools):
            raise ValueError("max_calls_per_turn must be >= 1, and 1 with overlap_tools")
        if reward_text not in ("last_turn", "conversation"):
            raise ValueError(f"reward_text must be 'last_turn' or 'conversation', got {reward_text!r}")
        self.max_calls_per_turn, self.tool_answer_separator = max_calls_per_turn, tool_answer_separator
        self.reward_text = reward_text
        if tool_output_truncate_side not in ("left", "right", "middle"):
            raise ValueError("tool_output_truncate_side must be left, right or middle, got "
                             f"{tool_output_truncate_side!r}")
        self.tool_output_truncate_side = tool_output_truncate_side
        self.pool = DaemonThreadPool(num_tool_workers)  # a hung tool cannot keep the process from exiting

    @classmethod
    def from_config(cls, rollout: Rollout, tokenizer, mt_cfg,
                    interaction: Interaction | None = None) -> MultiTurnRollout:
        """From a `MultiTurnConfig` (rollout.multi_turn) and its interaction (`rollout.interactions.build_interaction`;
        None: the interaction file's, or the built-in tools')."""
        if interaction is None:
            interaction = (load_interaction(mt_cfg.interaction_path, mt_cfg.interaction_name)
                           if mt_cfg.interaction_path else BuiltinToolsInteraction(mt_cfg.tools))
        return cls(rollout, tokenizer, interaction, mt_cfg.max_turns, mt_cfg.max_response_tokens, mt_cfg.tool_timeout_s,
                   mt_cfg.max_tool_output_chars, mt_cfg.tool_turn_template, mt_cfg.call_start, mt_cfg.call_end,
                   mt_cfg.num_tool_workers, mt_cfg.overlap_tools, mt_cfg.max_calls_per_turn,
                   mt_cfg.tool_answer_separator, mt_cfg.reward_text, mt_cfg.tool_output_truncate_side)

    # ---- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingParams,
                 samples: list[dict] | None = None) -> MultiTurnOutput:
        samples = self.episode_samples(prompt_ids, attention_mask, samples)
        num_prompts, n = prompt_ids.shape[0], sampling.n
        convs = []
        for b in range(num_prompts):
            prompt = prompt_ids[b][attention_mask[b].bool()].tolist()
            sample = {"data_source": samples[b].get("data_source"), "extra": samples[b].get("extra"), "prompt_index": b}
            convs += [_Conversation(prompt, self.interaction.start(sample)) for _ in range(n)]  # row b*n+j
        # one call a turn: the turn stops at the call's end marker; several: it runs to its end of turn
        stop = list(dict.fromkeys([*sampling.stop, self.call_end])) if self.max_calls_per_turn == 1 else list(
            sampling.stop)
        if self.overlap_tools:
            self._generate_overlapped(convs, sampling, stop, self._slots(convs, n))
            return self._assemble(prompt_ids, attention_mask, n, convs)
        for turn in range(self.max_turns):
            live = [c for c in convs if not c.done]
            if not live:
                break
            budgets = [self._turn_budget(c, sampling) for c in live]
            seed = None if sampling.seed is None else sampling.seed + 7919 * turn
            round_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets), stop=stop, seed=seed)
            out = self.rollout.generate(*self._contexts(live, prompt_ids.device), round_sampling,
                                        **self._slots(convs, n))
            calls = self._append_model_turns(live, out, budgets, stop, last_turn=turn == self.max_turns - 1)
            self._append_tool_turns(calls)
        return self._assemble(prompt_ids, attention_mask, n, convs)

    def _slots(self, convs: list[_Conversation], n: int) -> dict:
        """The fast backend's decode slots for a round (or the stream): as many as a single-turn call of these
        prompts' n samples gets (min(rows, micro_batch_size * n)), not as for rows of n = 1, which would decode
        the conversations micro_batch_size at a time."""
        if not hasattr(self.rollout, "generate_stream"):
            return {}
        return {"num_slots": min(len(convs), self.rollout.micro_batch_size * n)}

    def _turn_budget(self, c: _Conversation, sampling: SamplingParams) -> int:
        """Tokens `c`'s next model turn may take: the per-turn limit, or what is left of the response budget."""
        return min(sampling.max_new_tokens, self.max_response_tokens - len(c.ids))

    def _contexts(self, live: list[_Conversation], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The live conversations' full contexts, left-padded: (L, W) ids and mask."""
        width = max(len(c.prompt) + len(c.ids) for c in live)
        ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(live), width, dtype=torch.long)
        for i, c in enumerate(live):
            context = c.prompt + c.ids
            ids[i, width - len(context):] = torch.tensor(context)
            mask[i, width - len(context):] = 1
        return ids.to(device), mask.to(device)

    def _append_model_turns(self, live, out: RolloutOutput, budgets, stop, last_turn: bool) -> list[tuple]:
        """Appends each live conversation's new turn; returns the (conversation, ToolCall) pairs to answer."""
        calls = []
        keeps = out.response_mask.bool().cpu()  # (one transfer each, not one per conversation)
        response_ids, log_probs = out.response_ids.cpu(), out.sampled_log_probs.cpu()
        for i, c in enumerate(live):
            ids = response_ids[i][keeps[i]].tolist()[: budgets[i]]
            logp = log_probs[i][keeps[i]].tolist()[: budgets[i]]
            turn_calls = self._take_model_turn(c, ids, logp, out.response_text[i], stop, last_turn)
            if turn_calls:
                calls.append((c, turn_calls))
        return calls

    def _take_model_turn(self, c: _Conversation, ids: list[int], logp: list[float], text: str, stop: list[str],
                         last_turn: bool) -> list[ToolCall]:
        """Appends one model turn (its exact ids, the sampler's log-probs) to `c`; the tool calls to answer (at
        most max_calls_per_turn), none when the conversation is done."""
        stop_ids = set(getattr(self.rollout, "stop_ids", None) or [self.tokenizer.eos_token_id])
        c.ids += ids
        c.model_mask += [1] * len(ids)
        c.log_probs += logp
        c.num_turns += 1
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        c.last_text = text
        # a call: the turn stopped at the end marker, or (a tokenizer whose marker is a special token, which
        # stop strings do not see) ended its turn right after a call; a user stop string ends the conversation
        ended_by_eos = bool(ids) and ids[-1] in stop_ids
        c.closed_turn = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended_by_eos else ""
        is_call = self.call_end in raw and not any(s in raw for s in stop if s != self.call_end)
        room = self.max_response_tokens - len(c.ids)
        if not is_call or last_turn or room <= 0:
            c.done = True
            return []
        parse = getattr(self.interaction, "parse_call", None)
        if parse is not None:
            calls = [parse(raw)]
        elif self.max_calls_per_turn == 1:
            calls = [parse_tool_call(raw, self.call_start, self.call_end)]
        else:
            calls = parse_tool_calls(raw, self.call_start, self.call_end)[: self.max_calls_per_turn]
        c.num_calls += len(calls)
        return calls

    def _tool_job(self, c: _Conversation, call: ToolCall):
        if call.error is not None:
            return lambda: f"error: {call.error}"
        return lambda: self.interaction.step(c.state, call)

    def _append_tool_turns(self, calls: list[tuple[_Conversation, list[ToolCall]]]) -> None:
        """Runs every conversation's calls concurrently and appends each conversation's answers as one tool turn
        (loss mask 0)."""
        jobs = [self._tool_job(c, call) for c, turn_calls in calls for call in turn_calls]
        answers = iter(run_tool_calls(jobs, self.tool_timeout_s, self.pool))
        for c, turn_calls in calls:
            self._append_tool_turn(c, turn_calls, [next(answers) for _ in turn_calls])

    def _append_tool_turn(self, c: _Conversation, calls: list[ToolCall], answers: list[str]) -> None:
        """Appends the answers to a turn's tool calls as one tool turn (loss mask 0), or ends `c` when it would not
        leave the model room to read it and answer."""
        cut = []
        for call, answer in zip(calls, answers):
            if call.error is not None or answer.startswith("error:"):
                c.num_errors += 1
            cut.append(cut_tool_answer(answer, self.max_tool_output_chars, self.tool_output_truncate_side))
        answer = self.tool_answer_separator.join(cut)
        template = self.tool_turn_template
        if c.closed_turn and template.startswith(c.closed_turn):  # the model closed its turn itself
            template = template[len(c.closed_turn):]
        ids = self.tokenizer.encode(template.replace("{output}", answer), add_special_tokens=False)
        if len(c.ids) + len(ids) >= self.max_response_tokens:  # no room left for the model to read it and answer
            c.done = True
            return
        c.ids += ids
        c.model_mask += [0] * len(ids)
        c.log_probs += [0.0] * len(ids)

    def _generate_overlapped(self, convs: list[_Conversation], sampling: SamplingParams, stop: list[str],
                             slots: dict) -> None:
        """The agent loop with tools off the decoding's critical path (multi_turn.overlap_tools): one streaming
        generate over all conversations. A conversation's turn is handled the moment its row ends; its tool
        runs on a dispatcher thread while the other rows decode, and its next turn joins the running batch when
        the answer is in (the fast engine takes new rows at each host sync)."""
        inbox: queue.Queue = queue.Queue()  # conversations back from their tools
        row_conv: list[_Conversation] = []
        waiting = [0]  # conversations whose tool is running (the engine thread's count)
        round_sampling = dataclasses.replace(sampling, n=1, stop=stop)
        stop_ids = list(getattr(self.rollout, "stop_ids", None) or [self.tokenizer.eos_token_id])
        device = getattr(self.rollout, "device", "cpu")

        def row_of(c: _Conversation) -> tuple[torch.Tensor, int]:
            row_conv.append(c)
            return torch.tensor(c.prompt + c.ids, dtype=torch.long), self._turn_budget(c, sampling)

        def dispatch(c: _Conversation, call: ToolCall) -> None:  # on its own thread; `c` is not touched here
            try:
                inbox.put((c, call, run_tool_calls([self._tool_job(c, call)], self.tool_timeout_s, self.pool)[0]))
            except BaseException as e:  # noqa: BLE001 - the engine thread must hear back, whatever happened
                inbox.put((c, call, e))

        class Feed:
            def finished(self_, row: int, tokens: list[int], log_probs: torch.Tensor) -> None:
                c = row_conv[row]  # the engine kept the row within its turn budget
                lengths, texts = cut_responses(self.tokenizer, stop_ids, torch.tensor([tokens], dtype=torch.long), stop)
                ids = tokens[: lengths[0]]
                calls = self._take_model_turn(c, ids, log_probs[: len(ids)].tolist(), texts[0], stop,
                                              last_turn=c.num_turns + 1 >= self.max_turns)
                if calls:  # one (overlap_tools keeps max_calls_per_turn at 1)
                    waiting[0] += 1
                    threading.Thread(target=dispatch, args=(c, calls[0]), daemon=True,
                                     name="shardrl-tool-dispatch").start()

            def take(self_, block: bool) -> list[tuple[torch.Tensor, int]]:
                # every answer is appended here, on the engine's thread (the tokenizer is used from one thread)
                rows = []
                while waiting[0]:
                    try:
                        c, call, answer = inbox.get(block=block and not rows)
                    except queue.Empty:
                        break
                    waiting[0] -= 1
                    if isinstance(answer, BaseException):
                        raise RuntimeError(f"running a tool call failed: {answer!r}") from answer
                    self._append_tool_turn(c, [call], [answer])
                    if not c.done:
                        rows.append(row_of(c))
                return rows

        first = [row_of(c) for c in convs]
        need_seq = max(len(c.prompt) for c in convs) + self.max_response_tokens + 1
        self.rollout.generate_stream([p.to(device) for p, _ in first], [lim for _, lim in first], round_sampling,
                                     Feed(), need_seq, **slots)

    def _assemble(self, prompt_ids, attention_mask, n: int, convs: list[_Conversation]) -> MultiTurnOutput:
        responses = [(torch.tensor(c.ids, dtype=torch.long), torch.tensor(c.log_probs, dtype=torch.float32))
                     for c in convs]
        if self.reward_text == "conversation":  # what the reward reads: every turn after the prompt, as verl does
            for c in convs:
                c.last_text = self.tokenizer.decode(c.ids, skip_special_tokens=True)
        base = assemble_output(prompt_ids, attention_mask, n, responses, [c.last_text for c in convs], self.pad_id)
        width = base.response_ids.shape[1]
        model_mask = torch.zeros(len(convs), width, dtype=torch.long)  # (N, R)
        for r, c in enumerate(convs):
            model_mask[r, : len(c.model_mask)] = torch.tensor(c.model_mask, dtype=torch.long)
        scores = None
        if interaction_gives_rewards(self.interaction):
            scores = [self.interaction.reward(c.state, c.last_text) for c in convs]
            scores = [None if s is None else float(s) for s in scores]
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(RolloutOutput)}
        return MultiTurnOutput(**{**fields, "response_mask": model_mask.to(base.response_mask.device)},
                               response_attention_mask=base.response_mask,
                               num_turns=[c.num_turns for c in convs], num_tool_calls=[c.num_calls for c in convs],
                               num_tool_errors=[c.num_errors for c in convs],
                               interaction_scores=scores)


def cut_tool_answer(answer: str, limit: int, side: str = "left") -> str:
    """`answer` cut to `limit` characters as verl cuts a tool's response: "left" keeps its start, "right" its end,
    "middle" half of each."""
    if len(answer) <= limit:
        return answer
    if side == "left":
        return answer[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + answer[-limit:]
    half = limit // 2
    return answer[:half] + "...(truncated)..." + answer[len(answer) - half:]


def interaction_gives_rewards(interaction: Interaction) -> bool:
    """Whether `interaction` scores conversations itself (its class overrides `Interaction.reward`). Decided by
    the class, not by the values, so that every rank takes the same scoring path (the reward function's
    bookkeeping is collective)."""
    return getattr(type(interaction), "reward", None) is not Interaction.reward


def score_with_interaction(batch, score_fn) -> tuple[torch.Tensor, dict]:
    """The batch's scores and metrics: the interaction's final rewards when the batch has them
    ("interaction_score"; a None among them is an error), else `score_fn(batch)` -> (scores, metrics), the
    reward function's; plus the multi-turn metrics (this rank's means)."""
    if "interaction_score" in batch:
        given = batch["interaction_score"]
        if any(s is None for s in given):
            raise ValueError("the interaction's reward() returned None for a conversation; an interaction that "
                             "defines reward() must return a number for every one (or not define it, and let "
                             "the reward function score the final turn)")
        scores, metrics = torch.tensor(given, dtype=torch.float32), {}
    else:
        try:
            scores, metrics = score_fn(batch)
        except ValueError as e:
            if "agent_calls" not in batch:
                raise
            raise ValueError(f"the agent returned None from every episode of this step, so the reward function "
                             f"scores them, and it cannot: {e}. Return each episode's reward from the agent (a "
                             "number), or give a reward function (reward.function_path)") from e
    if "fixed_score" in batch:  # rows scored before the reward function (an agent episode that failed)
        for i, s in enumerate(batch["fixed_score"]):
            if s is not None:
                scores[i] = s
    for key in ("num_turns", "num_tool_calls", "num_tool_errors"):  # (multi-turn's; an agent's are below)
        if key in batch:
            metrics[f"multi_turn/{key}_mean"] = float(batch[key].mean()) if len(batch) else 0.0
    for key in AGENT_COUNTS:
        if f"agent_{key}" in batch:
            metrics[f"agent/{key}_mean"] = float(batch[f"agent_{key}"].mean()) if len(batch) else 0.0
    return scores, metrics
