"""Benchmarks (run as scripts from the repository root; see bench/RESULTS.md)."""

from __future__ import annotations

import json


def append_jsonl(path: str | None, records) -> None:
    """Appends one JSON line per record to `path` (the file a GPU session collects); no-op without a path."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
