"""What an FP8 rollout's layout needs before any model is built (`shardrl.rollout.fast.fp8` quantizes): the scales
of a weight, and whether the device multiplies in FP8."""

from __future__ import annotations

import torch


def scale_shape(shape: tuple[int, int], block_size: int = 0) -> tuple[int, int]:
    """The scales of a weight of `shape` (out, in): (out, 1) per channel, (out/B, in/B) per B x B tile."""
    out, inp = shape
    if not block_size:
        return out, 1
    if out % block_size or inp % block_size:
        raise ValueError(f"a weight of shape {tuple(shape)} does not tile into {block_size} x {block_size} blocks "
                         "(rollout.fp8.block_size); use per-channel scales (block_size null) or a size dividing both")
    return out // block_size, inp // block_size


def check_dynamic_activations(device: torch.device) -> None:
    """FP8 activations need `torch._scaled_mm` on a GPU of compute capability 8.9 or more (Ada, Hopper)."""
    if device.type != "cuda":
        raise ValueError(f"rollout.fp8.activations=dynamic needs a CUDA GPU of compute capability >= 8.9 (FP8 "
                         f"matmuls); this rollout runs on {device.type}: set rollout.fp8.activations=none "
                         "(weight-only FP8)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"rollout.fp8.activations=dynamic needs compute capability >= 8.9 (FP8 matmuls); this GPU "
                         f"has {major}.{minor}: set rollout.fp8.activations=none (weight-only FP8)")
