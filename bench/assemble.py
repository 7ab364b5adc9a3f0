"""The end of a fast-rollout generation on the host: the uncut rows made one padded tensor, cut at their first EOS
and decoded (`DecodeLoop._assemble`, `cut_responses`), at var_512's size (512 rows of 64-1023 tokens, a third
ending at EOS) with bench/e2e.py's word-level tokenizer over Qwen2's 151,936 ids. The GPU waits while this runs,
once per generation. Prints (and appends to --out) one JSON line; run it in another tree for a baseline:

    python bench/assemble.py
    (cd /tmp/old_tree && PYTHONPATH=. python /path/to/bench/assemble.py --out /tmp/a.jsonl)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree run in (a baseline's, for the same-run comparison)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.e2e's tokenizer


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from bench.e2e import build_tokenizer
    from shardrl.rollout.fast.loop import DecodeLoop

    tok = build_tokenizer(151936)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, args.max_len, (args.rows,), generator=g).tolist()
    rows = [(torch.randint(4, 151936, (n,), generator=g).tolist(), torch.zeros(n)) for n in lengths]
    for tokens, _ in rows[::3]:
        tokens[-1] = tok.eos_token_id
    loop = DecodeLoop()  # (the host loop's state that `_assemble` reads)
    loop.tokenizer, loop.stop_ids, loop.pad_id, loop._top, loop.record_routing = tok, [tok.eos_token_id], \
        tok.pad_token_id, 0, False
    prompts = torch.ones(args.rows, 4, dtype=torch.long)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = loop._assemble(prompts, torch.ones_like(prompts), rows, 1, [])
        seconds.append(time.perf_counter() - start)
    record = dict(bench="assemble", tree=os.getcwd(), rows=args.rows, tokens=sum(lengths),
                  cut_tokens=int(out.response_mask.sum()), ms_median=round(1e3 * statistics.median(seconds), 1),
                  ms_min=round(1e3 * min(seconds), 1), cpus=os.cpu_count())
    print(json.dumps(record))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
