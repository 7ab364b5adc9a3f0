"""Multi-turn rollout throughput: the agent loop (`shardrl.rollout.episodes.multiturn`) against single-turn generation
of the same prompts, on the same backend, in the same run.

Two workloads:
    synthetic (default)  a random-init model (Qwen2-0.5B-shaped with --shape 0.5b, tiny with --quick) over a
                         character tokenizer of printable ASCII: a random model writes ">" (the call marker
                         here) and EOS each about once in 90 tokens, so conversations have several turns of a
                         few dozen tokens. The tool echoes a short answer after --tool-latency-s seconds.
    real (--model DIR)   a model folder (e.g. outputs/smollm2/model) on the tools example's prompts (--data,
                         made by examples/tools/prepare.py) with its calculator interaction.

Per workload, after --warmups untimed runs of each (graph capture, compilation), one timed multi-turn run and one timed
single-turn run (rollout.max_new_tokens = --max-response-tokens, stops at EOS only). Prints JSON lines:
    multi_turn   conversations/s, model tokens/s (trained tokens), all tokens/s (with tool turns), mean turns,
                 tool calls and model tokens per conversation, seconds spent waiting on tools
    single_turn  responses/s, tokens/s, mean tokens per response
    compare      equal_token_conv_per_s = single-turn tokens/s / multi-turn model tokens per conversation
                 (what single-turn generation reaches on conversations of as many model tokens) and
                 multi_over_single = multi-turn conversations/s over it: the agent loop's overhead (per-turn
                 re-prefill, the host round trip, the round's wait for its slowest tool); 1.0 is none

    python bench/multiturn.py --quick                                  # CPU smoke run, tiny model
    python bench/multiturn.py --backend fast --shape 0.5b --prompts 256 --n 4 [--tool-latency-s 0.2] [--overlap-tools]
    python bench/multiturn.py --backend fast --model outputs/smollm2/model --data outputs/tools/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import threading
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardrl.rollout import SamplingParams, build_rollout  # noqa: E402
from shardrl.rollout.episodes.multiturn import Interaction, MultiTurnRollout, load_interaction  # noqa: E402
from shardrl.tokenizer import build_char_tokenizer  # noqa: E402
from shardrl.tools import ToolCall  # noqa: E402

SHAPES = {
    "0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
}
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


class EchoInteraction(Interaction):
    """Takes every turn that ends in ">" for a call, and answers it with a short text after `latency_s`, or
    with `spread`, after a time drawn uniformly from latency_s * [1 - spread, 1 + spread] (seeded)."""

    tools = []

    def __init__(self, latency_s: float, spread: float = 0.0):
        self.latency_s, self.spread = latency_s, spread
        self.rng, self.lock = random.Random(0), threading.Lock()

    def parse_call(self, text):
        return ToolCall(name="echo")

    def step(self, state, call):
        with self.lock:
            u = self.rng.uniform(-1.0, 1.0)
        time.sleep(self.latency_s * (1.0 + self.spread * u))
        return "ok"


class TimedInteraction:
    """Wraps an interaction's `step` to add up the seconds spent in tools (over all threads)."""

    def __init__(self, inner):
        self.inner, self.tool_s = inner, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, state, call):
        t0 = time.perf_counter()
        try:
            return self.inner.step(state, call)
        finally:
            self.tool_s += time.perf_counter() - t0


def synthetic(args, device, dtype):
    tok = build_char_tokenizer(ALPHABET)
    kw = dict(SHAPES["tiny" if args.quick else args.shape], vocab_size=len(tok), pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = ["".join(ALPHABET[i] for i in torch.randint(0, 62, (args.prompt_len,), generator=gen).tolist())
               for _ in range(args.prompts)]
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    mt_kwargs = dict(call_start="", call_end=">", tool_turn_template=" <{output}> ")
    return tok, model, enc["input_ids"], enc["attention_mask"], EchoInteraction(args.tool_latency_s, args.tool_latency_spread), mt_kwargs


def real(args, device, dtype):
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    rows = [json.loads(line) for line in open(args.data)][: args.prompts]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    path, _, name = args.interaction.partition(":")
    return tok, model, enc["input_ids"], enc["attention_mask"], load_interaction(path, name or "Interaction"), {}


def profile_calls(rollout) -> list[dict]:
    """The rollout's `last_stats` after each of its generate calls (the fast rollout's; an empty dict where a tree or
    backend has none), appended to the returned list: where a multi-turn run's time went, summed by `summed`."""
    calls: list[dict] = []
    for name in ("generate", "generate_stream"):
        inner = getattr(rollout, name, None)
        if inner is None:
            continue

        def wrapped(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            out = _inner(*a, **kw)
            calls.append(dict(getattr(rollout, "last_stats", {}) or {}, call_s=time.perf_counter() - t0))
            return out

        setattr(rollout, name, wrapped)
    return calls


def profile_call(fn, device) -> None:
    """`fn` once under torch.profiler: the top operators by host time and by device time, as JSON lines."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total" if device.type == "cuda" else None):
        if key is None:
            continue
        top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:25]
        print(json.dumps({"profile": key, "top": [dict(name=e.key[:80], count=e.count,
                                                         ms=round(getattr(e, key, 0) / 1000, 2)) for e in top]}),
              flush=True)


def summed(calls: list[dict]) -> dict:
    """The calls' counts and seconds added up (slot occupancy: row steps over slot steps)."""
    keys = ("call_s", "decode_s", "admit_s", "host_s", "feed_wait_s", "decode_steps", "syncs", "row_steps",
            "slot_steps", "prefill_tokens", "cached_tokens", "cascade_steps", "compactions")
    total = {k: sum(c.get(k, 0) for c in calls) for k in keys if any(k in c for c in calls)}
    total = {k: round(v, 3) if isinstance(v, float) else v for k, v in total.items()}
    total["calls"] = len(calls)
    if total.get("slot_steps"):
        total["occupancy"] = round(total["row_steps"] / total["slot_steps"], 3)
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="fast", choices=["hf", "fast"])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--quick", action="store_true", help="tiny model, few prompts, CPU if no GPU: a smoke run")
    p.add_argument("--model", default=None, help="a model folder: the real workload")
    p.add_argument("--data", default="outputs/tools/train.jsonl")
    p.add_argument("--interaction", default="examples/tools/interaction.py:CalculatorInteraction")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per model turn")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-response-tokens", type=int, default=512)
    p.add_argument("--tool-latency-s", type=float, default=0.0, help="synthetic tool's answer time")
    p.add_argument("--tool-latency-spread", type=float, default=0.0,
                   help="synthetic tool: each call takes latency * U[1 - spread, 1 + spread] (0 to 1)")
    p.add_argument("--max-batch", type=int, default=None, help="fast backend: decode slots")
    p.add_argument("--warmups", type=int, default=2,
                   help="untimed runs before each timed one (each decode width compiles when first seen)")
    p.add_argument("--overlap-tools", action="store_true",
                   help="fast backend: tools run while the other conversations decode (multi_turn.overlap_tools)")
    p.add_argument("--num-tool-workers", type=int, default=16)
    p.add_argument("--profile", action="store_true",
                   help="also run the multi-turn call once under torch.profiler and print its top operators by "
                        "host and by device time (where the rollout's admissions go)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.prompt_len = min(args.prompts, 4), min(args.n, 2), min(args.prompt_len, 16)
        args.max_new_tokens, args.max_response_tokens = min(args.max_new_tokens, 32), min(args.max_response_tokens, 96)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok, model, ids, mask, interaction, mt_kwargs = (real if args.model else synthetic)(args, device, dtype)
    kwargs = {"max_batch": args.max_batch} if args.backend == "fast" and args.max_batch else {}
    rollout = build_rollout(args.backend, model.config, tok, device, dtype, **kwargs)
    rollout.load_weights(model.named_parameters())
    del model
    calls = profile_calls(rollout)
    timed = TimedInteraction(interaction)
    mt = MultiTurnRollout(rollout, tok, timed, max_turns=args.max_turns, max_response_tokens=args.max_response_tokens,
                          num_tool_workers=args.num_tool_workers, overlap_tools=args.overlap_tools, **mt_kwargs)
    ids, mask = ids.to(device), mask.to(device)
    base = dict(backend=args.backend, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                workload="real" if args.model else f"synthetic_{'tiny' if args.quick else args.shape}",
                prompts=args.prompts, n=args.n, conversations=args.prompts * args.n,
                overlap_tools=args.overlap_tools, num_tool_workers=args.num_tool_workers,
                tool_latency_s=args.tool_latency_s, tool_latency_spread=args.tool_latency_spread)

    def compile_s() -> float:  # torch.compile's seconds so far in this process (recompiles included)
        return torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0)

    def timed_run(fn):
        for w in range(args.warmups):  # graph capture, compilation (a width first seen compiles), allocator
            fn(seed=1 + 1000 * w)
        calls.clear()
        timed.tool_s = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize()
        c0, t0 = compile_s(), time.perf_counter()
        out = fn(seed=2)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timed.compile_s = compile_s() - c0  # what the warm-up left to compile: inside the timed seconds
        return out, time.perf_counter() - t0

    multi_sampling = lambda seed: SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed)
    out, multi_s = timed_run(lambda seed: mt.generate(ids, mask, multi_sampling(seed)))
    tool_s = timed.tool_s  # summed over the tool threads of the timed run
    multi_calls = summed(calls)
    if args.profile:
        profile_call(lambda: mt.generate(ids, mask, multi_sampling(3)), device)
    conv = len(out)
    model_tokens = float(out.response_mask.sum())
    all_tokens = float(out.response_attention_mask.sum())
    multi = dict(base, mode="multi_turn", seconds=round(multi_s, 3), conv_per_s=round(conv / multi_s, 2),
                 model_tokens_per_s=round(model_tokens / multi_s, 1), all_tokens_per_s=round(all_tokens / multi_s, 1),
                 mean_turns=round(sum(out.num_turns) / conv, 2), mean_tool_calls=round(sum(out.num_tool_calls) / conv, 2),
                 mean_model_tokens=round(model_tokens / conv, 1), mean_all_tokens=round(all_tokens / conv, 1),
                 tool_thread_s=round(tool_s, 3), compile_s=round(timed.compile_s, 3), rollout_calls=multi_calls)
    print(json.dumps(multi), flush=True)

    single_sampling = lambda seed: SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_response_tokens,
                                                  seed=seed)
    single_out, single_s = timed_run(lambda seed: rollout.generate(ids, mask, single_sampling(seed)))
    single_tokens = float(single_out.response_mask.sum())
    single = dict(base, mode="single_turn", seconds=round(single_s, 3), conv_per_s=round(conv / single_s, 2),
                  tokens_per_s=round(single_tokens / single_s, 1), mean_tokens=round(single_tokens / conv, 1),
                  compile_s=round(timed.compile_s, 3),
                  rollout_calls=summed(calls))
    print(json.dumps(single), flush=True)
    equal = (single_tokens / single_s) / max(model_tokens / conv, 1e-9)
    print(json.dumps(dict(base, mode="compare", equal_token_conv_per_s=round(equal, 2),
                          multi_over_single=round((conv / multi_s) / equal, 3))), flush=True)


if __name__ == "__main__":
    main()
