"""Rollout throughput on one GPU: the fast engine (`shardrl.rollout.fast.rollout`) against HF `generate` in the same run.

Model: Qwen2-1.5B-shaped, random init (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab
151936, tied embeddings, as bench/engine.py), bf16. Prompts: random token ids, no padding. Sampling at
temperature 1 without truncation and without EOS (every row runs to its limit), so each backend produces
the same number of tokens.

Cases:
    fixed_B   B prompts of --prompt-len tokens, --new-tokens new tokens each, all in one batch of B
    mixed     --mixed-prompts prompts whose response limits are uniform in [--mixed-min, --mixed-max];
              a batch (fast: decode slots; HF: rows per generate call) of --mixed-batch
    tail_B    B prompts in one batch of B, response limits drawn as the lengths of responses that end with
              probability 1/400 at each token, cut at 1024 (mean ~365: bench/e2e.py's var_512 case), so the
              live rows dwindle over the last steps
Rows:
    fast          FastRollout with its CUDA defaults: CUDA graphs, attention="triton" (each slot read up to its
                  length, the new K/V written by the kernel), the one-pass Triton sampler, the layer's parts
                  around attention compiled
    fast_torch_sampler  as fast, sampler="torch" (the compiled torch sampler, noise drawn by a separate kernel)
    fast_sdpa     as fast, attention="sdpa" (masked, over the first bucketed length)
    fast_eager    as fast, nothing compiled (the graphs replay eager kernels)
    fast_no_compact  as fast, without compaction (every step runs on all slots, finished ones too)
    fast_halving  as fast, with session 6's compaction widths (the slots halved up to three times: 512, 256,
                  128, 64) instead of steps of an eighth of the slots down to 32
    hf_dynamic    HF generate, DynamicCache (the reference backend's engine)
    hf_static     HF generate, cache_implementation="static" (HF compiles the forward itself)

Each (case, row): one warm-up run with the same shapes (graph capture, compilation), then a timed run.
Prints one JSON line per result: new tokens/s (end to end, prefill included, and of the decode alone), the
prefill time (fast:
a run with one new token; HF: a forward of the prompts), and the fraction of the memory-bandwidth limit
its decode reached: (decode steps x weight bytes + KV bytes of the live rows' context) / decode time /
--bandwidth (4.3 TB/s on an H200). Fast rows add the time to load new weights (from GPU tensors, as the
engine exports them) and to release/resume the cache (resume recaptures the graphs), and the trainer's
health metric on 16 responses: |sampler log-prob - training engine's recomputation|, mean and max.

    python bench/rollout.py                                   # everything, ~minutes on one H200
    python bench/rollout.py --cases fixed_256,mixed --rows hf_dynamic,fast
    python bench/rollout.py --quick                           # tiny model on the CPU: a smoke run
    python bench/rollout.py --cases greedy_64 --rows fast     # greedy agreement with HF in bf16

The `greedy_B` case checks correctness instead of speed: B prompts decoded greedily by the fast engine and
by HF `generate` (same bf16 weights). It reports the fraction of identical responses and, where a response
differs, the first differing position and how far apart the two chosen tokens are in an fp32 forward of the
shared prefix (a gap far below the typical top-1/top-2 gap means the two picks were a near-tie that bf16
rounding decided).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` as a package

QWEN2_1P5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
TINY = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
HBM_BYTES_PER_S = 4.3e12


class IdTokenizer:
    """Enough of a tokenizer for throughput runs: no EOS, and no text."""

    eos_token_id, bos_token_id, pad_token_id = None, None, 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def batch_decode(self, rows, skip_special_tokens=True) -> list[str]:
        return [""] * len(rows)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def model_bytes(config, dtype) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes per cached token)."""
    h, layers, v = config.hidden_size, config.num_hidden_layers, config.vocab_size
    d = h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    per_layer = h * h * 2 + h * kv * 2 + h * 2 + kv * 2 + 3 * h * config.intermediate_size  # +biases, norms
    size = torch.finfo(dtype).bits // 8
    return (layers * per_layer + h * v + h) * size, layers * 2 * kv * size  # head read once (embedding: B rows)


def build_case(name: str, args, vocab: int, gen: torch.Generator):
    """(prompt ids (N, P), per-prompt limits (N,), batch)."""
    if name == "mixed":
        num, batch = args.mixed_prompts, args.mixed_batch
        limits = torch.randint(args.mixed_min, args.mixed_max + 1, (num,), generator=gen)
    elif name.startswith("tail_"):
        num = batch = int(name.split("_")[1])
        u = torch.rand(num, generator=gen, dtype=torch.float64)  # geometric: the first token that is EOS
        limits = (torch.log1p(-u) / torch.log1p(torch.tensor(-1 / 400, dtype=torch.float64))).ceil()
        limits = limits.clamp(1, 1024).long()
    else:
        num = batch = int(name.split("_")[1])
        limits = torch.full((num,), args.new_tokens)
    return torch.randint(1, vocab, (num, args.prompt_len), generator=gen), limits, batch


def decode_bytes(limits: torch.Tensor, prompt_len: int, steps: int, weight_bytes: int, kv_per_token: int) -> float:
    """Bytes an ideal decode moves: weights once per step, and each live row's context once per token."""
    t = limits.double() - 1  # decoded tokens per row (the first comes from the prefill)
    context = (t * prompt_len + t * (t + 1) / 2).sum().item()
    return steps * weight_bytes + context * kv_per_token


def run_fast(row: str, hf_model, config, prompts, limits, batch, args, device, dtype) -> dict:
    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.fast.rollout import FastRollout

    class HalvingRollout(FastRollout):  # the baseline of `fast_halving`: session 6's widths
        def _widths(self, num_slots):
            return sorted({num_slots, *(w for k in (1, 2, 3) if (w := -(-num_slots // 2**k)) >= self.min_width)})

    cls = HalvingRollout if row == "fast_halving" else FastRollout
    rollout = cls(config, IdTokenizer(), device, dtype, micro_batch_size=batch, max_batch=batch,
                  compile=False if row == "fast_eager" else None, sync_every=args.sync_every,
                  seq_bucket=args.seq_bucket, attention="sdpa" if row == "fast_sdpa" else "auto",
                  sampler="torch" if row == "fast_torch_sampler" else "auto",
                  min_width=10**9 if row == "fast_no_compact" else 32)
    _, load_s = timed(lambda: rollout.load_weights(hf_model.named_parameters()), device)
    ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=int(limits.max()), seed=0)
    generate = lambda lim: rollout.generate(ids, mask, sampling, max_new_tokens=lim)  # noqa: E731
    _, warmup_s = timed(lambda: generate(limits), device)
    out, total_s = timed(lambda: generate(limits), device)
    stats = dict(rollout.last_stats)
    generate(torch.ones_like(limits))
    _, prefill_s = timed(lambda: generate(torch.ones_like(limits)), device)
    _, release_s = timed(rollout.release, device)
    _, resume_s = timed(rollout.resume, device)
    _, release_w_s = timed(lambda: rollout.release(weights=True), device)
    _, resume_w_s = timed(rollout.resume, device)
    same_after_resume = torch.equal(generate(limits).response_ids, out.response_ids)  # same seed, same tokens
    drift = sampler_vs_engine_log_probs(hf_model, out)
    return dict(tokens=int(out.response_mask.sum()), seconds=total_s, prefill_s=prefill_s, warmup_s=warmup_s,
                decode_steps=stats["decode_steps"], num_slots=stats["num_slots"], max_seq=stats["max_seq"],
                slot_steps=stats["slot_steps"], compactions=stats["compactions"],
                graphs=len(rollout._graphs), load_weights_s=load_s, release_s=release_s, resume_s=resume_s,
                release_weights_s=release_w_s, resume_weights_s=resume_w_s, same_after_resume=same_after_resume,
                kv_cache_gib=rollout._state.kv.numel() * rollout._state.kv.element_size() / 2**30, **drift)


def sampler_vs_engine_log_probs(hf_model, out, rows: int = 16) -> dict:
    """The trainer's health metric `rollout/logprob_abs_diff` on the first `rows` responses: the sampler's
    log-probs against the training engine's recomputation (`PolicyModel`: packed, chunked) with the same
    weights and dtype; mean and max of |difference| over response tokens."""
    from shardrl.engine.model import PolicyModel

    batch = out.to_batch()
    rows = min(rows, len(batch))
    mask = batch["loss_mask"][:rows].bool()
    use_cache, hf_model.config.use_cache = hf_model.config.use_cache, False  # as the engine runs it
    try:
        with torch.no_grad():
            engine_lp = PolicyModel(hf_model).eval()(batch["input_ids"][:rows], batch["attention_mask"][:rows])["log_probs"]
    finally:
        hf_model.config.use_cache = use_cache
    diff = (engine_lp.float() - batch["sampled_log_probs"][:rows].to(engine_lp.device))[mask].abs()
    return dict(logprob_abs_diff_mean=diff.mean().item(), logprob_abs_diff_max=diff.max().item(),
                logprob_rows=rows)


class RowLimits:
    """HF stopping criterion: row i is done after limits[i] new tokens."""

    def __init__(self, limits: torch.Tensor, prompt_len: int):
        self.limits, self.prompt_len = limits, prompt_len

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits


def run_hf(row: str, hf_model, config, prompts, limits, batch, args, device, dtype) -> dict:
    from transformers import GenerationConfig, StoppingCriteriaList

    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=int(limits.max()),
                               eos_token_id=None, pad_token_id=0, use_cache=True,
                               cache_implementation="static" if row == "hf_static" else None)
    hf_model.generation_config = gen_cfg

    def generate():
        steps, tokens = 0, 0
        for start in range(0, prompts.shape[0], batch):
            ids = prompts[start : start + batch].to(device)
            lim = limits[start : start + batch].to(device)
            out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg,
                                    stopping_criteria=StoppingCriteriaList([RowLimits(lim, ids.shape[1])]))
            steps += out.shape[1] - ids.shape[1] - 1
            tokens += int(lim.sum())  # no EOS: each row runs to its limit, then pads
        return steps, tokens

    torch.manual_seed(0)
    # dynamic-cache generate compiles nothing: after the fixed cases the mixed case needs no warm-up run
    # (which would double its minutes); the static cache compiles per shape, so it always warms up
    warm = row == "hf_static" or not args.hf_warm_once or not getattr(run_hf, "warmed", False)
    _, warmup_s = timed(generate, device) if warm else (None, 0.0)
    run_hf.warmed = True
    (steps, tokens), total_s = timed(generate, device)

    def prefill():
        for start in range(0, prompts.shape[0], batch):
            hf_model(input_ids=prompts[start : start + batch].to(device), logits_to_keep=1)

    with torch.no_grad():
        prefill()
        _, prefill_s = timed(prefill, device)
    return dict(tokens=tokens, seconds=total_s, prefill_s=prefill_s, warmup_s=warmup_s, decode_steps=steps)


def _greedy_fast(model, config, ids, mask, new_tokens, device, dtype, **kwargs) -> torch.Tensor:
    from shardrl.rollout.base import SamplingParams
    from shardrl.rollout.fast.rollout import FastRollout

    rollout = FastRollout(config, IdTokenizer(), device, dtype, micro_batch_size=ids.shape[0], max_batch=ids.shape[0],
                          **kwargs)
    rollout.load_weights(model.named_parameters())
    out = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=new_tokens)).response_ids.to(device)
    rollout.release(weights=True)
    return out


def _greedy_hf(model, ids, mask, new_tokens, rows_per_call: int) -> torch.Tensor:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           eos_token_id=None, pad_token_id=0)
    return torch.cat([model.generate(input_ids=i, attention_mask=m, generation_config=cfg)[:, ids.shape[1]:]
                      for i, m in zip(ids.split(rows_per_call), mask.split(rows_per_call))])


def _identical(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).all(1).float().mean())


def _mean_first_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the first position where a and b differ (the length where they never do)."""
    differ = torch.cat([a != b, torch.ones_like(a[:, :1], dtype=torch.bool)], 1)  # a sentinel at the end
    return float(differ.float().argmax(1).float().mean())


@torch.no_grad()
def greedy_agreement(hf_model, config, prompts, new_tokens: int, device, dtype) -> dict:
    """Greedy responses of the fast engine vs HF generate on the same weights (see the module doc): in the
    benchmark dtype, HF against itself with another batch split (how often rounding alone flips a greedy
    pick), and both in fp32."""
    import copy

    batch = prompts.shape[0]
    ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
    ours = _greedy_fast(hf_model, config, ids, mask, new_tokens, device, dtype)
    theirs = _greedy_hf(hf_model, ids, mask, new_tokens, batch)
    theirs_split = _greedy_hf(hf_model, ids, mask, new_tokens, max(1, batch // 4))
    differ = (ours != theirs)
    same = ~differ.any(1)
    ref = copy.deepcopy(hf_model).float()  # the arbiter: fp32 logits of the shared prefix
    gaps, first = [], []
    for row in (~same).nonzero().flatten().tolist():
        pos = int(differ[row].nonzero()[0])
        first.append(pos)
        prefix = torch.cat([ids[row], theirs[row, :pos]])[None]
        logits = ref(input_ids=prefix, logits_to_keep=1).logits[0, -1]
        gaps.append(float((logits[ours[row, pos]] - logits[theirs[row, pos]]).abs()))
    # the scale to compare with: the fp32 top-1/top-2 gap at every position of HF's responses
    full = torch.cat([ids, theirs], 1)
    top2 = ref(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float().topk(2, dim=-1).values
    typical = (top2[..., 0] - top2[..., 1]).flatten()
    fp32 = {}
    if dtype != torch.float32:
        # who follows the fp32 greedy path longer: bf16 rounding, or an error of ours?
        exact = _greedy_hf(ref, ids, mask, new_tokens, batch)
        ours_eager = _greedy_fast(hf_model, config, ids, mask, new_tokens, device, dtype, compile=False)
        fp32 = dict(fp32_identical_fraction=_identical(_greedy_fast(ref, config, ids, mask, new_tokens, device,
                                                                    torch.float32), exact),
                    fp32_path_followed_mean_tokens={
                        name: _mean_first_divergence(out, exact) for name, out in
                        (("fast", ours), ("fast_not_compiled", ours_eager), ("hf", theirs),
                         ("hf_other_split", theirs_split))})
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(rows=batch, new_tokens=new_tokens, identical_fraction=_identical(ours, theirs),
                hf_vs_hf_other_split_identical_fraction=_identical(theirs, theirs_split), **fp32,
                differing_rows=len(first), first_difference_positions=first,
                fp32_gap_at_difference_max=max(gaps) if gaps else 0.0,
                fp32_gap_at_difference_median=float(torch.tensor(gaps).median()) if gaps else 0.0,
                fp32_top2_gap_median=float(typical.median()),
                fp32_top2_gap_p10=float(typical.quantile(0.1)))


def report(res: dict, out: str | None) -> None:
    from bench import append_jsonl

    res = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in res.items()}  # small ones too
    print(json.dumps(res), flush=True)
    append_jsonl(out, [res])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="fixed_64,fixed_256,mixed")
    parser.add_argument("--rows", default="hf_dynamic,hf_static,fast")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mixed-prompts", type=int, default=512)
    parser.add_argument("--mixed-batch", type=int, default=256)
    parser.add_argument("--mixed-min", type=int, default=16)
    parser.add_argument("--mixed-max", type=int, default=1024)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--seq-bucket", type=int, default=128)
    parser.add_argument("--init-std", type=float, default=None,
                        help="weight init std (HF default 0.02: near-flat logits); larger gives a more confident model")
    parser.add_argument("--bandwidth", type=float, default=HBM_BYTES_PER_S, help="bytes/s of the memory")
    parser.add_argument("--hf-warm-once", action="store_true",
                        help="warm HF dynamic-cache generate up on the first case only (saves minutes on GPUs)")
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequences, CPU: a smoke run")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()

    import transformers

    shape = dict(TINY if args.quick else QWEN2_1P5B)
    if args.quick:
        args.prompt_len, args.new_tokens, args.mixed_prompts, args.mixed_batch = 16, 16, 12, 4
        args.mixed_min, args.mixed_max, args.seq_bucket = 2, 40, 16
        if args.cases == parser.get_default("cases"):
            args.cases = "fixed_4,mixed"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.init_std is not None:
        shape["initializer_range"] = args.init_std
    config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device(device):
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    hf_model.eval().requires_grad_(False)
    weight_bytes, kv_per_token = model_bytes(config, dtype)
    runners = {"fast": run_fast, "fast_sdpa": run_fast, "fast_eager": run_fast, "fast_torch_sampler": run_fast,
               "fast_no_compact": run_fast, "fast_halving": run_fast,
               "hf_dynamic": run_hf, "hf_static": run_hf}
    for case in args.cases.split(","):
        if case.startswith("greedy_"):
            gen = torch.Generator().manual_seed(2)
            prompts = torch.randint(1, config.vocab_size, (int(case.split("_")[1]), args.prompt_len), generator=gen)
            agreement = greedy_agreement(hf_model, config, prompts, args.new_tokens, device, dtype)
            res = dict(bench="rollout_greedy_agreement", case=case, init_std=config.initializer_range, **agreement,
                       device=str(device), dtype=str(dtype))
            report(res, args.out)
            continue
        prompts, limits, batch = build_case(case, args, config.vocab_size, torch.Generator().manual_seed(1))
        baseline = None
        for row in args.rows.split(","):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            res = runners[row](row, hf_model, config, prompts, limits, batch, args, device, dtype)
            decode_s = max(res["seconds"] - res["prefill_s"], 1e-9)
            moved = decode_bytes(limits, args.prompt_len, res["decode_steps"], weight_bytes, kv_per_token)
            res = dict(bench="rollout", case=case, row=row, prompts=prompts.shape[0], batch=batch,
                       prompt_len=args.prompt_len, new_tokens=f"{int(limits.min())}-{int(limits.max())}",
                       **res, tokens_per_s=res["tokens"] / res["seconds"], decode_s=decode_s,
                       # the first token of each row comes from the prefill; the rest from decode steps
                       decode_tokens_per_s=(res["tokens"] - prompts.shape[0]) / decode_s,
                       bandwidth_fraction=moved / decode_s / args.bandwidth, device=str(device), dtype=str(dtype))
            if device.type == "cuda":
                res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if row == "hf_dynamic":
                baseline = res
            if baseline:
                res["vs_hf_dynamic"] = res["tokens_per_s"] / baseline["tokens_per_s"]
                res["decode_vs_hf_dynamic"] = res["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
            report(res, args.out)


if __name__ == "__main__":
    main()
