"""What the rollout's Triton kernels accept, importable without Triton (the CPU path asks it too).

Its own module so that the kernels (`decode_kernel`) and the model that calls them (`fast_model`) both
import it from below, instead of importing each other.
"""

from __future__ import annotations


def triton_head_dim(head_dim: int) -> bool:
    """Whether the Triton decode kernel takes this head dim: a power of two >= 16 (Triton's dot needs 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0
