"""A tool-use warm start for SmolLM2-135M-Instruct: a few supervised steps on *bare arithmetic* questions
("What is 17 + 25?") answered the way the tools example's rollout writes a conversation (a calculator call,
the tool's answer as a ChatML turn, then "#### 42"), so that the model calls the tool at all. The word
problems of the RL task are not in it: which expression a word problem needs is left for RL to learn.

Before and after, it measures on the word problems of `--val` (greedy, the multi-turn rollout with the
example's calculator interaction): the share of conversations that call the calculator, that call it
without error, and that end with the right "####" answer, and the mean reward (the trainer's validation
number, `val/reward_mean`, on the same prompts). `--eval-only` measures a model folder and trains nothing.

    python examples/tools/warm_start.py                        # outputs/tools/warm_model
    shardrl train examples/tools/cpu.yaml model.path=outputs/tools/warm_model
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


def example_text(tok, prefix: list[dict], question: str, expression: str, answer: int, tool_turn: str):
    """(ids, labels) of one conversation as the rollout lays it out; labels -100 outside the model's turns."""
    prompt = tok.apply_chat_template(prefix + [{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"
    pieces = [(prompt, False), (call, True), (tool_turn.replace("{output}", str(answer)), False),
              (f"#### {answer}{tok.eos_token}", True)]
    ids, labels = [], []
    for text, trained in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


def evaluate(model, tok, rows: list[dict], mt_cfg, max_new_tokens: int) -> dict:
    """Greedy multi-turn rollouts on `rows` with the example's calculator interaction (HF generate, on the
    model's device)."""
    from shardrl.rollout import SamplingParams, build_rollout
    from shardrl.rollout.multiturn import MultiTurnRollout, load_interaction

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
    p.add_argument("--model", default="outputs/smollm2/model")
    p.add_argument("--out", default="outputs/tools/warm_model")
    p.add_argument("--val", default="outputs/tools/val.jsonl")
    p.add_argument("--num-val", type=int, default=48)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48, help="per model turn, in the evaluation")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per conversation, in the evaluation")
    p.add_argument("--max-response-tokens", type=int, default=160, help="per conversation, in the evaluation")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eval-only", action="store_true", help="measure --model on --val; no training, nothing saved")
    args = p.parse_args(argv)
    prepare = _module("tools_prepare", HERE / "prepare.py")
    prefix = [{"role": "system", "content": prepare.SYSTEM}, *prepare.EXAMPLE]
    from shardrl.config import MultiTurnConfig

    tool_turn = MultiTurnConfig().tool_turn_template
    # the defaults are examples/tools/cpu.yaml's; gpu.yaml's: --max-turns 4 --max-response-tokens 384 --max-new-tokens 128
    mt_cfg = {"max_turns": args.max_turns, "max_response_tokens": args.max_response_tokens}
    if not Path(args.model, "config.json").is_file():
        sys.exit(f"no model folder at {args.model}: run `python examples/smollm2/prepare.py` first")
    if not Path(args.val).is_file():
        sys.exit(f"no {args.val}: run `python examples/tools/prepare.py` first")
    torch.manual_seed(args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    val = [json.loads(line) for line in open(args.val)][: args.num_val]

    report = {"before": evaluate(model.eval(), tok, val, mt_cfg, args.max_new_tokens)}
    print(json.dumps({"before": report["before"]}), flush=True)
    if args.eval_only:
        return

    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = [example_text(tok, prefix, *bare_question(rng), tool_turn) for _ in range(args.batch)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        ids, labels, mask = ids.to(args.device), labels.to(args.device), mask.to(args.device)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4),
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    model.eval()
    report["after"] = evaluate(model, tok, val, mt_cfg, args.max_new_tokens)
    print(json.dumps({"after": report["after"]}), flush=True)
    out = Path(args.out)
    model.cpu().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "warm_start.json").write_text(json.dumps({**report, **vars(args)}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
