"""FP8 (E4M3) weights for the fast rollout's linear layers (`rollout.quantization=fp8`).

A weight W (out, in) is held as Q = W / s rounded to `torch.float8_e4m3fn` with fp32 scales s, one per output
channel (s (out, 1) = amax(|W[o, :]|) / 448) or, with `block_size` B, one per B x B tile (s (out/B, in/B), as in
DeepSeek's and Qwen's FP8 checkpoints). Its dequantized value is Q * s, computed in fp32 and rounded to the
model's dtype (`dequantize_fp8`): what a plain model holding those weights computes is what the rollout computes.

The matmul (`fp8_linear`):
    weight-only   x @ dequantize(Q, s)^T: exactly the plain model holding the dequantized weights (what the tests
                  check). Each call writes the dequantized weight, so on a GPU it saves memory, not bandwidth,
                  unless the compiler fuses the dequantization into the GEMM; `dynamic` reads FP8 bytes only
    dynamic       CUDA, compute capability >= 8.9, per-channel scales: x quantized per token (its own amax / 448)
                  and `torch._scaled_mm` with rowwise scales (scale_a (M, 1), scale_b (1, N), both fp32; b = Q^T,
                  column-major as Q is row-major; out in x's dtype)

Zero rows get scale 1 (Q = 0); a weight with a non-finite value is refused (`quantize_fp8_into` returns its
amax so that the caller checks a whole load with one host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from shardrl.models.fp8 import scale_shape

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Fp8Weight(NamedTuple):
    """A linear layer's FP8 weight as the decoder reads it: `qweight` (out, in) E4M3, `scale` fp32 (out, 1) per
    channel or (out/B, in/B) per tile of `block_size` B (0: per channel); `dynamic`: FP8 activations too."""

    qweight: torch.Tensor
    scale: torch.Tensor
    block_size: int = 0
    dynamic: bool = False


def _tiles(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """w (out, in) -> (out/B, in/B, B, B), a view of its B x B tiles."""
    out, inp = w.shape
    return w.view(out // block_size, block_size, inp // block_size, block_size).transpose(1, 2)


@torch.no_grad()
def quantize_fp8_into(w: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, block_size: int = 0
                      ) -> torch.Tensor:
    """Quantizes `w` (out, in) into `qweight` and `scale` (preallocated, `scale_shape`) in place, on their device
    (so captured graphs stay valid); returns the amax per scale, for the caller to check finite."""
    w = w.to(qweight.device).float()  # (moved in its own dtype, widened there)
    if block_size:
        amax = _tiles(w, block_size).abs().amax(dim=(-1, -2))  # (out/B, in/B)
    else:
        amax = w.abs().amax(dim=-1, keepdim=True)  # (out, 1)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale.copy_(s)
    if block_size:
        q = (_tiles(w, block_size) / s[..., None, None]).transpose(1, 2).reshape(w.shape)
    else:
        q = w / s
    qweight.copy_(q.clamp(-FP8_MAX, FP8_MAX))  # (rounding can overshoot 448 by an ulp: clamp before the cast)
    return amax


def quantize_fp8(w: torch.Tensor, block_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, s) of `w` (out, in) on its device: `quantize_fp8_into` into new tensors; a non-finite `w` raises."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(scale_shape(tuple(w.shape), block_size), dtype=torch.float32, device=w.device)
    check_finite(quantize_fp8_into(w, q, s, block_size), "the weight")
    return q, s


def check_finite(amax: torch.Tensor, what: str) -> None:
    """Refuses a weight whose amax is not finite (one host sync)."""
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what} holds inf or NaN: FP8 has no scale for it (rollout.quantization=fp8); the "
                         "trainer's weights diverged")


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block_size: int = 0
                   ) -> torch.Tensor:
    """Q * s in fp32, rounded to `dtype`: (out, in)."""
    q = qweight.to(torch.float32)
    if block_size:
        return (_tiles(q, block_size) * scale[..., None, None]).transpose(1, 2).reshape(q.shape).to(dtype)
    return (q * scale).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> E4M3 (M, K) and its fp32 scales (M, 1): each token by its own amax / 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) for the FP8 weight `w` (module docstring): x (..., in) -> (..., out) in x's dtype."""
    if not w.dynamic:
        return F.linear(x, dequantize_fp8(w.qweight, w.scale, x.dtype, w.block_size), bias)
    xq, xs = quantize_per_token(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=x.dtype)
    y = y.view(*x.shape[:-1], -1)
    return y if bias is None else y + bias
