"""The fast rollout against HF `generate` (the reference backend) and a plain forward, on tiny random
models (CPU, fp32): greedy tokens equal, sampled log-probs equal a recomputation, continuous batching,
weight loading, release/resume."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from shardrl.engine.model import build_causal_lm
from shardrl.rollout import FastRollout, RolloutOutput, SamplingParams, build_rollout
from shardrl.rollout.fast.rollout import GREEDY, SAMPLE, TRUNCATED, sample_tokens
from shardrl.rollout.fast.attention import TritonDecodeAttention
from shardrl.testing import TINY_MODELS
from shardrl.tokenizer import build_char_tokenizer
from test_rollout_hf import (assert_sampled_log_probs_recomputed, assert_seeded_sampling, assert_some_rows_end_at_eos,
                             recomputed_log_probs)

# different lengths; the last is longer than the others together
PROMPTS = ["1+2=", "hello world ", "ab", "what is 7*6? ", "x", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny_config(tok, kind: str = "qwen2", **extra):
    # a wide init gives random models varied text (std 0.02 makes a tied model repeat its last token)
    kw = dict(TINY_MODELS[kind], vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, initializer_range=0.3, **extra)
    return transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)


def reference_model(tok, seed: int, kind: str = "qwen2", **config):
    return build_causal_lm(tiny_config(tok, kind, **config), None, "cpu", torch.float32, seed=seed).eval()


def make_rollout(name, tok, model, device: str = "cpu", **kwargs):
    """A rollout of `model`'s config with its weights."""
    rollout = build_rollout(name, model.config, tok, device, torch.float32, **kwargs)
    rollout.load_weights(model.named_parameters())
    return rollout


def encode(tok, prompts=PROMPTS):
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def with_eos_at_different_steps(tok, model):
    """A copy of `tok` whose EOS is the character that ends the greedy responses at the most different
    steps: random tiny models rarely emit the real EOS, and the test wants rows to end apart."""
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=16)
    texts = make_rollout("hf", tok, model).generate(ids, mask, greedy).response_text
    char = max(sorted(set("".join(texts)) - {" "}), key=lambda c: len({t.find(c) for t in texts}))
    eos_tok = copy.deepcopy(tok)
    eos_tok.eos_token = char
    return eos_tok


def assert_same_output(got: RolloutOutput, want: RolloutOutput):
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.response_text == want.response_text
    assert torch.equal(got.prompt_ids, want.prompt_ids) and torch.equal(got.prompt_index, want.prompt_index)
    torch.testing.assert_close(got.sampled_log_probs, want.sampled_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])  # qwen2: q/k/v biases, untied head; llama: tied head
@pytest.mark.parametrize("max_batch,sync_every,min_width", [(None, 16, 32), (2, 3, 32), (4, 1, 32), (None, 2, 1)])
def test_greedy_equals_hf_generate(tok, kind, max_batch, sync_every, min_width):
    model = reference_model(tok, seed=1, kind=kind)
    eos_tok = with_eos_at_different_steps(tok, model)
    ids, mask = encode(eos_tok)
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=16)
    want = make_rollout("hf", eos_tok, model).generate(ids, mask, greedy)
    fast = make_rollout("fast", eos_tok, model, max_batch=max_batch, sync_every=sync_every, min_width=min_width)
    got = fast.generate(ids, mask, greedy)
    assert_same_output(got, want)
    stats = fast.last_stats
    if min_width == 1:  # rows ending apart moved to ever narrower slot prefixes, and the steps ran on those
        assert stats["compactions"] >= 1 and stats["slot_steps"] < stats["decode_steps"] * stats["num_slots"]
    else:
        assert stats["compactions"] == 0 and stats["slot_steps"] == stats["decode_steps"] * stats["num_slots"]
    lengths = want.response_mask.sum(1)
    ended = (want.response_ids == eos_tok.eos_token_id).any(1)
    assert len(set(lengths.tolist())) >= 3 and ended.any()  # rows end apart
    num_rows = len(PROMPTS) * 2
    assert fast.last_stats["num_slots"] == (max_batch or num_rows)
    # with fewer slots than rows, freed slots took waiting rows: more decode steps than the longest row
    if max_batch is not None:
        assert fast.last_stats["decode_steps"] > int(lengths.max())
    # occupancy: each row decodes every token after the first (the prefill makes that one), in a slot of the width
    assert int((lengths - 1).sum()) <= stats["row_steps"] <= stats["slot_steps"]
    assert all(stats[k] >= 0 for k in ("decode_s", "admit_s", "feed_wait_s", "host_s")) and stats["admit_s"] > 0


def test_a_capture_warm_up_mid_generate_changes_nothing(tok):
    """A graph is captured on the first step of each (mode, seq_len), mid-generate, after warm-up steps
    that run for real; their state must be put back. On the CPU: warm up before every step."""
    model = reference_model(tok, seed=2)
    ids, mask = encode(tok)
    plain = make_rollout("fast", tok, model, max_batch=3, sync_every=5, seq_bucket=8)
    warmed = make_rollout("fast", tok, model, max_batch=3, sync_every=5, seq_bucket=8)
    runner = warmed._steps
    step = runner.step
    runner.step = lambda st, mode, seq_len, width, top=0: (
        runner.warm_up(lambda *a: step(*a, top), st, mode, seq_len, width), step(st, mode, seq_len, width, top))
    for sampling in (SamplingParams(n=2, greedy=True, max_new_tokens=20),
                     SamplingParams(n=2, temperature=1.0, top_k=8, max_new_tokens=20, seed=1)):
        assert_same_output(warmed.generate(ids, mask, sampling), plain.generate(ids, mask, sampling))


@pytest.mark.parametrize("temperature,top_k,top_p,min_width",
                         [(0.7, 10, 0.9, 32), (1.0, 0, 1.0, 32), (1.3, 0, 0.8, 32), (0.0, 0, 1.0, 32), (1.0, 0, 1.0, 1)])
def test_sampled_log_probs_equal_forward_recomputation(tok, temperature, top_k, top_p, min_width):
    model = reference_model(tok, seed=2)
    rollout = make_rollout("fast", tok, model, max_batch=5, sync_every=4, min_width=min_width)
    ids, mask = encode(tok)
    sampling = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=20, seed=5)
    assert_sampled_log_probs_recomputed(rollout.generate(ids, mask, sampling), model, sampling, min_tokens=40)


def test_truncation_to_one_token_is_greedy(tok):
    rollout = make_rollout("fast", tok, reference_model(tok, seed=3), max_batch=4)
    ids, mask = encode(tok)
    greedy = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12))
    for trunc in (dict(top_k=1), dict(top_p=1e-6)):  # T=1: the log-probs are greedy's too
        out = rollout.generate(ids, mask, SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=7, **trunc))
        assert_same_output(out, greedy)


@pytest.mark.parametrize("mode,kwargs", [(SAMPLE, {}), (TRUNCATED, dict(top_k=3)), (TRUNCATED, dict(top_p=0.7))])
def test_sample_tokens_draws_the_right_distribution(mode, kwargs):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.8
    probs = torch.softmax(logits / temperature, -1)
    if "top_k" in kwargs:
        probs[kwargs["top_k"]:] = 0
    if "top_p" in kwargs:  # keep a token while the better-ranked mass is below top_p: here the first two
        probs[(probs.cumsum(-1) - probs) >= kwargs["top_p"]] = 0
    probs /= probs.sum()
    rows = 200_000
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(rows, 6).exponential_(generator=gen)
    tokens, logp = sample_tokens(logits.expand(rows, 6), mode, noise, torch.tensor(temperature),
                                 torch.tensor(kwargs.get("top_k", 6)), torch.tensor(kwargs.get("top_p", 2.0)))
    freq = torch.bincount(tokens, minlength=6).float() / rows
    torch.testing.assert_close(freq, probs, atol=4e-3, rtol=0)
    full = torch.log_softmax(logits / temperature, -1)  # untruncated, whatever the sampler kept
    torch.testing.assert_close(logp, full[tokens])
    greedy_tokens, greedy_logp = sample_tokens(logits[None], GREEDY, None, None, None, None)
    assert greedy_tokens.tolist() == [0] and torch.allclose(greedy_logp, torch.log_softmax(logits, -1)[:1])


def test_seed_reproduces_and_leaves_global_rng_alone(tok):
    assert_seeded_sampling(make_rollout("fast", tok, reference_model(tok, seed=4), max_batch=3, sync_every=5), tok)


def test_n_samples_are_prompt_major(tok):
    rollout = make_rollout("fast", tok, reference_model(tok, seed=3), max_batch=5)
    ids, mask = encode(tok)
    n = 3
    out = rollout.generate(ids, mask, SamplingParams(n=n, temperature=1.5, max_new_tokens=10, seed=0))
    assert len(out) == len(PROMPTS) * n
    assert out.prompt_index.tolist() == [b for b in range(len(PROMPTS)) for _ in range(n)]
    assert torch.equal(out.prompt_ids, ids[out.prompt_index]) and torch.equal(out.prompt_mask, mask[out.prompt_index])
    assert len(out.response_text) == len(out)
    for b in range(len(PROMPTS)):  # the samples of one prompt differ
        group = out.response_text[b * n : (b + 1) * n]
        assert len(set(group)) > 1, group


def test_abort_ends_the_call_at_its_next_sync(tok):
    """`Rollout.abort` (a server whose clients left): once true, the rows decoding end at the next host sync with the
    tokens they have (a prefix of the full call's), the rows not started yet with none; the rollout serves the next
    call as before."""
    rollout = make_rollout("fast", tok, reference_model(tok, seed=3), max_batch=2, sync_every=4)
    ids, mask = encode(tok)
    sampling = SamplingParams(n=2, temperature=0.0, greedy=True, max_new_tokens=40)
    full = rollout.generate(ids, mask, sampling)
    asked = []
    rollout.abort = lambda: asked.append(1) or len(asked) > 2  # true at the third sync
    try:
        cut = rollout.generate(ids, mask, sampling)
    finally:
        rollout.abort = None
    got = cut.response_mask.sum(1).tolist()
    assert len(asked) == 3 and len(got) == len(PROMPTS) * 2
    # two slots: the first two rows decoded 1 + 2 * 4 tokens (admission, two syncs of 4 steps), the others none
    assert got[:2] == [9, 9] and set(got[2:]) == {0}, got
    assert torch.equal(cut.response_ids[:2, :9], full.response_ids[:2, :9])
    again = rollout.generate(ids, mask, sampling)
    assert torch.equal(again.response_ids, full.response_ids)


def test_eos_ends_a_response(tok):
    model = reference_model(tok, seed=6)
    eos_tok = with_eos_at_different_steps(tok, model)
    rollout = make_rollout("fast", eos_tok, model, max_batch=7, sync_every=6)
    ids, mask = encode(eos_tok)
    out = rollout.generate(ids, mask, SamplingParams(n=4, temperature=1.0, max_new_tokens=30, seed=0))
    assert_some_rows_end_at_eos(out, eos_tok, max_new_tokens=30)


def test_stop_strings_cut_as_the_reference_does(tok):
    model = reference_model(tok, seed=1)
    ids, mask = encode(tok)
    free = make_rollout("hf", tok, model).generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=24))
    stop = [free.response_text[0][5:7], free.response_text[3][2], "never-seen"]
    sampling = SamplingParams(greedy=True, max_new_tokens=24, stop=stop)
    want = make_rollout("hf", tok, model).generate(ids, mask, sampling)
    got = make_rollout("fast", tok, model, max_batch=3, sync_every=4).generate(ids, mask, sampling)
    assert_same_output(got, want)
    assert got.response_mask.sum(1).min() < 24 and not any(s in t for t in got.response_text for s in stop)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_load_weights_makes_generation_follow_the_new_model(tok, kind):
    first, second = reference_model(tok, seed=1, kind=kind), reference_model(tok, seed=9, kind=kind)
    fast = make_rollout("fast", tok, first, max_batch=4, sync_every=4)
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    before = fast.generate(ids, mask, greedy)
    assert_same_output(before, make_rollout("hf", tok, first).generate(ids, mask, greedy))
    # one tensor at a time, as Engine.export_weights streams them (named_parameters drops the tied head)
    kv = fast._state.kv
    fast.load_weights((name, p.detach().clone()) for name, p in second.named_parameters())
    assert fast._state.kv is kv  # the engine (cache, graphs) was kept
    after = fast.generate(ids, mask, greedy)
    assert after.response_text != before.response_text
    assert_same_output(after, make_rollout("hf", tok, second).generate(ids, mask, greedy))


def test_load_weights_rejects_unknown_names_and_shapes(tok):
    rollout = make_rollout("fast", tok, reference_model(tok, seed=1))
    with pytest.raises(KeyError, match="no parameter 'model.layers.7.mlp.up_proj.weight'"):
        rollout.load_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"expects \(64, 32\)"):
        rollout.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])


def test_parameter_names_mirror_hf(tok):
    for kind in ("qwen2", "llama"):
        hf = reference_model(tok, seed=1, kind=kind)
        fast = build_rollout("fast", tiny_config(tok, kind), tok, "cpu", torch.float32)
        shapes = lambda m: {n: p.shape for n, p in m.named_parameters(remove_duplicate=False)}  # noqa: E731
        assert shapes(fast.model) == shapes(hf)
        assert ("model.layers.0.self_attn.q_proj.bias" in shapes(fast.model)) == (kind == "qwen2")
        tied = fast.model.lm_head.weight is fast.model.model.embed_tokens.weight
        assert tied == (kind == "llama")


def test_fused_projections_follow_moves_and_loads(tok):
    """q/k/v and gate/up weights are views into one fused tensor each: after a move (every tensor gets
    its own storage) they are fused anew, and loading new weights updates what the GEMMs read."""
    first, second = reference_model(tok, seed=1), reference_model(tok, seed=9)
    fast = make_rollout("fast", tok, first, max_batch=4)
    fast.model._apply(lambda t: t.clone())  # what a move to another device does
    attn, mlp = fast.model.model.layers[1].self_attn, fast.model.model.layers[1].mlp
    for view, fused in ((attn.k_proj.weight, attn.qkv_weight), (attn.v_proj.bias, attn.qkv_bias),
                        (mlp.up_proj.weight, mlp.gate_up_weight)):
        assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    fast.load_weights(second.named_parameters())
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    assert_same_output(fast.generate(ids, mask, greedy), make_rollout("hf", tok, second).generate(ids, mask, greedy))


def test_compiled_step_equals_eager(tok):
    """`compile=True` (the layer's parts around attention compiled once for all layers and attended
    lengths, and a compiled sampler) samples what the eager step samples."""
    model = reference_model(tok, seed=1)
    ids, mask = encode(tok)
    sampled = SamplingParams(n=2, temperature=0.9, max_new_tokens=20, seed=3)
    kwargs = dict(max_batch=4, sync_every=4, seq_bucket=16)  # lengths cross 16-position buckets: 2 shapes
    eager = make_rollout("fast", tok, model, **kwargs).generate(ids, mask, sampled)
    got = make_rollout("fast", tok, model, compile=True, **kwargs).generate(ids, mask, sampled)
    assert torch.equal(got.response_ids, eager.response_ids)
    torch.testing.assert_close(got.sampled_log_probs, eager.sampled_log_probs, atol=1e-5, rtol=0)


def test_release_and_resume(tok):
    model = reference_model(tok, seed=1)
    rollout = make_rollout("fast", tok, model, max_batch=3)
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    before = rollout.generate(ids, mask, greedy)
    rollout.release(weights=True)
    assert rollout._state is None
    with pytest.raises(RuntimeError, match="resume"):
        rollout.generate(ids, mask, greedy)
    rollout.load_weights(model.named_parameters())  # allowed while released
    rollout.resume()
    assert rollout._state.num_slots == 3
    assert_same_output(rollout.generate(ids, mask, greedy), before)


def test_cache_grows_and_limits_per_prompt(tok):
    model = reference_model(tok, seed=5)
    rollout = make_rollout("fast", tok, model, sync_every=8)
    ids, mask = encode(tok)
    rollout.generate(ids[:2], mask[:2], SamplingParams(greedy=True, max_new_tokens=4))
    small = (rollout._state.num_slots, rollout._state.max_seq)
    long = SamplingParams(greedy=True, max_new_tokens=150)  # past the first cache's 128 positions
    out = rollout.generate(ids, mask, long)
    assert (rollout._state.num_slots, rollout._state.max_seq) > small and rollout._state.max_seq >= 150
    assert_same_output(out, make_rollout("hf", tok, model).generate(ids, mask, long))
    limits = [1, 5, 150, 9, 2, 33]
    cut = rollout.generate(ids, mask, long, max_new_tokens=limits)
    for r, limit in enumerate(limits):
        length = min(limit, int(out.response_mask[r].sum()))
        assert int(cut.response_mask[r].sum()) == length
        assert torch.equal(cut.response_ids[r, :length], out.response_ids[r, :length])


def test_errors_name_the_problem(tok):
    with pytest.raises(ValueError, match="rope type 'longrope'.*rollout.backend=hf"):
        FastRollout(tiny_config(tok, "llama", rope_scaling=dict(rope_type="longrope", factor=4.0, short_factor=[1.0] * 4,
                                                                  long_factor=[2.0] * 4,
                                                                  original_max_position_embeddings=64)),
                    tok, "cpu", torch.float32)
    with pytest.raises(ValueError, match="supports"):
        gpt2 = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=4)
        FastRollout(gpt2, tok, "cpu", torch.float32)
    with pytest.raises(ValueError, match="attention='triton' needs a CUDA device"):
        FastRollout(tiny_config(tok), tok, "cpu", torch.float32, attention="triton")
    with pytest.raises(ValueError, match="must be 'auto', 'triton' or 'sdpa'"):
        FastRollout(tiny_config(tok), tok, "cpu", torch.float32, attention="flash")
    with pytest.raises(ValueError, match="sampler='triton' needs a CUDA device"):
        FastRollout(tiny_config(tok), tok, "cpu", torch.float32, sampler="triton")
    with pytest.raises(ValueError, match="must be 'auto', 'triton' or 'torch'"):
        FastRollout(tiny_config(tok), tok, "cpu", torch.float32, sampler="gumbel")
    rollout = make_rollout("fast", tok, reference_model(tok, seed=1), max_seq_len=20)
    ids, mask = encode(tok)
    with pytest.raises(ValueError, match="max_seq_len=20"):
        rollout.generate(ids, mask, SamplingParams(max_new_tokens=16))
    enc = tok(["ab", "abcd"], padding=True, padding_side="right", return_tensors="pt")
    with pytest.raises(ValueError, match="left-padded"):
        rollout.generate(enc["input_ids"], enc["attention_mask"], SamplingParams())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention,compile,min_width", [
    ("triton", False, 32), ("triton", True, 32), ("triton_unfused_write", True, 32), ("sdpa", False, 32),
    ("sdpa", True, 32), ("triton", True, 1), ("sdpa", False, 1)])
def test_cuda_graphs_match_the_reference(tok, attention, compile, min_width):
    """On a GPU in fp32: graph replays give HF's greedy tokens, the eager step's samples, and the same
    again after release/resume (which recaptures the graphs). Head dim 16: the Triton kernel's smallest.
    min_width 1: the tail of each call compacts to 3, 2 and 1 slots, each width with its own graphs."""
    model = reference_model(tok, seed=1, hidden_size=64)
    eos_tok = with_eos_at_different_steps(tok, model)
    ids, mask = encode(eos_tok)
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=40)
    sampled = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=40, seed=3)
    want = make_rollout("hf", eos_tok, model).generate(ids, mask, greedy)  # on the CPU

    def fast(attention, **kwargs):
        unfused = attention == "triton_unfused_write"
        rollout = make_rollout("fast", eos_tok, model, "cuda", max_batch=4, sync_every=4, seq_bucket=32,
                               attention="triton" if unfused else attention, min_width=min_width, **kwargs)
        if unfused:
            rollout._block.attention = TritonDecodeAttention(fuse_kv_write=False)
        return rollout

    def on_cpu(out: RolloutOutput) -> RolloutOutput:
        return RolloutOutput(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(out).items()})

    graphed = fast(compile=compile, attention=attention)
    eager = fast(cuda_graphs=False, compile=False, attention=attention)
    got = on_cpu(graphed.generate(ids.cuda(), mask.cuda(), greedy))
    assert graphed._graphs
    assert (graphed.last_stats["compactions"] > 0) == (min_width == 1)
    widths = {key[2] for key in graphed._graphs}  # (mode, seq_len, width, cascade)
    assert len(widths) >= 2 if min_width == 1 else widths == {4}
    assert torch.equal(got.response_ids, want.response_ids) and got.response_text == want.response_text
    torch.testing.assert_close(got.sampled_log_probs, want.sampled_log_probs, atol=1e-4, rtol=0)
    plain = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=3)  # triton: the fused sampler's mode
    for params in (plain, sampled):
        a = on_cpu(graphed.generate(ids.cuda(), mask.cuda(), params))
        b = on_cpu(eager.generate(ids.cuda(), mask.cuda(), params))
        assert torch.equal(a.response_ids, b.response_ids)
        # compiled code sums in another order: 1e-5 apart was seen (log-probs near -2)
        torch.testing.assert_close(a.sampled_log_probs, b.sampled_log_probs, atol=1e-4 if compile else 1e-5, rtol=0)
        loss_mask = a.to_batch()["loss_mask"].bool()
        torch.testing.assert_close(a.to_batch()["sampled_log_probs"][loss_mask],
                                   recomputed_log_probs(model, a, 0.9)[loss_mask], atol=1e-4, rtol=0)
    num_graphs = len(graphed._graphs)
    graphed.release()
    assert not graphed._graphs
    graphed.resume()
    assert len(graphed._graphs) == num_graphs
    assert torch.equal(on_cpu(graphed.generate(ids.cuda(), mask.cuda(), sampled)).response_ids, a.response_ids)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_attention_matches_sdpa_in_bf16():
    """The Triton kernel at the benchmark's head layout (12 query heads on 2 KV heads, head dim 128), with
    positions at and around 64-entry block edges; it reads nothing past a slot's position. With the new K/V
    given, it writes them at the positions as the indexed copy does and attends as after that copy; the
    same with each slot's entries split over several programs."""
    from shardrl.rollout.fast.decode_kernel import decode_attention
    from shardrl.rollout.fast.attention import write_kv

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hkv, g, d, max_seq = 16, 2, 6, 128, 512
    kv = torch.randn(2, b, hkv, max_seq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(b, hkv, g, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new, v_new = torch.randn(2, b, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    positions = torch.tensor([0, 1, 62, 63, 64, 65, 255, 256, 300, 383, 384, 400, 510, 511, 7, 127], device="cuda")
    written = kv.clone()
    write_kv(k_new, v_new, written, torch.arange(b, device="cuda"), positions)
    visible = (torch.arange(max_seq, device="cuda") <= positions[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), written[0].float(), written[1].float(),
                                                            attn_mask=visible)
    for splits in (1, 3, 4):  # entries cut over several programs, then combined
        torch.testing.assert_close(decode_attention(q, written, positions, splits=splits).float(), want,
                                   atol=2e-2, rtol=2e-2)
        fused = kv.clone()
        torch.testing.assert_close(decode_attention(q, fused, positions, k_new, v_new, splits=splits).float(), want,
                                   atol=2e-2, rtol=2e-2)
        assert torch.equal(fused, written)
    for s, p in enumerate(positions.tolist()):
        written[:, s, :, p + 1:] = float("nan")  # past each position: never read
        fused[:, s, :, p:] = float("nan")  # the fused kernel reads its own entry from registers
    assert not decode_attention(q, written, positions).isnan().any()
    assert not decode_attention(q, fused, positions, k_new, v_new).isnan().any()
    assert not decode_attention(q, fused, positions, k_new, v_new, splits=4).isnan().any()
    written32 = written.float().nan_to_num()
    torch.testing.assert_close(decode_attention(q.float(), written32, positions), want, atol=1e-5, rtol=0)  # no TF32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_sampler_draws_the_right_distribution():
    """The one-pass Triton sampler: greedy = argmax (lowest index on a tie) over a Qwen-sized vocabulary cut
    into splits, log-probs = log softmax(logits / T) of the token, sample frequencies = softmax(logits / T)
    over 200k rows, the seed reproduces, and a captured graph draws fresh noise when the seed tensor changes."""
    from shardrl.rollout.fast.sample_kernel import fused_sample

    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = 151_936  # not a multiple of the kernel's block
    logits = torch.randn(8, vocab, device="cuda", generator=gen).to(torch.bfloat16) * 4
    logits[0, 10] = logits[0, 150_000] = logits[0].max() + 1  # a tie across splits
    logits[1, 3] = logits[1, 4] = logits[1].max() + 1  # a tie within a block
    temperature, seed = torch.tensor(0.7, device="cuda"), torch.tensor([5], device="cuda")
    tokens, logp = fused_sample(logits, True, temperature, seed)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[:2].tolist() == [10, 3]
    torch.testing.assert_close(logp, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0])
    tokens, logp = fused_sample(logits, False, temperature, seed)
    torch.testing.assert_close(logp, torch.log_softmax(logits.float() / 0.7, -1).gather(1, tokens[:, None])[:, 0])
    assert torch.equal(fused_sample(logits, False, temperature, seed)[0], tokens)

    small = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device="cuda")
    probs = torch.softmax(small / 0.7, -1)
    rows = 200_000
    for splits, block in ((1, 1024), (3, 4)):  # one split; two splits of 4 and 2 tokens, one per lane
        tokens, logp = fused_sample(small.expand(rows, 6), False, temperature, seed, splits=splits, block=block)
        freq = torch.bincount(tokens, minlength=6).float() / rows
        torch.testing.assert_close(freq, probs, atol=4e-3, rtol=0)
        torch.testing.assert_close(logp, torch.log_softmax(small / 0.7, -1)[tokens])

    logits = small.expand(4096, 6).contiguous()
    graph = torch.cuda.CUDAGraph()
    fused_sample(logits, False, temperature, seed)  # compiled before capture
    with torch.cuda.graph(graph):
        captured, _ = fused_sample(logits, False, temperature, seed)
    draws = []
    for key in (1, 2, 1):
        seed.fill_(key)
        graph.replay()
        draws.append(captured.clone())
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_and_resume_cycles_hold_no_more_memory(tok):
    """A trainer step releases and resumes the rollout; the memory held after resume() is the same every step.
    (A new warm-up stream per capture left a 32 MiB cuBLAS workspace behind each time: the e2e benchmark's
    peaks grew by 0.032 GiB a step, in every configuration.)"""
    model = reference_model(tok, seed=1, hidden_size=64)
    rollout = make_rollout("fast", tok, model, "cuda", max_batch=4)
    ids, mask = encode(tok)
    sampled = SamplingParams(max_new_tokens=8, seed=0)
    held = []
    for _ in range(4):
        rollout.generate(ids.cuda(), mask.cuda(), sampled)
        rollout.release()
        rollout.resume()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert max(held[1:]) - min(held[1:]) < 2**20, held


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_recaptures_without_warm_up_and_samples_the_same_tokens(tok):
    """resume() recaptures every graph the rollout used, over the new cache, without the eager warm-up steps a
    first capture runs; the recaptured graphs give the tokens the first ones gave (same seed), compaction's
    narrower widths included."""
    from shardrl.rollout.fast.step import DecodeRunner

    model = reference_model(tok, seed=1, hidden_size=64)
    rollout = make_rollout("fast", tok, model, "cuda", max_batch=6, min_width=2, width_step=2, sync_every=2)
    ids, mask = encode(tok)
    sampled = SamplingParams(max_new_tokens=24, seed=0)
    limits = [3, 24, 9, 14, 5, 20]  # rows end apart: the slots compact through several widths
    before = rollout.generate(ids.cuda(), mask.cuda(), sampled, max_new_tokens=limits)
    graphs = set(rollout._steps.keys)
    assert len({key[2] for key in graphs}) >= 2, graphs  # several widths captured
    warm_ups = []
    plain = DecodeRunner.warm_up
    DecodeRunner.warm_up = staticmethod(lambda *args, **kwargs: warm_ups.append(args[3:]) or plain(*args, **kwargs))
    try:
        rollout.release()
        rollout.resume()
        assert set(rollout._steps.graphs) == graphs and warm_ups == []
        after = rollout.generate(ids.cuda(), mask.cuda(), sampled, max_new_tokens=limits)
    finally:
        DecodeRunner.warm_up = plain
    assert warm_ups == []  # no graph was captured anew in the call either
    assert_same_output(after, before)


def test_compaction_widths_step_down_by_an_eighth_of_the_slots():
    """The prefixes a decode step may run on: the slot count, then its eighths (multiples of 8 above 8 slots),
    down to `min_width`; `width_step` overrides the step, and `min_width` at the slot count turns compaction off."""
    def widths(num_slots, min_width=32, width_step=None):
        rollout = object.__new__(FastRollout)
        rollout.min_width, rollout.width_step = min_width, width_step
        return rollout._widths(num_slots)

    assert widths(512) == [32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert widths(100) == [32, 48, 64, 80, 96, 100]  # steps of 13 rounded up to 16
    assert widths(8, min_width=1) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert widths(9, min_width=1, width_step=2) == [1, 2, 4, 6, 8, 9]
    assert widths(64, width_step=12) == [32, 36, 48, 60, 64]  # a step given is taken as it is
    assert widths(32) == [32] and widths(20) == [20]  # no narrower prefix: no compaction


def test_compiled_blocks_raise_dynamo_recompile_limit_above_the_widths_a_call_uses():
    """The decode parts compile once per slot width: 512 slots give 9 widths, past dynamo's default limit of 8,
    beyond which a width's layers would run uncompiled. A compiled block raises the limit (and never lowers it)."""
    from shardrl.rollout.fast.rollout import FastRollout
    from shardrl.rollout.fast.block import DecoderBlock

    widths = FastRollout._widths(type("R", (), {"min_width": 8, "width_step": None})(), 512)
    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        config.recompile_limit = 8
        DecoderBlock(compile=False)
        assert config.recompile_limit == 8
        DecoderBlock(compile=True)
        assert config.recompile_limit >= 2 * len(widths) > 8
        config.recompile_limit = 1000
        DecoderBlock(compile=True)
        assert config.recompile_limit == 1000
    finally:
        config.recompile_limit = before


class DripFeed:
    """A `RowFeed` that hands over one more prompt at every host sync (the rows keep coming while others decode),
    recording the order of syncs (`take`), admissions and decode steps."""

    def __init__(self, prompts: list[torch.Tensor], limit: int, events: list[str]):
        self.waiting, self.limit, self.events, self.out = list(prompts), limit, events, {}

    def take(self, block: bool):
        self.events.append("take")
        return [(self.waiting.pop(0), self.limit)] if self.waiting else []

    def finished(self, row: int, tokens: list[int], log_probs: torch.Tensor) -> None:
        self.out[row] = tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stream_admitting_while_rows_decode_equals_generate(tok, overlap, monkeypatch):
    """generate_stream with rows joining at every sync: each row's greedy tokens are those of `generate` on its
    prompt alone. With `overlap`, a sync with rows decoding launches their steps before it admits (the admission's
    host work runs while the device decodes); without, it admits first."""
    model = reference_model(tok, seed=1)
    eos_tok = with_eos_at_different_steps(tok, model)
    fast = make_rollout("fast", eos_tok, model, max_batch=4, sync_every=3)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    want = []
    for p in PROMPTS:
        ids, mask = encode(eos_tok, [p])
        out = fast.generate(ids, mask, greedy)
        want.append(out.response_ids[0, : int(out.response_mask[0].sum())].tolist())
    events: list[str] = []
    admit, step = fast._admit, fast._run_step
    monkeypatch.setattr(fast, "_admit", lambda *a: (events.append("admit"), admit(*a))[1])
    monkeypatch.setattr(fast, "_run_step", lambda *a: (events.append("step"), step(*a))[1])
    read_back = []  # fed prompts whose ids the admission read from the device (waiting for queued steps on a GPU)
    tokens_of = fast._tokens_of
    monkeypatch.setattr(fast, "_tokens_of", lambda prompts, b: (
        read_back.append(b) if b > 0 and b not in fast._prompt_tokens else None, tokens_of(prompts, b))[1])
    prompts = [encode(eos_tok, [p])[0][0] for p in PROMPTS]
    feed = DripFeed(prompts[1:], 12, events)
    fast.generate_stream(prompts[:1], [12], greedy, feed, need_seq=64, overlap=overlap)
    for row, tokens in feed.out.items():  # (uncut: through the end token, which `generate` keeps too)
        assert tokens == want[row], row
    assert sorted(feed.out) == list(range(len(PROMPTS)))
    assert not read_back
    # after each sync (take) that admits while rows decode: steps first with overlap, the admission first without
    syncs = [i for i, e in enumerate(events) if e == "take"] + [len(events)]
    between = [events[a + 1:b] for a, b in zip(syncs, syncs[1:])]
    first = [seg[0] for seg in between if "admit" in seg and "step" in seg]
    # (the first sync has nothing decoding: it admits first either way)
    assert len(first) >= 4 and first[0] == "admit" and set(first[1:]) == ({"step"} if overlap else {"admit"}), between
