"""`shardrl plan` for a vision-language model (issue 61): the memory ledger counts the vision tower's parameters
(state, grads and optimizer state, or no grads and no optimizer state when it is frozen) and the vision tower's
work on the image tokens a micro-batch's prompts may hold (inside data.max_prompt_length). Each number is checked
against a count made here from the HF model's own parameters and the tiny config's widths."""

from __future__ import annotations

import json

import pytest
import transformers

from shardrl.config.offline import SFTConfig
from shardrl.config.schema import load_config
from shardrl.engine.model import load_hf_config
from shardrl.plan.layout import GIB, derive_layout, derive_offline_layout
from shardrl.plan.memory import format_phase_ledger, offline_ledger, phase_ledger
from shardrl.testing import tiny_config

MLP_TENSORS = {"qwen2_5_vl": 4, "qwen3_vl": 2}  # Qwen2.5-VL's vision MLP is gated (gate, up, act, product)


def counts(kind: str) -> tuple[int, int]:
    """(all parameters, the vision tower's) of the HF model itself."""
    model = transformers.AutoModelForImageTextToText.from_config(load_hf_config(None, tiny_config(kind)))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.visual.parameters())


def terms(ledger: dict, phase: str) -> dict[str, float]:
    return {i["name"]: i["gib"] * GIB for i in ledger["phases"][phase]["items"]}


def per_patch_block(kind: str) -> int:
    """What autograd keeps per patch per vision block of the tiny configs (width 16, MLP 32, bf16 compute): two
    norms (fp32 input + output), q, k, v, the attention's output and the projection's input, the MLP's tensors."""
    return 2 * (4 * 16 + 2 * 16) + 5 * 2 * 16 + MLP_TENSORS[kind] * 2 * 32


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_the_rl_ledger_counts_the_vision_tower_and_the_prompts_image_tokens(kind):
    total, vision = counts(kind)
    tiny = f"model.tiny={json.dumps(tiny_config(kind))}"
    common = [tiny, "data.max_prompt_length=64", "actor.engine.micro_batch_size_per_gpu=2"]
    cfg = load_config(None, common)
    ledger = phase_ledger(cfg, derive_layout(cfg, 1, 4), load_hf_config(None, tiny_config(kind)))
    assert ledger["num_params"] == total
    gen, update = terms(ledger, "gen"), terms(ledger, "update")
    assert gen["actor params"] == pytest.approx(total * 4 / 4)  # fp32 master, 4 shards
    assert gen["actor optimizer state"] == pytest.approx(2 * total * 4 / 4)
    assert update["actor grads"] == pytest.approx(total * 4 / 4)
    # a micro-batch of 2 rows holds at most 2 x 64 prompt tokens, each an image token of 2 x 2 patches, 2 blocks
    assert update["vision activations"] == pytest.approx(2 * 64 * 4 * 2 * per_patch_block(kind))
    assert "vision activations" in format_phase_ledger(ledger)

    frozen_cfg = load_config(None, [*common, "model.freeze_vision_tower=true", "actor.use_kl_loss=true"])
    frozen = phase_ledger(frozen_cfg, derive_layout(frozen_cfg, 1, 4), load_hf_config(None, tiny_config(kind)))
    gen, update, prep = terms(frozen, "gen"), terms(frozen, "update"), terms(frozen, "prep")
    assert gen["actor params"] == pytest.approx(total * 4 / 4)  # a frozen tower's weights are still held
    assert gen["actor optimizer state"] == pytest.approx(2 * (total - vision) * 4 / 4)
    assert update["actor grads"] == pytest.approx((total - vision) * 4 / 4)
    # frozen: no activations kept, one block's forward at a time (4 x width + 2 x MLP width, bf16)
    assert "vision activations" not in update
    assert update["vision forward"] == prep["vision forward"] == pytest.approx(2 * 64 * 4 * (4 * 16 + 2 * 32) * 2)
    # LoRA adapts the language model only: the tower is frozen as well, its weights in param_dtype with the base's
    lora_cfg = load_config(None, [*common, "model.lora.rank=4"])
    lora = terms(phase_ledger(lora_cfg, derive_layout(lora_cfg, 1, 4), load_hf_config(None, tiny_config(kind))),
                 "update")
    assert "vision activations" not in lora and lora["vision forward"] == update["vision forward"]


def test_the_sft_ledger_counts_the_vision_tower_and_its_image_tokens():
    total, vision = counts("qwen2_5_vl")
    tiny = f"model.tiny={json.dumps(tiny_config('qwen2_5_vl'))}"
    cfg = load_config(None, [tiny, "data.max_length=100", "engine.use_dynamic_bsz=false",
                             "engine.micro_batch_size_per_gpu=3", "model.gradient_checkpointing=true"], cls=SFTConfig)
    hf_config = load_hf_config(None, tiny_config("qwen2_5_vl"))
    ledger = offline_ledger(cfg, derive_offline_layout(cfg, "sft", 1, 2), hf_config)
    update = terms(ledger, "update")
    assert update["model params"] == pytest.approx(total * 4 / 2)
    assert update["model optimizer state"] == pytest.approx(2 * total * 4 / 2)
    assert update["model grads"] == pytest.approx(total * 4 / 2)
    # an SFT row's images may be anywhere in it: 3 rows x 100 tokens; checkpointed: each block's input and one block
    assert update["vision activations"] == pytest.approx(3 * 100 * 4 * (2 * 2 * 16 + per_patch_block("qwen2_5_vl")))
    cfg.model.freeze_vision_tower = True
    frozen = terms(offline_ledger(cfg, derive_offline_layout(cfg, "sft", 1, 2), hf_config), "update")
    assert frozen["model optimizer state"] == pytest.approx(2 * (total - vision) * 4 / 2)
    assert frozen["model grads"] == pytest.approx((total - vision) * 4 / 2)


def test_under_ulysses_every_rank_counts_the_whole_micro_batchs_images():
    """sp=2: a rank holds half of each row's tokens but runs the vision tower on all the micro-batch's images."""
    tiny = f"model.tiny={json.dumps(tiny_config('qwen2_5_vl'))}"
    per = per_patch_block("qwen2_5_vl")
    common = [tiny, "data.max_prompt_length=64", "actor.engine.ulysses_sequence_parallel_size=2"]
    hf_config = load_hf_config(None, tiny_config("qwen2_5_vl"))
    fixed = load_config(None, [*common, "actor.engine.micro_batch_size_per_gpu=2"])
    update = terms(phase_ledger(fixed, derive_layout(fixed, 1, 4), hf_config), "update")
    assert update["vision activations"] == pytest.approx(2 * 64 * 4 * 2 * per)  # 2 rows' prompts, as with sp=1
    dynamic = load_config(None, [*common, "actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=96"])
    ledger = phase_ledger(dynamic, derive_layout(dynamic, 1, 4), hf_config)
    assert terms(ledger, "update")["vision activations"] == pytest.approx(2 * 96 * 4 * 2 * per)  # 2 ranks' budgets
    assert "max_token_len_per_gpu x 2 (sp)" in format_phase_ledger(ledger)
    sft = load_config(None, [tiny, "data.max_length=100", "engine.use_dynamic_bsz=false",
                             "engine.micro_batch_size_per_gpu=3", "engine.ulysses_sequence_parallel_size=2"],
                      cls=SFTConfig)
    update = terms(offline_ledger(sft, derive_offline_layout(sft, "sft", 1, 2), hf_config), "update")
    assert update["vision activations"] == pytest.approx(3 * 100 * 4 * 2 * per)  # 3 rows x 2 pieces of 50
