"""Reduce a per-token loss `(B, T)` to the scalar that is backpropagated.

A training engine cuts a mini-batch into micro-batches (and across data-parallel ranks) and adds the
gradients up. For the sum of the pieces to equal the loss of the whole mini-batch, every piece must
divide by the *global* count, not its own: pass `num_global_tokens` (real tokens in the whole
mini-batch, all ranks) or `num_global_seqs` (sequences in it). Left as None they default to this
batch's own counts, which is right when the batch is the whole mini-batch.

Metrics are `shardrl.metrics.SumCount` (sum, count) pairs: the engine adds sums and counts up over
micro-batches and data-parallel ranks and divides once, so a logged number is a property of the mini-batch, not
of how it was cut.
"""

import torch

from shardrl.algos.masked import masked_sum
from shardrl.metrics import SumCount

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_global_tokens=None,
    num_global_seqs=None,
) -> torch.Tensor:
    """Aggregate `loss_mat` `(B, T)` over real tokens (`mask` `(B, T)`) into a scalar.

    - "token-mean": sum over all real tokens / num_global_tokens (default: mask.sum()).
    - "seq-mean-token-mean": each sequence's mean over its tokens, summed / num_global_seqs (default B).
    - "seq-mean-token-sum": each sequence's sum over its tokens, summed / num_global_seqs (default B).
    A sequence with no real tokens contributes 0.
    """
    if mode == "token-mean":
        if num_global_tokens is None:
            num_global_tokens = mask.sum()
        denom = torch.as_tensor(num_global_tokens, dtype=loss_mat.dtype, device=loss_mat.device)
        return masked_sum(loss_mat, mask) / denom.clamp(min=1)

    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq_lens = mask.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)  # (B,)
        seq_losses = seq_sums / seq_lens  # (B,)
    else:
        seq_losses = seq_sums  # (B,)
    if num_global_seqs is None:
        num_global_seqs = loss_mat.shape[0]
    denom = torch.as_tensor(num_global_seqs, dtype=loss_mat.dtype, device=loss_mat.device)
    return seq_losses.sum() / denom.clamp(min=1)


def share_metric(share: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", num_global_tokens=None,
                 num_global_seqs=None) -> SumCount:
    """`agg_loss`'s result as a metric pair: (share x the count it was divided by, this batch's own count
    of tokens or sequences). Summed over the pieces of a mini-batch, sum / count is the mini-batch loss."""
    if mode == "token-mean":
        local, denom = mask.sum(), num_global_tokens
    else:
        local, denom = torch.tensor(mask.shape[0], device=mask.device), num_global_seqs
    local = local.to(torch.float64)
    denom = local if denom is None else torch.as_tensor(denom, dtype=torch.float64, device=share.device)
    return SumCount(share.detach().to(torch.float64) * denom.clamp(min=1), local)


def masked_metric(values: torch.Tensor, mask: torch.Tensor) -> SumCount:
    """A token mean as a metric: (sum of `values` `(B, T)` over real tokens, number of real tokens)."""
    return SumCount(masked_sum(values.detach().to(torch.float64), mask), mask.sum().to(torch.float64))
