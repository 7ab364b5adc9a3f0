"""The second built-in example, `shardrl train --example reasoning_gym`: GRPO on reasoning-gym's `leg_counting` task.

The prompts and the reward are reasoning-gym's, unchanged (`data.reasoning_gym`): questions such as "Your task is to
count how many legs there are in total when given a list of animals. Now, how many legs are there in total if you
have 1 spider?", with one animal of the task's 37 (the generator's `min_animals=max_animals=max_instances=1`), and
the reward is the task's own `score_answer` on the text inside the reply's <answer></answer> (reasoning-gym's answer
format). What must be learned is how many legs each animal has, which only the reward tells.

As in the demo, everything is made locally: a character tokenizer (the demo's alphabet plus capitals and the
tags' `<>/`), a tiny Qwen2-shaped model, and a short supervised warm-up that teaches the reply's shape,
"<answer>N</answer>" then EOS, on 30 random-answer replies: the legs are left to RL, so the model starts near the
reward of a guess.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

ASSETS = Path("outputs") / "reasoning_gym_assets"
"""Where `shardrl train --example reasoning_gym` makes (and then reuses) the example's tokenizer and model."""
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*=?.,:()#\n<>/\"'"
TASK = "leg_counting"
TASK_CONFIG = "{leg_counting: {min_animals: 1, max_animals: 1, max_instances: 1}}"


def example_overrides(assets: Path) -> list[str]:
    """The example's settings, as overrides a user's own `key=value`s come after (and win over)."""
    return [
        f"model.path={assets / 'model'}",
        f"data.reasoning_gym.tasks=[{TASK}]",
        f"data.reasoning_gym.config={TASK_CONFIG}",
        "data.reasoning_gym.size=1000",
        "data.reasoning_gym.val_size=64",
        "data.reasoning_gym.system_prompt=null",  # (a tiny model reads no instructions; the warm-up gave the format)
        "data.reasoning_gym.answer_format=whole",  # the reply is the number alone
        # the last 48 tokens of each question, where its animal is: a tiny model gains nothing from the task's fixed
        # instructions, and its updates on the CPU cost 4 times less (data.truncation=left keeps a prompt's end)
        "data.max_prompt_length=48",
        "data.truncation=left",
        "data.train_batch_size=16",
        "rollout.n=16",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        "rollout.micro_batch_size=128",
        "actor.ppo_mini_batch_size=8",
        "actor.optim.lr=1e-3",
        "actor.optim.weight_decay=0.0",
        "actor.engine.param_dtype=float32",
        "actor.engine.micro_batch_size_per_gpu=32",  # (packed rows of 190 tokens would cost a T x T mask on the CPU)
        "algorithm.adv_estimator=grpo",
        "trainer.total_steps=100",
        "trainer.val_freq=25",
        "trainer.val_before_train=true",
        "trainer.experiment_name=reasoning_gym",
    ]


def prepare_example_assets(root: Path, warmup_steps: int = 40, seed: int = 0) -> Path:
    """Tokenizer and warmed-up model under `root` (reused when already there)."""
    import transformers

    from shardrl.data.reasoning_gym import import_reasoning_gym
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import format_warmup

    model_dir = root / "model"
    if (model_dir / "model.safetensors").is_file():
        return root
    rg = import_reasoning_gym()
    root.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(ALPHABET)
    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **MODEL)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # a few steps on the true answers, as the demo's warm-up: the reply's shape, and a start on the legs (from a reply
    # of random legs, GRPO collapses onto the commonest count, 4 or 6, for every animal: a group then has no spread)
    questions = rg.create_dataset(TASK, size=256, seed=10_000 + seed, min_animals=1, max_animals=1, max_instances=1)
    pairs = [(tok.encode(tok.apply_chat_template([{"role": "user", "content": entry["question"]}],
                                                 add_generation_prompt=True, tokenize=False))[-48:],
              tok.encode(entry["answer"])) for entry in questions]
    format_warmup(model, tok, pairs, warmup_steps, seed)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return root
