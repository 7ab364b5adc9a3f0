"""Greedy accuracy of a model folder on a prompt file, scored as the trainer's validation scores it
(the same data loading, fast rollout, and built-in reward of each row's data_source). One JSON line.

    python examples/smollm2/evaluate.py outputs/smollm2/model outputs/smollm2/val.jsonl --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time


def evaluate(model_path: str, prompt_file: str, max_new_tokens: int = 128, max_prompt_length: int = 128,
             limit: int | None = None, backend: str = "fast") -> dict:
    import torch
    import transformers

    from shardrl.data.prompts import collate_prompts, load_prompt_dataset
    from shardrl.rewards.manager import RewardManager
    from shardrl.rollout import SamplingParams, build_rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as the trainer's rollout
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    data = load_prompt_dataset([prompt_file], tok, max_prompt_length=max_prompt_length, truncation="error")
    items = [data[i] for i in range(len(data) if limit is None else min(limit, len(data)))]
    rollout = build_rollout(backend, model.config, tok, device, dtype)
    rollout.load_weights((n, p.detach()) for n, p in model.named_parameters())
    del model
    prompts = collate_prompts(items, tok.pad_token_id)
    t0 = time.perf_counter()
    out = rollout.generate(prompts["input_ids"].to(device), prompts["attention_mask"].to(device),
                           SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
    gen_s = time.perf_counter() - t0
    scored = [{"data_source": it["data_source"], "response_text": text, "extra": it["extra"]}
              for it, text in zip(items, out.response_text)]
    scores, _ = RewardManager().score(scored)
    lengths = out.response_mask.sum(1).float()
    return {"model": model_path, "prompts": len(items), "accuracy": float(scores.mean()),
            "has_answer_marker": sum("####" in t for t in out.response_text) / len(items),
            "response_length_mean": float(lengths.mean()),
            "clipped": float((lengths >= max_new_tokens).float().mean()), "gen_s": round(gen_s, 2),
            "examples": out.response_text[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-length", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--backend", default="fast", choices=["fast", "hf"])
    args = parser.parse_args()
    print(json.dumps(evaluate(args.model, args.prompts, args.max_new_tokens, args.max_prompt_length, args.limit,
                              args.backend)))


if __name__ == "__main__":
    main()
