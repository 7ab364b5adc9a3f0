"""LoRA on a vision-language model's language part (issue 61): the adapters go on the language model's linear
layers only (the vision tower, whose MLP shares the decoder's leaf names, keeps none and stays frozen); at init the
model is the base; only the adapters get gradients; the merged export is a plain HF image-text-to-text folder whose
log-probs (with the images) are the adapted engine's; the peft adapter folder names its layers in full.

fp32 on CPU, the tiny Qwen2.5-VL and Qwen3-VL configs (`TINY_VL_MODELS`)."""

from __future__ import annotations

import json

import pytest
import torch

from shardrl.config.engine import LoRAConfig
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.lora import LORA_MARK
from shardrl.engine.model import load_hf_config
from shardrl.testing import random_vl_batch, record_grads, run_distributed, tiny_config
from test_vl import ROWS, hf_reference, pg_loss

pytestmark = pytest.mark.multiproc


def _lora_step(kind: str, folder: str) -> dict:
    """The base engine's log-probs; a LoRA engine's at init, its gradients and trained parameters over one step, its
    log-probs after it; then its merged HF export and peft adapter folder, written to `folder`."""
    batch = random_vl_batch(load_hf_config(None, tiny_config(kind)), ROWS)
    base = build_engine(ModelConfig(tiny=tiny_config(kind)), EngineConfig(param_dtype="float32"))
    out = {"base": base.infer_batch(batch)["log_probs"]}
    del base
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear")
    engine = build_engine(ModelConfig(tiny=tiny_config(kind), lora=lora),
                          EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2), OptimConfig(lr=1e-2))
    out["at_init"] = engine.infer_batch(batch)["log_probs"]
    out["trained"] = sorted(engine.hf_name(n) for n, p in engine.module.named_parameters() if p.requires_grad)
    out["adapted_layers"] = sorted(n.split(".lora_")[0] for n in out["trained"])
    grads = record_grads(engine)
    engine.train_batch(batch, pg_loss)
    out["grads"] = grads[0]
    out["adapted"] = engine.infer_batch(batch)["log_probs"]
    engine.save_hf(f"{folder}/hf")
    engine.save_lora_adapter(f"{folder}/adapter")
    return out


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_lora_adapts_the_language_model_only_and_its_merged_export_loads_in_transformers(kind, tmp_path):
    import transformers

    out = run_distributed(_lora_step, 1, kind, str(tmp_path))
    # at init (B = 0) the model is the base: to a rounding (one fp32 ulp of a log-prob was seen on a CPU whose
    # matmul kernel for the adapted layer sums in another order); a B of 1e-3 everywhere moves them by 2e-3
    torch.testing.assert_close(out["at_init"], out["base"], rtol=0, atol=2e-6)
    # adapters on the language model's linear layers, every one; none in the vision tower (it has gate/up/down
    # projections too in Qwen2.5-VL) and none on the output head
    model = transformers.AutoModelForImageTextToText.from_config(load_hf_config(None, tiny_config(kind)))
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                     and n.startswith("model.language_model."))
    assert sorted(set(out["adapted_layers"])) == linears and len(out["adapted_layers"]) == 2 * len(linears)
    assert all(LORA_MARK in n for n in out["trained"])
    # the only gradients are the adapters' (B moves first: A's gradient is B^T times something, 0 at init)
    assert sorted(out["grads"]) == out["trained"]
    assert all(out["grads"][n].abs().sum() > 0 for n in out["trained"] if ".lora_B." in n)
    assert float((out["adapted"] - out["base"]).abs().max()) > 1e-3  # the step moved the model
    # the merged export: an HF VL folder whose per-row log-probs with the images are the adapted engine's
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert not any(LORA_MARK in n or "base_layer" in n for n, _ in exported.named_parameters())
    batch = random_vl_batch(load_hf_config(None, tiny_config(kind)), ROWS)
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for i, ref in enumerate(hf_reference(kind, batch, model=exported.eval())):
        torch.testing.assert_close(out["adapted"][i, width_p:width_p + ref.numel()], ref, atol=2e-5, rtol=0)
    # the adapter folder names its layers in full: a leaf name would reach the vision tower's layers too
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == linears
