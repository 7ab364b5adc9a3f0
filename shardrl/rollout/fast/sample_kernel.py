"""Sampling from logits in one pass over them: a Triton kernel for the fast rollout's decode step (CUDA).

The torch sampler (`shardrl.rollout.fast.rollout.sample_tokens`) reads the (B, V) logits, casts them to fp32, reads a
(B, V) fp32 buffer of Exp(1) noise that a separate kernel filled, and reduces twice (the Gumbel-max argmax
and the logsumexp of the log-prob). Here each of `splits` programs per row reads its share of the row once,
in the logits' own dtype, draws its Gumbel noise in registers (Philox, `tl.rand4x`: four uniforms per call,
keyed by a seed that lives on the device, so a captured graph draws fresh noise on every replay; one call
per element made the kernel as slow as the torch sampler), and keeps three running reductions:
the row's max and sum of exp (its logsumexp) and the best noisy score with its index. A second kernel
combines the splits and gathers the sampled token's logit for its log-prob.

Same contract as `sample_tokens` for the greedy and plain-sampling modes: tokens (B,) and log softmax(logits
/ T) of the sampled token (B,), temperature 1 for greedy; ties go to the lowest index, as `torch.argmax`.
The random stream differs from the torch sampler's (the tokens are a different sample of the same
distribution), and it is fixed by the seed. Top-k / top-p need a sort and stay in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partials(logits_ptr, stride_row, vocab, chunk, temperature_ptr, seed_ptr, part_ptr,
                     BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    row, split = tl.program_id(0), tl.program_id(1)
    first = split * chunk
    stop = tl.minimum(first + chunk, vocab)
    inv_t = 1.0 if GREEDY else 1.0 / tl.load(temperature_ptr)
    key = tl.load(seed_ptr) + row  # one Philox stream per row
    QUARTER: tl.constexpr = BLOCK // 4
    cols = tl.arange(0, QUARTER)
    row_max = tl.full([QUARTER], float("-inf"), tl.float32)  # per lane, reduced at the end
    row_sum = tl.zeros([QUARTER], tl.float32)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([QUARTER], tl.int32)
    for start in range(first, stop, BLOCK):
        # one Philox call gives 4 uniforms (counter start/4 + lane): one for each quarter of the block
        if not GREEDY:
            u0, u1, u2, u3 = tl.rand4x(key, start // 4 + cols)
        for quarter in tl.static_range(4):
            index = start + quarter * QUARTER + cols
            live = index < stop
            x = tl.load(logits_ptr + row * stride_row + index, mask=live, other=float("-inf")).to(tl.float32)
            x = x * inv_t
            new_max = tl.maximum(row_max, x)
            # lanes that have seen only -inf keep sum 0 (no exp(-inf - -inf))
            row_sum = tl.where(new_max == float("-inf"), 0.0,
                               row_sum * tl.exp(row_max - new_max) + tl.exp(x - new_max))
            row_max = new_max
            if GREEDY:
                score = x
            else:  # x + Gumbel noise; u in [1e-12, 1): -log(u) is never 0 or inf
                if quarter == 0:
                    u = u0
                elif quarter == 1:
                    u = u1
                elif quarter == 2:
                    u = u2
                else:
                    u = u3
                score = x - tl.log(-tl.log(tl.maximum(u, 1e-12)))
            score = tl.where(live, score, float("-inf"))
            better = score > best  # strictly: on a tie the earlier index stays
            best_index = tl.where(better, index, best_index)
            best = tl.where(better, score, best)
    split_max = tl.max(row_max, 0)
    split_sum = tl.sum(tl.where(row_max == float("-inf"), 0.0, row_sum * tl.exp(row_max - split_max)), 0)
    split_best = tl.max(best, 0)
    # the lowest index among the lanes holding the best score
    split_index = tl.min(tl.where(best == split_best, best_index, 2147483647), 0)
    base = part_ptr + (row * tl.num_programs(1) + split) * 4
    tl.store(base, split_max)
    tl.store(base + 1, split_sum)
    tl.store(base + 2, split_best)
    tl.store(base + 3, split_index.to(tl.float32))  # exact: vocabulary indices are < 2**24


@triton.jit
def _sample_combine(part_ptr, num_splits, logits_ptr, stride_row, temperature_ptr, tokens_ptr, log_probs_ptr,
                    BLOCK_SPLITS: tl.constexpr, GREEDY: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    live = splits < num_splits  # the lanes past them weigh nothing and are never chosen
    base = part_ptr + (row * num_splits + splits) * 4
    part_max = tl.load(base, mask=live, other=float("-inf"))
    part_sum = tl.load(base + 1, mask=live, other=0.0)
    part_best = tl.load(base + 2, mask=live, other=float("-inf"))
    part_index = tl.load(base + 3, mask=live, other=0.0)
    row_max = tl.max(part_max, 0)
    log_sum = row_max + tl.log(tl.sum(tl.where(live, part_sum * tl.exp(part_max - row_max), 0.0), 0))
    best = tl.max(part_best, 0)
    # the lowest index wins a tie, as within a split
    token = tl.min(tl.where(live & (part_best == best), part_index, 3.0e38), 0).to(tl.int64)
    inv_t = 1.0 if GREEDY else 1.0 / tl.load(temperature_ptr)
    logit = tl.load(logits_ptr + row * stride_row + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token)
    tl.store(log_probs_ptr + row, logit - log_sum)


def fused_sample(logits: torch.Tensor, greedy: bool, temperature: torch.Tensor, seed: torch.Tensor,
                 splits: int = 16, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B,) long and their log softmax(logits / T) (B,) fp32 from logits (B, V) with unit stride in
    V: the argmax (greedy, T = 1) or a Gumbel-max sample, with noise keyed by `seed` (a 1-element int64
    tensor on the device; change it between calls for fresh noise). `temperature`: a 1-element fp32
    tensor on the device. No host sync, so it can be captured in a CUDA graph."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("fused_sample needs logits with unit stride in the vocabulary dim")
    if vocab >= 2**24:
        raise ValueError(f"fused_sample keeps token indices in fp32 partials; a vocabulary of {vocab} is too big")
    if block < 4 or block & (block - 1):
        raise ValueError(f"fused_sample's block must be a power of two >= 4, got {block}")
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, chunk)  # every split holds at least one token
    part = torch.empty(rows, splits, 4, dtype=torch.float32, device=logits.device)  # max, sum, best, index
    _sample_partials[(rows, splits)](logits, logits.stride(0), vocab, chunk, temperature, seed, part,
                                     BLOCK=block, GREEDY=greedy, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_combine[(rows,)](part, splits, logits, logits.stride(0), temperature, tokens, log_probs,
                             BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)), GREEDY=greedy, num_warps=1)
    return tokens, log_probs
