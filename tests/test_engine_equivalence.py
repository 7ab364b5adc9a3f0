"""One `train_batch` gives the same parameters however the work is laid out, and the same as a plain,
unsharded PyTorch loop written here; `infer_batch` gives the plain model's log-probs.

All runs are fp32 on CPU (gloo). Each layout runs in one spawn that tries many variants, so process
start-up is paid a few times, not once per case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardrl.algos.aggregate import agg_loss
from shardrl.config import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import TINY_MODELS, random_batch, run_distributed

pytestmark = pytest.mark.multiproc

NUM_SEQS, MAX_LEN = 8, 20
# Adam's first step is lr * g / (|g| + eps): with eps=1e-8 a gradient entry near 1e-9 turns summation-order
# rounding (1e-12) into a visible update difference; eps=1e-6 keeps the comparison about the math.
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=1.0)
ATOL = 2e-6  # parameters move by ~lr=1e-3 in one step; layouts must agree far below that


def make_batch(kind: str):
    return random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS[kind]["vocab_size"], seed=1)


def pg_loss_fn(mode: str):
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        loss_mat = -outputs["log_probs"] * mb["advantages"]
        loss = agg_loss(loss_mat, mb["loss_mask"], mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs)
        return loss, {}
    return loss_fn


def reference_step(kind: str, mode: str = "token-mean", device: str = "cpu"):
    """The plain loop: the HF model on the padded batch, full logits, AdamW, clip."""
    config = load_hf_config(None, TINY_MODELS[kind])
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0).to(device)
    batch = make_batch(kind).to(device)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape, device=device)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = agg_loss(-logp * batch["advantages"], batch["loss_mask"], mode)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"])
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip_grad"])
    opt.step()
    return {"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
            "loss": loss.item(), "grad_norm": float(grad_norm), "log_probs": (logp.detach() * (pos > 0)).cpu()}  # nothing scores a first token


def engine_step(kind: str, engine_kwargs: dict, mode: str = "token-mean", model_kwargs: dict | None = None,
                mesh=None):
    """Runs on every rank: one train_batch on this rank's share; returns full params and metrics.
    `mesh` reuses a device mesh (and its communicators) across engines of the same layout."""
    model_cfg = ModelConfig(tiny=TINY_MODELS[kind], **(model_kwargs or {}))
    engine_kwargs = {"param_dtype": "float32", **engine_kwargs}
    engine_cfg = EngineConfig(logprob_chunk_size=7, loss_agg_mode=mode, **engine_kwargs)
    engine = build_engine(model_cfg, engine_cfg, OptimConfig(**OPTIM), mesh=mesh)
    batch = make_batch(kind).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    infer = engine.infer_batch(batch)["log_probs"]
    infer_all = [torch.zeros_like(infer) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(infer_all, infer, group=engine.dp_group)
    metrics = engine.train_batch(batch, pg_loss_fn(mode))
    params = {k: v.cpu() for k, v in engine.export_weights()}
    return {"params": params, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "num_micro_batches": metrics["num_micro_batches"], "log_probs": torch.cat(infer_all).cpu()}


VARIANTS_2 = {
    "mb2": dict(micro_batch_size_per_gpu=2),
    "mb1": dict(micro_batch_size_per_gpu=1),
    "mb4": dict(micro_batch_size_per_gpu=4),
    "zero2": dict(micro_batch_size_per_gpu=2, reshard_after_forward=False),
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24),
    "prefetch": dict(micro_batch_size_per_gpu=2, forward_prefetch=True),
    "ulysses_sp2": dict(micro_batch_size_per_gpu=2, ulysses_sequence_parallel_size=2),  # dp=1
}
VARIANTS_4 = {
    "full": dict(micro_batch_size_per_gpu=1),
    "hsdp": dict(micro_batch_size_per_gpu=2, fsdp_size=2),
    "hsdp_dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=20, fsdp_size=2),
    "ulysses_sp2_dp2": dict(micro_batch_size_per_gpu=2, ulysses_sequence_parallel_size=2),
    # 2 KV heads < sp=4: each is repeated; dynamic budget is per rank (a row's quarter)
    "ulysses_sp4": dict(use_dynamic_bsz=True, max_token_len_per_gpu=6, ulysses_sequence_parallel_size=4),
}


def many_steps(kind: str, variants: dict, extra: dict | None = None):
    out = {name: engine_step(kind, kw) for name, kw in variants.items()}
    for name, (kw, mode, model_kw) in (extra or {}).items():
        out[name] = engine_step(kind, kw, mode, model_kw)
    return out


@pytest.fixture(scope="module")
def reference():
    return {(k, m): reference_step(k, m) for k in TINY_MODELS for m in ("token-mean", "seq-mean-token-mean",
                                                                          "seq-mean-token-sum")}


@pytest.fixture(scope="module")
def world2():
    extra = {
        "padded": (dict(micro_batch_size_per_gpu=2), "token-mean", dict(use_remove_padding=False)),
        "checkpointing": (dict(micro_batch_size_per_gpu=2), "token-mean", dict(gradient_checkpointing=True)),
        "cpu_offload_policy": (dict(micro_batch_size_per_gpu=2, offload_params=True), "token-mean", None),
        "seq-mean-token-mean": (dict(micro_batch_size_per_gpu=1), "seq-mean-token-mean", None),
        "seq-mean-token-sum": (dict(use_dynamic_bsz=True, max_token_len_per_gpu=24), "seq-mean-token-sum", None),
    }
    return {"qwen2": run_distributed(many_steps, 2, "qwen2", VARIANTS_2, extra),
            "llama": run_distributed(many_steps, 2, "llama", {"mb2": VARIANTS_2["mb2"]})}


@pytest.fixture(scope="module")
def world4():
    return run_distributed(many_steps, 4, "qwen2", VARIANTS_4)


@pytest.fixture(scope="module")
def world1():
    # "varlen": packed attention through the registered varlen function (its per-sequence path on CPU)
    extra = {"varlen": (dict(micro_batch_size_per_gpu=4), "token-mean", dict(attn_implementation="shardrl_varlen")),
             # decoder blocks compiled with torch.compile (inductor's CPU backend here)
             "compile": (dict(micro_batch_size_per_gpu=4, compile=True), "token-mean",
                         dict(attn_implementation="shardrl_varlen"))}
    return run_distributed(many_steps, 1, "qwen2", {"mb1": dict(micro_batch_size_per_gpu=1),
                                                      "mb8": dict(micro_batch_size_per_gpu=8)}, extra)


def assert_same_params(got: dict, want: dict, atol: float = ATOL):
    assert set(got) == set(want), set(got) ^ set(want)
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff:.3g} > {atol}"


def test_reference_step_moves_parameters(reference):
    # guards the comparisons below: a step that changed nothing would make every layout "agree"
    config = load_hf_config(None, TINY_MODELS["qwen2"])
    init = dict(build_causal_lm(config, None, "cpu", torch.float32, seed=0).named_parameters())
    moved = max((reference["qwen2", "token-mean"]["params"][k] - v).abs().max().item() for k, v in init.items())
    assert moved > 5e-4
    # and clipping is active, so the layouts must also agree on the total norm over their shards
    assert reference["qwen2", "token-mean"]["grad_norm"] > OPTIM["clip_grad"]


@pytest.mark.parametrize("variant", sorted(VARIANTS_2))
def test_world2_matches_plain_loop(world2, reference, variant):
    got, want = world2["qwen2"][variant], reference["qwen2", "token-mean"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert_same_params(got["params"], want["params"])


def test_dynamic_batching_cuts_by_tokens(world2):
    # 4 sequences per rank with a 24-token budget cannot fit in one micro-batch
    assert world2["qwen2"]["dynamic"]["num_micro_batches"] >= 2
    assert world2["qwen2"]["mb1"]["num_micro_batches"] == 4


@pytest.mark.parametrize("variant", ["padded", "checkpointing", "cpu_offload_policy"])
def test_padded_checkpointed_offloaded_match_plain_loop(world2, reference, variant):
    assert_same_params(world2["qwen2"][variant]["params"], reference["qwen2", "token-mean"]["params"])


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_agg_modes_match_plain_loop(world2, reference, mode):
    got, want = world2["qwen2"][mode], reference["qwen2", mode]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert_same_params(got["params"], want["params"])


def test_tied_llama_matches_plain_loop(world2, reference):
    got, want = world2["llama"]["mb2"], reference["llama", "token-mean"]
    assert_same_params(got["params"], want["params"])


@pytest.mark.parametrize("variant", sorted(VARIANTS_4))
def test_world4_and_hsdp_match_plain_loop(world4, reference, variant):
    got, want = world4[variant], reference["qwen2", "token-mean"]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert_same_params(got["params"], want["params"])


@pytest.mark.parametrize("variant", ["mb1", "mb8", "varlen", "compile"])
def test_world1_matches_plain_loop(world1, reference, variant):
    assert_same_params(world1[variant]["params"], reference["qwen2", "token-mean"]["params"])


@pytest.mark.parametrize("world", ["world1", "world2", "world4"])
def test_infer_log_probs_equal_plain_model(request, reference, world):
    results = request.getfixturevalue(world)
    results = results["qwen2"] if world == "world2" else results
    want = reference["qwen2", "token-mean"]["log_probs"]
    for name, res in results.items():  # includes dynamic batching, which reorders samples
        diff = (res["log_probs"] - want).abs().max().item()
        assert diff < 1e-5, f"variant {name}: max |diff| {diff:.3g}"
