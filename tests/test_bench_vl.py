"""bench/vl_e2e.py, the VL whole-step benchmark against TRL: its quick mode runs on the CPU (the tiny Qwen2.5-VL, two
steps a system) and writes every line, both systems training on the prompts with their images (the prompt's tokens
count the image's placeholders, TRL's batches carry the patches); the fast rollout's greedy output is HF
`generate`'s. The 3B shape is Qwen2.5-VL-3B's size, and both systems get the same numbers for it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import vl_e2e
from shardrl.config.registry import load_config

ROOT = Path(__file__).resolve().parent.parent
QUICK = vl_e2e.QUICK_CASES["tiny"]
ROWS = QUICK["prompts"] * QUICK["n"]
IMAGE_TOKENS = (QUICK["side"] // 28) ** 2  # the tiny tower's patch 14, merge 2
PROMPT_LEN = QUICK["words"] + IMAGE_TOKENS + 2  # + vision start and end


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_e2e")
    out = root / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "bench/vl_e2e.py", "--quick", "--root", str(root / "run"),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["bench"] == "vl_e2e" and r["quick"] for r in records)
    assert all((r["prompt_len"], r["image_tokens"], r["n"]) == (PROMPT_LEN, IMAGE_TOKENS, QUICK["n"]) for r in records)
    return {r["system"]: r for r in records}


def _sane_steps(rec: dict, steps: int = 2) -> None:
    assert "error" not in rec, rec.get("error")
    assert rec["steps"] == steps and len(rec["step_times"]) == steps
    assert all(t > 0 for t in rec["step_times"]) and rec["step_s"] > 0 and rec["gen_s"] > 0
    assert rec["tokens_per_s_per_gpu"] > 0
    assert len(rec["reward_mean"]) == steps and all(0 <= r <= 1 for r in rec["reward_mean"])
    assert 1 <= rec["response_length_min"] <= rec["response_length_max"] <= QUICK["new"]


def test_shardrl_trains_on_the_prompts_with_their_images(lines):
    rec = lines["shardrl"]
    _sane_steps(rec)
    assert rec["update_s"] > 0
    assert rec["prompt_length_mean"] == PROMPT_LEN  # the image's placeholders are in the prompts it trained on
    assert rec["rollout_backend"] == "hf"  # (null on the CPU; fast on CUDA)


def test_trl_trains_on_the_same_prompts_with_their_images(lines):
    rec = lines["trl"]
    if importlib.util.find_spec("trl") is None:
        assert "pip install trl" in rec["error"]
        pytest.skip("trl is not installed: its line says so")
    _sane_steps(rec)
    assert rec["prompt_length_mean"] == PROMPT_LEN
    patches = IMAGE_TOKENS * 4  # merge 2 x 2 patches a token
    assert rec["image_patches_per_batch"] == [ROWS * patches] * 2  # every sample's image, every batch


def test_fast_rollout_and_hf_generate_give_the_same_greedy_tokens_at_the_steps_batch(lines):
    fast, hf = lines["fast"], lines["hf_generate"]
    for rec in (fast, hf):
        assert rec["rows"] == ROWS and rec["new_tokens"] == QUICK["new"] and rec["tokens"] == ROWS * QUICK["new"]
        assert rec["seconds"] > 0 and rec["tokens_per_s"] > 0 and (rec["device"], rec["dtype"]) == ("cpu", "float32")
    # fp32: the same tokens, but for a near-tie that the order of a sum decided (a random model's logits are close)
    assert fast["identical_to_hf_fraction"] == 1.0 or fast["fp32_gap_at_difference_max"] < 1e-4, fast
    assert fast["fp32_top2_gap_median"] > 1e-3
    assert fast["images_encoded"] == QUICK["prompts"]  # one tower run a prompt, not a row


def test_the_3b_shape_is_qwen2_5_vl_3b_and_both_systems_get_its_numbers(tmp_path):
    import transformers

    config = vl_e2e.hf_config("qwen2_5_vl_3b")
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 3.75  # the published 3.75B
    case = dict(vl_e2e.CASES["qwen2_5_vl_3b"], prompt_len=322)
    overrides = vl_e2e.shardrl_overrides(tmp_path, case, steps=4, cuda=True, shape="qwen2_5_vl_3b", extra=[])
    cfg = load_config(None, overrides)
    trl = vl_e2e.trl_args(tmp_path, case, steps=3, cuda=True)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (16, 8, 256)
    assert (trl["num_generations"], trl["max_completion_length"], trl["max_steps"]) == (8, 256, 3)
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == 16 * 8 == trl[
        "per_device_train_batch_size"] * trl["steps_per_generation"]  # one optimizer step a rollout of 128
    assert cfg.actor.optim.lr == trl["learning_rate"] == 1e-6 and trl["beta"] == 0.0
    assert cfg.model.gradient_checkpointing and trl["gradient_checkpointing"]
    assert cfg.model.dtype == "bfloat16" and trl["bf16"]
    assert cfg.data.max_prompt_length == 322 and cfg.data.image_key == "images"
