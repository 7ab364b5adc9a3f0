"""Statistics over the real tokens of a padded `(B, T)` batch.

`mask` is 1 on real response tokens and 0 on padding. Padding positions are read through
`torch.where`, never multiplied, so garbage there (inf, NaN) cannot leak into a result. A count of
zero gives 0, not NaN, and nothing here syncs with the host.

These are local statistics (one rank's tensors); a caller that wants batch-global statistics across
data-parallel ranks all-reduces the sums and counts itself.
"""

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    zeroed = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all real tokens; `unbiased` divides by n - 1 like torch.var (0 when n <= 1)."""
    count = mask.sum().to(values.dtype)
    mean = masked_sum(values, mask) / count.clamp(min=1)
    sq_dev_sum = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    return sq_dev_sum / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, stats=None
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over real tokens; padding comes out 0. `shift_mean=False`
    keeps the original mean (scales only). `stats=(mean, var)` whitens with statistics computed elsewhere,
    e.g. over every data-parallel rank's batch."""
    mean, var = stats if stats is not None else (masked_mean(values, mask), masked_var(values, mask))
    whitened = (values - mean) * torch.rsqrt(var + eps)  # (B, T)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=values.dtype, device=values.device))
