"""The run's `Plan`: derived once per process from the config (step plan, layout, response budget), which it never
changes; and the response budget it holds is the one every reader uses (an agent's episodes reach
rollout.agent.max_response_tokens, not rollout.max_new_tokens)."""

from __future__ import annotations

import pytest

from shardrl.config.schema import config_to_dict, load_config
from shardrl.plan.plan import Plan

AGENT = ["rollout.agent.entrypoint=agent.py:run", "rollout.max_new_tokens=4", "rollout.agent.max_response_tokens=64",
         "data.max_prompt_length=16", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4"]


def test_an_agent_runs_plan_its_layout_and_its_checks_on_the_agents_budget():
    cfg = load_config(None, AGENT)
    plan = Plan.for_rl(cfg, 1, 1)
    assert plan.response == ("rollout.agent.max_response_tokens", 64) and plan.max_response_tokens == 64
    assert plan.layout.max_new_tokens == 64 and plan.layout.max_seq_len == 16 + 64  # (was 16 + 4)
    # the token budget of a dynamic micro-batch must hold one whole episode, not one turn
    tight = load_config(None, AGENT + ["actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=40"])
    with pytest.raises(ValueError, match=r"up to 80 tokens \(data.max_prompt_length 16 \+ "
                                         r"rollout.agent.max_response_tokens 64\)"):
        Plan.for_rl(tight, 1, 1)
    # overlong shaping spans the last tokens before the agent's budget
    shaped = load_config(None, AGENT + ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32"])
    assert shaped.reward.overlong_buffer.len == 32  # (was refused: "must be <= rollout.max_new_tokens=4")
    with pytest.raises(ValueError, match="must be <= rollout.agent.max_response_tokens=64"):
        load_config(None, AGENT + ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=65"])


def test_single_and_multi_turn_budgets_are_as_before():
    assert Plan.for_rl(load_config(None, []), 1, 1).response == ("rollout.max_new_tokens", 32)
    multi = load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                               "rollout.multi_turn.max_response_tokens=48"])
    assert Plan.for_rl(multi, 1, 1).response == ("rollout.multi_turn.max_response_tokens", 48)


def test_the_plan_resolves_into_its_own_copy_of_the_config():
    cfg = load_config(None, ["trainer.nproc_per_node=1"])
    before = config_to_dict(cfg)
    plan = Plan.for_rl(cfg, 2, 4)
    plan.resolve_device(None, __import__("torch").device("cpu"))
    assert config_to_dict(cfg) == before  # the loaded config is never changed
    t = plan.config.trainer
    assert (t.nnodes, t.nproc_per_node) == (2, 4) and plan.config.rollout.backend == "hf"
    assert any(line.startswith("rollout.backend=hf") for line in plan.choices)


def _count_derivations(overrides: list[str]) -> dict:
    """The derivations of one rank's whole RL run, counted."""
    from shardrl.config import schema
    from shardrl.launch.rank import run
    from shardrl.plan import layout, plan as plan_module, step_plan

    counts = {"StepPlan.from_config": 0, "derive_layout": 0}
    from_config, derive = step_plan.StepPlan.from_config.__func__, layout.derive_layout

    def counted_from_config(cls, cfg):
        counts["StepPlan.from_config"] += 1
        return from_config(cls, cfg)

    def counted_derive(*args, **kwargs):
        counts["derive_layout"] += 1
        return derive(*args, **kwargs)

    loaded = []
    load = schema.load_config

    def keep(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    step_plan.StepPlan.from_config = classmethod(counted_from_config)
    layout.derive_layout = plan_module.derive_layout = counted_derive
    schema.load_config = keep
    try:
        run(None, overrides)
    finally:
        step_plan.StepPlan.from_config = classmethod(from_config)
        layout.derive_layout = plan_module.derive_layout = derive
        schema.load_config = load
    counts["config_changed"] = [config_to_dict(c) != config_to_dict(load_config(None, overrides)) for c in loaded]
    return counts


@pytest.mark.multiproc
def test_a_run_derives_its_plan_once_per_process(tmp_path):
    from shardrl.testing import run_distributed, small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets")
    overrides = small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=1",
                               "trainer.val_freq=0", "algorithm.adv_estimator=gae")
    counts = run_distributed(_count_derivations, 2, overrides)
    assert counts == {"StepPlan.from_config": 1, "derive_layout": 1, "config_changed": [False]}
