"""The demo task: "a+b=" prompts whose answer is the sum, easy enough for a tiny model to learn with RL."""

from __future__ import annotations

import json
import os
import random


def make_arith_dataset(path: str, num_rows: int, seed: int = 0, max_operand: int = 9) -> str:
    """Write `num_rows` JSONL rows {"prompt": "12+7=", "data_source": "arith", "ground_truth": "19"} to `path`.

    Operands are drawn uniformly from [0, max_operand]: 9 gives single-digit sums, 99 two-digit operands.
    """
    if num_rows <= 0:
        raise ValueError(f"num_rows must be positive, got {num_rows}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "data_source": "arith", "ground_truth": str(a + b)}) + "\n")
    return path
