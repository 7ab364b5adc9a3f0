"""Greedy accuracy of a model folder on a prompt file, scored as the trainer's validation scores it
(the same data loading, fast rollout, and built-in reward of each row's data_source). One JSON line.

    python examples/smollm2/evaluate.py outputs/smollm2/model outputs/smollm2/val.jsonl --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time


class HeldOut:
    """Greedy accuracy on a prompt file of any weights of one model shape, by the fast rollout built once (its
    CUDA graphs too): what `evaluate` measures, called again as training goes (bench/learn.py)."""

    def __init__(self, hf_config, tokenizer, prompt_file: str, max_new_tokens: int = 128,
                 max_prompt_length: int = 128, limit: int | None = None, backend: str = "fast"):
        import torch

        from shardrl.data.prompts import collate_prompts, load_prompt_dataset
        from shardrl.rollout import build_rollout

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32  # as the trainer's rollout
        data = load_prompt_dataset([prompt_file], tokenizer, max_prompt_length=max_prompt_length,
                                   truncation="error")
        self.items = [data[i] for i in range(len(data) if limit is None else min(limit, len(data)))]
        self.prompts = collate_prompts(self.items, tokenizer.pad_token_id)
        self.max_new_tokens = max_new_tokens
        self.rollout = build_rollout(backend, hf_config, tokenizer, self.device, self.dtype)

    def __call__(self, weights) -> dict:
        """Accuracy and reply statistics of `weights` ((HF name, tensor) pairs of the whole model)."""
        import torch

        from shardrl.rewards.manager import RewardManager
        from shardrl.rollout import SamplingParams

        self.rollout.load_weights((n, w.to(self.dtype)) for n, w in weights)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.rollout.generate(self.prompts["input_ids"].to(self.device),
                                        self.prompts["attention_mask"].to(self.device),
                                        SamplingParams(n=1, greedy=True, max_new_tokens=self.max_new_tokens))
        gen_s = time.perf_counter() - t0
        scored = [{"data_source": it["data_source"], "response_text": text, "extra": it["extra"]}
                  for it, text in zip(self.items, out.response_text)]
        scores, _ = RewardManager().score(scored)
        lengths = out.response_mask.sum(1).float()
        n = len(self.items)
        return {"prompts": n, "accuracy": float(scores.mean()),
                "has_answer_marker": sum("####" in t for t in out.response_text) / n,
                "response_length_mean": float(lengths.mean()),
                "clipped": float((lengths >= self.max_new_tokens).float().mean()), "gen_s": round(gen_s, 2),
                "examples": out.response_text[:3]}


def evaluate(model_path: str, prompt_file: str, max_new_tokens: int = 128, max_prompt_length: int = 128,
             limit: int | None = None, backend: str = "fast") -> dict:
    import torch
    import transformers

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    held_out = HeldOut(model.config, tok, prompt_file, max_new_tokens, max_prompt_length, limit, backend)
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    del model
    return {"model": model_path, **held_out(weights)}


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
