"""The built-in demo of `shardrl train` (no config): GRPO teaches a tiny model single-digit addition.

Everything is made locally, no download: a character tokenizer, a tiny Qwen2-shaped model, and prompts
like "3+4=" whose reward is 1 when the response is "7". A supervised warm-up of only 30 small steps
teaches the answer format (a number, then EOS) and barely starts on the sums: the model begins at about
0.1 mean reward, and what it reaches after that is learned by RL. (Without it, from pure chance, GRPO on
this task collapses onto the most frequent sum, 9, for every prompt: a model that ignores the prompt
gets 0.1, and a group that always answers 9 has no variance left to learn from.)
"""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEMO_ASSETS = Path("outputs") / "demo_assets"
"""Where `shardrl train` with no config makes (and then reuses) the demo's model and data."""
DEMO_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def demo_overrides(assets: Path) -> list[str]:
    """The demo's settings, as overrides a user's own `key=value`s come after (and win over)."""
    return [
        f"model.path={assets / 'model'}",
        f"data.train_files=[{assets / 'train.jsonl'}]",
        f"data.val_files=[{assets / 'val.jsonl'}]",
        "data.max_prompt_length=16",
        "data.train_batch_size=16",
        "rollout.n=16",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        "rollout.micro_batch_size=64",
        "actor.ppo_mini_batch_size=8",
        "actor.optim.lr=2e-4",
        "actor.optim.weight_decay=0.0",
        "actor.engine.param_dtype=float32",
        "actor.engine.use_dynamic_bsz=true",
        "actor.engine.max_token_len_per_gpu=4096",
        "algorithm.adv_estimator=grpo",
        "trainer.total_steps=400",
        "trainer.val_freq=50",
        "trainer.experiment_name=demo",
        "trainer.export_hf=true",  # <run folder>/hf_model: what learned, for from_pretrained (README, the demo)
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


REVERSE = "reverse"
"""`prepare_demo_assets(op=REVERSE)`: reverse a string of 3 or 4 letters of "abc" ("abca=" -> "acba"), answers of 3
or 4 tokens: bench/distill.py's task where a sequence-level 0/1 reward is sparse and a per-token one is not. (Over
"abcd" with up to 5 letters, 1,344 strings, 400 warm-up steps gave a teacher of only 0.20 expected reward.)"""


def demo_problems(op: str = "+") -> dict[str, str]:
    """The task's prompts and their answers: `op` "+" single-digit sums of at most 9 (the demo), "*" products of
    digits, or `REVERSE`."""
    if op == REVERSE:
        words = ["".join(w) for n in (3, 4) for w in itertools.product("abc", repeat=n)]
        return {f"{w}=": w[::-1] for w in words}
    if op not in ("+", "*"):
        raise ValueError(f"demo op must be '+', '*' or {REVERSE!r}, got {op!r}")
    # sums stay single digits: one answer token each (with two-digit sums, wrong "1x" answers push the
    # shared first token "1" down for every prompt and the policy unlearns two-digit answers altogether)
    return {f"{a}{op}{b}=": str(a * b if op == "*" else a + b)
            for a in range(10) for b in range(10) if a + b <= 9 or op == "*"}


def prepare_demo_assets(root: Path, warmup_steps: int = 20, seed: int = 0, op: str = "+",
                        prefix_noise: float = 0.0) -> Path:
    """Tokenizer, warmed-up model and data under `root` (reused when already there). `op`: the task
    (`demo_problems`); "*" and `REVERSE` are bench/distill.py's tasks with longer answers. `prefix_noise`: the
    share of the answer's tokens the warm-up feeds in replaced by a random answer character, their targets kept
    (a teacher for on-policy distillation that knows the next right token after a wrong one; 0: the demo's)."""
    import transformers

    from shardrl.tokenizer import build_char_tokenizer

    model_dir = root / "model"
    if (model_dir / "model.safetensors").is_file() and (root / "val.jsonl").is_file():
        return root
    answers = demo_problems(op)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    rows = [{"prompt": p, "data_source": "arith", "ground_truth": a} for p, a in answers.items()]
    _write_jsonl(root / "train.jsonl", rows)
    _write_jsonl(root / "val.jsonl", rows)

    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **DEMO_MODEL)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    pairs = [(tok.encode(p), tok.encode(a)) for p, a in answers.items()]
    noise_ids = tok.encode("".join(sorted(set("".join(answers.values())))))
    format_warmup(model, tok, pairs, warmup_steps, seed, prefix_noise=prefix_noise, noise_ids=noise_ids)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return root


def format_warmup(model, tok, pairs: list[tuple[list[int], list[int]]], steps: int, seed: int,
                  batch_size: int = 32, lr: float = 3e-3, prefix_noise: float = 0.0,
                  noise_ids: list[int] | None = None) -> None:
    """Supervised steps on (prompt ids, answer ids) pairs: the answer, then EOS, after the prompt. `prefix_noise`:
    the share of answer tokens fed in replaced by one of `noise_ids`, their targets kept (`prepare_demo_assets`)."""
    rng = random.Random(seed)
    noise_rng = random.Random(seed + 1)  # its own stream: prefix_noise=0 samples the same batches
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        texts, prompt_lens = [], []
        for prompt, answer in rng.sample(pairs, batch_size):
            texts.append(prompt + answer + [tok.eos_token_id])
            prompt_lens.append(len(prompt))
        width = max(map(len, texts))
        ids = torch.full((len(texts), width), tok.pad_token_id)
        labels = torch.full((len(texts), width), -100)
        for i, (t, p) in enumerate(zip(texts, prompt_lens)):
            ids[i, : len(t)] = torch.tensor(t)
            labels[i, p: len(t)] = torch.tensor(t[p:])
            for j in range(p, len(t) - 1):  # the input after a wrong token; the labels still say the right one
                if prefix_noise and noise_rng.random() < prefix_noise:
                    ids[i, j] = noise_rng.choice(noise_ids)
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (torch.arange(width) < torch.tensor(
            [len(t) for t in texts])[:, None]), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
