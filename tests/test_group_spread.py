"""reward/group_spread_frac, the share of a step's groups (a prompt's responses) whose rewards differ, and the line a
run says once when a step has none under a group baseline (its advantages are then all 0): against a plain loop,
the same over ranks as on one, and a run whose reward is always 0 says it once."""

from __future__ import annotations

import json
import logging

import torch

from shardrl.config.schema import load_config
from shardrl.trainer.rl import group_spread, no_spread_warning


def spread_by_loop(index: list[int], scores: list[float]) -> tuple[int, int]:
    groups: dict[int, list[float]] = {}
    for i, s in zip(index, scores):
        groups.setdefault(i, []).append(s)
    sized = [g for g in groups.values() if len(g) > 1]
    return sum(max(g) > min(g) for g in sized), len(sized)


def test_the_share_of_groups_whose_rewards_differ_matches_a_loop_and_adds_up_over_ranks():
    gen = torch.Generator().manual_seed(0)
    index = torch.tensor([3, 0, 3, 7, 0, 5, 7, 3, 9, 9, 9, 0])  # not contiguous; group 5 is one response
    scores = torch.randint(0, 2, (len(index),), generator=gen).float()
    scores[index == 9] = 1.0  # a group all right
    scores[index == 7] = 0.0  # a group all wrong
    spread, groups = spread_by_loop(index.tolist(), scores.tolist())
    assert (spread, groups) == (2, 4)  # (groups 0 and 3 differ for this seed)
    got = group_spread(index, scores)["reward/group_spread_frac"]
    assert (got.total, got.count) == (spread, groups)
    # ranks hold whole groups: their pieces add up to the whole batch's
    first = torch.isin(index, torch.tensor([0, 7]))
    a, b = (group_spread(index[m], scores[m])["reward/group_spread_frac"] for m in (first, ~first))
    assert (a.total + b.total, a.count + b.count) == (spread, groups)
    # one response a prompt: no groups, no metric
    assert group_spread(torch.arange(4), torch.ones(4)) == {}


def test_the_line_is_said_for_a_group_baseline_without_spread_only():
    cfg = load_config(None, ["rollout.n=4"])
    none = {"reward/group_spread_frac": 0.0, "reward/mean": 0.0}
    line = no_spread_warning(cfg, True, 4, none)
    assert line.startswith("step 5: in no group of rollout.n=4 responses do the rewards differ "
                           "(reward/group_spread_frac 0, reward/mean 0), so every advantage of "
                           "algorithm.adv_estimator=grpo is 0")
    assert no_spread_warning(cfg, True, 4, {**none, "reward/group_spread_frac": 0.25}) is None
    assert no_spread_warning(cfg, True, 4, {"reward/mean": 0.0}) is None  # (rollout.n=1: no metric)
    assert no_spread_warning(cfg, False, 4, none) is None  # gae, reinforce_plus_plus: other baselines
    kl = load_config(None, ["rollout.n=4", "algorithm.use_kl_in_reward=true"])
    assert no_spread_warning(kl, True, 4, none) is None  # the KL in the reward differs by response


def test_a_run_whose_reward_never_differs_says_so_once(tmp_path, monkeypatch, caplog):
    from shardrl.cli import main

    reward = tmp_path / "zero.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shardrl.trainer.rl"):
        status = main(["train", "trainer.logger=[jsonl]", "trainer.total_steps=3", "trainer.val_freq=0",
                       f"reward.function_path={reward}", f"trainer.output_dir={tmp_path / 'run'}"])
    assert status == 0
    said = [r.getMessage() for r in caplog.records if "do the rewards differ" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 1: in no group of rollout.n=16 responses")
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["reward/group_spread_frac"] for r in records] == [0.0, 0.0, 0.0]

