"""The fast rollout's paged KV cache and its prefix index (`shardrl.rollout.fast.paged`): rows of a prompt share its
blocks, a prompt that starts with what an earlier row's cache held (a conversation's next turn, the n samples
admitted later) prefills only the rest, and the tokens and log-probs are those of a rollout without the index
(greedy tokens equal, sampled log-probs equal a plain forward's), at block sizes from 1 to a whole row; new
weights forget the index. CPU, fp32, tiny random models."""

from __future__ import annotations

import pytest
import torch

from shardrl.rollout import SamplingParams
from shardrl.rollout.fast.paged import BlockPool
from test_rollout_fast import (PROMPTS, assert_same_output, encode, make_rollout, reference_model, tok,  # noqa: F401
                               with_eos_at_different_steps)
from test_rollout_hf import recomputed_log_probs


def test_shared_prefix_groups_reach_the_device_live_rows_first():
    """The decode kernel walks the group rows up to the first empty one: after a group dissolves, the groups after
    it move up, with their members and shared lengths intact."""
    from shardrl.rollout.fast.paged import SharedPrefixGroups

    shared, groups = torch.zeros(8, dtype=torch.long), torch.full((4, 3), -1, dtype=torch.long)
    g = SharedPrefixGroups(8, 3, shared, groups)
    g.add([0, 1], 64)
    g.add([2, 3, 4], 128)
    g.add([5, 6], 64)
    g.push()
    assert groups.tolist() == [[0, 1, -1], [2, 3, 4], [5, 6, -1], [-1, -1, -1]]
    g.remove(0)  # the first group dissolves (one slot left)
    g.move(4, 7)
    g.push()
    assert groups.tolist() == [[2, 3, 7], [5, 6, -1], [-1, -1, -1], [-1, -1, -1]]
    assert shared.tolist() == [0, 0, 128, 128, 0, 64, 64, 128]
    g.add([0, 1], 64)  # takes the free id 0 on the host, the first free row on the device
    g.push()
    assert groups.tolist() == [[0, 1, -1], [2, 3, 7], [5, 6, -1], [-1, -1, -1]]
    # the shared-prefix kernel reads whole blocks unmasked: a prefix that ends inside a block is refused
    blocks = SharedPrefixGroups(8, 3, shared, groups, block_size=64)
    with pytest.raises(ValueError, match="100 entries is not whole blocks of 64"):
        blocks.add([0, 1], 100)
    blocks.add([0, 1], 128)


def test_the_pool_counts_holders_keeps_finished_prefixes_and_evicts_the_least_recent():
    pool = BlockPool(7, 2)  # blocks 1..6 (0 is scratch)
    a = pool.allocate(3)
    assert 0 not in a and pool.available() == 3
    pool.register([5, 6, 7, 8, 9], a, written=5)  # two full blocks indexed, the third partial
    pool.release(a)
    assert pool.available() == 6 and len(pool.idle) == 2
    hit = pool.lookup([5, 6, 7, 8, 1, 2], limit=6)
    assert hit == a[:2] and pool.refs[a[0]] == 1 and not pool.idle
    assert pool.lookup([5, 6, 7, 9], limit=4) == [a[0]]  # the shared first block only
    assert pool.lookup([5, 6, 7, 8], limit=3) == [a[0]]  # at most `limit` positions
    pool.release(hit + [a[0], a[0]])
    assert pool.refs[a[0]] == 0 and list(pool.idle) == [a[1], a[0]]  # a[0] used last
    taken = pool.allocate(5)  # four free ones, then the least recently used indexed one
    assert a[1] in taken and a[0] not in taken and pool.lookup([5, 6, 7, 8], 4) == [a[0]]
    with pytest.raises(RuntimeError, match="0 free blocks, 1 asked for"):
        pool.allocate(1)
    pool.release([a[0]])
    assert list(pool.idle) == [a[0]] and pool.available() == 1
    pool.clear_index()  # new weights: nothing is found, the idle block is free again
    assert pool.lookup([5, 6, 7, 8], 4) == [] and not pool.idle and pool.free == [a[0]]


def test_eviction_takes_the_ends_of_chains_first():
    """A row's blocks are released deepest first: the least recently used idle block is a chain's end, so evicting
    it leaves the rest of the prefix readable."""
    pool = BlockPool(5, 2)
    chain = pool.allocate(4)
    pool.register(list(range(8)), chain, written=8)
    pool.release(chain)
    assert pool.allocate(1) == [chain[3]]
    assert pool.lookup(list(range(8)), 8) == chain[:3]


def test_a_pinned_session_keeps_its_blocks_until_space_runs_short():
    pool = BlockPool(9, 2)  # 8 blocks
    conv = pool.allocate(3)
    pool.register([1, 2, 3, 4, 5, 6], conv, written=6)
    pool.release(conv)
    assert pool.pin("s", [1, 2, 3, 4, 5, 6, 7]) == 3 and not pool.idle  # held: not evictable
    pool.drop_holders()  # (a call starts) the session's hold stays
    assert all(pool.refs[b] == 1 for b in conv) and pool.available() == 5
    other = pool.allocate(5)
    assert not set(other) & set(conv)
    pool.release(other)
    assert pool.pin("s", [1, 2, 3, 4]) == 2 and pool.refs[conv[2]] == 0  # the new pin replaces the last
    pool.allocate(8)  # more than is left: the session goes first
    assert not pool.pins and pool.lookup([1, 2, 3, 4], 4) == []
    pool = BlockPool(9, 2)
    blocks = pool.allocate(6)
    pool.register(list(range(12)), blocks, written=12)
    pool.release(blocks)
    assert pool.pin("long", list(range(12))) == 0  # (more than half the pool: not kept)
    pool.pin("short", list(range(4)))
    pool.clear_index()  # new weights: no session either
    assert not pool.pins and pool.available() == 8


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_conversation_survives_other_traffic(tok, pinned):
    """A conversation's blocks, pinned under its session, are read by its next turn after other prompts took the
    cache's space; unpinned, the least recently used go first and the next turn prefills it again."""
    model = reference_model(tok, seed=1)
    fast = make_rollout("fast", tok, model, block_size=4, max_batch=2, max_seq_len=64)
    greedy = SamplingParams(greedy=True, max_new_tokens=24)
    first = fast.generate(*encode(tok, ["the quick brown fox jumps"]), greedy)
    ids, mask = next_turns(tok, first)
    if pinned:
        assert fast.pin_session("conv", ids[0][mask[0].bool()].tolist()) >= 32
    for i in range(6):  # other prompts: 2 rows of about 7 blocks a call, of the 32
        fast.generate(*encode(tok, [f"{i}{i} other {i}", f"{i} more"]), SamplingParams(greedy=True,
                                                                                       max_new_tokens=20))
    fast.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=4))
    assert (fast.last_stats["cached_tokens"] >= 32) is pinned, fast.last_stats


def test_a_failed_call_leaves_no_block_held_and_no_cached_prefix_wrong(tok, monkeypatch):
    """A call that raises in the middle (rows admitted, blocks held) leaves nothing behind: the next call starts
    with every block free or idle, and prompts that read what the failed call cached give the tokens of a fresh
    rollout."""
    from shardrl.rollout.fast.rollout import FastRollout

    model = reference_model(tok, seed=1)
    kwargs = dict(block_size=4, max_batch=4, sync_every=2, max_seq_len=128)
    fast = make_rollout("fast", tok, model, **kwargs)
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=12)
    steps = [0]
    real = FastRollout._run_step

    def failing(self, *args, **kw):
        steps[0] += 1
        if steps[0] == 5:
            raise RuntimeError("out of memory (a test)")
        return real(self, *args, **kw)

    for _ in range(3):
        monkeypatch.setattr(FastRollout, "_run_step", failing)
        steps[0] = 0
        with pytest.raises(RuntimeError, match="a test"):
            fast.generate(*encode(tok), greedy)
        monkeypatch.setattr(FastRollout, "_run_step", real)
        fast.generate(*encode(tok, ["zz"]), greedy)  # one unrelated prompt in between
        assert sum(fast._pool.refs) == 0
    got = fast.generate(*encode(tok), greedy)
    assert_same_output(got, make_rollout("fast", tok, model, **kwargs).generate(*encode(tok), greedy))


def next_turns(tok, out, extra: str = " ok? "):
    """Each row's context (prompt, response) and `extra`: a conversation's next turn, token-exact."""
    rows = []
    for r in range(len(out)):
        prompt = out.prompt_ids[r][out.prompt_mask[r].bool()].tolist()
        rows.append(prompt + out.response_ids[r][out.response_mask[r].bool()].tolist() + tok(extra)["input_ids"])
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_equal_prompts_in_one_call_are_prefilled_once(tok, prefix_cache):
    """Rows of n = 1 whose prompts are the same tokens (a conversation's copies at its first turn, clients sending
    one prompt) share one prefill, as a prompt's n samples do; their tokens and log-probs are those of the n-sample
    call (the same noise: rows draw in order) and of the HF reference."""
    model = reference_model(tok, seed=2)
    kwargs = dict(block_size=4, max_batch=8, prefix_cache=prefix_cache)
    fast = make_rollout("fast", tok, model, **kwargs)
    prompts = ["what is 7*6? ", "hello worlds ", "what is 7*6? ", "what is 7*6? ", "hello worlds "]  # (13 each)
    ids, mask = encode(tok, prompts)
    one = SamplingParams(n=1, temperature=1.0, max_new_tokens=9, seed=3)
    out = fast.generate(ids, mask, one)
    lengths = mask.sum(1).tolist()
    assert fast.last_stats["prefill_tokens"] == lengths[0] + lengths[1]  # (equal lengths: no padding in the chunk)
    got = recomputed_log_probs(model, out, 1.0)[:, ids.shape[1]:]
    keep = out.response_mask.bool()
    assert torch.allclose(out.sampled_log_probs[keep], got[keep], atol=1e-4)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=9)
    assert_same_output(fast.generate(ids, mask, greedy), make_rollout("hf", tok, model).generate(ids, mask, greedy))


def test_a_kv_budget_admits_rows_as_blocks_free_and_changes_no_token(tok):
    """`kv_cache_tokens` below slots x max_seq: rows wait for blocks (at most what the budget holds at their
    longest decode together), and the tokens and log-probs are those of the rollout whose cache holds every slot."""
    model = reference_model(tok, seed=1)
    tok = with_eos_at_different_steps(tok, model)
    kwargs = dict(block_size=4, max_batch=8, max_seq_len=40, sync_every=3)
    greedy = SamplingParams(n=3, greedy=True, max_new_tokens=14)
    whole = make_rollout("fast", tok, model, **kwargs)
    want = whole.generate(*encode(tok), greedy)
    assert whole.last_stats["peak_rows"] == 8
    budget = make_rollout("fast", tok, model, kv_cache_tokens=80, **kwargs)
    got = budget.generate(*encode(tok), greedy)
    assert_same_output(got, want)
    assert budget._pool.num_blocks == 80 // 4 + 1
    assert 2 <= budget.last_stats["peak_rows"] < 8  # (a prompt's rows share its full blocks: more than 80 / 40)
    assert sum(budget._pool.refs) == 0
    sampled = budget.generate(*encode(tok), SamplingParams(n=3, temperature=1.0, max_new_tokens=14, seed=7))
    keep = sampled.response_mask.bool()  # (the noise a row draws depends on when it is admitted: not want's tokens)
    recomputed = recomputed_log_probs(model, sampled, 1.0)[:, sampled.prompt_ids.shape[1]:]
    assert torch.allclose(sampled.sampled_log_probs[keep], recomputed[keep], atol=1e-4)
    with pytest.raises(ValueError, match=r"kv_cache_tokens=16 \(rollout.fast.kv_cache_tokens\) cannot hold one row of 40 positions"):
        make_rollout("fast", tok, model, kv_cache_tokens=16, **kwargs).generate(*encode(tok), greedy)


def test_multi_turn_rounds_decode_all_conversations_at_once(tok):
    """The multi-turn rollout's rounds call the fast backend with n = 1 rows of every conversation: the slots are
    those of a single-turn call of the prompts' n samples (min(rows, micro_batch_size * n)), not micro_batch_size."""
    from shardrl.rollout.episodes.multiturn import Interaction, MultiTurnRollout

    model = reference_model(tok, seed=1)
    fast = make_rollout("fast", tok, model, micro_batch_size=2)
    multi = MultiTurnRollout(fast, tok, Interaction(), max_turns=2, max_response_tokens=24)
    ids, mask = encode(tok, PROMPTS[:3])
    multi.generate(ids, mask, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1))
    assert fast.last_stats["num_slots"] == 8  # 2 prompts x 4 samples' worth, not 2


@pytest.mark.parametrize("block_size", [1, 4, 7, 64])
def test_paged_generation_equals_the_reference_and_next_turns_read_the_cache(tok, block_size):
    model = reference_model(tok, seed=1)
    tok = with_eos_at_different_steps(tok, model)
    kwargs = dict(block_size=block_size, max_batch=4, sync_every=3, min_width=2, width_step=2, seq_bucket=8,
                  max_seq_len=128)  # (a cache that grows is a new one: its index starts empty)
    fast = make_rollout("fast", tok, model, **kwargs)
    plain = make_rollout("fast", tok, model, **{**kwargs, "prefix_cache": False})
    hf = make_rollout("hf", tok, model)
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=14)
    first = fast.generate(*encode(tok), greedy)
    assert_same_output(first, hf.generate(*encode(tok), greedy))
    assert fast.last_stats["compactions"] > 0  # 12 rows over 4 slots, ending apart: slots reused, rows moved
    ids, mask = next_turns(tok, first)
    one = SamplingParams(greedy=True, max_new_tokens=10)
    second = fast.generate(ids, mask, one)
    assert_same_output(second, hf.generate(ids, mask, one))
    cached, run = fast.last_stats["cached_tokens"], fast.last_stats["prefill_tokens"]
    assert_same_output(plain.generate(ids, mask, one), second)
    assert plain.last_stats["cached_tokens"] == 0
    if block_size < 64:
        # each next turn starts with a row's whole cache (its prompt and fed tokens): all its full blocks are read,
        # once per distinct context (greedy samples of one prompt are equal: their next turns are one prefill)
        held = [int(first.prompt_mask[r].sum() + first.response_mask[r].sum()) - 1 for r in range(len(first))]
        distinct = {tuple(ids[r][mask[r].bool()].tolist()): r for r in reversed(range(len(first)))}
        assert len(distinct) < len(first)
        want = sum(min(held[r] // block_size, (int(mask[r].sum()) - 1) // block_size) * block_size
                   for r in distinct.values())
        assert cached >= want > 0
        assert run < plain.last_stats["prefill_tokens"]
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=5)
    out = fast.generate(ids, mask, sampled)
    assert_same_output(out, plain.generate(ids, mask, sampled))  # same noise, same draws
    batch = out.to_batch()
    real = batch["loss_mask"].bool()
    torch.testing.assert_close(batch["sampled_log_probs"][real], recomputed_log_probs(model, out, 1.0)[real],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mistral_window", "gemma2", "gemma3_text", "qwen3_moe"])
def test_a_cached_prefix_serves_sliding_windows_soft_caps_and_experts(name):
    """Next turns whose prompts read a cached prefix on the families with other attention (sliding windows
    shorter than the prefix, Gemma's soft-cap, Gemma 3's local rope) and routed experts: HF's greedy tokens."""
    from test_rollout_fast_families import attn_of, family_config, hf_model

    from shardrl.rollout import FastRollout, HFRollout
    from shardrl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = hf_model(family_config(tok, name))
    fast = FastRollout(model.config, tok, "cpu", torch.float32, max_batch=4, sync_every=5, seq_bucket=16,
                       block_size=4, max_seq_len=128)
    fast.load_weights(model.named_parameters())
    hf = HFRollout(model.config, tok, "cpu", torch.float32, attn_implementation=attn_of(model.config))
    hf.load_weights(model.named_parameters())
    greedy = SamplingParams(greedy=True, max_new_tokens=20)
    first = fast.generate(*encode(tok), greedy)
    ids, mask = next_turns(tok, first)
    second = fast.generate(ids, mask, greedy)
    assert fast.last_stats["cached_tokens"] > 100
    want = hf.generate(ids, mask, greedy)
    assert torch.equal(second.response_ids, want.response_ids), (second.response_text, want.response_text)
    torch.testing.assert_close(second.sampled_log_probs, want.sampled_log_probs, atol=1e-5, rtol=0)


def test_new_weights_forget_the_cached_prefixes(tok):
    model, other = reference_model(tok, seed=1), reference_model(tok, seed=2)
    kwargs = dict(block_size=4, max_batch=4, max_seq_len=128)
    fast = make_rollout("fast", tok, model, **kwargs)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    ids, mask = next_turns(tok, fast.generate(*encode(tok), greedy))
    fast.load_weights(other.named_parameters())
    got = fast.generate(ids, mask, greedy)
    assert fast.last_stats["cached_tokens"] == 0
    assert_same_output(got, make_rollout("fast", tok, other, **kwargs).generate(ids, mask, greedy))
    fast.generate(*encode(tok), greedy)  # (what the new weights cache is read again)
    fast.generate(ids, mask, greedy)
    assert fast.last_stats["cached_tokens"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_paged_decode_in_cuda_graphs_reads_the_cache_as_the_cpu_does(tok, attention):
    """On the GPU (fp32: Triton in IEEE precision, the decode step in CUDA graphs, compiled parts): next turns read
    their cached context and give HF's greedy tokens, and sampled rows equal those of the cache-less path."""
    model = reference_model(tok, seed=1, hidden_size=64).cuda()  # head dim 16, the Triton kernel's least
    tok = with_eos_at_different_steps(tok, model.cpu())
    model = model.cuda()
    kwargs = dict(block_size=16, max_batch=4, sync_every=3, min_width=2, width_step=2, max_seq_len=256,
                  attention=attention)
    fast = make_rollout("fast", tok, model, device="cuda", **kwargs)
    plain = make_rollout("fast", tok, model, device="cuda", **{**kwargs, "prefix_cache": False})
    hf = make_rollout("hf", tok, model, device="cuda")
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=24)
    first = fast.generate(*encode(tok), greedy)
    ids, mask = next_turns(tok, first)
    second = fast.generate(ids, mask, greedy)
    assert fast.last_stats["cached_tokens"] > 0
    want = hf.generate(ids, mask, greedy)
    assert torch.equal(second.response_ids.cpu(), want.response_ids.cpu())
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=5)
    got, ref = fast.generate(ids, mask, sampled), plain.generate(ids, mask, sampled)
    assert torch.equal(got.response_ids.cpu(), ref.response_ids.cpu())
    torch.testing.assert_close(got.sampled_log_probs.cpu(), ref.sampled_log_probs.cpu(), atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prefix_decode_in_cuda_graphs_equals_each_row_reading_its_own_cache(tok):
    """The n samples of a prompt read its shared blocks together (the decode kernel's cascade, compiled and in CUDA
    graphs, fp32): HF's greedy tokens, and sampled tokens and log-probs equal to the rollout without it, while rows
    end apart, groups dissolve and slots compact. (The CPU check: tests/triton_interpreter_checks.py cascade.)"""
    model = reference_model(tok, seed=1, hidden_size=64).cuda()  # head dim 16
    tok = with_eos_at_different_steps(tok, model.cpu())
    model = model.cuda()
    ids, mask = encode(tok, ["the quick brown fox jumps over " * 3, "what is 7*6? " * 4, "hello world " * 5, "ab"])
    kwargs = dict(block_size=16, max_batch=16, sync_every=3, min_width=4, width_step=4, attention="triton")
    fast = make_rollout("fast", tok, model, device="cuda", **kwargs)
    plain = make_rollout("fast", tok, model, device="cuda", **{**kwargs, "cascade": False})
    greedy = SamplingParams(n=4, greedy=True, max_new_tokens=40)
    got = fast.generate(ids.cuda(), mask.cuda(), greedy)
    assert fast.last_stats["cascade_steps"] > 0 and any(key[3] for key in fast._graphs)
    want = make_rollout("hf", tok, model, device="cuda").generate(ids.cuda(), mask.cuda(), greedy)
    assert torch.equal(got.response_ids.cpu(), want.response_ids.cpu())
    sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=5)
    got, ref = fast.generate(ids.cuda(), mask.cuda(), sampled), plain.generate(ids.cuda(), mask.cuda(), sampled)
    assert plain.last_stats["cascade_steps"] == 0
    assert torch.equal(got.response_ids.cpu(), ref.response_ids.cpu())
    torch.testing.assert_close(got.sampled_log_probs.cpu(), ref.sampled_log_probs.cpu(), atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("g,d,window", [(3, 64, None), (7, 128, None), (2, 64, 48)])
def test_the_prefill_kernel_in_bf16_attends_over_each_prompts_cached_positions(g, d, window):
    """`prefill_attention` compiled, bf16, the heads of real models (SmolLM2's G = 3 at D = 64, Qwen2.5-7B's 7 at
    128, a sliding window): prompts of 1 to 300 new tokens after cached prefixes of 0 to 512 entries, in blocks of 16,
    against fp32 attention over each prompt's positions. (The CPU check: tests/triton_interpreter_checks.py prefill.)"""
    from triton_interpreter_checks import check_prefill_case

    cases = [(None, window, None, None), (None, window, 30.0, 0.1)]
    check_prefill_case(torch.bfloat16, 2e-2, 2, g, d, 16, [0, 32, 160, 512], [300, 1, 77, 129], cases, 64, "cuda",
                       torch.Generator().manual_seed(0))


def test_an_rl_run_logs_the_share_of_prompt_tokens_read_from_the_cache(tmp_path, monkeypatch):
    """rollout/prompt_cached_frac: with blocks of 2 positions and 2 decode slots, a prompt's 4 samples are admitted
    apart, and the later pair reads the first's full block (the demo's prompts are 4 tokens: 2 of them)."""
    import json

    import shardrl.rollout.build as generation
    from shardrl.testing import small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets
    from shardrl.launch.rank import run

    build = generation.build_rollout
    monkeypatch.setattr(generation, "build_rollout", lambda name, *a, **k: build(
        name, *a, **({**k, "block_size": 2} if name == "fast" else k)))
    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=0)
    run_dir = run(None, small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=2",
                                       "rollout.backend=fast", "rollout.fast.max_batch=2"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0.2 < r["rollout/prompt_cached_frac"] < 1 for r in records), [r.get("rollout/prompt_cached_frac") for r in records]
