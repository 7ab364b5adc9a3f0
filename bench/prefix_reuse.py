"""Prefix reuse in the fast rollout (issue 36): the paged cache with its prefix index against the rollout of another
tree (the code before it: a contiguous cache per slot, each prompt's K/V copied to its n slots, every turn prefilled
whole), in the same run, on the same GPU.

Cases (random-init weights, random prompt ids; the trees are imported in worker processes of their own):
    long_prompt  GRPO-shaped: --prompts prompts of --prompt-len tokens, n = --n samples each, --new-tokens new
                 tokens (sampled, seeded: both trees draw the same noise, but in bf16 kernels that sum in
                 another order can tip a close draw, after which that row's tokens part, so the digests need not
                 agree; the CUDA tests compare greedy tokens), all rows through --slots decode slots; new prompts
                 for every call
    next_turn    the same prompts once more, each extended by its first response and --extra-len more tokens
                 (a conversation's next turn): the new tree reads the cached context, the old prefills it again

Per tree and case: seconds (the median of --repeats timed calls after a warm-up call; the next turns' repeats
read the cache of the first, as a conversation's turns past the second would), new tokens/s, prompt tokens
prefilled and read from the cache, and a digest of the response ids. The compare line gives the speedups and
whether the digests agree. The multi-turn tools workload is `bench/multiturn.py`, run from each tree.

    python bench/prefix_reuse.py --quick                                  # CPU smoke run, tiny model
    git archive c3addb1 shardrl | tar -x -C /tmp/old                      # the tree before the paged cache
    python bench/prefix_reuse.py --trees new=.,old=/tmp/old --shape 1.5b --prompts 32 --n 8 --prompt-len 2048
    python bench/prefix_reuse.py --trees new=.,flat=.@cascade=0,ps8=.@prefix_splits=8,old=/tmp/old   # variants

A tree may carry FastRollout keyword arguments after `@` (`k=v+k2=v2`, integers; those the tree's FastRollout does
not take are left out), e.g. the new tree without its shared-prefix decode (`cascade=0`). Every tree is compared
with the last one.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    # Qwen2.5-1.5B's shape
    "1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                 tie_word_embeddings=True),
    # Qwen2.5-7B's shape
    "7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
               tie_word_embeddings=False),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True),
}


class IdTokenizer:
    """The little of a tokenizer the fast rollout reads: ids only (no text; nothing is decoded but the digests)."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eos_token_id, self.pad_token_id = vocab_size, vocab_size - 1, vocab_size - 2
        self.bos_token_id, self.chat_template = None, None

    def __len__(self) -> int:
        return self.vocab_size

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))

    def batch_decode(self, rows, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(r) for r in rows]


def worker(args) -> None:
    """One tree's measurements (run in a process whose shardrl is that tree's)."""
    import torch
    import transformers

    from shardrl.rollout import FastRollout, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape])
    config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)
    tok = IdTokenizer(config.vocab_size)
    kwargs = dict(max_batch=args.slots, max_seq_len=args.prompt_len * 2 + args.new_tokens * 2 + args.extra_len + 64)
    params = inspect.signature(FastRollout.__init__).parameters
    if "block_size" in params:
        kwargs["block_size"] = args.block_size
    for item in filter(None, args.extra.split("+")):
        key, value = item.split("=", 1)
        if key in params:
            kwargs[key] = int(value)
    rollout = FastRollout(config, tok, device, dtype, **kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random weights; a wide init keeps the sampled text varied
        for p in rollout.model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    # new prompts for every call (as every RL step's): no call reads another's prompts from the cache
    calls = [torch.randint(0, config.vocab_size - 2, (args.prompts, args.prompt_len), generator=gen)
             for _ in range(args.repeats + 1)]
    prompts, mask = calls[-1], torch.ones_like(calls[-1])
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(inputs, am, params):
        times, out = [], None
        for i, ids in enumerate(inputs):  # the first: warm-up (capture, compile)
            sync()
            t0 = time.perf_counter()
            out = rollout.generate(ids.to(device), am.to(device), params)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        stats = dict(rollout.last_stats)
        digest = hashlib.sha256(out.response_ids.cpu().numpy().tobytes()).hexdigest()[:16]
        new = int(out.response_mask.sum())
        s = statistics.median(times)
        timing = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()
                  if k in ("decode_s", "admit_s", "host_s", "decode_steps", "syncs", "cascade_steps")}
        return out, dict(seconds=s, new_tokens=new, new_tokens_per_s=new / s, digest=digest,
                         prefill_tokens=stats.get("prefill_tokens"), cached_tokens=stats.get("cached_tokens", 0),
                         last_call=timing)

    first, long_prompt = timed(calls, mask, sampling)
    print(json.dumps({"tree": args.tree, "case": "long_prompt", **long_prompt}), flush=True)
    if args.profile and device == "cuda":  # one more long-prompt call, its kernels by device time
        from torch.profiler import ProfilerActivity, profile

        fresh = torch.randint(0, config.vocab_size - 2, (args.prompts, args.prompt_len), generator=gen)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rollout.generate(fresh.to(device), mask.to(device), sampling)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events)
        top = [dict(kernel=e.key[:90], calls=e.count, ms=round(e.self_device_time_total / 1e3, 2),
                    share=round(e.self_device_time_total / max(total, 1), 4)) for e in events[:25]]
        print(json.dumps({"tree": args.tree, "case": "long_prompt_profile", "device_ms": round(total / 1e3, 1),
                          "top": top}), flush=True)
    # next turns: each row's prompt and response, then extra tokens (the new tree's index holds the contexts of the
    # last call above)
    rows = []
    for r in range(len(first)):
        resp = first.response_ids[r][first.response_mask[r].bool()].cpu()
        extra = torch.randint(0, config.vocab_size - 2, (args.extra_len,), generator=gen)
        rows.append(torch.cat([prompts[r // args.n], resp, extra]))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], am[r, width - len(row):] = row, 1
    next_sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens, seed=2)
    _, next_turn = timed([ids] * (args.repeats + 1), am, next_sampling)
    print(json.dumps({"tree": args.tree, "case": "next_turn", **next_turn}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", default="new=.", help="name=path,...: the shardrl trees to compare")
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--extra-len", type=int, default=64)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, short prompts, CPU: a smoke run")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--profile", action="store_true", help="one more long-prompt call profiled (CUDA)")
    parser.add_argument("--extra", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default="new", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.shape, args.prompts, args.n, args.prompt_len, args.new_tokens = "tiny", 4, 4, 96, 16
        args.extra_len, args.slots, args.block_size, args.repeats = 8, 8, 16, 1
    if args.worker:
        worker(args)
        return
    lines = []
    for name, spec in (t.split("=", 1) for t in args.trees.split(",")):
        path, _, extra = spec.partition("@")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("trees", "quick", "out", "worker", "tree", "extra", "profile") and v is not None]
        flags += ["--profile"] if args.profile else []
        flags.append(f"--extra={extra}")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--tree={name}", *flags]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode:
            print(f"{name}: failed\n{run.stderr[-3000:]}", file=sys.stderr)
            continue
        lines += [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    by = {(x["tree"], x["case"]): x for x in lines}
    names = list(dict.fromkeys(x["tree"] for x in lines))
    for case in ("long_prompt", "next_turn"):
        for name in names[:-1]:
            if (name, case) in by and (names[-1], case) in by:
                new, old = by[(name, case)], by[(names[-1], case)]
                lines.append({"compare": case, f"{name}_over_{names[-1]}": old["seconds"] / new["seconds"],
                              "same_tokens": new["digest"] == old["digest"]})
    for line in lines:
        print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps({"bench": "prefix_reuse", **line}) + "\n")


if __name__ == "__main__":
    main()
