"""bench/learn.py, time to accuracy against TRL: both sides get the same numbers from one setup (the TRL side through
bench/e2e.py's mapping), TRL's reward is shardrl's gsm8k scorer, and a LoRA model is evaluated with its adapters
merged under the plain model's names."""

from pathlib import Path

import pytest
import torch

from bench import learn
from bench.e2e import trl_grpo_args
from shardrl.config.registry import load_config


def test_the_gpu_setup_gives_trl_four_optimizer_steps_of_128_samples_a_step_of_512():
    args = learn.trl_args(learn.SETUPS["gpu"], Path("/tmp/x"), seed=3, lora=False, cuda=True)
    assert args["per_device_train_batch_size"] == 64 and args["gradient_accumulation_steps"] == 2
    assert args["steps_per_generation"] == 8  # 8 micro-batches of 64 = 512 samples generated at once
    assert args["max_steps"] == 240 and args["logging_steps"] == 4  # 60 rollout steps of 4 optimizer steps
    assert args["num_generations"] == 8 and args["max_completion_length"] == 128
    assert (args["loss_type"], args["beta"], args["learning_rate"], args["warmup_steps"]) == ("dapo", 0.0, 2e-6, 3)
    assert (args["weight_decay"], args["max_grad_norm"], args["epsilon"], args["seed"]) == (0.0, 1.0, 0.2, 3)
    assert args["bf16"] and not args["use_cpu"] and args["lr_scheduler_type"] == "constant_with_warmup"
    assert learn.trl_args(learn.SETUPS["gpu"], Path("/tmp/x"), 0, lora=True, cuda=True)["learning_rate"] == 5e-5


def test_e2e_mapping_keeps_one_optimizer_step_a_rollout_and_refuses_a_mini_batch_that_does_not_divide():
    args = trl_grpo_args("/tmp/x", prompts=8, n=8, new=256, steps=3, lr=1e-6, cuda=False)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (16, 4)
    assert args["steps_per_generation"] == 4 and args["max_steps"] == 3 and args["use_cpu"]
    with pytest.raises(ValueError, match="must divide prompts=64"):
        trl_grpo_args("/tmp/x", prompts=64, n=8, new=128, steps=1, lr=1e-6, cuda=True, mini_batch_prompts=24)


def test_shardrl_overrides_set_the_same_numbers_in_the_example_config(tmp_path):
    setup = learn.SETUPS["gpu"]
    overrides = learn.shardrl_overrides(setup, tmp_path / "model", tmp_path / "t.jsonl", tmp_path / "v.jsonl",
                                        seed=2, lora=True, cuda=True, run_dir=tmp_path / "run")
    cfg = load_config("examples/smollm2/gpu.yaml", overrides)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (64, 8, 128)
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.loss_agg_mode, cfg.actor.use_kl_loss) == (16, "token-mean", False)
    optim = cfg.actor.optim
    assert (optim.lr, list(optim.betas), optim.eps, optim.weight_decay, optim.warmup_steps, optim.clip_grad) == (
        5e-5, [0.9, 0.999], 1e-8, 0.0, 3, 1.0)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.rollout.seed, cfg.data.shuffle) == (32, 32.0, 2, False)
    assert (cfg.trainer.total_steps, cfg.trainer.val_freq, cfg.trainer.val_before_train) == (60, 5, True)


def test_trl_reward_is_the_gsm8k_scorer():
    completions = [[{"role": "assistant", "content": "3 x 4 = 12\n#### 12"}],
                   [{"role": "assistant", "content": "the answer is 12"}],
                   [{"role": "assistant", "content": "#### 13"}]]
    assert learn.gsm8k_reward(completions, ["gsm8k"] * 3, ["12"] * 3) == [1.0, 0.0, 0.0]


def test_a_lora_models_weights_are_the_merged_plain_model():
    peft = pytest.importorskip("peft")
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    plain = dict(learn.hf_weights(base))
    names = set(plain)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at 0: a merge that forgot the delta would pass
    weights = dict(learn.hf_weights(model))
    assert set(weights) == names
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + q.lora_B["default"].weight @ q.lora_A["default"].weight * 2.0
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], want)
    assert not torch.allclose(want, plain["model.layers.0.self_attn.q_proj.weight"])
    ids = torch.tensor([[1, 5, 9]])
    merged = transformers.LlamaForCausalLM(config)
    merged.load_state_dict(weights, strict=False)
    torch.testing.assert_close(merged(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
