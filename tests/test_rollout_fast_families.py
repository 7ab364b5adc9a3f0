"""The fast rollout on every model family it supports (`shardrl.models.families`): Qwen3, Llama 3.x rope
scaling, Mistral, Qwen2 with sliding windows, Gemma 2 and Gemma 3 text, the mixtures of experts Qwen3-MoE and
Mixtral. Tiny random configs built from each
family's HF config class, fp32 on the CPU: greedy tokens equal HF `generate`'s over 32+ new tokens (prompts
longer than the sliding window), sampled log-probs equal the training engine's recomputation, and every
HF weight name loads. The Triton decode kernel's window and soft-cap run in Triton's interpreter here and
compiled in the cuda test.

Run as a script (`TRITON_INTERPRET=1 python tests/test_rollout_fast_families.py`) it runs the interpreter
check, which `test_fast_family_triton_window_and_softcap_in_interpreter` does in a fresh process."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from shardrl.config.schema import load_config
from shardrl.engine.model import build_causal_lm
from shardrl.rollout import FastRollout, RolloutOutput, SamplingParams
from shardrl.tokenizer import build_char_tokenizer
from shardrl.plan.defaults import resolve_device_defaults

WINDOW = 8  # the longest prompt is 25 tokens, and 32+ are generated: every sliding layer slides

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.3)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# name: (HF config class, its arguments); the first word of the name is the family
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
    "llama3_rope": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral_window": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=8, tie_word_embeddings=False)),
    "qwen2_window": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                                    num_hidden_layers=3, tie_word_embeddings=False)),
    # Gemma: 3 layers, sliding / full / sliding; head_dim 16 with a query_pre_attn_scalar of its own
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, num_hidden_layers=3, sliding_window=WINDOW,
                                               query_pre_attn_scalar=12, attn_logit_softcapping=4.0,
                                               final_logit_softcapping=3.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=16, num_hidden_layers=3, sliding_window=WINDOW,
                                                        sliding_window_pattern=2, query_pre_attn_scalar=12)),
    # mixtures of experts: top-2 of 8 (Qwen3-MoE, renormalized; its layer 1 dense) and of 4 (Mixtral)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, moe_intermediate_size=16, num_experts=8,
                                                    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                                    tie_word_embeddings=False)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                                 tie_word_embeddings=False)),
    # OLMoE: q/k norms over all heads at once, top-2 of 4 experts left unnormalized, on every layer
    "olmoe": (transformers.OlmoeConfig, dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=False, tie_word_embeddings=False)),
}
ROPE_VARIANTS = {
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
}
PROMPTS = ["1+2=", "hello world ", "ab", "what is 7*6? ", "x", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def family_config(tok, name: str, **extra):
    cls, kwargs = FAMILIES[name]
    return cls(**{**BASE, **kwargs, **extra}, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def attn_of(config) -> str:
    return "eager" if config.model_type.startswith("gemma") else "sdpa"  # HF's Gemma 2 has no SDPA (soft-cap)


def hf_model(config, seed: int = 1):
    return build_causal_lm(config, None, "cpu", torch.float32, seed=seed, attn_implementation=attn_of(config)).eval()


def encode(tok):
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def hf_greedy(tok, model, max_new_tokens: int) -> RolloutOutput:
    from shardrl.rollout import HFRollout

    hf = HFRollout(model.config, tok, "cpu", torch.float32, attn_implementation=attn_of(model.config))
    hf.load_weights(model.named_parameters())
    return hf.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=max_new_tokens))


def fast_rollout(tok, model, **kwargs) -> FastRollout:
    fast = FastRollout(model.config, tok, "cpu", torch.float32, max_batch=4, sync_every=6, seq_bucket=16, **kwargs)
    fast.load_weights(model.named_parameters())  # as Engine.export_weights streams them: one name per tensor
    return fast


def assert_same_tokens(got: RolloutOutput, want: RolloutOutput):
    assert torch.equal(got.response_ids, want.response_ids), (got.response_text, want.response_text)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.sampled_log_probs, want.sampled_log_probs, atol=1e-5, rtol=0)


def engine_log_probs(out: RolloutOutput, model, temperature: float) -> torch.Tensor:
    """The training engine's packed, chunked recomputation of `out`'s log-probs, (N, P+R)."""
    from shardrl.engine.model import PolicyModel

    batch = out.to_batch()
    model.config.use_cache = False  # as the engine: a cache would hide the packed sequence boundaries
    with torch.no_grad():
        return PolicyModel(model, chunk_size=7).eval()(batch["input_ids"], batch["attention_mask"],
                                                       remove_padding=True, temperature=temperature)["log_probs"]


def assert_log_probs_recomputed(out: RolloutOutput, model, temperature: float, engine: bool = True,
                                atol: float = 1e-5):
    """The sampler's log-probs equal HF's plain forward and (`engine`) the training engine's recomputation."""
    from test_rollout_hf import recomputed_log_probs

    batch = out.to_batch()
    loss_mask = batch["loss_mask"].bool()
    assert loss_mask.sum() > 100
    got = batch["sampled_log_probs"][loss_mask]
    torch.testing.assert_close(got, recomputed_log_probs(model, out, temperature)[loss_mask], atol=atol, rtol=0)
    if engine:
        torch.testing.assert_close(got, engine_log_probs(out, model, temperature)[loss_mask], atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fast_family_matches_hf_generate_and_the_engine(tok, name, caplog):
    config = family_config(tok, name)
    model = hf_model(config)
    want = hf_greedy(tok, model, max_new_tokens=36)
    with caplog.at_level(logging.WARNING):
        fast = fast_rollout(tok, model)
    assert "left" not in caplog.text  # every parameter came from an HF name (the tied head too)
    assert_same_tokens(fast.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=36)), want)
    assert want.response_mask.sum(1).max() >= 32
    sampled = fast.generate(*encode(tok), SamplingParams(n=2, temperature=0.9, max_new_tokens=24, seed=3))
    assert_log_probs_recomputed(sampled, model, 0.9)

    consts = fast.model.layer_consts
    windows = [c.window for c in consts]
    if name.startswith(("mistral", "qwen2", "gemma")):
        assert WINDOW in windows and (None in windows) == (not name.startswith("mistral"))
        # the window decides tokens here: without it the same weights decode otherwise
        fast.model.layer_consts = [c._replace(window=None) for c in consts]
        unwindowed = fast.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=36))
        assert not torch.equal(unwindowed.response_ids, want.response_ids)
        fast.model.layer_consts = consts
    if name == "gemma2":  # so does the attention soft-cap
        fast.model.layer_consts = [c._replace(softcap=None) for c in consts]
        uncapped = fast.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=36))
        assert not torch.equal(uncapped.response_ids, want.response_ids)
        fast.model.layer_consts = consts


@pytest.mark.parametrize("normalize", [True, False])
def test_the_dense_expert_path_of_cuda_graphs_equals_the_grouped_one(normalize):
    """Where a CUDA graph cannot take grouped products (fp32, unaligned rows), a decode step runs every expert on
    every token: the same sums as the grouped path (and the loop), per token, to fp32 rounding."""
    from shardrl.rollout.fast.moe import dense_experts, moe_mlp, route

    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(13, 32, generator=g), torch.randn(8, 32, generator=g)
    gate_up, down = torch.randn(8, 2 * 16, 32, generator=g) / 6, torch.randn(8, 32, 16, generator=g) / 4
    want = moe_mlp(x, router, gate_up, down, "silu", 2, normalize, True)
    weights, experts = route(x, router, 2, normalize, True)
    got = dense_experts(x, weights, experts, gate_up, down, "silu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    other = route(x, router, 2, not normalize, True)[0]  # the other weighting is caught
    assert (dense_experts(x, other, experts, gate_up, down, "silu") - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_fast_family_moe_routing_decides_the_tokens(tok, name, monkeypatch):
    """The routed experts as grouped matrix products and as a loop over the experts decode the same tokens as
    HF; routing weights normalized otherwise than the config says (or the router's choice ignored)
    decode others."""
    import shardrl.rollout.fast.moe as fm

    model = hf_model(family_config(tok, name))
    want = hf_greedy(tok, model, max_new_tokens=36)
    greedy = SamplingParams(greedy=True, max_new_tokens=36)
    fast = fast_rollout(tok, model)
    consts = fast.model.layer_consts
    assert [c.top_k for c in consts] == ([2, 0] if name == "qwen3_moe" else [2, 2])  # Qwen3-MoE: layer 1 dense
    normalized = name != "olmoe"  # (OLMoE's config here leaves the top-k weights as the softmax gave them)
    assert [c.normalize_top_k for c in consts if c.top_k] == [normalized] * (1 if name == "qwen3_moe" else 2)
    calls = []
    real = fm.grouped_mm_usable
    monkeypatch.setattr(fm, "grouped_mm_usable", lambda *a: calls.append(real(*a)) or calls[-1])
    assert_same_tokens(fast.generate(*encode(tok), greedy), want)
    assert calls and all(calls)  # the grouped products ran
    monkeypatch.setattr(fm, "grouped_mm_usable", lambda *a: False)
    assert_same_tokens(fast.generate(*encode(tok), greedy), want)  # the loop
    monkeypatch.setattr(fm, "grouped_mm_usable", real)
    fast.model.layer_consts = [c._replace(normalize_top_k=not normalized) for c in consts]
    assert not torch.equal(fast.generate(*encode(tok), greedy).response_ids, want.response_ids)
    fast.model.layer_consts = [c._replace(top_k=c.top_k and 1) for c in consts]
    assert not torch.equal(fast.generate(*encode(tok), greedy).response_ids, want.response_ids)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_fast_family_moe_records_the_routing_the_engine_computes(tok, name):
    """record_routing (router replay R3): every token the rollout ran (the prompts in the prefill, the response
    tokens in the steps that fed them) carries the experts it was routed to per routed layer, the same the
    engine's HF model picks for the assembled sequence; only padding and each row's last token (never fed)
    read -1. Sampled, n=2 over 4 slots: rows reuse slots, the batch compacts, a stop string cuts some rows."""
    from shardrl.engine.model import PolicyModel

    model = hf_model(family_config(tok, name))
    fast = fast_rollout(tok, model, record_routing=True, min_width=2, width_step=2)
    stop = ["e"]
    out = fast.generate(*encode(tok), SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=3, stop=stop))
    assert fast.last_stats["compactions"] > 0
    batch = out.to_batch()
    routed = batch["routed_experts"]
    layers, top_k = (1, 2) if name == "qwen3_moe" else (2, 2)  # Qwen3-MoE's layer 1 is dense
    assert routed.shape == (*batch["input_ids"].shape, layers, top_k) and routed.dtype == torch.int16
    with torch.no_grad():
        want = PolicyModel(model).eval()(batch["input_ids"], batch["attention_mask"], remove_padding=True,
                                         record_routing=True)["routed_experts"]
    real, known = batch["attention_mask"].bool(), (routed >= 0).all(-1).all(-1)
    assert not (known & ~real).any()
    last = real.long().cumsum(1) == real.sum(1, keepdim=True)  # each row's last real token
    # a row that ended at EOS or its limit never fed its last token; one cut at a stop string most often did
    # (the stop was seen at a sync, after more steps), and then its tokens all carry a routing
    lengths = batch["response_mask"].sum(1)
    ends = batch["input_ids"][last & real]  # each row's last token
    unfed = (ends == tok.eos_token_id) | (lengths == 20)
    fed_last = []
    for r in range(len(out)):
        if torch.equal(known[r], real[r]):
            fed_last.append(r)
            assert not unfed[r], r
        else:
            assert torch.equal(known[r], real[r] & ~last[r]), r
    assert fed_last and len(fed_last) < len(out), fed_last
    assert torch.equal(routed[known].long().sort(-1).values, want[known].long().sort(-1).values)
    fast.record_routing = False
    assert fast.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=4)).routed_experts is None


def test_an_aborted_call_records_the_routing_of_what_it_ran(tok):
    """`Rollout.abort` with record_routing (an agent's R3 rollout behind the server, its clients gone): the rows
    admitted before the abort keep the routing of every token they ran, equal to the full call's; rows never admitted
    read -1 everywhere (nothing was run); an abort before any admission gives all -1 (was: StopIteration or
    KeyError, which left the server's request hanging)."""
    model = hf_model(family_config(tok, "mixtral"))
    fast = fast_rollout(tok, model, record_routing=True, min_width=2, width_step=2)
    sampling = SamplingParams(greedy=True, max_new_tokens=20)
    full = fast.generate(*encode(tok), sampling).to_batch()
    for syncs, admitted in ((0, 0), (2, 4)):  # (4 slots: the first 4 rows admitted at the first sync)
        asked = []
        fast.abort = lambda: asked.append(1) or len(asked) > syncs
        try:
            out = fast.generate(*encode(tok), sampling)
        finally:
            fast.abort = None
        batch = out.to_batch()
        routed, made = batch["routed_experts"], batch["response_mask"].sum(1)
        assert (made[:admitted] > 0).all() and (made[admitted:] == 0).all(), made
        assert (routed[admitted:] == -1).all()
        for r in range(admitted):  # (the full call's tokens, as far as this one ran them)
            ran = (routed[r] >= 0).all(-1).all(-1)
            width = routed.shape[1]
            assert ran.sum() >= made[r]
            assert torch.equal(routed[r][ran], full["routed_experts"][r, :width][ran])


def test_fast_family_engine_applies_the_final_softcap(tok):
    """Gemma 2's final_logit_softcapping: the training engine's log-probs (with and without entropy, under
    autograd or not) are the sampler's (it applied the cap; before the fix the engine's were up to 5.7 off)."""
    model = hf_model(family_config(tok, "gemma2"))
    out = fast_rollout(tok, model).generate(*encode(tok), SamplingParams(n=2, temperature=0.9, max_new_tokens=24,
                                                                         seed=3))
    assert_log_probs_recomputed(out, model, 0.9, engine=True)


@pytest.mark.parametrize("rope", list(ROPE_VARIANTS))
def test_fast_family_llama_rope_scaling(tok, rope):
    """linear, dynamic (within max_position_embeddings, where HF leaves its frequencies alone) and yarn
    (whose attention factor scales cos and sin)."""
    config = family_config(tok, "llama3_rope", rope_parameters=ROPE_VARIANTS[rope])
    model = hf_model(config)
    want = hf_greedy(tok, model, max_new_tokens=32)
    fast = fast_rollout(tok, model)
    assert_same_tokens(fast.generate(*encode(tok), SamplingParams(greedy=True, max_new_tokens=32)), want)
    if rope == "yarn":
        assert fast.model.rope_scaling["all"] != 1.0
    if rope == "dynamic":
        short = family_config(tok, "llama3_rope", rope_parameters=ROPE_VARIANTS[rope], max_position_embeddings=40)
        with pytest.raises(ValueError, match="past the 40 after which the 'dynamic' rope.*rollout.backend=hf"):
            fast_rollout(tok, hf_model(short)).generate(*encode(tok), SamplingParams(max_new_tokens=32))


def test_fast_family_gemma3_has_a_local_and_a_global_rope(tok):
    fast = FastRollout(family_config(tok, "gemma3_text", rope_parameters=dict(
        full_attention=dict(rope_type="linear", rope_theta=1e6, factor=8.0),
        sliding_attention=dict(rope_type="default", rope_theta=1e4))), tok, "cpu", torch.float32)
    m = fast.model
    assert m.layer_rope == ["sliding_attention", "full_attention", "sliding_attention"]
    d = 16
    local = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(m.inv_freq_sliding_attention, local)
    torch.testing.assert_close(m.inv_freq_full_attention, 1.0 / 1e6 ** (torch.arange(0, d, 2).float() / d) / 8)


def test_fast_family_unsupported_features_are_named(tok):
    cases = [
        (transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=4), "not 'gpt2'"),
        (transformers.Gemma3Config(text_config=dict(BASE, head_dim=16)), "model_type 'gemma3_text'"),
        (family_config(tok, "llama3_rope", rope_parameters=dict(rope_type="longrope", factor=4.0, rope_theta=1e4,
                                                               short_factor=[1.0] * 4, long_factor=[2.0] * 4,
                                                               original_max_position_embeddings=16)),
         "rope type 'longrope'"),
        (family_config(tok, "qwen3", hidden_act="gelu"), "hidden activation 'gelu'"),
        (family_config(tok, "gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
        (family_config(tok, "olmoe", clip_qkv=8.0), "clip_qkv=8.0"),
        (transformers.OlmoConfig(**BASE), "not 'olmo'"),
    ]
    for config, feature in cases:
        with pytest.raises(ValueError, match=f"{feature}.*rollout.backend=hf"):
            FastRollout(config, tok, "cpu", torch.float32)


def test_fast_family_backend_null_picks_fast_where_supported(tok, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in FAMILIES:
        resolved, lines = resolve_device_defaults(load_config(None, []), family_config(tok, name))
        assert resolved.rollout.backend == "fast", (name, lines)
    longrope = family_config(tok, "llama3_rope", rope_parameters=dict(
        rope_type="longrope", factor=4.0, rope_theta=1e4, short_factor=[1.0] * 4, long_factor=[2.0] * 4,
        original_max_position_embeddings=16))
    resolved, lines = resolve_device_defaults(load_config(None, []), longrope)
    assert resolved.rollout.backend == "hf"
    assert any("fast rollout cannot run this model" in line and "'longrope'" in line for line in lines), lines


def reference_decode_attention(q, kv, positions, scale, softcap, window):
    """What the Triton kernel computes, by `softcapped_attention` over a boolean mask (fp32)."""
    from shardrl.rollout.fast.attention import softcapped_attention, visible_keys

    visible = visible_keys(positions, torch.arange(kv.shape[-2], device=kv.device), window)[:, None, None, :]
    return softcapped_attention(q.float(), kv[0].float(), kv[1].float(), visible, scale, softcap)


def check_triton_window_and_softcap(device: str, dtypes, block_n: int) -> None:
    """The Triton decode kernel with a window and a soft-cap (and either alone) against the reference, with
    the fused K/V write and with splits; entries before each window's start are never read (NaN there)."""
    from shardrl.rollout.fast.decode_kernel import decode_attention
    from shardrl.rollout.fast.attention import write_kv

    gen = torch.Generator(device=device).manual_seed(0)
    b, hkv, g, d, max_seq = 6, 2, 3, 16, 80
    positions = torch.tensor([0, 5, 16, 17, 47, 79], device=device)
    slots = torch.arange(b, device=device)
    for dtype, atol in dtypes:
        kv = (torch.randn(2, b, hkv, max_seq, d, device=device, generator=gen) * 2).to(dtype)
        q = (torch.randn(b, hkv, g, d, device=device, generator=gen) * 2).to(dtype)
        k_new, v_new = torch.randn(2, b, hkv, d, device=device, generator=gen).to(dtype)
        written = kv.clone()
        write_kv(k_new, v_new, written, slots, positions)
        for scale, softcap, window in ((0.3, 2.0, 7), (0.3, None, 7), (None, 2.0, None), (0.3, 2.0, 1)):
            want = reference_decode_attention(q, written, positions, scale or d**-0.5, softcap, window)
            limits = dict(scale=scale, softcap=softcap, window=window, block_n=block_n)
            for splits in (1, 3):
                got = decode_attention(q, written, positions, splits=splits, **limits)
                torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
                fused = kv.clone()
                got = decode_attention(q, fused, positions, k_new, v_new, splits=splits, **limits)
                torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
                assert torch.equal(fused, written)
            if window is not None:
                outside = written.clone()
                for s, p in enumerate(positions.tolist()):
                    outside[:, s, :, : max(p - window + 1, 0)] = float("nan")
                    outside[:, s, :, p + 1:] = float("nan")
                got = decode_attention(q, outside, positions, splits=3, **limits)
                torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_fast_family_triton_window_and_softcap_in_interpreter():
    root = Path(__file__).parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "triton window and softcap: ok" in run.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_family_triton_window_and_softcap_on_gpu():
    check_triton_window_and_softcap("cuda", ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)), block_n=16)
    check_triton_window_and_softcap("cuda", ((torch.bfloat16, 3e-2),), block_n=64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,attention", [(name, "triton") for name in FAMILIES]
                         + [("gemma2", "sdpa"), ("mistral_window", "sdpa")])
def test_fast_family_cuda_graphs_match_hf(tok, name, attention):
    """On a GPU in fp32, compiled and graphed: HF's greedy tokens (HF on the CPU), sampled log-probs equal
    to HF's forward and the engine's recomputation (where it applies: no final soft-cap). Head dims of 16,
    the Triton kernel's smallest."""
    wide = name.startswith(("mistral", "qwen2", "llama", "mixtral", "olmoe"))
    extra = dict(hidden_size=64) if wide else {}  # head dim 16
    if name.startswith("mistral"):
        extra["head_dim"] = 16
    model = hf_model(family_config(tok, name, **extra))
    want = hf_greedy(tok, model, max_new_tokens=40)
    fast = FastRollout(model.config, tok, "cuda", torch.float32, max_batch=4, sync_every=4, seq_bucket=32,
                       attention=attention)
    fast.load_weights(model.named_parameters())
    ids, mask = encode(tok)
    got = fast.generate(ids.cuda(), mask.cuda(), SamplingParams(greedy=True, max_new_tokens=40))
    assert fast._graphs
    assert torch.equal(got.response_ids.cpu(), want.response_ids), (got.response_text, want.response_text)
    torch.testing.assert_close(got.sampled_log_probs.cpu(), want.sampled_log_probs, atol=1e-4, rtol=0)
    sampled = fast.generate(ids.cuda(), mask.cuda(), SamplingParams(n=2, temperature=0.9, max_new_tokens=32, seed=3))
    sampled = RolloutOutput(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(sampled).items()})
    assert_log_probs_recomputed(sampled, model, 0.9, engine=fast.model.final_softcap is None, atol=1e-4)


if __name__ == "__main__":  # run by test_fast_family_triton_window_and_softcap_in_interpreter
    check_triton_window_and_softcap("cpu", ((torch.float32, 1e-5), (torch.float16, 3e-3)), block_n=16)
    print("triton window and softcap: ok")
