"""Arithmetic word problems with a calculator tool: the SmolLM2 example's problems (examples/smollm2/prepare.py),
each prompt opened by a system message that shows the model how to call the calculator (Hermes/Qwen format).

    python examples/smollm2/prepare.py            # the model folder, outputs/smollm2/model (once)
    python examples/tools/prepare.py --out outputs/tools   # train.jsonl, val.jsonl with the tool prompt
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

SYSTEM = "You have a calculator. Call it first, then give the final answer after '####'."
EXAMPLE = [  # one worked exchange as chat turns, in the very format the rollout writes (a 135M model does not
    # call a tool from a description alone)
    {"role": "user", "content": "Tom has 3 bags with 4 apples in each bag. How many apples does Tom have?"},
    {"role": "assistant", "content": "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
                                     "\"3 * 4\"}}\n</tool_call>"},
    {"role": "user", "content": "<tool_response>\n12\n</tool_response>"},
    {"role": "assistant", "content": "#### 12"},
]


def smollm2_prepare():
    """examples/smollm2/prepare.py as a module (examples are not a package)."""
    path = Path(__file__).resolve().parent.parent / "smollm2" / "prepare.py"
    spec = importlib.util.spec_from_file_location("smollm2_prepare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_tool_prompt(row: dict) -> dict:
    """The row as a chat: the system message, the worked example, then the question without the '####'
    instruction (the system message gives it)."""
    question = row["prompt"][0]["content"].split("\n", 1)[0]
    return {**row, "prompt": [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tools")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    paths = smollm2_prepare().write_dataset(out, args.num_train, args.num_val, args.seed)
    for path in paths:
        rows = [with_tool_prompt(json.loads(line)) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"data: {paths[0]}, {paths[1]}")


if __name__ == "__main__":
    main()
