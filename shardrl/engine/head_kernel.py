"""The policy head's passes over a chunk's (n, V) logits as Triton kernels (CUDA): one read of the logits in
forward, one read and one write in backward.

- `head_forward`: each row's log-normalizer logsumexp(x / T), the target token's log-prob and, if asked,
  the entropy of softmax(x / T). One program per row keeps a running max, sum of exp and sum of exp * x per
  lane (an online softmax), so the row is read once, in the logits' own dtype.
- `head_backward`: the gradient of sum(g_lp * log p[target] + g_ent * H) with respect to the logits,
  (g_lp * (onehot - p) - g_ent * p * (log p + H)) / T, written in the logits' dtype.

The compiled torch functions these replace (`shardrl.engine.logprob`) read the bf16 logits well below the GPU's
memory bandwidth (measured: bench/RESULTS.md, "Current figures: Update profile"; the kernels against them:
"Current figures: Log-prob head"). Same results up to fp32 rounding; the CPU runs the
eager torch code, and the tests run these kernels in Triton's interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_forward(logits_ptr, stride_row, vocab, targets_ptr, inv_t, logz_ptr, logp_ptr, entropy_ptr,
                  BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane, combined at the end
    run_sum = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - run_max)
    run_dot = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - run_max) * x
    for start in range(0, vocab, BLOCK):
        index = start + cols
        live = index < vocab
        x = tl.load(base + index, mask=live, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(run_max, x)
        seen = new_max != float("-inf")  # lanes that have read only padding keep zeros (no -inf - -inf)
        rescale = tl.where(seen, tl.exp(run_max - new_max), 0.0)
        e = tl.where(seen, tl.exp(x - new_max), 0.0)
        run_sum = run_sum * rescale + e
        if ENTROPY:
            run_dot = run_dot * rescale + e * tl.where(live, x, 0.0)
        run_max = new_max
    row_max = tl.max(run_max, 0)
    weight = tl.where(run_max != float("-inf"), tl.exp(run_max - row_max), 0.0)
    total = tl.sum(run_sum * weight, 0)
    logz = row_max + tl.log(total)
    target = tl.load(targets_ptr + row)
    tl.store(logz_ptr + row, logz)
    tl.store(logp_ptr + row, tl.load(base + target).to(tl.float32) * inv_t - logz)
    if ENTROPY:
        tl.store(entropy_ptr + row, logz - tl.sum(run_dot * weight, 0) / total)


@triton.jit
def _head_backward(logits_ptr, stride_row, vocab, targets_ptr, logz_ptr, entropy_ptr, grad_lp_ptr,
                   grad_ent_ptr, inv_t, out_ptr, out_stride_row, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = index < vocab
    x = tl.load(logits_ptr + row * stride_row + index, mask=live, other=0.0).to(tl.float32) * inv_t
    log_p = x - tl.load(logz_ptr + row)
    p = tl.exp(log_p)
    hit = (index == tl.load(targets_ptr + row)).to(tl.float32)
    grad = tl.load(grad_lp_ptr + row) * (hit - p)
    if ENTROPY:
        grad -= tl.load(grad_ent_ptr + row) * p * (log_p + tl.load(entropy_ptr + row))
    tl.store(out_ptr + row * out_stride_row + index, (grad * inv_t).to(out_ptr.dtype.element_ty), mask=live)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("the head kernels need (n, V) logits with unit stride in V")


def head_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                 block: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log p(target) (n,), logsumexp(logits / T) (n,) and the entropy (n,) or None, all fp32."""
    _check(logits)
    n, vocab = logits.shape
    logz = torch.empty(n, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(logz)
    entropy = torch.empty_like(logz) if with_entropy else None
    if n:
        _head_forward[(n,)](logits, logits.stride(0), vocab, targets, 1.0 / temperature, logz, logp,
                            entropy if with_entropy else logz, BLOCK=block, ENTROPY=with_entropy, num_warps=8)
    return logp, logz, entropy


def head_backward(logits: torch.Tensor, targets: torch.Tensor, logz: torch.Tensor, entropy: torch.Tensor | None,
                  grad_lp: torch.Tensor, grad_ent: torch.Tensor | None, temperature: float,
                  block: int = 2048) -> torch.Tensor:
    """d/dlogits of sum(grad_lp * log p[target] + grad_ent * H), (n, V) in the logits' dtype. `grad_ent` None:
    the entropy took no gradient (`entropy` is then not read)."""
    _check(logits)
    n, vocab = logits.shape
    out = torch.empty_like(logits)
    with_entropy = grad_ent is not None
    grad_lp = grad_lp.float().contiguous()
    if n:
        _head_backward[(n, triton.cdiv(vocab, block))](
            logits, logits.stride(0), vocab, targets, logz, entropy if with_entropy else logz, grad_lp,
            grad_ent.float().contiguous() if with_entropy else grad_lp, 1.0 / temperature, out, out.stride(0),
            BLOCK=block, ENTROPY=with_entropy, num_warps=8)
    return out
