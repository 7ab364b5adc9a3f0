"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) train through the FSDP2 engine: gradients equal a plain
HF loop's, where the plain loop runs HF's eager experts (a Python loop over the experts a batch hit) and the engine
its default grouped matrix products, over world 1/2, micro-batches and dynamic batches; a router whose top-k
weights are normalized otherwise fails the comparison. Also the FLOP count and the memory ledger of an MoE model
(active parameters)."""

from __future__ import annotations

import logging

import pytest
import torch

from shardrl.config.schema import ConfigError, EngineConfig, ModelConfig, load_config
from shardrl.engine import build_engine
from shardrl.engine.model import load_hf_config
from shardrl.engine.moe import apply_experts_implementation, resolve_experts_implementation
from shardrl.models.families import moe_layer_count
from shardrl.plan.perf import model_shape
from shardrl.testing import TINY_MOE_MODELS, run_distributed, tiny_config
from test_engine_equivalence import assert_same_grads, engine_step, reference_step

FAMILIES = sorted(TINY_MOE_MODELS)
# world -> variant -> engine settings
VARIANTS = {
    1: {"mb1": dict(micro_batch_size_per_gpu=1), "mb8": dict(micro_batch_size_per_gpu=8),
        "eager_mb4": dict(micro_batch_size_per_gpu=4)},
    2: {"mb2": dict(micro_batch_size_per_gpu=2), "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24),
        "checkpointing": dict(micro_batch_size_per_gpu=2)},
}
MODEL_VARIANTS = {"checkpointing": dict(gradient_checkpointing=True)}  # model settings of a variant
EAGER = {"eager_mb4"}  # variants whose engine runs HF's eager experts too


def _engine_runs(world: int, kinds: list[str], model_overrides: dict | None = None) -> dict:
    out = {}
    for kind in kinds:
        for name, engine in VARIANTS[world].items():
            model = {"experts_implementation": "eager" if name in EAGER else "auto", **MODEL_VARIANTS.get(name, {})}
            if model_overrides:
                model["tiny"] = {**tiny_config(kind), **model_overrides}
            out[kind, name] = engine_step(kind, engine, model_kwargs=model)
    # which experts' forward the engine's model dispatches to
    engine = build_engine(ModelConfig(tiny=tiny_config(kinds[0])), EngineConfig(param_dtype="float32"))
    experts = next(m for n, m in engine.module.named_modules() if n.endswith("mlp.experts"))
    out["implementation"] = experts.config._experts_implementation
    return out


@pytest.fixture(scope="module")
def reference():
    return {kind: reference_step(kind) for kind in FAMILIES}


@pytest.fixture(scope="module")
def runs():
    return {world: run_distributed(_engine_runs, world, world, FAMILIES) for world in VARIANTS}


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", FAMILIES)
def test_moe_gradients_equal_a_plain_loop_with_eager_experts(runs, reference, kind):
    want = reference[kind]
    for world, variants in VARIANTS.items():
        for name in variants:
            got = runs[world][kind, name]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (world, name)
            assert_same_grads(got["grads"], want["grads"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (world, name)
            diff = (got["log_probs"] - want["log_probs"]).abs().max().item()
            assert diff < 1e-5, (world, name, diff)
    assert runs[1]["implementation"] == runs[2]["implementation"] == "grouped_mm"  # against the loop
    # the experts' own parameters are compared (and have a gradient): the routing is exercised
    experts = [n for n in want["grads"] if "experts" in n]
    assert experts and all(want["grads"][n].abs().max() > 0 for n in experts)


@pytest.mark.multiproc
def test_a_router_normalized_otherwise_fails_the_comparison(reference):
    """What the comparison must catch: Qwen3-MoE's top-k weights left unnormalized (norm_topk_prob off) in the
    engine, against the plain loop's renormalized ones."""
    wrong = run_distributed(_engine_runs, 1, 1, ["qwen3_moe"], {"norm_topk_prob": False})
    with pytest.raises(AssertionError, match="grad diff"):
        assert_same_grads(wrong["qwen3_moe", "mb1"]["grads"], reference["qwen3_moe"]["grads"])


def test_experts_implementation_auto_takes_grouped_mm_where_the_shapes_allow(caplog):
    config = load_hf_config(None, TINY_MOE_MODELS["qwen3_moe"])
    assert resolve_experts_implementation("auto", config) == "grouped_mm"
    assert apply_experts_implementation(config, "auto") == "grouped_mm" and config._experts_implementation == "grouped_mm"
    odd = load_hf_config(None, {**TINY_MOE_MODELS["qwen3_moe"], "moe_intermediate_size": 12})
    with caplog.at_level(logging.INFO, logger="shardrl.engine.moe"):
        assert resolve_experts_implementation("auto", odd) == "eager"
    assert "expert intermediate size 12 not a multiple of 8" in caplog.text
    with pytest.raises(ValueError, match=r"experts_implementation=grouped_mm needs the expert intermediate size \(12\)"):
        apply_experts_implementation(odd, "grouped_mm")
    assert apply_experts_implementation(load_hf_config(None, tiny_config("qwen2")), "auto") is None  # dense
    with pytest.raises(ConfigError, match="model.experts_implementation"):
        load_config(None, ["model.experts_implementation=loop"])


def test_flops_and_ledger_count_the_active_experts():
    from shardrl.plan.layout import derive_layout
    from shardrl.plan.memory import activation_bytes_per_token_layer, phase_ledger

    kwargs = TINY_MOE_MODELS["qwen3_moe"]
    config = load_hf_config(None, kwargs)
    h, i, k, e, layers = 32, 16, 2, 8, 2
    attention = h * 8 * (2 * 4 + 2 * 2)  # q, o: 4 heads of 8; k, v: 2
    mlp = 3 * h * i * k + h * e  # the k routed experts' three matrices, and the router
    shape = model_shape(config)
    assert shape.num_params == layers * (attention + mlp) + h * 101
    # Qwen3-MoE's dense layers (mlp_only_layers) count their dense MLP
    mixed = load_hf_config(None, {**kwargs, "mlp_only_layers": [0]})
    assert moe_layer_count(mixed) == 1
    assert model_shape(mixed).num_params == 2 * attention + mlp + 3 * h * 64 + h * 101
    # activations: the k experts' hidden units per token, not the (unused) dense intermediate_size
    per_token, formula = activation_bytes_per_token_layer(config, 2)
    dense_like, _ = activation_bytes_per_token_layer(load_hf_config(None, {**tiny_config("qwen2")}), 2)
    assert "MLP 2 experts x (4 x 2 B x 16 + 2 x 2 B x 32) + router 4 B x 8" in formula
    cfg = load_config(None, [f"model.tiny={kwargs}".replace("'", '"')])
    ledger = phase_ledger(cfg, derive_layout(cfg, 1, 1), config)
    total = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(config).parameters())
    assert ledger["num_params"] == total  # every expert is stored
    gen = {i["name"]: i for i in ledger["phases"]["gen"]["items"]}
    assert "(4 x 32 + 2 x 32)" in gen["prefill chunk"]["how"]  # k=2 experts of 16, not the dense 64
    norms_attn = 2 * (4 * 32 + 2 * 32) + 2 * (3 * 32 + 2 * 16) + 2 * 32
    assert per_token == norms_attn + 2 * (4 * 2 * 16 + 2 * 2 * 32) + 4 * 8
    assert per_token != dense_like
    # router replay (R2): the recorded routing in the old-log-prob pass, the replayed one in the update
    assert not any("routing" in i["name"] for phase in ledger["phases"].values() for i in phase["items"])
    r2 = load_config(None, [f"model.tiny={kwargs}".replace("'", '"'), "actor.router_replay.mode=R2",
                            "actor.ppo_mini_batch_size=1", "actor.engine.use_dynamic_bsz=true",
                            "actor.engine.max_token_len_per_gpu=1000"])
    phases = phase_ledger(r2, derive_layout(r2, 1, 1), config)["phases"]
    prep = {i["name"]: i["gib"] for i in phases["prep"]["items"]}
    update = {i["name"]: i["gib"] for i in phases["update"]["items"]}
    assert prep["recorded routing"] * 2**30 == pytest.approx(1000 * layers * k * (8 + 2))
    assert update["replayed routing"] * 2**30 == pytest.approx(1000 * layers * k * 2)
    # expert parallelism: a rank gathers its E / ep experts of a layer (the largest unit less the others' share)
    unsharded = {}
    for ep in (1, 2):
        cfg = load_config(None, [f"model.tiny={kwargs}".replace("'", '"'), f"actor.engine.expert_parallel_size={ep}"])
        update = {i["name"]: i for i in phase_ledger(cfg, derive_layout(cfg, 2, 1), config)["phases"]["update"]["items"]}
        unsharded[ep] = update["unsharded params"]
    experts = 3 * e * h * i
    assert (unsharded[1]["gib"] - unsharded[2]["gib"]) * 2**30 == pytest.approx(2 * (experts - experts // 2) * 2)
    assert "experts / ep=2" in unsharded[2]["how"]
    # at ep 8 a block (one expert of 8 left) is smaller than the root's unit (embeddings and head): that is counted
    cfg = load_config(None, [f"model.tiny={kwargs}".replace("'", '"'), "actor.engine.expert_parallel_size=8"])
    update = {i["name"]: i for i in phase_ledger(cfg, derive_layout(cfg, 8, 1), config)["phases"]["update"]["items"]}
    root = 2 * h * 101 + h  # untied embeddings and head, the final norm
    assert update["unsharded params"]["gib"] * 2**30 == pytest.approx(2 * root * 2)


# ---- router replay -------------------------------------------------------------------------------------
def forced_routing_reference(kind: str, routed: torch.Tensor) -> dict:
    """The plain loop with each router made to choose `routed` (B, T, L, k): its weights are the softmax at
    those experts, renormalized as the model does (Qwen3-MoE here: norm_topk_prob), written out here."""
    import torch.nn.functional as F

    from test_engine_equivalence import make_batch

    from shardrl.algos.aggregate import agg_loss
    from shardrl.engine.model import build_causal_lm

    config = load_hf_config(None, tiny_config(kind))
    config._experts_implementation = "eager"
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for i, router in enumerate(routers):
        def forward(hidden, router=router, i=i):
            logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
            given = routed[:, :, i].flatten(0, 1).long()
            weights = logits.float().softmax(-1).gather(-1, given)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), given
        router.forward = forward
    batch = make_batch(kind)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    agg_loss(-logp * batch["advantages"], batch["loss_mask"], "token-mean").backward()
    return {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _replay_runs(kind: str, forced: torch.Tensor) -> dict:
    """On every rank (this rank's share of the batch): the engine's recorded routing, the gradients of a step
    replaying its own routing (and its mismatch count), and of a step replaying `forced`."""
    from test_engine_equivalence import engine_step, make_batch

    import shardrl.engine.base as base
    from shardrl.engine import build_engine
    from shardrl.testing import record_grads

    world = torch.distributed.get_world_size()
    engine_kw = dict(micro_batch_size_per_gpu=1) if world == 1 else dict(use_dynamic_bsz=True, max_token_len_per_gpu=24)
    out = {}
    for name, routed in (("own", None), ("forced", forced), ("forced_checkpointing", forced)):
        model = ModelConfig(tiny=tiny_config(kind), gradient_checkpointing=name == "forced_checkpointing")
        engine = build_engine(model, EngineConfig(param_dtype="float32", **engine_kw),
                              __import__("shardrl.config.schema", fromlist=["OptimConfig"]).OptimConfig(lr=1e-3, clip_grad=0.0))
        grads = record_grads(engine)
        batch = make_batch(kind)
        if routed is None:
            rec = engine.infer_batch(batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank], record_routing=True)
            assert rec["routed_experts"].dtype == torch.int16  # (gloo gathers no int16: as int64 here)
            parts = [torch.zeros_like(rec["routed_experts"], dtype=torch.long) for _ in range(world)]
            torch.distributed.all_gather(parts, rec["routed_experts"].long().contiguous())
            out["recorded"] = torch.cat(parts)
            routed = out["recorded"]
        mine = batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
        plain_logp = engine.infer_batch(mine)["log_probs"]
        batch["routed_experts"] = routed
        # inference (the old log-probs, the reference's) routes its own way whatever the batch holds
        out[f"{name}_infer_unchanged"] = torch.equal(
            engine.infer_batch(batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank])["log_probs"], plain_logp)
        from test_engine_equivalence import pg_loss_fn
        metrics = engine.train_batch(batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank], pg_loss_fn("token-mean"))
        out[name] = {"grads": grads[0], "mismatch": metrics["router_replay_mismatch"]}
    return out


@pytest.mark.multiproc
def test_router_replay_records_hf_routing_and_replays_it_as_a_plain_loop_forced_to_it():
    """Recorded: the experts HF's router picks for every real token (checked against the plain model's router
    logits). Replaying its own routing changes no gradient (mismatch 0). Replaying another routing gives the
    gradients of a plain loop whose routers are forced to it, at world 1 and at world 2 with dynamic batches
    (packing, reordering and sharding keep each token's experts), with the mismatch the fraction of (token,
    layer) pairs whose experts differ."""
    from test_engine_equivalence import make_batch

    kind = "qwen3_moe"
    batch = make_batch(kind)
    config = load_hf_config(None, tiny_config(kind))
    model = __import__("shardrl.engine.model", fromlist=["build_causal_lm"]).build_causal_lm(
        config, None, "cpu", torch.float32, seed=0)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    router_logits = model(input_ids=ids, attention_mask=am, position_ids=pos, output_router_logits=True).router_logits
    hf_top = torch.stack([lg.softmax(-1).topk(2, -1).indices for lg in router_logits], 1).view(*ids.shape, 2, 2)
    g = torch.Generator().manual_seed(5)
    forced = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(ids.numel() * 2)]).view(*ids.shape, 2, 2)
    want = forced_routing_reference(kind, forced)
    plain = reference_step(kind)["grads"]
    for world in (1, 2):
        got = run_distributed(_replay_runs, world, kind, forced)
        real = am.bool()
        rec = got["recorded"]
        assert rec.shape == (*ids.shape, 2, 2)
        assert torch.equal(rec[real].sort(-1).values, hf_top[real].sort(-1).values), world
        assert got["own"]["mismatch"] == 0.0
        assert_same_grads(got["own"]["grads"], plain)
        assert_same_grads(got["forced"]["grads"], want)
        assert_same_grads(got["forced_checkpointing"]["grads"], want)  # the recompute in backward routed the same
        assert got["forced_infer_unchanged"] and got["forced_checkpointing_infer_unchanged"]
        assert got["forced_checkpointing"]["mismatch"] == got["forced"]["mismatch"]  # counted in the forward only
        differ = (forced.sort(-1).values != rec.sort(-1).values).any(-1)[real].float().mean().item()
        assert got["forced"]["mismatch"] == pytest.approx(differ) and differ > 0.5, world
    with pytest.raises(AssertionError, match="grad diff"):
        assert_same_grads(want, plain)  # the forced routing matters


def test_an_rl_run_of_a_mixture_of_experts_replays_its_routing(tmp_path):
    """A GRPO run of a tiny Qwen3-MoE (two mini-batches a step, so an old-log-prob pass records the routing) with
    actor.router_replay.mode=R2 logs the share of routings the update would have changed: none in the first
    mini-batch's forward (nothing has moved yet), some once the first optimizer step moved the router (the
    entropy bonus gives a gradient where a random model's rewards are all equal). A dense model with R2 is a
    config error."""
    import json

    from shardrl.testing import small_demo_run
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import prepare_demo_assets
    from shardrl.launch.rank import run

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=0)
    tiny = {**TINY_MOE_MODELS["qwen3_moe"], "vocab_size": len(build_char_tokenizer()), "initializer_range": 0.3}
    overrides = small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=3",
                               "model.path=null", f"model.tiny={json.dumps(tiny)}",
                               f"model.tokenizer_path={assets / 'model'}", "actor.optim.lr=3e-2",
                               "actor.router_replay.mode=R2", "actor.entropy_coeff=0.05",
                               "actor.router_aux_loss_coef=0.01")
    run_dir = run(None, overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["actor/router_replay_mismatch"] for r in records]
    assert len(mismatch) == 3 and all(0 <= m < 1 for m in mismatch) and max(mismatch) > 0, mismatch
    assert all(r["actor/router_aux_loss"] > 0 for r in records)  # (about top-k for a balanced router)
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.01 needs a mixture-of-experts model"):
        run(None, small_demo_run(assets, tmp_path / "dense_aux", "actor.router_aux_loss_coef=0.01"))
    with pytest.raises(ConfigError, match="router_replay.mode=R2 needs a mixture-of-experts model"):
        run(None, small_demo_run(assets, tmp_path / "dense", "actor.router_replay.mode=R2"))


def test_an_rl_run_replays_the_routing_its_fast_rollout_recorded(tmp_path, monkeypatch):
    """actor.router_replay.mode=R3 (rollout.backend null picks the fast rollout, on the CPU too): the rollout's
    recorded routing rides in the batch, and the old-log-prob pass and the update are routed as it says. With
    the rollout's weights the trainer's (fp32), the trainer would route no token otherwise (mismatch 0, in both
    plans: with an old-log-prob pass, and with one update a step); a recording corrupted on its way (every expert
    shifted by one) is what the update then routes by, nearly every routing counted as one it would not choose,
    and its old log-probs leave the sampler's. Multi-turn, the hf backend and dense models are config errors."""
    import json

    from shardrl.rollout.fast.rollout import FastRollout
    from shardrl.testing import small_demo_run
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import prepare_demo_assets
    from shardrl.launch.rank import run

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=0)
    tiny = {**TINY_MOE_MODELS["qwen3_moe"], "vocab_size": len(build_char_tokenizer()), "initializer_range": 0.3}

    def r3_run(name, *extra):
        overrides = small_demo_run(assets, tmp_path / name, "trainer.logger=[jsonl]", "trainer.total_steps=2",
                                   "model.path=null", f"model.tiny={json.dumps(tiny)}",
                                   f"model.tokenizer_path={assets / 'model'}", "actor.optim.lr=3e-2",
                                   "actor.router_replay.mode=R3", "actor.entropy_coeff=0.05", *extra)
        run_dir = run(None, overrides)
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    one_update = r3_run("one", "actor.ppo_mini_batch_size=4")  # the old log-probs from the update's forward
    assert [r["actor/router_replay_mismatch"] for r in one_update] == [0.0, 0.0]
    two = r3_run("two")  # an old-log-prob pass, then two updates a step
    # the old-log-prob pass routed as the sampler was: the sampler's log-probs (the mismatch counts the second
    # mini-batch's forward, after the first optimizer step moved the routers)
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in two)

    recorded = FastRollout._routed_experts

    def shifted(self, *args):
        routed = recorded(self, *args)
        return torch.where(routed >= 0, (routed + 1) % 8, routed)

    monkeypatch.setattr(FastRollout, "_routed_experts", shifted)
    corrupted = r3_run("corrupted")
    assert all(r["actor/router_replay_mismatch"] > 0.9 for r in corrupted)
    assert all(r["rollout/logprob_abs_diff"] > 1e-2 for r in corrupted)
    monkeypatch.undo()
    for setting, match in ((["rollout.backend=hf"], "R3 replays the routing the fast rollout records"),
                           (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
                            "single-turn rollouts only")):
        with pytest.raises(ConfigError, match=match):
            r3_run("bad", *setting)
    with pytest.raises(ConfigError, match="router_replay.mode=R3 needs a mixture-of-experts model"):
        run(None, small_demo_run(assets, tmp_path / "dense", "actor.router_replay.mode=R3"))


def _aux_loss_grads(kind: str, coef: float) -> dict:
    from test_engine_equivalence import make_batch

    from shardrl.config.schema import ActorConfig, OptimConfig
    from shardrl.testing import record_grads
    from shardrl.trainer.updates import actor_loss_fn

    engine = build_engine(ModelConfig(tiny=tiny_config(kind)), EngineConfig(param_dtype="float32",
                                                                            micro_batch_size_per_gpu=8),
                          OptimConfig(lr=1e-3, clip_grad=0.0))
    engine.enable_router_aux_loss()
    grads = record_grads(engine)
    batch = make_batch(kind)
    batch["old_log_probs"] = torch.zeros_like(batch["advantages"])  # the ratio's gradient at ratio 1: exp(0) below
    loss = actor_loss_fn(ActorConfig(router_aux_loss_coef=coef, clip_ratio_low=1e9 - 1, clip_ratio_high=1e9),
                         "token-mean")

    def plain_pg(outputs, mb, num_tokens, num_seqs):  # the ratio exp(logp - 0) clipped nowhere: d/dθ = ratio * dlogp
        mb["old_log_probs"] = outputs["log_probs"].detach()
        return loss(outputs, mb, num_tokens, num_seqs)
    metrics = engine.train_batch(batch, plain_pg)
    return {"grads": grads[0], "aux": metrics.get("actor/router_aux_loss")}


def _aux_loss_grads_each(kind: str, coefs: tuple[float, ...]) -> dict:
    """`_aux_loss_grads` for each coefficient, one engine after the other on the same process."""
    return {coef: _aux_loss_grads(kind, coef) for coef in coefs}


def test_the_load_balancing_loss_is_hfs_added_with_its_coefficient():
    """actor.router_aux_loss_coef: the update's gradient is that of the policy loss plus coef x HF's
    load_balancing_loss_func over the batch's real tokens (a plain loop here, on the padded batch); the logged
    actor/router_aux_loss is that function's value."""
    import sys

    import torch.nn.functional as F
    from test_engine_equivalence import make_batch

    from shardrl.algos.aggregate import agg_loss
    from shardrl.engine.model import build_causal_lm

    kind, coef = "qwen3_moe", 0.5
    config = load_hf_config(None, tiny_config(kind))
    config._experts_implementation = "eager"
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    batch = make_batch(kind)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, output_router_logits=True)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(out.logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    aux = sys.modules[type(model).__module__].load_balancing_loss_func(out.router_logits, 8, 2, am)
    (agg_loss(-logp * batch["advantages"], batch["loss_mask"], "token-mean") + coef * aux).backward()
    want = {k: v.grad for k, v in model.named_parameters()}
    runs = run_distributed(_aux_loss_grads_each, 1, kind, (coef, 0.0))  # both engines on one process
    got = runs[coef]
    assert got["aux"] == pytest.approx(float(aux), rel=1e-5)
    assert_same_grads(got["grads"], want)
    without = runs[0.0]["grads"]
    with pytest.raises(AssertionError, match="grad diff"):
        assert_same_grads(without, want)


def _lora_moe_samples() -> dict:
    from shardrl.config.schema import LoRAConfig, OptimConfig
    from shardrl.rollout import FastRollout, SamplingParams
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.generation import LoRASync, export_for_rollout

    tok = build_char_tokenizer()
    tiny = {**TINY_MOE_MODELS["qwen3_moe"], "vocab_size": len(tok), "initializer_range": 0.3}
    engine = build_engine(ModelConfig(tiny=tiny, lora=LoRAConfig(rank=4, alpha=8)), EngineConfig(param_dtype="float32"),
                          OptimConfig())
    adapted = sorted({n.split(".lora_")[0].removeprefix("lm.") for n, _ in engine.module.named_parameters()
                      if ".lora_" in n})
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if ".lora_" in n:
                p.normal_(0, 0.1)
    enc = tok(["1+2=", "hello world "], padding=True, return_tensors="pt")
    out = {"adapted": adapted}
    for mode in ("full", "unmerged", "merged"):
        rollout = FastRollout(engine.hf_config, tok, "cpu", torch.float32, lazy_weights=mode != "full")
        if mode == "full":
            rollout.load_weights(export_for_rollout(engine, torch.device("cpu")))
        else:
            LoRASync(engine, rollout, mode, torch.float32).sync()
        out[mode] = rollout.generate(enc["input_ids"], enc["attention_mask"],
                                     SamplingParams(greedy=True, max_new_tokens=12)).response_ids
    return out


@pytest.mark.multiproc
def test_lora_on_a_mixture_of_experts_adapts_its_linear_layers_and_syncs_to_the_fast_rollout():
    """model.lora all-linear on Qwen3-MoE: adapters on its linear layers (here the attention's: every MLP is
    routed), none on the routers or the experts' 3-D weights (which peft's all-linear would wrap, and no sync
    would carry); the adapter-only syncs sample what the merged export samples."""
    got = run_distributed(_lora_moe_samples, 1)
    leaves = {name.rsplit(".", 1)[-1] for name in got["adapted"]}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj"}, got["adapted"]
    assert torch.equal(got["unmerged"], got["full"]) and torch.equal(got["merged"], got["full"])


def test_a_router_shardrl_does_not_know_builds_when_nothing_is_replayed():
    """Replay's renormalization rule is asked for at the first replay, so MoE families without one still train."""
    from shardrl.engine.model import PolicyModel, build_causal_lm
    from shardrl.models.families import router_rule

    config = load_hf_config(None, dict(model_type="granitemoe", vocab_size=101, hidden_size=32, intermediate_size=16,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="router replay: the 'granitemoe' router is not known"):
        router_rule(config)
    model = PolicyModel(build_causal_lm(config, None, "cpu", torch.float32))
    ids = torch.randint(0, 101, (2, 5))
    assert model(ids, torch.ones_like(ids))["log_probs"].shape == (2, 5)


def test_replay_and_the_aux_loss_refuse_sequence_parallel_at_start():
    from shardrl.trainer.rl import check_router_replay

    moe = load_hf_config(None, TINY_MOE_MODELS["qwen3_moe"])
    for setting in ("actor.router_replay.mode=R2", "actor.router_aux_loss_coef=0.01"):
        cfg = load_config(None, ["actor.engine.ulysses_sequence_parallel_size=2", setting])
        with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2: router replay and the load-balancing"):
            check_router_replay(cfg, moe, print)
    check_router_replay(load_config(None, ["actor.engine.ulysses_sequence_parallel_size=2"]), moe, print)  # off: fine


def _cuda_moe_steps(kinds: list[str]) -> dict:
    from shardrl.distributed import build_device_mesh

    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = build_device_mesh(-1, 1)
    return {kind: engine_step(kind, dict(micro_batch_size_per_gpu=2, param_dtype="bfloat16"), mesh=mesh,
                              model_kwargs=dict(experts_implementation="grouped_mm")) for kind in kinds}


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_on_cuda_in_bf16_follows_the_fp32_plain_loop():
    """On a GPU: the engine's experts through `torch._grouped_mm` (CUDA's kernel, bf16 mixed precision) against
    the fp32 plain loop over HF's eager experts, up to bf16 rounding (the thresholds of
    test_engine_gpu.py's bf16 test)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    got = run_distributed(_cuda_moe_steps, 1, FAMILIES)
    for kind in FAMILIES:
        want = reference_step(kind, device="cuda")
        g, w = got[kind]["grads"], want["grads"]
        assert set(g) == set(w), kind
        gv = torch.cat([g[k].flatten() for k in w]).double()
        wv = torch.cat([w[k].flatten() for k in w]).double()
        assert got[kind]["loss"] == pytest.approx(want["loss"], rel=2e-2), kind
        assert float(torch.nn.functional.cosine_similarity(gv, wv, dim=0)) > 0.999, kind
        assert float((gv - wv).abs().max() / wv.abs().max()) < 0.05, kind


def _compiled_replay_runs(forced: torch.Tensor) -> dict:
    from test_engine_equivalence import make_batch, pg_loss_fn

    from shardrl.config.schema import OptimConfig
    from shardrl.testing import record_grads

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for compiled in (False, True):
        engine = build_engine(ModelConfig(tiny=tiny_config("qwen3_moe")),
                              EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2, compile=compiled),
                              OptimConfig(lr=1e-3, clip_grad=0.0))
        grads = record_grads(engine)
        batch = make_batch("qwen3_moe")
        recorded = engine.infer_batch(batch, record_routing=True)["routed_experts"].cpu()
        batch["routed_experts"] = forced
        metrics = engine.train_batch(batch, pg_loss_fn("token-mean"))
        out[compiled] = dict(recorded=recorded, grads=grads[0], mismatch=metrics["router_replay_mismatch"])
    return out


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_replay_under_compile_on_cuda_records_and_replays_as_without():
    """Compiled blocks (what a run of a >= 0.5B model gets on a GPU) record the same routing, every layer, and
    replaying a forced routing gives the uncompiled engine's gradients and mismatch."""
    from test_engine_equivalence import make_batch

    ids = make_batch("qwen3_moe")["input_ids"]
    g = torch.Generator().manual_seed(5)
    forced = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(ids.numel() * 2)]).view(*ids.shape, 2, 2)
    got = run_distributed(_compiled_replay_runs, 1, forced)
    assert torch.equal(got[True]["recorded"], got[False]["recorded"])
    assert got[True]["mismatch"] == pytest.approx(got[False]["mismatch"]) and got[True]["mismatch"] > 0.5
    assert_same_grads(got[True]["grads"], got[False]["grads"], rtol=1e-4)


def _moe_exports(folder: str) -> dict:
    """A Mixtral and a Qwen3-MoE engine after one update: the weights the rollout is sent, and their HF export."""
    from pathlib import Path

    from test_engine_equivalence import make_batch, pg_loss_fn

    from shardrl.config.schema import OptimConfig

    out = {}
    for kind in HUB_EXPERTS:
        engine = build_engine(ModelConfig(tiny=tiny_config(kind)), EngineConfig(param_dtype="float32"),
                              OptimConfig(lr=1e-2, clip_grad=0.0))
        with engine.training():
            engine.train_batch(make_batch(kind), pg_loss_fn("token-mean"))
        out[kind] = {name: t.clone() for name, t in engine.export_weights(torch.float32)}
        engine.save_hf(Path(folder) / kind, dtype=torch.float32)
    return out


# layer 0's experts as each family publishes them (and transformers' save_pretrained writes them): the name of an
# expert's gate, up and down projection
HUB_EXPERTS = {"mixtral": "model.layers.0.block_sparse_moe.experts.{}.w{}.weight",
               "qwen3_moe": "model.layers.0.mlp.experts.{}.{}_proj.weight"}


def test_an_hf_export_of_a_mixture_of_experts_is_in_its_familys_hub_layout(tmp_path):
    """`trainer.export_hf` of a Mixtral or Qwen3-MoE wrote the in-memory fused experts (`mlp.experts.gate_up_proj`
    (E, 2I, H)), which vLLM, SGLang and transformers 4.x do not read: it writes one tensor per expert and projection
    under the family's names (as save_pretrained does), each the fused tensor's slice, and from_pretrained gives the
    trained model's logits. The weights sent to the rollout stay fused."""
    from safetensors.torch import load_file
    import transformers

    from shardrl.engine.model import build_causal_lm

    sent = run_distributed(_moe_exports, 1, str(tmp_path))
    for kind, name in HUB_EXPERTS.items():
        fused = sent[kind]
        assert "model.layers.0.mlp.experts.gate_up_proj" in fused  # the rollout's layout, unchanged
        files = load_file(tmp_path / kind / "model.safetensors")
        assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in files), kind
        gate_up, down = fused["model.layers.0.mlp.experts.gate_up_proj"], fused["model.layers.0.mlp.experts.down_proj"]
        width = gate_up.shape[1] // 2  # (E, 2I, H): gate rows then up rows
        parts = ("1", "3", "2") if kind == "mixtral" else ("gate", "up", "down")
        for e in range(gate_up.shape[0]):
            for part, want in zip(parts, (gate_up[e, :width], gate_up[e, width:], down[e]), strict=True):
                assert torch.equal(files[name.format(e, part)], want), (kind, e, part)
        router = f"model.layers.0.{'block_sparse_moe' if kind == 'mixtral' else 'mlp'}.gate.weight"
        assert torch.equal(files[router], fused["model.layers.0.mlp.gate.weight"])
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32).eval()
        trained = build_causal_lm(load_hf_config(None, tiny_config(kind)), None, "cpu", torch.float32, seed=1).eval()
        trained.load_state_dict(fused)
        trained.save_pretrained(tmp_path / f"{kind}_hf")  # transformers' own export of the same model
        assert set(files) == set(load_file(tmp_path / f"{kind}_hf" / "model.safetensors"))
        ids = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17]])
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5, rtol=0)
