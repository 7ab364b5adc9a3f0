"""Preference pairs from a model's own samples on the word problems of examples/smollm2: each prompt sampled n
times, scored by the built-in "####" scorer; a prompt with a right and a wrong reply gives one pair (a right reply
chosen over a wrong one, finished replies first; `--pairs-per-prompt K`: up to K distinct such pairs). One JSONL row
per pair, TRL's conversational format:
{"prompt": [messages], "chosen": reply, "rejected": reply, "data_source", "ground_truth"}.

    python examples/preference/pairs.py outputs/smollm2/model outputs/smollm2/train.jsonl outputs/preference/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def make_pairs(model_path: str, prompt_file: str, n: int = 8, max_new_tokens: int = 128, temperature: float = 1.0,
               seed: int = 0, backend: str = "fast", limit: int | None = None,
               pairs_per_prompt: int = 1) -> tuple[list[dict], dict]:
    import torch
    import transformers

    from shardrl.data.prompts import collate_prompts, load_prompt_dataset, read_rows
    from shardrl.rewards.manager import RewardManager
    from shardrl.rollout import SamplingParams, build_rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    data = load_prompt_dataset([prompt_file], tok, max_prompt_length=256, truncation="error")
    rows = [row for _, row in read_rows(prompt_file)]
    rollout = build_rollout(backend if device == "cuda" else "hf", model.config, tok, device, dtype)
    rollout.load_weights((name, p.detach()) for name, p in model.named_parameters())
    del model
    items = [data[i] for i in range(len(data) if limit is None else min(limit, len(data)))]
    prompts = collate_prompts(items, tok.pad_token_id)
    t0 = time.perf_counter()
    out = rollout.generate(prompts["input_ids"].to(device), prompts["attention_mask"].to(device),
                           SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed))
    gen_s = time.perf_counter() - t0
    index = out.prompt_index.tolist()
    scores, _ = RewardManager().score([{"data_source": items[i]["data_source"], "response_text": text,
                                        "extra": items[i]["extra"]} for i, text in zip(index, out.response_text)])
    finished = (out.response_mask.sum(1) < max_new_tokens).tolist()
    by_prompt: dict[int, list[tuple[float, bool, str]]] = {}
    for i, score, done, text in zip(index, scores.tolist(), finished, out.response_text):
        if text.strip():  # an empty reply is no completion to train on
            by_prompt.setdefault(i, []).append((score, done, text))
    rng, pairs = random.Random(seed), []
    for i, samples in sorted(by_prompt.items()):
        right = [s for s in samples if s[0] >= 1.0]
        wrong = [s for s in samples if s[0] < 1.0]
        if not right or not wrong:
            continue
        row = rows[i]  # truncation="error": every row is an item, in order
        right = [s[2] for s in right if s[1]] or [s[2] for s in right]  # finished replies first
        wrong = [s[2] for s in wrong if s[1]] or [s[2] for s in wrong]
        combos = sorted({(r, w) for r in right for w in wrong})
        for chosen, rejected in rng.sample(combos, min(pairs_per_prompt, len(combos))):
            pairs.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected,
                          "data_source": row.get("data_source"), "ground_truth": row.get("ground_truth")})
    stats = {"prompts": len(items), "samples": len(index), "sample_accuracy": float(scores.mean()),
             "pairs": len(pairs), "rejected_with_marker": sum("####" in p["rejected"] for p in pairs) / max(1, len(pairs)),
             "gen_s": round(gen_s, 1)}
    return pairs, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="the first LIMIT prompts only")
    parser.add_argument("--pairs-per-prompt", type=int, default=1)
    args = parser.parse_args()
    pairs, stats = make_pairs(args.model, args.prompts, args.n, args.max_new_tokens, args.temperature, args.seed,
                              limit=args.limit, pairs_per_prompt=args.pairs_per_prompt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(json.dumps({"out": str(out), **stats}))


if __name__ == "__main__":
    main()
