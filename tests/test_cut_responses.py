"""`cut_responses` (every rollout's rule for where a response ends and what its text is) found with one tensor op and
decoded by `decode_rows`, against the row-by-row rule it replaced, written out here: the same lengths and texts for
rows with and without EOS, EOS inside the row, a pad id that is also EOS, stop strings, empty rows."""

from __future__ import annotations

import random

import pytest
import torch

from shardrl.rollout.base import contains_stop, cut_at_stop, cut_responses, stop_length
from shardrl.tokenizer import build_char_tokenizer, decode_rows


def reference_cut(tokenizer, stop_ids, generated: torch.Tensor, stop):
    """The rule as it was: scan each row for its first stop id, then decode it on its own."""
    lengths, texts = [], []
    stops = set(stop_ids)
    for row in generated.tolist():
        end = next((i for i, t in enumerate(row) if t in stops), len(row))
        body = row[:end]
        length = len(body) + 1 if len(body) < len(row) else len(row)
        if stop:
            at = stop_length(tokenizer, body, stop)
            if at is not None:
                length = at
        text = tokenizer.decode(row[:length], skip_special_tokens=True)
        lengths.append(length)
        texts.append(cut_at_stop(text, stop) if stop else text)
    return lengths, texts


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def random_rows(tok, seed: int, rows: int = 40, width: int = 30) -> torch.Tensor:
    rng = random.Random(seed)
    letters = [tok.convert_tokens_to_ids(c) for c in "abcdef xyz+="]
    out = []
    for _ in range(rows):
        n = rng.randint(0, width)
        row = [rng.choice(letters) for _ in range(n)]
        if row and rng.random() < 0.5:  # an EOS somewhere, sometimes followed by more tokens
            row[rng.randrange(len(row))] = tok.eos_token_id
        out.append(row + [tok.pad_token_id] * (width - n))
    return torch.tensor(out, dtype=torch.long)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stop", [[], ["xy"], ["= ", "ff"]])
def test_the_cut_is_the_row_by_row_rule(tok, seed, stop):
    generated = random_rows(tok, seed)
    for stop_ids in ([tok.eos_token_id], [tok.eos_token_id, tok.pad_token_id], []):
        got = cut_responses(tok, stop_ids, generated, stop)
        assert got == reference_cut(tok, stop_ids, generated, stop), (stop_ids, stop)
    if stop:  # (the cases hold stop strings at all)
        texts = reference_cut(tok, [tok.eos_token_id], generated, [])[1]
        assert any(contains_stop(t, stop) for t in texts)


def test_rows_of_no_tokens_are_cut_empty(tok):
    """A call aborted before it made any token hands over rows of width 0."""
    empty = torch.zeros(3, 0, dtype=torch.long)
    assert cut_responses(tok, [tok.eos_token_id], empty, []) == ([0, 0, 0], ["", "", ""])
    assert cut_responses(tok, [tok.eos_token_id], empty, ["x"]) == reference_cut(tok, [tok.eos_token_id], empty, ["x"])


def test_decode_rows_is_decode(tok):
    rows = random_rows(tok, 5).tolist()
    rows[3] = []
    assert decode_rows(tok, rows) == [tok.decode(r, skip_special_tokens=True) for r in rows]
    assert decode_rows(tok, rows, skip_special_tokens=False) == [tok.decode(r) for r in rows]

    class OwnDecode(type(tok)):  # a tokenizer with a decode of its own is called through it
        def decode(self, token_ids, **kwargs):
            return "own"

    other = OwnDecode.__new__(OwnDecode)
    other.__dict__.update(tok.__dict__)
    assert decode_rows(other, rows[:2]) == ["own", "own"]
