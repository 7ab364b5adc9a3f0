"""Expert parallelism (`shardrl.engine.expert_parallel`): a mixture-of-experts layer's experts spread over 2 and 4
gloo processes, tokens exchanged by all-to-all, against the unsharded HF experts run on every rank's tokens
together: outputs, the inputs' and routing weights' gradients, and each rank's experts' gradients; then a whole
tiny Qwen3-MoE model with its experts spread, against the plain model on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardrl.engine.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import run_distributed, tiny_config

pytestmark = pytest.mark.multiproc  # (all but the refusals)
TOKENS = [5, 9, 1, 0]  # each rank's token count (rank 3 has none)


def _lm(kind: str):
    """The tiny model (seed 0, the same on every rank), HF's eager experts (the reference's loop)."""
    config = load_hf_config(None, tiny_config(kind))
    config._experts_implementation = "eager"
    return build_causal_lm(config, None, "cpu", torch.float32, seed=0)


def _experts(kind: str):
    return next(m for n, m in _lm(kind).named_modules() if n.endswith("mlp.experts"))


def _inputs(kind: str, world: int):
    """Every rank's tokens, expert choices, routing weights and output weights (the loss), the same everywhere."""
    c = tiny_config(kind)
    e, k = c.get("num_experts", c.get("num_local_experts")), c["num_experts_per_tok"]
    g = torch.Generator().manual_seed(3)
    out = []
    for t in TOKENS[:world]:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
        out.append((torch.randn(t, c["hidden_size"], generator=g), idx, torch.rand(t, k, generator=g),
                    torch.randn(t, c["hidden_size"], generator=g)))
    return out


def _layer_run(kind: str, implementation: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = ExpertParallelExperts(_experts(kind), grouped=implementation == "grouped")
    hidden, idx, weights, probe = _inputs(kind, world)[rank]
    hidden.requires_grad_(True)
    weights.requires_grad_(True)
    out = layer(hidden, idx, weights)
    (out * probe).sum().backward()
    return dict(out=out.detach(), hidden=hidden.grad, weights=weights.grad, first=layer.first,
                gate_up=layer.gate_up_proj.grad, down=layer.down_proj.grad)


def _gathered(fn, *args) -> list[dict]:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, fn(*args))
    return parts


def _reference(kind: str, world: int) -> dict:
    experts = _experts(kind)
    parts = _inputs(kind, world)
    hidden = torch.cat([p[0] for p in parts]).requires_grad_(True)
    weights = torch.cat([p[2] for p in parts]).requires_grad_(True)
    out = experts(hidden, torch.cat([p[1] for p in parts]), weights)
    (out * torch.cat([p[3] for p in parts])).sum().backward()
    return dict(out=out.detach(), hidden=hidden.grad, weights=weights.grad, gate_up=experts.gate_up_proj.grad,
                down=experts.down_proj.grad)


@pytest.mark.parametrize("kind,implementation,world", [("qwen3_moe", "grouped", 4), ("qwen3_moe", "loop", 2),
                                                       ("mixtral", "grouped", 2)])
def test_expert_parallel_layer_equals_the_unsharded_experts(kind, implementation, world):
    got = run_distributed(_gathered, world, _layer_run, kind, implementation)
    want = _reference(kind, world)
    cut = [0, *torch.tensor(TOKENS[:world]).cumsum(0).tolist()]
    for rank, part in enumerate(got):
        rows = slice(cut[rank], cut[rank + 1])
        for key in ("out", "hidden", "weights"):
            torch.testing.assert_close(part[key], want[key][rows], atol=1e-5, rtol=1e-5, msg=f"{key} rank {rank}")
        local = slice(part["first"], part["first"] + part["gate_up"].shape[0])
        torch.testing.assert_close(part["gate_up"], want["gate_up"][local], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part["down"], want["down"][local], atol=1e-5, rtol=1e-5)
    assert sorted(p["first"] for p in got) == [r * want["gate_up"].shape[0] // world for r in range(world)]


def _model_run(kind: str) -> dict:
    """A whole model with its experts spread: each rank scores its own sequences; the experts' gradients stay on
    their rank, the other parameters' are summed over the ranks (as data parallelism reduces them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = _lm(kind)
    assert apply_expert_parallel(lm) == lm.config.num_hidden_layers
    ids = _sequences(kind, world)[rank]
    logits = lm(input_ids=ids).logits
    (logits.log_softmax(-1)[..., 1:7].sum() if ids.numel() else logits.sum()).backward()
    grads = {}
    for name, p in lm.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if "experts" not in name:
            dist.all_reduce(g)
        grads[name] = g
    return grads


def _sequences(kind: str, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, tiny_config(kind)["vocab_size"], (r + 1, 6), generator=g) for r in range(world)]


@pytest.mark.parametrize("world", [2])
def test_a_model_with_its_experts_spread_has_the_plain_models_gradients(world):
    kind = "qwen3_moe"
    got = run_distributed(_gathered, world, _model_run, kind)
    lm = _lm(kind)
    for ids in _sequences(kind, world):
        lm(input_ids=ids).logits.log_softmax(-1)[..., 1:7].sum().backward()
    want = {n: p.grad for n, p in lm.named_parameters()}
    per = want["model.layers.0.mlp.experts.gate_up_proj"].shape[0] // world
    for rank, grads in enumerate(got):
        for name, g in grads.items():
            w = want[name][rank * per:(rank + 1) * per] if "experts" in name else want[name]
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=f"{name} rank {rank}")


def test_experts_that_do_not_divide_over_the_ranks_are_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="8 experts do not divide over 3 ranks"):
        ExpertParallelExperts(_experts("qwen3_moe"))


def test_experts_of_another_layout_are_refused():
    """gpt-oss-like experts (transposed (E, H, 2I) with biases) are not taken for the (E, 2I, H) layout."""
    import torch.nn as nn

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 12))
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 12))
            self.down_proj = nn.Parameter(torch.zeros(4, 6, 8))
            self.act_fn = torch.nn.functional.silu

    with pytest.raises(ValueError, match="not laid out as gate_up_proj"):  # (before any process group is asked)
        ExpertParallelExperts(Transposed())
