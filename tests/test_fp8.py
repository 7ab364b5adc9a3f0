"""FP8 rollouts (`rollout.quantization=fp8`, `shardrl.rollout.fast.fp8`): the quantizer and its scale layout against a
plain reference written here, and the fast rollout on tiny models (CPU, fp32, weight-only): its log-probs equal a
plain forward of the model whose linear weights are replaced by their dequantized FP8 values."""

from __future__ import annotations

import copy

import pytest
import torch

from shardrl.rollout import SamplingParams
from shardrl.rollout.fast.fp8 import FP8_DTYPE, dequantize_fp8, fp8_linear, Fp8Weight, quantize_fp8
from shardrl.tokenizer import build_char_tokenizer
from test_rollout_fast import encode, make_rollout, reference_model
from test_rollout_hf import recomputed_log_probs

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def reference_quantize(w: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Element by element from the definition: scale = amax / 448 over each row (or each block x block tile), 1
    for an all-zero one; Q = round-to-E4M3(w / scale)."""
    out, inp = w.shape
    rows, cols = (out, 1) if not block else (out // block, inp // block)
    scale = torch.ones(rows, cols)
    q = torch.empty(out, inp)
    for r in range(rows):
        for c in range(cols):
            sl = (slice(r, r + 1), slice(None)) if not block else (slice(r * block, (r + 1) * block),
                                                                    slice(c * block, (c + 1) * block))
            amax = w[sl].abs().max().item()
            if amax > 0:
                scale[r, c] = amax / 448.0
            q[sl] = w[sl] / scale[r, c]
    return q.to(FP8_DTYPE), scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 0) -> torch.Tensor:
    if block:
        scale = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.float() * scale


@pytest.mark.parametrize("block", [0, 4])
def test_quantize_matches_the_reference_and_round_trips_within_e4m3_precision(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 16, generator=g) * torch.logspace(-3, 1, 12)[:, None]  # rows of very different sizes
    w[5] = 0.0  # an all-zero row (and, with blocks, zero tiles)
    q, s = quantize_fp8(w, block)
    ref_q, ref_s = reference_quantize(w, block)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == ((12, 1) if not block else (3, 4))
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), ref_q.float())
    back = dequantize_fp8(q, s, torch.float32, block)
    assert torch.equal(back, reference_dequantize(q, s, block))
    assert torch.equal(back[5], torch.zeros(16))
    # each row's (tile's) largest value lands on 448 exactly; E4M3 keeps 3 mantissa bits: error <= 2^-4 relative,
    # plus the subnormal step (2^-9 * scale) for small values
    scales = s if not block else s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    assert ((back - w).abs() <= w.abs() / 16 + scales * 2.0**-9 + 1e-12).all()
    assert (back != w).any()  # (it does round)


def test_a_weight_with_inf_or_nan_is_refused():
    w = torch.randn(4, 8)
    w[2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(w)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(w)


def test_block_size_must_tile_the_weight():
    with pytest.raises(ValueError, match="does not tile into 8 x 8"):
        quantize_fp8(torch.randn(12, 16), 8)


@pytest.mark.parametrize("block", [0, 4])
def test_fp8_linear_weight_only_equals_a_linear_of_the_dequantized_weight(block):
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(8, 16, generator=g), torch.randn(8, generator=g), torch.randn(3, 5, 16, generator=g)
    q, s = quantize_fp8(w, block)
    got = fp8_linear(x, Fp8Weight(q, s, block), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, reference_dequantize(q, s, block), b),
                               atol=1e-5, rtol=1e-5)


def dequantized_model(model, block: int = 0, round_trip=None):
    """A copy of `model` whose decoder linear weights are replaced by their FP8 round trip (the reference's own, or
    `round_trip(w)`)."""
    model = copy.deepcopy(model)
    round_trip = round_trip or (lambda w: reference_dequantize(*reference_quantize(w, block), block))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
                p.copy_(round_trip(p))
    return model


def e5m2_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per-channel E5M2 (one mantissa bit fewer than E4M3): a coarser quantization, to bound the mismatch by."""
    scale = w.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e5m2).max
    return (w / scale).to(torch.float8_e5m2).float() * scale


@pytest.mark.parametrize("kind,block", [("qwen2", 0), ("llama", 0), ("qwen2", 8)])
def test_fp8_rollout_log_probs_equal_a_forward_of_the_dequantized_model(tok, kind, block):
    model = reference_model(tok, seed=1, kind=kind)
    ids, mask = encode(tok)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    fp8 = make_rollout("fast", tok, model, quantization="fp8", fp8_block_size=block)
    out = fp8.generate(ids, mask, sampling)
    batch = out.to_batch()
    loss_mask = batch["loss_mask"].bool()
    got = batch["sampled_log_probs"][loss_mask]
    with torch.no_grad():
        exact = recomputed_log_probs(dequantized_model(model, block), out, 1.0)[loss_mask]
        trainer = recomputed_log_probs(model, out, 1.0)[loss_mask]
        coarser = recomputed_log_probs(dequantized_model(model, round_trip=e5m2_round_trip), out, 1.0)[loss_mask]
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=0)
    # against the full-precision model the sampler's log-probs are off: not nothing, and less than E5M2 weights'
    # (these random models, initialised wide, are far more sensitive than trained ones)
    diff = (got - trainer).abs().mean().item()
    assert 1e-3 < diff < (coarser - trainer).abs().mean().item(), diff
    # greedy: the first tokens mostly the full-precision rollout's (later ones part once one differs)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    a = fp8.generate(ids, mask, greedy).response_ids
    b = make_rollout("fast", tok, model).generate(ids, mask, greedy).response_ids
    assert (a[:, 0] == b[:, 0]).float().mean() >= 0.5 and not torch.equal(a, b)


def test_a_weight_sync_after_an_update_quantizes_the_new_weights(tok):
    model = reference_model(tok, seed=1)
    ids, mask = encode(tok)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    rollout = make_rollout("fast", tok, model, quantization="fp8")
    qkv = rollout.model.model.layers[0].self_attn.qkv_weight
    address = qkv.data_ptr()
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in updated.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rollout.load_weights(updated.named_parameters())
    assert qkv.data_ptr() == address and qkv.dtype == FP8_DTYPE  # in place: captured graphs stay valid
    after = rollout.generate(ids, mask, sampling)
    lm = after.to_batch()["loss_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(after.to_batch()["sampled_log_probs"][lm],
                                   recomputed_log_probs(dequantized_model(updated), after, 1.0)[lm], atol=1e-5, rtol=0)
        old = recomputed_log_probs(dequantized_model(model), after, 1.0)[lm]
    assert (after.to_batch()["sampled_log_probs"][lm] - old).abs().max() > 1e-3
    # a sync carrying inf is refused
    bad = {n: p.detach().clone() for n, p in updated.named_parameters()}
    bad["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        rollout.load_weights(bad.items())


def test_fp8_rollout_keeps_embeddings_norms_and_head_in_the_model_dtype(tok):
    rollout = make_rollout("fast", tok, reference_model(tok, seed=1), quantization="fp8")
    dtypes = {n: p.dtype for n, p in rollout.model.named_parameters()}
    fp8 = sorted(n for n, d in dtypes.items() if d == FP8_DTYPE)
    assert len(fp8) == 2 * 7 and all(n.rpartition(".")[0].rpartition(".")[2] in LINEARS for n in fp8)
    assert dtypes["lm_head.weight"] == dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == dtypes["model.layers.0.self_attn.q_proj.bias"] == torch.float32
    layer = rollout.model.model.layers[0]
    assert layer.self_attn.qkv_scale.shape == (32 + 16 + 16, 1) and layer.mlp.gate_up_scale.shape == (128, 1)


def test_fp8_rollout_refusals(tok):
    model = reference_model(tok, seed=1)
    with pytest.raises(ValueError, match="activations=dynamic needs a CUDA GPU"):
        make_rollout("fast", tok, model, quantization="fp8", fp8_activations="dynamic")
    with pytest.raises(ValueError, match="quantization='int4'"):
        make_rollout("fast", tok, model, quantization="int4")
    rollout = make_rollout("fast", tok, model, quantization="fp8")
    with pytest.raises(ValueError, match="FP8 rollout"):
        rollout.share_weights(model.named_parameters())


def test_config_fp8_is_a_fast_backend_setting_and_turns_rollout_correction_on():
    from shardrl.config.schema import ConfigError
    from shardrl.config.registry import load_config
    from shardrl.plan.defaults import resolve_device_defaults
    from shardrl.plan.plan import Plan

    with pytest.raises(ConfigError, match=r"rollout.quantization.*backend=fast only"):
        load_config(None, ["rollout.backend=hf", "rollout.quantization=fp8"])
    with pytest.raises(ConfigError, match=r"rollout.quantization applies to backend=fast only.*null chose hf"):
        resolve_device_defaults(load_config(None, ["rollout.quantization=fp8"]))  # (this CPU: hf)
    with pytest.raises(ConfigError, match=r"rollout.fp8.activations.*block scales"):
        load_config(None, ["rollout.fp8.activations=dynamic", "rollout.fp8.block_size=128"])
    with pytest.raises(ConfigError, match=r"rollout.quantization.*model.lora"):
        load_config(None, ["rollout.backend=fast", "rollout.quantization=fp8", "model.lora.rank=8"])
    # algorithm.rollout_is left null: on with fp8 (one line says so), off without; a value given stays
    fp8 = load_config(None, ["rollout.backend=fast", "rollout.quantization=fp8", "actor.ppo_mini_batch_size=8"])
    assert fp8.algorithm.rollout_is is None and fp8.rollout_correction()
    plan = Plan.for_rl(fp8, 1, 1)
    assert plan.config.algorithm.rollout_is is True and plan.steps.rollout_is in ("batch", "loss")
    assert [line for line in plan.choices if line.startswith("algorithm.rollout_is=true (null: on with rollout.q")]
    plain = Plan.for_rl(load_config(None, ["rollout.backend=fast"]), 1, 1)
    assert plain.config.algorithm.rollout_is is False and plain.steps.rollout_is == "off" and not plain.choices
    off = Plan.for_rl(load_config(None, ["rollout.backend=fast", "rollout.quantization=fp8",
                                         "algorithm.rollout_is=false"]), 1, 1)
    assert off.config.algorithm.rollout_is is False and off.steps.rollout_is == "off"
    # the rollout built from the config is FP8
    from shardrl.rollout.build import fast_rollout_kwargs
    kwargs = fast_rollout_kwargs(load_config(None, ["rollout.backend=fast", "rollout.quantization=fp8",
                                                    "rollout.fp8.block_size=128"]).rollout)
    assert (kwargs["quantization"], kwargs["fp8_block_size"], kwargs["fp8_activations"]) == ("fp8", 128, "none")


def test_an_fp8_rollout_the_run_cannot_build_is_refused_before_any_model_is():
    """Start-up (`resolve_device_defaults`, which has the policy's config and knows the device) refuses block scales
    that do not tile the model's linear layers and FP8 activations without a GPU of compute capability 8.9 (they
    were refused only when the rollout was built, after the engines had loaded the model); rollout.fp8 settings
    without rollout.quantization=fp8 are warned of (they change nothing)."""
    from shardrl.config.registry import load_config
    from shardrl.config.schema import ConfigError
    from shardrl.engine.model import load_hf_config
    from shardrl.plan.defaults import resolve_device_defaults

    tiny = ("model.tiny={model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 1000}")
    fp8 = [tiny, "rollout.backend=fast", "rollout.quantization=fp8"]
    cfg = load_config(None, [*fp8, "rollout.fp8.block_size=48"])
    hf = load_hf_config(cfg.model.path, cfg.model.tiny)
    with pytest.raises(ConfigError, match=r"rollout.quantization=fp8: a weight of shape \(64, 64\) does not tile"):
        resolve_device_defaults(cfg, hf)
    resolve_device_defaults(load_config(None, [*fp8, "rollout.fp8.block_size=32"]), hf)  # (32 tiles 64 and 128)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="activations=dynamic needs a CUDA GPU"):
            resolve_device_defaults(load_config(None, [*fp8, "rollout.fp8.activations=dynamic"]), hf)
    for given in ("rollout.fp8.activations=dynamic", "rollout.fp8.block_size=128"):
        lines = load_config(None, ["rollout.backend=fast", given]).ignored_settings()
        assert [line for line in lines if line.startswith(f"{given.split('=')[0]} is set but rollout.quantization=")]
    assert not load_config(None, [*fp8, "rollout.fp8.block_size=128"]).ignored_settings()


@pytest.mark.parametrize("block", [None, 32])
def test_memory_ledger_counts_the_fp8_rollout_weights_as_the_rollout_holds_them(tok, block):
    from shardrl.config.registry import load_config
    from shardrl.engine.model import load_hf_config
    from shardrl.plan.layout import GIB, derive_layout
    from shardrl.plan.memory import phase_ledger
    from shardrl.rollout import build_rollout

    tiny = ("model.tiny={model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 1000, tie_word_embeddings: false}")
    overrides = [tiny, "rollout.backend=fast", "rollout.quantization=fp8"]
    c = load_config(None, overrides + ([f"rollout.fp8.block_size={block}"] if block else []))
    hf = load_hf_config(c.model.path, c.model.tiny)
    rollout = build_rollout("fast", hf, tok, "cpu", torch.bfloat16, quantization="fp8", fp8_block_size=block)
    held = sum(p.numel() * p.element_size() for p in rollout.model.parameters())
    held += sum(b.numel() * b.element_size() for n, b in rollout.model.named_buffers() if n.endswith("weight_scale"))
    gen = {i["name"]: i for i in phase_ledger(c, derive_layout(c, 1, 1), hf)["phases"]["gen"]["items"]}
    assert gen["rollout weights"]["gib"] * GIB == pytest.approx(held) and "FP8" in gen["rollout weights"]["how"]
    bf16 = load_config(None, [tiny, "rollout.backend=fast"])
    plain = {i["name"]: i for i in phase_ledger(bf16, derive_layout(bf16, 1, 1), hf)["phases"]["gen"]["items"]}
    assert plain["rollout weights"]["gib"] > gen["rollout weights"]["gib"]
