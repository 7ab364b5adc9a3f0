"""What the rollout's Triton kernels accept, importable without Triton (the CPU path asks it too).

Its own module so that the kernels (`decode_kernel`) and the model that calls them (`fast.model`) both
import it from below, instead of importing each other.
"""

from __future__ import annotations


def triton_head_dim(head_dim: int) -> bool:
    """Whether the Triton decode kernel takes this head dim: a power of two >= 16 (Triton's dot needs 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def cascade_members(num_heads_per_kv: int, rows: int = 64) -> int:
    """How many slots a shared-prefix group of the decode kernel holds: as many whose G query heads fit in `rows`
    rows of one product (at least one, at most 16)."""
    return max(1, min(16, rows // num_heads_per_kv))
