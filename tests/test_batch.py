"""`Batch`: every operation keeps tensors, non-tensor fields and meta in step, sample for sample."""

from __future__ import annotations

import pytest
import torch

from shardrl.batch import Batch, inverse_permutation

B = 6


def make_batch(n: int = B) -> Batch:
    # each sample's values encode its index, so a wrong row or a field out of step shows as a wrong number
    ids = torch.arange(n)
    return Batch(
        tensors={"ids": ids, "x": ids[:, None].float() * 10 + torch.arange(3).float()},  # (n,), (n, 3)
        fields={"text": [f"s{i}" for i in range(n)], "source": [i % 2 for i in range(n)]},
        meta={"num_tokens": 123},
    )


def assert_samples(batch: Batch, expected: list[int]):
    """`batch` holds exactly the samples `expected` of `make_batch()`, in that order."""
    assert len(batch) == len(expected)
    assert batch["ids"].tolist() == expected
    assert torch.equal(batch["x"], torch.tensor(expected)[:, None].float() * 10 + torch.arange(3).float())
    assert batch["text"] == [f"s{i}" for i in expected]
    assert batch["source"] == [i % 2 for i in expected]


def test_construction_checks_sizes():
    with pytest.raises(ValueError, match="disagree on the batch size") as e:
        Batch({"a": torch.zeros(3), "b": torch.zeros(4, 2)})
    assert "'a': 3" in str(e.value) and "'b': 4" in str(e.value)
    with pytest.raises(ValueError, match="disagree"):
        Batch({"a": torch.zeros(3)}, {"t": ["x", "y"]})
    b = make_batch()
    assert len(b) == B
    assert len(Batch()) == 0
    assert len(Batch(fields={"t": ("a", "b")})) == 2
    assert Batch(fields={"t": ("a", "b")})["t"] == ["a", "b"]  # tuples become lists
    assert b.keys() == ["ids", "x", "text", "source"]
    assert "text" in b and "nope" not in b
    with pytest.raises(KeyError, match="nope"):
        b["nope"]


def test_select_shares_tensors_and_keeps_meta():
    b = make_batch()
    s = b.select(["x", "text"])
    assert sorted(s.keys()) == ["text", "x"]
    assert s["x"] is b["x"]
    assert s.meta == {"num_tokens": 123} and s.meta is not b.meta
    with pytest.raises(KeyError, match="missing|no entries"):
        b.select(["x", "missing"])


@pytest.mark.parametrize("idx, expected", [
    (slice(1, 4), [1, 2, 3]),
    (slice(None, None, 2), [0, 2, 4]),
    ([5, 0, 3], [5, 0, 3]),
    ([2, 2], [2, 2]),
    (torch.tensor([4, 1]), [4, 1]),
    ([], []),
])
def test_index(idx, expected):
    b = make_batch()
    out = b.index(idx)
    assert_samples(out, expected)
    assert out.meta == {"num_tokens": 123}


def test_split_and_chunk():
    b = make_batch()
    parts = b.split(4)
    assert [p["ids"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    assert [p["text"] for p in parts] == [["s0", "s1", "s2", "s3"], ["s4", "s5"]]
    assert all(p.meta == {"num_tokens": 123} for p in parts)
    with pytest.raises(ValueError, match=">= 1, got 0"):
        b.split(0)

    chunks = b.chunk(3)
    assert len(chunks) == 3
    for i, c in enumerate(chunks):
        assert_samples(c, [2 * i, 2 * i + 1])
    with pytest.raises(ValueError, match="batch of 6 samples into 4 equal chunks"):
        b.chunk(4)
    with pytest.raises(ValueError, match="into 0 equal chunks"):
        b.chunk(0)


def test_reorder_then_inverse_restores_exactly():
    b = make_batch()
    perm = [3, 0, 5, 1, 4, 2]
    r = b.reorder(perm)
    assert_samples(r, perm)
    inv = inverse_permutation(perm)
    assert inv.tolist() == [1, 3, 5, 0, 4, 2]
    back = r.reorder(inv)
    assert_samples(back, list(range(B)))
    assert torch.equal(back["x"], b["x"])
    assert back.meta == b.meta
    # a tensor permutation works the same
    assert_samples(b.reorder(torch.tensor(perm)).reorder(inverse_permutation(torch.tensor(perm))), list(range(B)))
    with pytest.raises(ValueError, match="not a permutation of 6"):
        b.reorder([0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="not a permutation of 6"):
        b.reorder([0, 1, 2])


def test_concat():
    b = make_batch()
    pieces = [b.index([4, 5]), b.index([0]), b.index([2, 1])]
    pieces[1].meta = {"num_tokens": 0}
    pieces[0].meta = {"num_tokens": 7}
    c = Batch.concat(pieces)
    assert_samples(c, [4, 5, 0, 2, 1])
    assert c.meta == {"num_tokens": 7}  # from the first
    with pytest.raises(ValueError, match="different keys"):
        Batch.concat([b, b.select(["ids", "x", "text"])])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_to_keeps_everything():
    b = make_batch()
    d = b.to("cpu")
    assert_samples(d, list(range(B)))
    assert d.meta == b.meta
    assert all(v.device.type == "cpu" for v in d.tensors.values())


def test_update_and_setitem():
    b = make_batch()
    other = Batch({"y": torch.arange(B) * 2, "x": torch.zeros(B, 3)}, {"gt": list("abcdef")}, {"extra": 1})
    assert b.update(other) is b
    assert b["y"].tolist() == [0, 2, 4, 6, 8, 10]
    assert torch.equal(b["x"], torch.zeros(B, 3))  # replaced
    assert b["gt"] == list("abcdef")
    assert b.meta == {"num_tokens": 123, "extra": 1}
    with pytest.raises(ValueError, match="batches of 6 and 2 samples"):
        b.update(Batch({"z": torch.zeros(2)}))

    with pytest.raises(ValueError, match="'bad' has batch size 5, the batch has 6"):
        b["bad"] = torch.zeros(5)
    with pytest.raises(ValueError, match="'bad' has batch size 7, the batch has 6"):
        b["bad"] = list(range(7))
    assert "bad" not in b
    # a key switches kind: a tensor entry replaced by a list moves to fields, and back
    b["ids"] = [str(i) for i in range(B)]
    assert "ids" not in b.tensors and b.fields["ids"] == ["0", "1", "2", "3", "4", "5"]
    b["ids"] = torch.arange(B)
    assert "ids" not in b.fields and b.tensors["ids"].tolist() == list(range(B))
    # an empty batch takes any size
    e = Batch()
    e["a"] = torch.zeros(3)
    assert len(e) == 3
