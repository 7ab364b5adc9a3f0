"""The one batch container of shardrl.

A `Batch` holds per-sample tensors (every one `(B, ...)`), per-sample non-tensor fields (lists of
length B: prompt text, data source, ground truth, ...) and `meta`, a dict of per-batch values that are
not per sample (e.g. the global token count a loss is normalized by). Runtime flags do not belong in
`meta`; they belong to config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    fields: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.fields.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch entries disagree on the batch size: {sizes}")
        self.fields = {k: list(v) for k, v in self.fields.items()}

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.fields.values():
            return len(v)
        return 0

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.fields:
            return self.fields[key]
        raise KeyError(f"batch has no entry {key!r}; it has {sorted(self.keys())}")

    def __setitem__(self, key: str, value):
        if len(self.tensors) + len(self.fields) > 0 and _size_of(value) != len(self):
            raise ValueError(f"entry {key!r} has batch size {_size_of(value)}, the batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            self.fields.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.fields[key] = list(value)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.fields

    def keys(self) -> list[str]:
        return [*self.tensors, *self.fields]

    def select(self, keys: Iterable[str]) -> Batch:
        """A batch with only `keys` (tensors are shared, not copied)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no entries {missing}; it has {sorted(self.keys())}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.fields.items() if k in keys},
            dict(self.meta),
        )

    def index(self, idx: torch.Tensor | Sequence[int] | slice) -> Batch:
        """The samples at `idx` (a slice, a list of ints or a LongTensor), in that order."""
        if isinstance(idx, slice):
            fields = {k: v[idx] for k, v in self.fields.items()}
            tensors = {k: v[idx] for k, v in self.tensors.items()}
        else:
            idx_list = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
            idx_t = torch.as_tensor(idx_list, dtype=torch.long)
            tensors = {k: v[idx_t.to(v.device)] for k, v in self.tensors.items()}
            fields = {k: [v[i] for i in idx_list] for k, v in self.fields.items()}
        return Batch(tensors, fields, dict(self.meta))

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` samples (the last may be smaller)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, num_chunks: int) -> list[Batch]:
        """`num_chunks` equal consecutive pieces, e.g. one per data-parallel rank."""
        if num_chunks < 1 or len(self) % num_chunks != 0:
            raise ValueError(f"cannot cut a batch of {len(self)} samples into {num_chunks} equal chunks")
        return self.split(len(self) // num_chunks)

    def reorder(self, perm: torch.Tensor | Sequence[int]) -> Batch:
        """Samples in the order `perm`; `reorder(inverse_permutation(perm))` undoes it."""
        perm_t = torch.as_tensor(perm, dtype=torch.long)
        if sorted(perm_t.tolist()) != list(range(len(self))):
            raise ValueError(f"not a permutation of {len(self)} samples: {perm_t.tolist()}")
        return self.index(perm_t)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        tensors = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return Batch(tensors, dict(self.fields), dict(self.meta))

    def update(self, other: Batch) -> Batch:
        """Adds (or replaces) the entries of `other`, which must have the same batch size."""
        if len(other) != len(self) and len(other.keys()) and len(self.keys()):
            raise ValueError(f"cannot merge batches of {len(self)} and {len(other)} samples")
        for k, v in other.tensors.items():
            self[k] = v
        for k, v in other.fields.items():
            self[k] = v
        self.meta.update(other.meta)
        return self

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stacks batches with the same keys along the batch dim; meta is taken from the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(f"cannot concat batches with different keys: {sorted(keys)} vs {sorted(b.keys())}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        fields = {k: [x for b in batches for x in b.fields[k]] for k in batches[0].fields}
        return Batch(tensors, fields, dict(batches[0].meta))


def inverse_permutation(perm: torch.Tensor | Sequence[int]) -> torch.Tensor:
    perm_t = torch.as_tensor(perm, dtype=torch.long)
    inv = torch.empty_like(perm_t)
    inv[perm_t] = torch.arange(len(perm_t))
    return inv


def _size_of(value) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)
