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
    assert len(apply_expert_parallel(lm)) == lm.config.num_hidden_layers
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


# ---- the engine: engine.expert_parallel_size -----------------------------------------------------------------
# world -> [(family, engine settings)]: ep 2 of 2 and of 4 ranks, ep 4 of 4; fixed and dynamic micro-batches,
# clipping (active: the reference's norm is 1.37)
ENGINE_VARIANTS = {
    2: [("qwen3_moe", dict(expert_parallel_size=2, micro_batch_size_per_gpu=2)),
        ("mixtral", dict(expert_parallel_size=2, micro_batch_size_per_gpu=1)),
        ("olmoe", dict(expert_parallel_size=2, use_dynamic_bsz=True, max_token_len_per_gpu=24))],
    4: [("qwen3_moe", dict(expert_parallel_size=2, use_dynamic_bsz=True, max_token_len_per_gpu=24)),
        ("qwen3_moe", dict(expert_parallel_size=4, micro_batch_size_per_gpu=1, clip=0.5))],
}


def _engine_variants(world: int) -> list[dict]:
    from test_engine_equivalence import engine_step

    out = []
    for kind, settings in ENGINE_VARIANTS[world]:
        settings = dict(settings)
        clip = settings.pop("clip", 0.0)
        out.append(engine_step(kind, settings, clip=clip))
    return out


@pytest.mark.parametrize("world", sorted(ENGINE_VARIANTS))
def test_the_engine_with_its_experts_spread_has_the_plain_loops_gradients_and_update(world):
    """FSDP2 with each MoE layer's experts spread over `ep` ranks (and sharded over the world // ep that hold the same
    ones) against the plain HF loop on the whole batch: the loss, every gradient (the experts' gathered over both
    mesh dims), the gradient norm (of parameters on two meshes), the parameters after AdamW (clipped in one variant)
    and the log-probs."""
    from test_engine_equivalence import assert_same_grads, reference_step

    got = run_distributed(_engine_variants, world, world)
    for (kind, settings), run in zip(ENGINE_VARIANTS[world], got):
        want = reference_step(kind, clip=settings.get("clip", 0.0))
        assert run["loss"] == pytest.approx(want["loss"], rel=1e-5), (kind, settings)
        assert_same_grads(run["grads"], want["grads"])
        assert run["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (kind, settings)
        for name, p in want["params"].items():
            torch.testing.assert_close(run["params"][name], p, atol=2e-6, rtol=0, msg=f"{name} {kind} {settings}")
        assert (run["log_probs"] - want["log_probs"]).abs().max().item() < 1e-5
        experts = [n for n in want["grads"] if "experts" in n]
        assert experts and all(want["grads"][n].abs().max() > 0 for n in experts)


def _ep_checkpoint(world: int, ep: int, folder: str, save: bool) -> dict:
    """Two steps of a tiny Qwen3-MoE engine at (world, ep); with `save`, saved after the first, else loaded there
    (saved at another layout) first: the weights after the second step."""
    from test_checkpoint import make_engine, train_step

    engine = make_engine("qwen3_moe", tiny=tiny_config("qwen3_moe"), expert_parallel_size=ep)
    if save:
        train_step(engine, 0)
        engine.save(folder)
    else:
        engine.load(folder)
    metrics = train_step(engine, 1)
    weights = {k: v.detach().cpu().clone() for k, v in engine.export_weights()}
    return dict(metrics=metrics, weights=weights)


def _ep_resumes(world: int, eps: tuple[int, ...], folder: str) -> dict:
    """`_ep_checkpoint` loading `folder` at each ep in `eps`, one engine after the other on the same processes."""
    return {ep: _ep_checkpoint(world, ep, folder, False) for ep in eps}


def test_an_expert_parallel_checkpoint_resumes_at_another_world_size_and_ep(tmp_path):
    """Saved at world 4 with ep 2 (the experts' state on a (2, 2) mesh), resumed at world 2 with ep 2 and at world
    2 without expert parallelism: the second step's loss, LR and weights are those of the run that never stopped
    (the optimizer's moments of every expert restored where that layout keeps them)."""
    folder = str(tmp_path / "ckpt")
    want = run_distributed(_ep_checkpoint, 4, 4, 2, folder, True)
    world = 2  # both resumes on one pair of processes, one engine after the other
    for ep, got in run_distributed(_ep_resumes, world, world, (2, 1), folder).items():
        assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5), (world, ep)
        assert got["metrics"]["lr"] == want["metrics"]["lr"]
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=2e-6, rtol=0, msg=f"{name} at {world}, ep {ep}")


def test_bad_expert_parallel_settings_are_named():
    from shardrl.config.schema import EngineConfig, ModelConfig
    from shardrl.distributed import init_distributed
    from shardrl.engine import build_engine

    init_distributed()  # a world of one, in this process

    cases = [
        (dict(kind="qwen2"), {}, "engine.expert_parallel_size=2 is for mixtures of experts"),
        (dict(), {}, "does not divide the world size 1"),
        (dict(), dict(compile=True), "compile=true is not supported yet"),
        (dict(), dict(strategy="fsdp"), "needs strategy=fsdp2"),
    ]
    for model, engine, message in cases:
        tiny = tiny_config(model.get("kind", "qwen3_moe"))
        with pytest.raises(ValueError, match=message):
            build_engine(ModelConfig(tiny=tiny), EngineConfig(expert_parallel_size=2, **engine))
    # a world of 6 with ep 2 leaves 3 ranks to shard each expert's second dim (2 x 16 and 32) over: refused by
    # name before FSDP2 would (the layout given as a mesh of 6 ranks that is never used)
    from types import SimpleNamespace

    six = SimpleNamespace(world_size=6, sp_size=1, is_hsdp=False, check_matches=lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"world // ep = 3 ranks .* 2 x 16 and 32"):
        build_engine(ModelConfig(tiny=tiny_config("qwen3_moe")), EngineConfig(expert_parallel_size=2), mesh=six)


def _rl_run(overrides: list[str]) -> list[dict]:
    import json
    from pathlib import Path

    from shardrl.launch.rank import run

    run_dir = run(None, overrides)
    if dist.get_rank() != 0:
        return []
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_an_rl_run_with_expert_parallelism_matches_the_run_without(tmp_path):
    """GRPO on two ranks, a tiny Qwen3-MoE, actor.engine.expert_parallel_size=2 (the reference without it): its
    first step's numbers equal those of the same run without expert parallelism (the same rollout from the same
    weights, the same update), and it runs its three steps with the routing replayed (R2) and the load-balancing
    loss on."""
    import json

    from shardrl.testing import TINY_MOE_MODELS, small_demo_run
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=0)
    tiny = {**TINY_MOE_MODELS["qwen3_moe"], "vocab_size": len(build_char_tokenizer()), "initializer_range": 0.3}
    runs = {}
    for ep in (1, 2):
        runs[ep] = run_distributed(_rl_run, 2, small_demo_run(
            assets, tmp_path / f"ep{ep}", "trainer.logger=[jsonl]", "trainer.total_steps=3", "model.path=null",
            f"model.tiny={json.dumps(tiny)}", f"model.tokenizer_path={assets / 'model'}", "actor.optim.lr=3e-2",
            "actor.router_replay.mode=R2", "actor.router_aux_loss_coef=0.01",
            f"actor.engine.expert_parallel_size={ep}"))
    assert len(runs[1]) == len(runs[2]) == 3
    first, want = runs[2][0], runs[1][0]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/router_aux_loss", "actor/entropy"):
        assert first[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    assert all(r["actor/grad_norm"] > 0 for r in runs[2])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_expert_parallelism_over_nccl_has_the_plain_loops_gradients():
    """The engine test above on two GPUs (NCCL all-to-alls, fp32): ep 2 against the plain loop."""
    from test_engine_equivalence import assert_same_grads, reference_step

    got = run_distributed(_engine_variants, 2, 2)
    for (kind, settings), run in zip(ENGINE_VARIANTS[2], got):
        want = reference_step(kind)
        assert run["loss"] == pytest.approx(want["loss"], rel=1e-5), (kind, settings)
        assert_same_grads(run["grads"], want["grads"], rtol=1e-4)
