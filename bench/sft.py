"""`shardrl sft`'s step throughput on one GPU against the engine's own `train_batch` on the same batches.

Model: Qwen2-1.5B-shaped, random init (`bench/engine.py`'s shape), bf16 compute, fp32 master weights and AdamW.
Data: conversations of about `--tokens` character tokens (a prompt and a reply of half each; the loss on the
reply), `--batch` per step, micro-batches of `--micro` (fixed) or dynamic by tokens.

Rows, both in one process on one engine, interleaved so that clocks and compile state are shared:
- `engine`: `engine.train_batch(batch, sft_loss)` on batches collated before the timer starts (the engine
  benchmark's rate at this micro-batch);
- `sft`: `SFTTrainer.train_step()`: the loader, collation, the same `train_batch`, and the step's metrics.

    python bench/sft.py [--steps 6] [--batch 16] [--micro 4] [--tokens 2048] [--compile] [--out results.jsonl]

Prints one JSON line per row: median tokens/s over the steps after two warm-up steps, and the ratio sft/engine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import QWEN2_1P5B  # noqa: E402


def conversations(path: Path, num: int, tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    half = tokens // 2 - 16  # the template adds "user: ", "assistant: " and newlines
    rows = [{"prompt": "".join(rng.choice(alphabet) for _ in range(half)),
             "response": "".join(rng.choice(alphabet) for _ in range(half))} for _ in range(num)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--dynamic", type=int, default=0, help="max_token_len_per_gpu (0: fixed micro-batches)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script runs")
    args = parser.parse_args()

    from shardrl.config.schema import SFTConfig, load_config
    from shardrl.distributed import init_distributed
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.run_folder import prepare_run_dir
    from shardrl.trainer.sft import SFTTrainer, sft_loss

    init_distributed()
    tmp = Path(tempfile.mkdtemp())
    build_char_tokenizer().save_pretrained(tmp / "tok")
    conversations(tmp / "rows.jsonl", 4 * args.batch * (args.steps + 2), args.tokens)
    from shardrl.testing import TINY_MODELS

    shape = TINY_MODELS["qwen2"] if args.smoke else QWEN2_1P5B
    tiny = "{" + ", ".join(f"{k}: {v}" for k, v in shape.items()) + "}"
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine = ([f"engine.use_dynamic_bsz=true", f"engine.max_token_len_per_gpu={args.dynamic}"] if args.dynamic
              else ["engine.use_dynamic_bsz=false", f"engine.micro_batch_size_per_gpu={args.micro}"])
    cfg = load_config(None, [f"model.tiny={tiny}", f"model.tokenizer_path={tmp / 'tok'}",
                             f"data.train_files=[{tmp / 'rows.jsonl'}]", f"data.batch_size={args.batch}",
                             f"data.max_length={args.tokens + 64}",
                             f"engine.param_dtype={'float32' if args.smoke else 'bfloat16'}",
                             f"engine.compile={str(args.compile).lower()}", *engine, "optim.lr=1e-5",
                             f"trainer.output_dir={tmp / 'run'}", f"trainer.total_steps={2 * args.steps + 4}",
                             "trainer.save_freq=0", "trainer.logger=[jsonl]"], cls=SFTConfig)
    trainer = SFTTrainer(cfg, prepare_run_dir(cfg))
    from shardrl.data.chat import collate_chats

    fixed = [collate_chats(next(trainer.loader), trainer.pad_id) for _ in range(args.steps + 2)]
    times = {"engine": [], "sft": []}
    tokens = {"engine": [], "sft": []}
    for i in range(args.steps + 2):
        for row in ("engine", "sft"):  # interleaved: the same clocks, caches and compiled graphs for both
            sync()
            t0 = time.perf_counter()
            if row == "engine":
                with trainer.engine.training():
                    trainer.engine.train_batch(fixed[i].to(trainer.device), sft_loss)
                n = float(fixed[i]["attention_mask"].sum())
            else:
                n = trainer.train_step()["perf/total_num_tokens"]
            sync()
            if i >= 2:
                times[row].append(time.perf_counter() - t0)
                tokens[row].append(n)
    rates = {row: statistics.median(t / s for t, s in zip(tokens[row], times[row])) for row in times}
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    for row in ("engine", "sft"):
        line = {"row": row, "tokens_per_s": round(rates[row]), "batch": args.batch, "micro": args.micro,
                "dynamic": args.dynamic, "tokens": args.tokens, "compile": args.compile,
                "step_s_median": round(statistics.median(times[row]), 4), "peak_gib": round(peak, 1),
                "sft_over_engine": round(rates["sft"] / rates["engine"], 4)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
