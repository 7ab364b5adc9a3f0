"""One `train_batch` gives the same gradients (and so the same step) however the work is laid out, and the
same as a plain, unsharded PyTorch loop written here; `infer_batch` gives the plain model's log-probs.

The gradients the optimizer steps on are compared, not only the parameters after the step: one AdamW step
moves each parameter by about lr * sign(g), which hides a wrong loss scale or weighting, and so does
clipping (it rescales the gradient to a fixed norm). So the cases run unclipped (`clip_grad=0`: the norm
is still reported) and compare each whole gradient with the plain loop's to 1e-5 of the largest gradient
entry; a few cases clip, to check the clipped step and the norm over shards.

All runs are fp32 on CPU (gloo). Each layout runs in one spawn that tries many variants, so process
start-up is paid a few times, not once per case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import TINY_MODELS, random_batch, record_grads, run_distributed, tiny_config

pytestmark = pytest.mark.multiproc

NUM_SEQS, MAX_LEN = 8, 20
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# Adam's first step is lr * g / (|g| + eps): with eps=1e-8 a gradient entry near 1e-9 turns summation-order
# rounding (1e-12) into a visible update difference; eps=1e-6 keeps the comparison about the math.
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=0.0)  # 0: no clipping
CLIP = 0.5  # the clipped cases; the plain loop's gradient norm (1.26) is well above it
# parameters move by ~lr=1e-3 in one step. Near |g| ~ eps an Adam step amplifies gradient rounding (~1e-8) by
# lr / (4 eps) = 250, so parameters agree to a few 1e-6; the gradients are what is compared tightly
ATOL = 1e-5
GRAD_RTOL = 1e-5  # of the largest gradient entry: fp32 summation order, far below any weighting error


def make_batch(kind: str):
    return random_batch(NUM_SEQS, MAX_LEN, tiny_config(kind)["vocab_size"], seed=1)


def pg_loss_fn(mode: str, calls: list | None = None):
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        if calls is not None:
            calls.append(len(mb))
        loss_mat = -outputs["log_probs"] * mb["advantages"]
        loss = agg_loss(loss_mat, mb["loss_mask"], mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs)
        return loss, {}
    return loss_fn


def reference_step(kind: str, mode: str = "token-mean", device: str = "cpu", clip: float = 0.0, batch=None):
    """The plain loop: the HF model on the padded batch, full logits, backward, (clip,) AdamW. Returns the
    gradients AdamW stepped on (clipped when `clip` > 0), the unclipped norm and the parameters after."""
    config = load_hf_config(None, tiny_config(kind))
    config._experts_implementation = "eager"  # a mixture of experts: HF's loop over the experts
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0).to(device)
    batch = (make_batch(kind) if batch is None else batch).to(device)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape, device=device)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = agg_loss(-logp * batch["advantages"], batch["loss_mask"], mode)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"])
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    grads = {k: v.grad.detach().cpu().clone() for k, v in model.named_parameters()}
    opt.step()
    logp = logp.detach() * (pos > 0)  # nothing scores a first token
    return {"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()}, "grads": grads,
            "loss": loss.item(), "grad_norm": float(grad_norm), "log_probs": logp.cpu()}


def engine_step(kind: str, engine_kwargs: dict, mode: str = "token-mean", model_kwargs: dict | None = None,
                mesh=None, clip: float = 0.0):
    """Runs on every rank: one train_batch on this rank's share; returns the whole gradients the optimizer
    stepped on, the full params after, and metrics. `mesh` reuses a device mesh (and its communicators)
    across engines of the same layout."""
    model_cfg = ModelConfig(**{"tiny": tiny_config(kind), **(model_kwargs or {})})
    engine_kwargs = {"param_dtype": "float32", **engine_kwargs}
    engine_cfg = EngineConfig(logprob_chunk_size=7, **engine_kwargs)
    engine = build_engine(model_cfg, engine_cfg, OptimConfig(**{**OPTIM, "clip_grad": clip}), mesh=mesh)
    grads = record_grads(engine)
    batch = make_batch(kind).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    infer = engine.infer_batch(batch)["log_probs"]
    infer_all = [torch.zeros_like(infer) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(infer_all, infer, group=engine.dp_group)
    calls: list[int] = []
    metrics = engine.train_batch(batch, pg_loss_fn(mode, calls))
    params = {k: v.cpu() for k, v in engine.export_weights()}
    assert len(grads) == 1, "train_batch skipped the optimizer step"
    return {"params": params, "grads": grads[0], "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "num_micro_batches": len(calls), "log_probs": torch.cat(infer_all).cpu()}


def case(mode: str = "token-mean", model: dict | None = None, clip: float = 0.0, kind: str = "qwen2", **engine):
    return dict(kind=kind, engine=engine, mode=mode, model=model, clip=clip)


VARIANTS_1 = {
    "mb1": case(micro_batch_size_per_gpu=1),
    "mb8": case(micro_batch_size_per_gpu=8),
    # packed attention through the registered varlen function (its per-sequence path on CPU)
    "varlen": case(model=dict(attn_implementation="shardrl_varlen"), micro_batch_size_per_gpu=4),
    # decoder blocks compiled with torch.compile (inductor's CPU backend here)
    "compile": case(model=dict(attn_implementation="shardrl_varlen"), micro_batch_size_per_gpu=4, compile=True),
}
VARIANTS_2 = {
    "mb2": case(micro_batch_size_per_gpu=2),
    "mb1": case(micro_batch_size_per_gpu=1),
    "mb4": case(micro_batch_size_per_gpu=4),
    "zero2": case(micro_batch_size_per_gpu=2, reshard_after_forward=False),
    "dynamic": case(use_dynamic_bsz=True, max_token_len_per_gpu=24),
    "prefetch": case(micro_batch_size_per_gpu=2, forward_prefetch=True),
    "ulysses_sp2": case(micro_batch_size_per_gpu=2, ulysses_sequence_parallel_size=2),  # dp=1
    "padded": case(model=dict(use_remove_padding=False), micro_batch_size_per_gpu=2),
    "checkpointing": case(model=dict(gradient_checkpointing=True), micro_batch_size_per_gpu=2),
    "cpu_offload_policy": case(micro_batch_size_per_gpu=2, offload_params=True),
    "seq-mean-token-mean": case("seq-mean-token-mean", micro_batch_size_per_gpu=1),
    "seq-mean-token-sum": case("seq-mean-token-sum", use_dynamic_bsz=True, max_token_len_per_gpu=24),
    "tied_llama": case(kind="llama", micro_batch_size_per_gpu=2),
    "clipped": case(clip=CLIP, micro_batch_size_per_gpu=2),
}
VARIANTS_4 = {
    "full": case(micro_batch_size_per_gpu=1),
    "hsdp": case(micro_batch_size_per_gpu=2, fsdp_size=2),
    "hsdp_dynamic": case(use_dynamic_bsz=True, max_token_len_per_gpu=20, fsdp_size=2),
    "ulysses_sp2_dp2": case(micro_batch_size_per_gpu=2, ulysses_sequence_parallel_size=2),
    # 2 KV heads < sp=4: each is repeated; dynamic budget is per rank (a row's quarter)
    "ulysses_sp4": case(use_dynamic_bsz=True, max_token_len_per_gpu=6, ulysses_sequence_parallel_size=4),
    "hsdp_clipped": case(clip=CLIP, micro_batch_size_per_gpu=2, fsdp_size=2),
}
WORLDS = {1: VARIANTS_1, 2: VARIANTS_2, 4: VARIANTS_4}
CASES = [(world, name) for world, variants in WORLDS.items() for name in variants]


def many_steps(variants: dict):
    return {name: engine_step(c["kind"], c["engine"], c["mode"], c["model"], clip=c["clip"])
            for name, c in variants.items()}


@pytest.fixture(scope="module")
def reference():
    ref = {(k, m, 0.0): reference_step(k, m) for k in TINY_MODELS for m in MODES}
    ref["qwen2", "token-mean", CLIP] = reference_step("qwen2", clip=CLIP)
    return ref


@pytest.fixture(scope="module")
def runs():
    """world size -> variant -> result; each world is spawned once, on first use."""
    class Lazy(dict):
        def __missing__(self, world):
            self[world] = run_distributed(many_steps, world, WORLDS[world])
            return self[world]
    return Lazy()


def assert_same_params(got: dict, want: dict, atol: float = ATOL):
    assert set(got) == set(want), set(got) ^ set(want)
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff:.3g} > {atol}"


def assert_same_grads(got: dict, want: dict, rtol: float = GRAD_RTOL):
    """Every parameter's gradient within `rtol` of the largest gradient entry (of all parameters: some, such
    as the key biases, have a gradient that is zero up to rounding)."""
    assert set(got) == set(want), set(got) ^ set(want)
    scale = max(w.abs().max().item() for w in want.values())
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        assert diff <= rtol * scale, f"{name}: max |grad diff| {diff:.3g} > {rtol} x max |grad| {scale:.3g}"


def test_reference_gradients_are_unclipped_and_steps_move_parameters(reference):
    # guards the comparisons below: a step that changed nothing would make every layout "agree"
    config = load_hf_config(None, TINY_MODELS["qwen2"])
    init = dict(build_causal_lm(config, None, "cpu", torch.float32, seed=0).named_parameters())
    plain, clipped = reference["qwen2", "token-mean", 0.0], reference["qwen2", "token-mean", CLIP]
    for ref in (plain, clipped):
        assert max((ref["params"][k] - v).abs().max().item() for k, v in init.items()) > 5e-4
    # the unclipped cases see the raw gradient; in the clipped ones clipping is active
    norm = torch.cat([g.flatten() for g in plain["grads"].values()]).norm().item()
    assert norm == pytest.approx(plain["grad_norm"], rel=1e-5) and norm > 2 * CLIP
    clipped_norm = torch.cat([g.flatten() for g in clipped["grads"].values()]).norm().item()
    assert clipped_norm == pytest.approx(CLIP, rel=1e-5)


def test_gradient_tolerance_sees_one_sequence_counted_twice(reference):
    # what the comparisons must catch: the loss of one micro-batch (here, one sequence) counted twice
    batch = make_batch("qwen2")
    batch["advantages"][0] *= 2
    wrong = reference_step("qwen2", batch=batch)["grads"]
    with pytest.raises(AssertionError, match="grad diff"):
        assert_same_grads(wrong, reference["qwen2", "token-mean", 0.0]["grads"])


@pytest.mark.parametrize("world,variant", CASES, ids=[f"world{w}-{v}" for w, v in CASES])
def test_layout_matches_plain_loop(runs, reference, world, variant):
    c = WORLDS[world][variant]
    got, want = runs[world][variant], reference[c["kind"], c["mode"], c["clip"]]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert_same_grads(got["grads"], want["grads"])
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)  # the unclipped norm over all shards
    assert_same_params(got["params"], want["params"])


def test_micro_batch_counts(runs):
    # 4 sequences per rank with a 24-token budget cannot fit in one micro-batch
    assert runs[2]["dynamic"]["num_micro_batches"] >= 2
    assert runs[2]["mb1"]["num_micro_batches"] == 4
    assert runs[2]["mb4"]["num_micro_batches"] == 1
    assert runs[1]["mb1"]["num_micro_batches"] == 8
    assert runs[1]["mb8"]["num_micro_batches"] == 1


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_infer_log_probs_equal_plain_model(runs, reference, world):
    for name, res in runs[world].items():  # includes dynamic batching, which reorders samples
        want = reference[WORLDS[world][name]["kind"], "token-mean", 0.0]["log_probs"]
        diff = (res["log_probs"] - want).abs().max().item()
        assert diff < 1e-5, f"variant {name}: max |diff| {diff:.3g}"
