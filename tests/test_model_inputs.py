"""Which model folders an engine accepts and how it says no: any causal LM that `AutoModelForCausalLM`
builds (GPT-2's class is GPT2LMHeadModel, not *ForCausalLM) trains; other models, corrupt weight files and
a vocabulary smaller than the tokenizer's are clear errors before any weights load."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine.model import build_causal_lm, check_model_weights, load_hf_config
from shardrl.testing import random_batch, run_distributed

# dropout off: the engine's train-mode forward must equal the plain model's
GPT2 = dict(model_type="gpt2", vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
            eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
NUM_SEQS, MAX_LEN = 8, 14


def gpt2_model():
    return build_causal_lm(load_hf_config(None, GPT2), None, "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "gpt2"
    gpt2_model().save_pretrained(path)
    return path


# ---------------------------------------------------------------- which folders are causal LMs


def test_gpt2_folder_and_tiny_config_are_causal_lms(gpt2_folder):
    assert transformers.AutoConfig.from_pretrained(gpt2_folder).architectures == ["GPT2LMHeadModel"]
    assert type(load_hf_config(str(gpt2_folder), None)).__name__ == "GPT2Config"
    assert type(load_hf_config(None, GPT2)).__name__ == "GPT2Config"


def test_models_that_are_not_causal_lms_are_refused(tmp_path):
    small = dict(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    transformers.BertConfig(**small, architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"holds a BertForMaskedLM, not a causal LM \(a model AutoModelForCausalLM "
                                         r"builds, here a BertLMHeadModel\)"):
        load_hf_config(str(tmp_path / "bert"), None)
    transformers.T5Config(architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match=r"holds a T5ForConditionalGeneration, not a causal LM \(a model "
                                         r"AutoModelForCausalLM builds\); shardrl trains causal language models"):
        load_hf_config(str(tmp_path / "t5"), None)
    classifier = transformers.Qwen2Config(num_labels=1, architectures=["Qwen2ForSequenceClassification"])
    classifier.save_pretrained(tmp_path / "cls")
    with pytest.raises(ValueError, match="holds a Qwen2ForSequenceClassification, not a causal LM"):
        load_hf_config(str(tmp_path / "cls"), None)
    assert load_hf_config(str(tmp_path / "cls"), None, task="seq_cls").model_type == "qwen2"
    with pytest.raises(ValueError, match="model.tiny: AutoModelForCausalLM builds no 't5' model"):
        load_hf_config(None, {"model_type": "t5"})


# ---------------------------------------------------------------- corrupt weights


def test_corrupt_safetensors_names_the_file(gpt2_folder, tmp_path):
    import shutil

    check_model_weights(str(gpt2_folder))  # the good one passes
    weights = (gpt2_folder / "model.safetensors").read_bytes()
    cases = {
        "truncated": (weights[:-100], r"truncated: its tensors end at byte \d+ but the file has \d+ bytes"),
        "garbage": (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, r"its header claims \d+ bytes but the file has 72"),
        "empty": (b"", "0 bytes, shorter than a header"),
        "not_json": ((20).to_bytes(8, "little") + b"{not json at all...}" + b"\0" * 10,
                     "its header is not JSON: Expecting property name.*"),
    }
    for name, (data, why) in cases.items():
        folder = tmp_path / name
        shutil.copytree(gpt2_folder, folder)
        (folder / "model.safetensors").write_bytes(data)
        with pytest.raises(ValueError, match=rf"weights file '.*{name}/model.safetensors' is corrupt \({why}\); "
                                             r"copy or save it again"):
            check_model_weights(str(folder))


# ---------------------------------------------------------------- GPT-2 trains on the engine


def hf_log_probs(model, batch) -> torch.Tensor:
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * (pos > 0)


def pg_loss(outputs, mb, num_tokens, num_seqs):
    return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens, num_global_seqs=num_seqs), {}


def gpt2_engine_worker(folder: str):
    from shardrl.engine import build_engine

    def gathered(engine, logp):
        parts = [torch.zeros_like(logp) for _ in range(engine.mesh.dp_size)]
        dist.all_gather(parts, logp.contiguous(), group=engine.dp_group)
        return torch.cat(parts)

    out = {}
    batch = random_batch(NUM_SEQS, MAX_LEN, GPT2["vocab_size"], seed=3)
    for name, model_cfg in (("tiny_packed", ModelConfig(tiny=GPT2)),
                            ("folder_packed", ModelConfig(path=folder)),
                            ("folder_padded", ModelConfig(path=folder, use_remove_padding=False))):
        engine = build_engine(model_cfg, EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2),
                              OptimConfig(lr=1e-2, clip_grad=0.0))
        mine = batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
        res = {"units": engine.num_fsdp_units(), "log_probs": gathered(engine, engine.infer_batch(mine)["log_probs"])}
        res["step"] = engine.train_batch(mine, pg_loss)
        res["after"] = gathered(engine, engine.infer_batch(mine)["log_probs"])
        out[name] = res
    return out


@pytest.mark.multiproc
def test_gpt2_trains_one_engine_step_from_config_and_from_folder(gpt2_folder):
    results = run_distributed(gpt2_engine_worker, 2, str(gpt2_folder))
    model = gpt2_model()
    batch = random_batch(NUM_SEQS, MAX_LEN, GPT2["vocab_size"], seed=3)
    want = hf_log_probs(model, batch)
    mask = batch["loss_mask"].float()
    loss = (-want * batch["advantages"] * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    for name, res in results.items():
        assert res["units"] == GPT2["n_layer"] + 1, name  # each GPT2Block (transformer.h), then the root
        assert (res["log_probs"] - want.detach()).abs().max() < 1e-5, name
        assert res["step"]["loss"] == pytest.approx(float(loss.detach()), rel=1e-5), name
        assert res["step"]["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4), name
        # the step raised the log-probs of the tokens with positive advantages (it trained)
        gain = ((res["after"] - res["log_probs"]) * batch["advantages"] * mask).sum()
        assert gain > 0, name
        assert (res["after"] - results["tiny_packed"]["after"]).abs().max() < 1e-4, name


# ---------------------------------------------------------------- dropout is off for RL


def train_mode_log_probs_twice(disable: bool):
    from shardrl.engine import build_engine

    noisy = {**GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # GPT-2's shipped values
    engine = build_engine(ModelConfig(tiny=noisy, disable_dropout=disable),
                          EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=8), OptimConfig())
    batch = random_batch(NUM_SEQS, MAX_LEN, GPT2["vocab_size"], seed=3)
    engine.module.train()  # the update's forward runs in train mode
    with torch.no_grad():
        a, b = (engine._forward(batch, 1.0, False)["log_probs"] for _ in range(2))
    return {"diff": float((a - b).abs().max()), "pdrop": engine.hf_config.resid_pdrop}


@pytest.mark.multiproc
def test_dropout_is_off_so_the_updates_forward_is_deterministic():
    on, off = (run_distributed(train_mode_log_probs_twice, 1, disable) for disable in (False, True))
    assert on["pdrop"] == 0.1 and on["diff"] > 1e-3  # kept on: two forwards of the same batch differ
    assert off["pdrop"] == 0.0 and off["diff"] == 0.0
