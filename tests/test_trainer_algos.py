"""The 2025-26 algorithms in the trainer, on the built-in demo on the CPU: rollout_is leaves an exactly
matched run (HF rollout, fp32: sampler and trainer agree to ~1e-6) unchanged and logs the mismatch; each mode
(rollout_is, gspo, gspo_token, DAPO's dynamic sampling with overlong shaping and clip-higher) still learns;
the example DAPO config loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardrl.testing import small_demo_run
from shardrl.trainer.demo import prepare_demo_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=30)


def train(assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    from shardrl.launch.rank import run

    out = run(None, small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", *extra))
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_rollout_is_leaves_a_matched_run_unchanged_and_logs_the_mismatch(assets, tmp_path):
    runs = {name: train(assets, tmp_path / name, "trainer.total_steps=3", *extra) for name, extra in {
        "off": [],
        "tis": ["algorithm.rollout_is=true"],
        "mis": ["algorithm.rollout_is=true", "algorithm.rollout_is_level=geometric", "algorithm.rollout_is_mode=mask",
                "algorithm.rollout_is_threshold=1.01"],
    }.items()}
    for step, off in enumerate(runs["off"]):
        # the mismatch diagnostics are on by default; sampler and trainer agree here
        assert off["rollout/logprob_abs_diff"] < 1e-5 and off["rollout/logprob_abs_diff_max"] < 1e-4
        assert abs(off["rollout/kl"]) < 1e-5 and 0 <= off["rollout/k3_kl"] < 1e-9
        assert "rollout_is/weight_mean" not in off
        for name in ("tis", "mis"):
            on = runs[name][step]
            assert on["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert on["rollout_is/truncated_frac"] == 0 and on["rollout_is/masked_frac"] == 0
            assert on["reward/mean"] == off["reward/mean"], (name, step)
            for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy"):
                assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), (name, step, key)
    assert runs["off"][-1]["actor/grad_norm"] > 0


MODES = {  # the reward whose first and last steps are compared, and the mode's settings
    "rollout_is": ("reward/mean", ["algorithm.rollout_is=true", "algorithm.rollout_is_level=geometric",
                                   "algorithm.rollout_is_mode=mask"]),
    "gspo": ("reward/mean", ["actor.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
                             "actor.clip_ratio_low=0.01", "actor.clip_ratio_high=0.01"]),
    # (with seq-mean-token-mean and GRPO's one advantage per sequence GSPO-token is GSPO: take token-mean)
    "gspo_token": ("reward/mean", ["actor.loss_mode=gspo_token", "actor.loss_agg_mode=token-mean",
                                   "actor.clip_ratio_low=0.01", "actor.clip_ratio_high=0.01"]),
    # the kept groups are the informative ones: the learning curve is the mean over every sample drawn
    # (verl's rule: a step that cannot fill its batch of informative groups stops the run; as the demo is learned
    # most groups agree, so a step may draw many batches)
    "dapo": ("dynamic_sampling/reward_mean_drawn", [
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=40",
        "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2", "actor.clip_ratio_high=0.28"]),
}


def test_each_mode_learns_on_the_demo(assets, tmp_path):
    # 16 prompts x 8 responses, two updates a step (so the ratios and clips act), 50 steps a mode
    figures = {}
    for name, (key, extra) in MODES.items():
        records = train(assets, tmp_path / name, "trainer.total_steps=50", "actor.optim.lr=1e-3",
                        "data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=8", *extra)
        rewards = [r[key] for r in records]
        figures[name] = (sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10)
        if name == "dapo":
            assert all(r["dynamic_sampling/num_gen_batches"] >= 1 for r in records)
            assert all(0 < r["dynamic_sampling/informative_frac"] <= 1 for r in records)
            assert all(r["response/length_max"] <= 4 and r["reward/overlong_penalty_mean"] <= 0 for r in records)
            assert min(r["reward/overlong_penalty_mean"] for r in records) < 0  # some responses hit the buffer
            assert all(r["adv/abs_mean"] > 0 for r in records)  # every kept group has an advantage
    print("reward first 10 -> last 10 steps:", {k: (round(a, 3), round(b, 3)) for k, (a, b) in figures.items()})
    for name, (first, last) in figures.items():
        assert last > first + 0.05, (name, figures)


def test_dapo_example_config_loads():
    from shardrl.config.schema import load_config

    cfg = load_config(str(Path(__file__).parent.parent / "examples" / "smollm2" / "dapo.yaml"))
    assert cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable
    assert cfg.actor.clip_ratio_high > cfg.actor.clip_ratio_low and cfg.actor.loss_agg_mode == "token-mean"


def test_rollout_is_mask_mode_needs_the_old_log_prob_pass():
    from shardrl.config.schema import load_config
    from shardrl.plan.step_plan import old_log_probs_from_update

    base = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    assert old_log_probs_from_update(load_config(None, base))[0]
    # truncate: the weights come from the update's forward; mask changes the loss's token count first
    assert old_log_probs_from_update(load_config(None, base + ["algorithm.rollout_is=true"]))[0]
    skip, why = old_log_probs_from_update(load_config(None, base + ["algorithm.rollout_is=true",
                                                                     "algorithm.rollout_is_mode=mask"]))
    assert not skip and "rollout_is_mode=mask" in why


def _dapo_two_ranks(overrides: list[str]) -> list[dict]:
    import torch.distributed as dist

    from shardrl.launch.rank import run

    run_dir = run(None, overrides)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")] if dist.get_rank() == 0 else []


@pytest.mark.multiproc
def test_dynamic_sampling_on_two_ranks_draws_in_step(assets, tmp_path):
    # each rank finds informative groups at its own pace; all draw the same number of batches (generation and
    # scoring are collective), until the ranks together have enough, so no rank waits on a collective the other
    # skips (the kept set and its balance over the ranks: tests/test_dynamic_sampling.py)
    from shardrl.testing import run_distributed

    records = run_distributed(_dapo_two_ranks, 2, small_demo_run(
        assets, tmp_path / "dapo2", "trainer.logger=[jsonl]", "trainer.total_steps=3",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0", "rollout.n=2"))
    assert len(records) == 3
    for r in records:
        assert r["dynamic_sampling/num_gen_batches"] >= 1 and 0 < r["dynamic_sampling/informative_frac"] <= 1
    assert max(r["dynamic_sampling/num_gen_batches"] for r in records) > 1  # some step needed more rounds
