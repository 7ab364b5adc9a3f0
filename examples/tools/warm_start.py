"""A tool-use warm start for SmolLM2-135M-Instruct, as data for `shardrl sft` (`warm_start.yaml`): *bare
arithmetic* questions ("What is 17 + 25?") answered the way the tools example's rollout writes a conversation
(a calculator call, the tool's answer as a ChatML turn, then "#### 42"), so that the model calls the tool at
all. The word problems of the RL task are not in it: which expression a word problem needs is left for RL.

`eval` measures a model folder on the word problems of `--val` (greedy, the multi-turn rollout with the
example's calculator interaction): the share of conversations that call the calculator, that call it without
error, and that end with the right "####" answer, and the mean reward (the trainer's validation number,
`val/reward_mean`, on the same prompts).

    python examples/tools/warm_start.py data                   # outputs/tools/warm_start.jsonl
    shardrl sft examples/tools/warm_start.yaml                 # outputs/tools/warm_start/hf_model
    python examples/tools/warm_start.py eval --model outputs/tools/warm_start/hf_model
    shardrl train examples/tools/cpu.yaml model.path=outputs/tools/warm_start/hf_model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_question(rng: random.Random) -> tuple[str, str, int]:
    """A bare arithmetic question, the expression to call the calculator with, and the answer."""
    op = rng.choice(["+", "-", "*", "/", "+*"])
    if op == "+":
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return rng.choice(["What is {e}?", "Compute {e}.", "Add {a} and {b}."]).format(e=f"{a} + {b}", a=a, b=b), \
            f"{a} + {b}", a + b
    if op == "-":
        a = rng.randint(10, 80)
        b = rng.randint(1, a - 1)
        return rng.choice(["What is {e}?", "Compute {e}.", "Subtract {b} from {a}."]).format(e=f"{a} - {b}", a=a, b=b), \
            f"{a} - {b}", a - b
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return rng.choice(["What is {e}?", "Compute {e}.", "Multiply {a} by {b}."]).format(e=f"{a} * {b}", a=a, b=b), \
            f"{a} * {b}", a * b
    if op == "/":
        b, q = rng.randint(2, 9), rng.randint(2, 12)
        return rng.choice(["What is {e}?", "Divide {a} by {b}."]).format(e=f"{b * q} / {b}", a=b * q, b=b), \
            f"{b * q} / {b}", q
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    return f"What is {a} * {b} + {c}?", f"{a} * {b} + {c}", a * b + c


def conversation(prefix: list[dict], question: str, expression: str, answer: int) -> dict:
    """One SFT row: the tool prompt, the question, the call, the tool's answer as the rollout's tool turn lays it
    out (a user turn of `<tool_response>`), then "#### answer". `shardrl sft` trains on the two assistant turns
    (and the worked example's), everything else is context."""
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"
    return {"messages": [*prefix, {"role": "user", "content": question}, {"role": "assistant", "content": call},
                         {"role": "user", "content": f"<tool_response>\n{answer}\n</tool_response>"},
                         {"role": "assistant", "content": f"#### {answer}"}]}


def evaluate(model, tok, rows: list[dict], mt_cfg, max_new_tokens: int) -> dict:
    """Greedy multi-turn rollouts on `rows` with the example's calculator interaction (HF generate, on the
    model's device)."""
    from shardrl.rollout import SamplingParams, build_rollout
    from shardrl.rollout.episodes.multiturn import MultiTurnRollout, load_interaction

    interaction = load_interaction(str(HERE / "interaction.py"), "CalculatorInteraction")
    device = next(model.parameters()).device
    inner = build_rollout("hf", model.config, tok, device, torch.float32)
    inner.load_weights(model.named_parameters())
    mt = MultiTurnRollout(inner, tok, interaction, max_turns=mt_cfg["max_turns"],
                          max_response_tokens=mt_cfg["max_response_tokens"])
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    tok.padding_side = "left"
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    samples = [{"data_source": r["data_source"], "extra": {"ground_truth": r["ground_truth"]}} for r in rows]
    out = mt.generate(enc["input_ids"], enc["attention_mask"],
                      SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens), samples=samples)
    n = len(rows)
    correct = [s >= 1.0 for s in out.interaction_scores]
    return {"conversations": n, "tool_call_rate": sum(c > 0 for c in out.num_tool_calls) / n,
            "clean_call_rate": sum(c > 0 and e == 0 for c, e in zip(out.num_tool_calls, out.num_tool_errors)) / n,
            "accuracy": sum(correct) / n, "reward_mean": sum(out.interaction_scores) / n,
            "mean_turns": sum(out.num_turns) / n,
            "example": out.response_text[0]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="write the warm-start conversations for `shardrl sft`")
    data.add_argument("--out", default="outputs/tools/warm_start.jsonl")
    data.add_argument("--num", type=int, default=320, help="conversations (warm_start.yaml: 40 steps of 8)")
    data.add_argument("--seed", type=int, default=0)
    ev = sub.add_parser("eval", help="measure a model folder on the word problems of --val")
    ev.add_argument("--model", default="outputs/smollm2/model")
    ev.add_argument("--val", default="outputs/tools/val.jsonl")
    ev.add_argument("--num-val", type=int, default=48)
    ev.add_argument("--max-new-tokens", type=int, default=48, help="per model turn")
    ev.add_argument("--max-turns", type=int, default=3, help="model turns per conversation")
    ev.add_argument("--max-response-tokens", type=int, default=160, help="per conversation")
    ev.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ev.add_argument("--json", default=None, help="also write the numbers to this file")
    args = p.parse_args(argv)
    prepare = _module("tools_prepare", HERE / "prepare.py")
    if args.command == "data":
        rng = random.Random(args.seed)
        prefix = [{"role": "system", "content": prepare.SYSTEM}, *prepare.EXAMPLE]
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(conversation(prefix, *bare_question(rng))) + "\n" for _ in range(args.num)))
        print(f"wrote {args.num} conversations to {out}")
        return
    # the defaults are examples/tools/cpu.yaml's; gpu.yaml's: --max-turns 4 --max-response-tokens 384 --max-new-tokens 128
    mt_cfg = {"max_turns": args.max_turns, "max_response_tokens": args.max_response_tokens}
    if not Path(args.model, "config.json").is_file():
        sys.exit(f"no model folder at {args.model}: run `python examples/smollm2/prepare.py` first")
    if not Path(args.val).is_file():
        sys.exit(f"no {args.val}: run `python examples/tools/prepare.py` first")
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    val = [json.loads(line) for line in open(args.val)][: args.num_val]
    t0 = time.perf_counter()
    report = evaluate(model.eval(), tok, val, mt_cfg, args.max_new_tokens) | {
        "model": args.model, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
