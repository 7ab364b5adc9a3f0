"""`shardrl plan` on offload: what an offloaded engine moves over the host link a step, checked against FSDP2's own
gathers and reductions counted on 2 ranks; the host memory of every offloaded role, in the dtypes torch keeps; the
memory ledger's gradients under accumulate_unsharded."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from shardrl.testing import TINY_MODELS, random_batch, run_distributed

TINY = TINY_MODELS["qwen2"]
SPEC = "model.tiny={" + ", ".join(f"{k}: {v}" for k, v in TINY.items()) + "}"
# 4 prompts x 2 of 64 tokens: 8 samples a rank, dynamic micro-batches of one 64-token sequence
BASE = ["data.train_batch_size=4", "rollout.n=2", "data.max_prompt_length=32", "rollout.max_new_tokens=32",
        "actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=64",
        "actor.engine.offload_params=true"]
SEVEN_B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def _numbers(tiny=TINY) -> dict:
    import transformers

    from shardrl.plan.memory import model_numbers

    return model_numbers(transformers.AutoConfig.for_model(**tiny))


def _plan(capsys, *overrides, nproc: int | None = None, spec: str = SPEC) -> dict:
    from shardrl.cli import main

    capsys.readouterr()
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    assert main(["plan", spec, *overrides, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _gb(out: dict) -> float:
    return out["host_adam"]["host_link_gb_per_step"]


# ---- the traffic against the engine's own ---------------------------------------------------------------------------
SETTINGS = [  # (engine settings, forward-only passes before the update, optimizer steps)
    (dict(), 1, 1), (dict(), 0, 2), (dict(), 2, 2),
    (dict(reshard_after_forward=False), 1, 1), (dict(reshard_after_forward=False), 0, 2),
    (dict(accumulate_unsharded=True), 1, 2), (dict(accumulate_unsharded=True), 0, 1),
]


def _count_host_link(settings) -> list[dict]:
    """Per setting (offload_params on, fp32): elements of this rank's shards all-gathered and reduce-scattered (the
    shards crossing the host link) over `passes` infer_batch calls then `steps` train_batch calls (optimizer steps) of
    4 samples a rank in micro-batches of 2; and this rank's shard. (2 ranks: on one, FSDP2 gathers nothing.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    from shardrl.algos.aggregate import agg_loss
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    seen = {"gathered": 0, "reduced": 0}
    gather, reduce = pg.foreach_all_gather, pg.foreach_reduce

    def counted_gather(fsdp_params, *a, **k):
        seen["gathered"] += sum(fp._sharded_param_data.numel() for fp in fsdp_params)
        return gather(fsdp_params, *a, **k)

    def counted_reduce(fsdp_params, *a, **k):
        seen["reduced"] += sum(fp._sharded_param_data.numel() for fp in fsdp_params)
        return reduce(fsdp_params, *a, **k)

    pg.foreach_all_gather, pg.foreach_reduce = counted_gather, counted_reduce

    def loss_fn(outputs, mb, num_tokens, num_seqs):
        return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                        num_global_tokens=num_tokens), {}

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for kw, passes, steps in settings:
        engine = build_engine(ModelConfig(tiny=TINY), EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2,
                                                                   offload_params=True, **kw),
                              OptimConfig(lr=1e-3), total_steps=2)
        batch = random_batch(4 * world, 14, TINY["vocab_size"], seed=1).index(list(range(rank, 4 * world, world)))
        seen.update(gathered=0, reduced=0)
        for _ in range(passes):
            engine.infer_batch(batch)
        for _ in range(steps):
            engine.train_batch(batch, loss_fn)
        out.append(dict(seen, shard=sum(fp._sharded_param_data.numel() for g in _groups(engine) for fp in g)))
    return out


def _groups(engine):
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state()._fsdp_param_group.fsdp_params for m in engine.module.modules()
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None]


@pytest.mark.multiproc
def test_offload_traffic_is_the_engines_own():
    """ZeRO-3 (a micro-batch gathers its forward's units and all but the last block again for its backward; a
    forward-only pass all but the last block), ZeRO-2 (one gather a micro-batch; forward-only passes once, kept for
    the update's first micro-batch) and accumulate_unsharded (once an optimizer step), with 0-2 forward-only passes
    and 1-2 optimizer steps: `offload_traffic`'s bytes are the shards FSDP2 moves, to within the shards' padding."""
    from shardrl.config.schema import EngineConfig
    from shardrl.plan.offload import offload_traffic

    numbers = _numbers()
    counted = run_distributed(_count_host_link, 2, SETTINGS)
    for (kw, passes, steps), got in zip(SETTINGS, counted):
        role = SimpleNamespace(role="actor", shard_size=2, mini_batch_samples_per_rank=4, num_micro_batches=2,
                               num_infer_micro_batches=2, num_updates=steps, max_token_len_per_gpu=None)
        layout = SimpleNamespace(samples_per_rank=4, sp=1, max_seq_len=14)
        plan = offload_traffic(numbers, EngineConfig(offload_params=True, **kw), role, layout, 4, passes)
        assert got["shard"] == pytest.approx(numbers["total"] / 2, rel=0.02)
        moved = (got["gathered"] + got["reduced"]) * 4  # fp32 bytes
        assert plan["host_link_gb_per_step"] * 1e9 == pytest.approx(moved, rel=0.02), (kw, passes, steps, got)


# ---- the passes a step runs ---------------------------------------------------------------------------------------
def test_plan_counts_the_forward_only_passes_the_step_runs(capsys):
    """The old log-probs' pass only where the update cannot supply them (one mini-batch, one epoch: it does), and with
    LoRA and a KL loss the reference's pass, which is the offloaded actor with its adapters off."""
    from shardrl.config.schema import EngineConfig
    from shardrl.plan.offload import offload_traffic

    numbers = _numbers()

    def traffic(out, passes, engine=EngineConfig(offload_params=True, use_dynamic_bsz=True, max_token_len_per_gpu=64),
                numbers=numbers):
        actor = SimpleNamespace(**out["actor"])
        layout = SimpleNamespace(samples_per_rank=out["samples_per_rank"], sp=1, max_seq_len=out["max_seq_len"])
        return offload_traffic(numbers, engine, actor, layout, 4, passes)["host_link_gb_per_step"]

    one_step = _plan(capsys, *BASE, "actor.ppo_mini_batch_size=4")
    assert one_step["actor"]["num_updates"] == 1 and _gb(one_step) == pytest.approx(traffic(one_step, 0))
    always = _plan(capsys, *BASE, "actor.ppo_mini_batch_size=4", "actor.recompute_old_log_probs=always")
    assert _gb(always) == pytest.approx(traffic(always, 1)) and _gb(always) > _gb(one_step)
    two_steps = _plan(capsys, *BASE, "actor.ppo_mini_batch_size=2")
    assert two_steps["actor"]["num_updates"] == 2 and _gb(two_steps) == pytest.approx(traffic(two_steps, 1))
    lora = ["model.lora.rank=8", "actor.ppo_mini_batch_size=2"]
    plain, kl = _plan(capsys, *BASE, *lora), _plan(capsys, *BASE, *lora, "actor.use_kl_loss=true")
    assert _gb(plain) == pytest.approx(traffic(plain, 1, numbers=_lora_numbers()))
    assert _gb(kl) == pytest.approx(traffic(kl, 2, numbers=_lora_numbers())) and _gb(kl) > _gb(plain)


def _lora_numbers() -> dict:
    import transformers

    from shardrl.config.engine import LoRAConfig
    from shardrl.plan.memory import model_numbers

    return model_numbers(transformers.AutoConfig.for_model(**TINY), lora=LoRAConfig(rank=8))


def test_the_traffic_counts_bytes_as_stored(capsys):
    """A bf16 model's shards and its gradients cross in bf16 (FSDP2 casts the reduced gradient to the sharded
    parameter's dtype before copying it to the host): half the fp32 model's bytes, the same passes."""
    fp32 = _plan(capsys, *BASE, "actor.ppo_mini_batch_size=2")
    bf16 = _plan(capsys, *BASE, "actor.ppo_mini_batch_size=2", "model.dtype=bfloat16")
    assert _gb(bf16) == pytest.approx(_gb(fp32) / 2)


def test_dynamic_micro_batches_are_counted_as_the_engine_cuts_them(capsys):
    """Sequences of 3,000 tokens under a 4,096-token budget go one a micro-batch (8, not 8 x 3,000 / 4,096 = 6):
    as fixed micro-batches of one sample."""
    common = ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
              "actor.recompute_old_log_probs=always", "data.max_prompt_length=1000", "rollout.max_new_tokens=2000",
              "actor.engine.offload_params=true"]
    dynamic = _plan(capsys, *common, "actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=4096")
    fixed = _plan(capsys, *common, "actor.engine.micro_batch_size_per_gpu=1")
    assert _gb(dynamic) == pytest.approx(_gb(fixed))


def test_the_traffic_line_of_a_7b_model_is_legible(capsys):
    spec = "model.tiny={" + ", ".join(f"{k}: {v}" for k, v in SEVEN_B.items()) + "}"
    out = _plan(capsys, "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.n=8",
                "data.max_prompt_length=256", "rollout.max_new_tokens=256", "actor.engine.use_dynamic_bsz=true",
                "actor.engine.max_token_len_per_gpu=8192", "actor.engine.offload_params=true",
                "actor.engine.offload_optimizer=true", spec=spec)
    line = out["host_adam"]["traffic_line"]
    assert "cross the host link about 1," in line and "e+" not in line, line


# ---- host memory -------------------------------------------------------------------------------------------------
def test_host_state_is_counted_in_the_dtypes_torch_keeps():
    """AdamW keeps its moments in the parameter's dtype: a bf16 model's offloaded state is 2 + 2 + 2 x 2 = 8 B a
    parameter, an fp32 one's 16 B."""
    from shardrl.config.schema import EngineConfig
    from shardrl.plan.offload import host_adam_estimate

    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    w.grad = torch.ones_like(w)
    opt = torch.optim.AdamW([w], fused=True)
    opt.step()
    assert opt.state[w]["exp_avg"].dtype == opt.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    numbers = dict(total=7_615_616_512, trained=None, frozen=0)
    for master, per_param in ((2, 8), (4, 16)):
        got = host_adam_estimate(numbers, EngineConfig(offload_params=True), 1, 1, "actor.engine", rate=1e9,
                                 master=master, host_gib=1024)
        assert got["host_state_gib"] == pytest.approx(7_615_616_512 * per_param / 2**30)


def test_host_memory_counts_every_offloaded_role(capsys):
    """With GAE the critic is a second model on the same host: both roles' state is added up, and a critic offloaded
    alone is reported; AdamW's moments of offload_optimizer alone wait in the host's memory too."""
    both = _plan(capsys, "algorithm.adv_estimator=gae", "actor.engine.offload_params=true",
                 "critic.engine.offload_params=true")
    # (the critic's engine settings default to the actor's)
    actor_only = _plan(capsys, "algorithm.adv_estimator=gae", "actor.engine.offload_params=true",
                       "critic.engine.offload_params=false")
    critic_only = _plan(capsys, "algorithm.adv_estimator=gae", "critic.engine.offload_params=true")
    assert set(both["host_adam"]["roles"]) == {"actor", "critic"}
    assert both["host_adam"]["host_state_gib"] == pytest.approx(
        actor_only["host_adam"]["host_state_gib"] + critic_only["host_adam"]["host_state_gib"])
    assert critic_only["host_adam"]["host_state_gib"] > 0.9 * actor_only["host_adam"]["host_state_gib"]
    moments = _plan(capsys, "actor.engine.offload_optimizer=true")["host_adam"]
    assert moments["host_state_gib"] == pytest.approx(2 * _numbers()["total"] * 4 / 2**30)
    assert "offload_optimizer=true: AdamW's moments wait in the host's memory" in moments["line"]


def test_advice_for_too_little_host_memory():
    """All ranks of a node share its host: a 7B sharded over one node's 8 GPUs holds the same 113.5 GiB there as on
    one GPU, so more GPUs on that node are not advised; HSDP's copies on a node are (a larger fsdp_size)."""
    from shardrl.config.schema import EngineConfig
    from shardrl.plan.offload import host_adam_estimate

    numbers = dict(total=7_615_616_512, trained=None, frozen=0)
    one = host_adam_estimate(numbers, EngineConfig(offload_params=True), 1, 1, "actor.engine", rate=1e9, host_gib=128)
    eight = host_adam_estimate(numbers, EngineConfig(offload_params=True), 8, 8, "actor.engine", rate=1e9,
                               host_gib=128)
    hsdp = host_adam_estimate(numbers, EngineConfig(offload_params=True), 4, 8, "actor.engine", rate=1e9,
                              host_gib=128)
    assert eight["host_state_gib"] == pytest.approx(one["host_state_gib"]) == pytest.approx(113.5, abs=0.1)
    assert "too much" in eight["line"] and "more nodes" in eight["line"] and "fsdp_size" not in eight["line"]
    assert "a larger fsdp_size" in hsdp["line"]


def test_ledger_counts_the_unsharded_gradients_of_accumulate_unsharded(capsys):
    """accumulate_unsharded over 2 ranks keeps the whole gradient in reduce_dtype on each GPU until the last
    micro-batch, beside the sharded one it is reduced to."""
    p = _numbers()["total"]
    out = _plan(capsys, "actor.engine.accumulate_unsharded=true", nproc=2)
    grads = next(i for i in out["memory"]["phases"]["update"]["items"] if i["name"] == "actor grads")
    assert grads["gib"] * 2**30 == pytest.approx(p * 4 + p * 4 / 2)
    off = _plan(capsys, "actor.engine.accumulate_unsharded=false", nproc=2)
    grads = next(i for i in off["memory"]["phases"]["update"]["items"] if i["name"] == "actor grads")
    assert grads["gib"] * 2**30 == pytest.approx(p * 4 / 2)
