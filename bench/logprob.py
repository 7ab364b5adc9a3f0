"""The training forward's output head: per-token log-probs of 16k tokens over a 152k vocabulary (the Qwen2-1.5B
head, bf16), forward and backward, with and without the entropy, on one GPU.

Rows (each the mean of 10 timed iterations after 3 warm-up ones, CUDA events):
- `logp`: log-probs only (`_ChunkLogProb`, the update's path when no entropy is asked for);
- `logp_entropy_metric`: log-probs and entropy, the entropy read as a metric only (no gradient into it):
  the update's path when old log-probs come from its own forward (`actor.recompute_old_log_probs=auto`);
- `logp_entropy_grad`: the same with an entropy bonus (a gradient into the entropy, `actor.entropy_coeff`);
- `checkpointed_eager` (the baseline, what both entropy rows ran before `_ChunkLogProbEntropy`): each chunk's
  eager fp32 log-softmax and entropy under activation checkpointing;
- `*_compiled`: the first three rows with the passes over the logits as compiled torch functions
  (`logprob.TRITON_HEAD = False`, the path before the Triton head kernels).

    python bench/logprob.py [--tokens 16384] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.profile_decode import cuda_ms  # noqa: E402
import shardrl.engine.logprob as logprob  # noqa: E402
from shardrl.engine.logprob import _chunk_logprob, chunked_log_probs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, chunk = args.tokens, args.chunk
    hidden = torch.randn(n, args.hidden, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, args.vocab, (n,), device="cuda", generator=g)
    w = torch.randn(n, device="cuda", generator=g)

    def baseline():
        lps, ents = [], []
        for s in range(0, n, chunk):
            lp, ent = checkpoint(_chunk_logprob, hidden[s:s + chunk], weight, None, targets[s:s + chunk], 1.0, True,
                                 None, use_reentrant=False)
            lps.append(lp)
            ents.append(ent)
        return torch.cat(lps), torch.cat(ents)

    rows = {
        "logp": lambda: (chunked_log_probs(hidden, weight, None, targets, 1.0, chunk)[0] * w).sum(),
        "logp_entropy_metric": lambda: (lambda r: (r[0] * w).sum() + r[1].detach().sum() * 0)(
            chunked_log_probs(hidden, weight, None, targets, 1.0, chunk, with_entropy=True)),
        "logp_entropy_grad": lambda: (lambda r: (r[0] * w).sum() + 0.01 * r[1].sum())(
            chunked_log_probs(hidden, weight, None, targets, 1.0, chunk, with_entropy=True)),
        "checkpointed_eager_metric": lambda: (lambda r: (r[0] * w).sum() + r[1].detach().sum() * 0)(baseline()),
        "checkpointed_eager_grad": lambda: (lambda r: (r[0] * w).sum() + 0.01 * r[1].sum())(baseline()),
    }
    for name in ("logp", "logp_entropy_metric", "logp_entropy_grad"):
        rows[f"{name}_compiled"] = rows[name]
    out = {}
    for name, loss in rows.items():
        def step():
            hidden.grad = weight.grad = None
            loss().backward()
        logprob.TRITON_HEAD = not name.endswith("_compiled")
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_ms(step, iters=10)
        out[name] = dict(bench="logprob", row=name, tokens=n, vocab=args.vocab, ms=round(ms, 2),
                         peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        print(json.dumps(out[name]), flush=True)
        append_jsonl(args.out, [out[name]])
    logprob.TRITON_HEAD = True
    for kind in ("metric", "grad"):
        print(f"entropy as {kind}: {out[f'checkpointed_eager_{kind}']['ms'] / out[f'logp_entropy_{kind}']['ms']:.2f}x "
              f"the checkpointed eager path; log-probs alone {out['logp']['ms']} ms")
        print(f"entropy as {kind}, Triton head against compiled torch: "
              f"{out[f'logp_entropy_{kind}_compiled']['ms'] / out[f'logp_entropy_{kind}']['ms']:.2f}x")


if __name__ == "__main__":
    main()
