"""`shardrl train` with no config (the built-in demo) visibly learns: the mean reward of the first steps
is under 0.2 and that of the last steps over 0.8, as its metrics.jsonl records."""

from __future__ import annotations

import json

from shardrl.trainer.main import resolve_overrides, run


def test_demo_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo writes ./outputs/demo_assets and ./outputs/demo/<time>
    run_dir = run(None, resolve_overrides(None, ["trainer.logger=[jsonl]"]))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in records]
    assert len(records) == 400
    assert sum(rewards[:10]) / 10 < 0.2
    assert sum(rewards[-20:]) / 20 > 0.8
    assert records[-1]["val/reward_mean"] > 0.8
    assert (run_dir / "reward_curve.png").is_file() and (run_dir / "summary.json").is_file()
