"""The HF rollout against hand-written references on a tiny random model (CPU, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from shardrl.config.schema import RolloutConfig
from shardrl.engine.model import PolicyModel, build_causal_lm
from shardrl.rollout import HFRollout, RolloutOutput, SamplingParams, build_rollout
from shardrl.testing import TINY_MODELS
from shardrl.tokenizer import build_char_tokenizer

PROMPTS = ["1+2=", "hello world ", "ab", "what is 7*6? "]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny_config(tok, kind: str = "qwen2"):
    kw = dict(TINY_MODELS[kind], vocab_size=len(tok), pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)


def reference_model(tok, seed: int, kind: str = "qwen2"):
    return build_causal_lm(tiny_config(tok, kind), None, "cpu", torch.float32, seed=seed).eval()


def make_rollout(tok, model, kind: str = "qwen2", **kwargs) -> HFRollout:
    rollout = build_rollout("hf", tiny_config(tok, kind), tok, "cpu", torch.float32, **kwargs)
    rollout.load_weights(model.named_parameters())
    return rollout


def encode(tok, prompts=PROMPTS):
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def greedy_reference(model, ids, mask, max_new_tokens: int, eos: int, pad: int):
    """Argmax of a full forward (no KV cache) each step; returns response ids and mask."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    tokens, live = [], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
        nxt = torch.where(done, pad, logits.argmax(-1))
        tokens.append(nxt)
        live.append((~done).long())
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, (~done).long()[:, None]], 1)
        done |= nxt == eos
        if done.all():
            break
    return torch.stack(tokens, 1), torch.stack(live, 1)


@torch.no_grad()
def recomputed_log_probs(model, out: RolloutOutput, temperature: float):
    """log softmax(logits / T) of every token under one plain forward of the whole sequence, (N, P+R)."""
    batch = out.to_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def test_greedy_equals_full_forward_argmax_loop(tok):
    model = reference_model(tok, seed=1)
    rollout = make_rollout(tok, model, micro_batch_size=3)  # 4 prompts: chunks of 3 and 1
    ids, mask = encode(tok)
    out = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=16, seed=None))
    ref_ids, ref_mask = greedy_reference(model, ids, mask, 16, tok.eos_token_id, tok.pad_token_id)
    assert torch.equal(out.response_ids, ref_ids)
    assert torch.equal(out.response_mask, ref_mask)
    assert out.response_text == [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(ref_ids, ref_mask)]
    # temperature 0 is greedy too
    again = rollout.generate(ids, mask, SamplingParams(temperature=0.0, max_new_tokens=16, seed=123))
    assert torch.equal(again.response_ids, out.response_ids)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 10, 0.9), (1.0, 0, 1.0), (0.0, 0, 1.0)])
def test_sampled_log_probs_equal_forward_recomputation(tok, temperature, top_k, top_p):
    model = reference_model(tok, seed=2)
    rollout = make_rollout(tok, model, micro_batch_size=2)
    ids, mask = encode(tok)
    sampling = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=20, seed=5)
    assert_sampled_log_probs_recomputed(rollout.generate(ids, mask, sampling), model, sampling, min_tokens=20)


def assert_sampled_log_probs_recomputed(out: RolloutOutput, model, sampling: SamplingParams, min_tokens: int):
    """The sampler's log-probs equal a plain forward's and the training engine's recomputation."""
    batch = out.to_batch()
    loss_mask = batch["loss_mask"].bool()
    expected = recomputed_log_probs(model, out, sampling.logprob_temperature)
    got = batch["sampled_log_probs"]
    assert loss_mask.sum() > min_tokens
    torch.testing.assert_close(got[loss_mask], expected[loss_mask], atol=1e-5, rtol=0)
    assert (got[~loss_mask] == 0).all() and (got[loss_mask] < 0).all()
    # the engine's own recomputation (packed, chunked) agrees too; like the engine, no KV cache, which
    # would hide the packed sequence boundaries from HF's mask builder
    lm = copy.deepcopy(model)
    lm.config.use_cache = False
    policy = PolicyModel(lm, chunk_size=7).eval()
    with torch.no_grad():
        engine_lp = policy(batch["input_ids"], batch["attention_mask"], remove_padding=True,
                           temperature=sampling.logprob_temperature)["log_probs"]
    torch.testing.assert_close(got[loss_mask], engine_lp[loss_mask], atol=1e-5, rtol=0)


def test_n_samples_are_prompt_major(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=3), micro_batch_size=3)
    ids, mask = encode(tok)
    n = 3
    out = rollout.generate(ids, mask, SamplingParams(n=n, temperature=1.5, max_new_tokens=10, seed=0))
    assert len(out) == len(PROMPTS) * n
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(out.prompt_ids, ids[out.prompt_index])
    assert torch.equal(out.prompt_mask, mask[out.prompt_index])
    assert len(out.response_text) == len(out)
    for b in range(len(PROMPTS)):  # the samples of one prompt differ
        group = out.response_text[b * n : (b + 1) * n]
        assert len(set(group)) > 1, group


def test_seed_reproduces_and_leaves_global_rng_alone(tok):
    assert_seeded_sampling(make_rollout(tok, reference_model(tok, seed=4), micro_batch_size=2), tok)


def assert_seeded_sampling(rollout, tok) -> None:
    """A seed gives the same samples again, another seed other samples, and the global RNG is untouched."""
    ids, mask = encode(tok)
    state = torch.random.get_rng_state()
    a = rollout.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=11))
    assert torch.equal(torch.random.get_rng_state(), state)
    b = rollout.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=11))
    c = rollout.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=12))
    assert torch.equal(a.response_ids, b.response_ids) and a.response_text == b.response_text
    assert torch.equal(a.sampled_log_probs, b.sampled_log_probs)
    assert a.response_text != c.response_text


def test_stop_string_cuts_the_mask(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=1))
    ids, mask = encode(tok)
    free = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=16))
    row0 = free.response_ids[0][free.response_mask[0].bool()].tolist()
    text0 = tok.decode(row0, skip_special_tokens=True)
    assert len(text0) >= 8, text0
    stop = text0[4:6]
    start = text0.find(stop)
    cut = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=16, stop=[stop, "never-seen"]))
    # the mask ends at the token whose decoded prefix first contains the stop string
    expected_len = next(k for k in range(1, len(row0) + 1) if stop in tok.decode(row0[:k], skip_special_tokens=True))
    assert int(cut.response_mask[0].sum()) == expected_len
    assert cut.response_mask[0, :expected_len].all() and not cut.response_mask[0, expected_len:].any()
    assert cut.response_ids[0, :expected_len].tolist() == row0[:expected_len]
    assert (cut.response_ids[0, expected_len:] == tok.pad_token_id).all()
    assert cut.response_text[0] == text0[:start]
    for r in range(len(cut)):  # every row: unchanged before its cut, and its text holds no stop string
        length = int(cut.response_mask[r].sum())
        assert torch.equal(cut.response_ids[r, :length], free.response_ids[r, :length])
        assert stop not in cut.response_text[r]
        assert free.response_text[r].startswith(cut.response_text[r])


def test_eos_ends_a_response(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=6))
    ids, mask = encode(tok)
    # hot sampling over a ~60-token vocab: some rows hit EOS within 40 tokens, some do not
    out = rollout.generate(ids, mask, SamplingParams(n=4, temperature=3.0, max_new_tokens=40, seed=0))
    assert_some_rows_end_at_eos(out, tok, max_new_tokens=40)


def assert_some_rows_end_at_eos(out: RolloutOutput, tok, max_new_tokens: int) -> None:
    """Each row ends at its first EOS (kept, masked in; padding after it) or runs to the limit, and some
    rows do each."""
    eos, width = tok.eos_token_id, out.response_ids.shape[1]
    ended = 0
    for r in range(len(out)):
        length = int(out.response_mask[r].sum())
        assert out.response_mask[r, :length].all() and not out.response_mask[r, length:].any()
        real = out.response_ids[r, :length].tolist()
        if eos in real:
            ended += 1
            assert real.index(eos) == length - 1  # EOS is the last response token, and masked in
            assert (out.response_ids[r, length:] == tok.pad_token_id).all()
        else:
            assert length == width == max_new_tokens
    assert 0 < ended < len(out), ended


@pytest.mark.parametrize("kind", ["qwen2", "llama"])  # llama: head tied to the embedding
def test_load_weights_makes_generation_follow_the_new_model(tok, kind):
    first, second = reference_model(tok, seed=1, kind=kind), reference_model(tok, seed=9, kind=kind)
    rollout = make_rollout(tok, first, kind=kind)
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    before = rollout.generate(ids, mask, greedy)
    loss_mask = before.to_batch()["loss_mask"].bool()
    # (a tied random model may greedily repeat the last prompt token, whatever its weights: log-probs tell)
    assert not torch.allclose(before.to_batch()["sampled_log_probs"][loss_mask],
                              recomputed_log_probs(second, before, 1.0)[loss_mask], atol=1e-3)
    # one tensor at a time, as Engine.export_weights streams them (named_parameters drops the tied head)
    rollout.load_weights((name, p.detach().clone()) for name, p in second.named_parameters())
    after = rollout.generate(ids, mask, greedy)
    ref_ids, ref_mask = greedy_reference(second, ids, mask, 12, tok.eos_token_id, tok.pad_token_id)
    assert torch.equal(after.response_ids, ref_ids) and torch.equal(after.response_mask, ref_mask)
    loss_mask = after.to_batch()["loss_mask"].bool()
    torch.testing.assert_close(after.to_batch()["sampled_log_probs"][loss_mask],
                               recomputed_log_probs(second, after, 1.0)[loss_mask], atol=1e-5, rtol=0)


def test_load_weights_rejects_unknown_names_and_shapes(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=1))
    with pytest.raises(KeyError, match="no parameter 'model.layers.7.mlp.up_proj.weight'"):
        rollout.load_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"expects \(64, 32\)"):
        rollout.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])


def test_to_batch_shapes_and_masks(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=2))
    ids, mask = encode(tok)
    out = rollout.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=1,
                                                     stop=["e"]))
    num, p, r = len(out), ids.shape[1], out.response_ids.shape[1]
    batch = out.to_batch()
    assert len(batch) == num == 8
    for key in ("input_ids", "attention_mask", "loss_mask", "sampled_log_probs"):
        assert batch[key].shape == (num, p + r), key
    assert batch["response_mask"].shape == (num, r)
    assert torch.equal(batch["input_ids"], torch.cat([out.prompt_ids, out.response_ids], 1))
    assert torch.equal(batch["attention_mask"], torch.cat([out.prompt_mask, out.response_mask], 1))
    assert not batch["loss_mask"][:, :p].any()
    assert torch.equal(batch["loss_mask"][:, p:], out.response_mask)
    assert torch.equal(batch["sampled_log_probs"][:, p:], out.sampled_log_probs)
    assert batch["prompt_index"].tolist() == out.prompt_index.tolist()
    assert batch["response_text"] == out.response_text
    assert batch["loss_mask"].sum() == out.response_mask.sum() > 0


def test_release_and_resume(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=1))
    ids, mask = encode(tok)
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    before = rollout.generate(ids, mask, greedy)
    rollout.release()
    with pytest.raises(RuntimeError, match="resume"):
        rollout.generate(ids, mask, greedy)
    rollout.resume()
    assert torch.equal(rollout.generate(ids, mask, greedy).response_ids, before.response_ids)


def test_sampling_params_from_config_and_checks():
    cfg = RolloutConfig(n=8, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64, stop=["</a>"], seed=3)
    params = SamplingParams.from_config(cfg)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens, params.stop,
            params.seed, params.is_greedy) == (8, 0.6, 0.95, 20, 64, ["</a>"], 3, False)
    val = SamplingParams.from_config(cfg, n=1, greedy=True)
    assert val.n == 1 and val.is_greedy and val.logprob_temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="unknown rollout backend 'vllm'"):
        build_rollout("vllm", None, None, "cpu", torch.float32)


def test_prompts_must_be_left_padded(tok):
    rollout = make_rollout(tok, reference_model(tok, seed=1))
    enc = tok(["ab", "abcd"], padding=True, padding_side="right", return_tensors="pt")
    with pytest.raises(ValueError, match="left-padded"):
        rollout.generate(enc["input_ids"], enc["attention_mask"], SamplingParams())


def test_building_the_rollout_leaves_the_actors_model_config_alone(tok):
    # the trainer builds the rollout from the actor engine's config object, which the actor's model reads at
    # every forward: the rollout's own attention (sdpa) must not become the actor's. (It did: under sequence
    # parallelism the actor then attended within its 1/sp piece of each row only, log-probs off by ~3.)
    from shardrl.engine.attention import ATTN_NAME, resolve_attn_implementation

    config = tiny_config(tok)
    attn = resolve_attn_implementation(ATTN_NAME, True)
    actor = build_causal_lm(config, None, "cpu", torch.float32, seed=1, attn_implementation=attn)
    actor.config.use_cache = False
    rollout = build_rollout("hf", config, tok, "cpu", torch.float32)
    assert rollout.model.config._attn_implementation == "sdpa" and rollout.model.config.use_cache
    assert actor.config._attn_implementation == ATTN_NAME and config._attn_implementation == ATTN_NAME
    assert actor.config.use_cache is False


def test_top_k_zero_samples_from_the_whole_vocabulary(tok):
    """rollout.top_k=0 means no top-k: every token gets drawn. (HF's generate applies its default top-k of 50
    unless told 0: 3 of this tokenizer's 53 ids were never sampled, and the recorded log-probs, of the full
    distribution, were not the sampling policy's.) The model's next-token logits are fixed by construction:
    residual dimension 0 is 100 for every token and no layer reads or writes it, so after the final norm it is
    ~sqrt(hidden) and the others ~0; the head's column 0 makes token t's logit -t / V (all within 1 of each
    other: the 3 least likely ids are still drawn ~1% of the time each)."""
    model = reference_model(tok, seed=0)
    v, h = len(tok), model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight[:, 0] = 0
            layer.self_attn.o_proj.weight[0, :] = 0
            layer.mlp.down_proj.weight[0, :] = 0
        model.lm_head.weight[:, 0] = -torch.arange(v) / v / h**0.5
    rollout = make_rollout(tok, model)
    ids, mask = encode(tok, ["ab"] * 16)
    sampling = SamplingParams.from_config(RolloutConfig(n=8, max_new_tokens=48, top_k=0, seed=3))
    out = rollout.generate(ids, mask, sampling)
    batch = out.to_batch()
    real = batch["loss_mask"].bool()
    drawn = batch["input_ids"][real]
    assert drawn.numel() > 2500
    assert len(torch.unique(drawn)) == v  # each of the 3 rarest: ~40 draws expected, missing one ~e^-40
    expected = torch.log_softmax(-torch.arange(v) / v, -1)[drawn]
    assert torch.allclose(batch["sampled_log_probs"][real], expected, atol=2e-3)


def test_stop_length_is_the_shortest_prefix_holding_a_stop_string():
    """`stop_length` searches back from the end (a rollout ends rows a few tokens past their stop): against the
    shortest prefix found by trying every length, over random ids, stops and tokens that decode to several
    characters (a stop string may begin inside one token and end in another)."""
    from shardrl.rollout.base import contains_stop, stop_length

    class Pieces:  # token t decodes to a piece of one to three characters
        pieces = ["a", "b", "ab", "ba", "c", "abc"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[t] for t in ids)

    tok, rng = Pieces(), torch.Generator().manual_seed(0)
    for _ in range(3000):
        ids = torch.randint(0, 6, (int(torch.randint(0, 40, (1,), generator=rng)),), generator=rng).tolist()
        stop = ["".join("abc"[int(i)] for i in torch.randint(0, 3, (int(torch.randint(1, 4, (1,), generator=rng)),),
                                                               generator=rng))]
        want = next((k for k in range(1, len(ids) + 1) if contains_stop(tok.decode(ids[:k]), stop)), None)
        assert stop_length(tok, ids, stop) == want, (ids, stop)


def test_a_stop_string_of_characters_made_of_several_tokens_ends_its_row():
    """Both rollouts look for stop strings in a row's last tokens only. A byte-level BPE spells an emoji in several
    tokens, so a stop string of ten emoji is over forty tokens: the tail looked at must hold that many (it held one
    token a character: the stop string was never found whole, and the row ran on to its limit, a streamed reply
    sending the stop string and what followed it)."""
    from types import SimpleNamespace

    import tokenizers

    from shardrl.rollout.fast.loop import DecodeLoop
    from shardrl.rollout.hf import _StopStringCriteria

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world, hello there"] * 4, vocab_size=262, min_frequency=1, show_progress=False)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    stop = ["🙂" * 10]
    ids = tok("hello there " + stop[0])["input_ids"]
    assert len(tok(stop[0])["input_ids"]) == 40 and stop[0] in tok.decode(ids)
    state = SimpleNamespace(out_tokens=torch.tensor([ids]), done=torch.zeros(1, dtype=torch.bool))
    loop = SimpleNamespace(_state=state, device=torch.device("cpu"), sync_every=16, tokenizer=tok)
    assert DecodeLoop._find_stops(loop, [0], [len(ids)], stop) == [0] and state.done.tolist() == [True]
    assert _StopStringCriteria(tok, stop, prompt_width=0)(torch.tensor([ids]), None).tolist() == [True]
