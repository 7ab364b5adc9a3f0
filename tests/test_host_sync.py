"""No host sync between a step's micro-batches: the engine reads each micro-batch's sizes back once before its
loop (`RowSizes`), so on a GPU the host queues a micro-batch's forward while the last one's backward runs. On the CPU
a dispatch mode stands in for CUDA's sync check: it records every op that reads a value back from the device on a
GPU (`.item()`, `nonzero`, boolean indexing, `repeat_interleave` without its size; with a function mode, `.tolist()`
and `.cpu()`, which dispatch nothing for a CPU tensor) or makes a tensor from host data
(`torch.tensor(...)`: a host-to-device copy that waits for the stream). And the host-sized layout is the same layout:
`packed_tokens`, `padded_tokens` and `attention_kwargs` give what they gave without sizes."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardrl.batch import Batch
from shardrl.engine.attention import attention_kwargs
from shardrl.engine.logprob import nonzero_known
from shardrl.engine.microbatch import row_sizes
from shardrl.engine.model import packed_tokens, padded_tokens
from shardrl.testing import TINY_MODELS, run_distributed

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim", "equal",
           "is_nonzero", "lift_fresh", "lift_fresh_copy"}
READ_BACKS = {"tolist", "cpu", "numpy"}
"""Tensor methods that copy a CUDA tensor to the host but dispatch no op for a CPU one (seen as torch functions)."""


def _record(seen: collections.Counter, kind: str) -> None:
    where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
             if "/shardrl/" in f.filename or "/transformers/" in f.filename]
    seen[(kind, " <- ".join(where[-3:][::-1]))] += 1


class _ReadBacks(TorchFunctionMode):
    def __init__(self, seen: collections.Counter):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READ_BACKS:
            _record(self.seen, func.__name__)
        return func(*args, **(kwargs or {}))


class HostSyncs(TorchDispatchMode):
    """Counts the ops that would make the host wait for a GPU, by (op, the shardrl lines that ran it): those
    dispatched (`SYNCING`, ...) and the tensor methods that read a value back without dispatching on a CPU
    (`READ_BACKS`)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()
        self._reads = _ReadBacks(self.seen)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[1]
        kind = name if name in SYNCING else None
        if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and kwargs.get("output_size") is None:
            kind = name
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            kind = f"{name}[bool]"
        if kind:
            _record(self.seen, kind)
        return func(*args, **kwargs)


def test_the_spy_sees_each_kind_of_read_back():
    """Every way a value comes back from the device counts, not only the ops that dispatch one: `.tolist()` and
    `.cpu()` copy a CUDA tensor to the host (a sync) but dispatch nothing for a CPU tensor, so a dispatch mode alone
    never sees them (a micro-batch's sizes read back with `.tolist()` in the loop went unseen)."""
    t = torch.arange(6)
    reads = {
        "item": lambda: t[1].item(), "int": lambda: int(t[1]), "nonzero": lambda: t.nonzero(),
        "bool index": lambda: t[t > 2], "tolist": lambda: t.tolist(), "cpu": lambda: t.cpu(),
        "numpy": lambda: t.numpy(), "tensor": lambda: torch.tensor([1, 2]),
    }
    for what, read in reads.items():
        spy = HostSyncs()
        with spy:
            read()
        assert spy.seen, f"{what} not seen"
    spy = HostSyncs()
    with spy:  # sized: no read-back
        torch.repeat_interleave(t, t, output_size=15)
        torch.nonzero_static(t > 2, size=3)
    assert not spy.seen, spy.seen


def rl_batch(rows: int = 8, prompt: int = 5, response: int = 7, vocab: int = 100, seed: int = 0,
             empty_row: bool = False) -> Batch:
    """[left-padded prompt | right-padded response] rows, as the trainer's; `empty_row`: the last row holds nothing."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, prompt + 1, (rows,), generator=g).tolist()
    rlen = torch.randint(1, response + 1, (rows,), generator=g).tolist()
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    resp = torch.zeros(rows, response, dtype=torch.long)
    for i in range(rows - int(empty_row)):
        mask[i, prompt - plen[i]:prompt + rlen[i]] = 1
        resp[i, :rlen[i]] = 1
    loss = torch.cat([torch.zeros(rows, prompt, dtype=torch.long), resp], 1)
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "response_mask": resp, "loss_mask": loss,
                  "advantages": torch.randn(rows, prompt + response, generator=g) * loss,
                  "old_log_probs": -torch.rand(rows, prompt + response, generator=g) * loss})


@pytest.mark.parametrize("empty_row", [False, True])
def test_the_host_sized_layout_is_the_layout_found_on_the_device(empty_row):
    batch = rl_batch(seed=3, empty_row=empty_row)
    score_from = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    pieces = [batch.index([0, 1, 2]), batch.index([]), batch.index([3, 4, 5, 6, 7])]
    sizes = row_sizes(pieces, score_from)
    assert sizes[1] is None
    for mb, mb_sizes in zip(pieces, sizes):
        if mb_sizes is None:
            continue
        ids, mask = mb["input_ids"], mb["attention_mask"]
        assert mb_sizes.lengths == tuple(mask.sum(1).tolist())
        for layout in (packed_tokens, padded_tokens):
            found, known = layout(ids, mask, score_from), layout(ids, mask, score_from, mb_sizes)
            assert mb_sizes.needed == int(found.needed.sum())
            for name in ("targets", "seq_start", "ends", "needed", "flat_index"):
                assert torch.equal(getattr(known, name), getattr(found, name)), (layout.__name__, name)
            assert torch.equal(known.needed_index(), found.needed_index())
            values = torch.randn(found.targets.shape[0])
            assert torch.equal(known.restore(values), found.restore(values))
        positions = packed_tokens(ids, mask).decoder_inputs["position_ids"][0]
        plain, sized = attention_kwargs(positions), attention_kwargs(positions, lengths=mb_sizes.lengths)
        assert torch.equal(sized.pop("cu_seq_lens_q"), plain.pop("cu_seq_lens_q"))
        assert torch.equal(sized.pop("cu_seq_lens_k"), plain.pop("cu_seq_lens_k"))
        assert sized == plain


def test_a_wrong_host_count_is_caught_not_used():
    flags = torch.tensor([False, True, True, False, True])
    assert nonzero_known(flags, 3).tolist() == [1, 2, 4]
    with pytest.raises(RuntimeError, match="host's count"):
        nonzero_known(flags, 2)


def _syncs_in_the_micro_batch_loops() -> dict:
    """One rank, the packed varlen path (as on a GPU), three dynamic micro-batches: the host syncs of `train_batch`
    from its first micro-batch to its gradient clip, and of each forward of `infer_batch`."""
    from shardrl.config.schema import ActorConfig, EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.trainer.updates import actor_loss_fn

    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"], attn_implementation="shardrl_varlen"),
                          EngineConfig(param_dtype="float32", use_dynamic_bsz=True, max_token_len_per_gpu=30),
                          OptimConfig(lr=1e-3, clip_grad=1.0), total_steps=3)
    loss_fn = actor_loss_fn(ActorConfig(entropy_coeff=0.01), "token-mean")
    engine.train_batch(rl_batch(seed=1), loss_fn, with_entropy=True)  # (first-use work out of the way)
    spy = HostSyncs()
    before, clip, forward = engine._before_micro_batch, engine._clip_grad_norm, engine._forward
    state = {"on": False}

    def watched_before(last):
        if not state["on"]:  # from the first micro-batch on
            spy.__enter__()
            state["on"] = True
        return before(last)

    def watched_clip(*args):
        spy.__exit__(None, None, None)
        state["on"] = False
        return clip(*args)

    engine._before_micro_batch, engine._clip_grad_norm = watched_before, watched_clip
    metrics = engine.train_batch(rl_batch(seed=2), loss_fn, with_entropy=True)
    train = dict(spy.seen)
    spy.seen.clear()

    def watched_forward(*args, **kwargs):
        with spy:
            return forward(*args, **kwargs)

    engine._forward = watched_forward
    engine.infer_batch(rl_batch(seed=3), with_entropy=True)
    return dict(train=train, infer=dict(spy.seen), micro_batches=metrics["num_micro_batches"])


@pytest.mark.multiproc
def test_no_host_sync_between_micro_batches():
    out = run_distributed(_syncs_in_the_micro_batch_loops, 1)
    assert out["micro_batches"] >= 3
    assert out["train"] == {}, f"host syncs inside train_batch's micro-batch loop: {out['train']}"
    assert out["infer"] == {}, f"host syncs inside infer_batch's forwards: {out['infer']}"
