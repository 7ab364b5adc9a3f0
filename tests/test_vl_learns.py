"""A tiny vision-language model learns a visual task with GRPO on the CPU (issue 61): `examples/vl_colors` (a tiny
Qwen2.5-VL names the color of the square it sees; its warm-up teaches the answer's format with random color words,
so a model that does not read the image stays at a third). The mean reward of the last 8 steps must pass 0.5, and
the first 5 steps' by 0.15: a run whose images do not reach the rollout or the engine, or whose reward is broken,
stays near or under 1/3."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from shardrl.launch.rank import run

EXAMPLE = Path(__file__).parents[1] / "examples" / "vl_colors"


def load_prepare():
    spec = importlib.util.spec_from_file_location("vl_colors_prepare", EXAMPLE / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prepare


def test_a_tiny_vlm_learns_to_name_the_color_it_sees(tmp_path):
    assets = load_prepare()(tmp_path / "assets", warmup_steps=60, num_train=96, num_val=12)
    run_dir = run(str(EXAMPLE / "cpu.yaml"), [
        f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'train.parquet'}]",
        f"data.val_files=[{assets / 'val.parquet'}]", f"reward.function_path={assets / 'reward.py'}",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.total_steps=24",
        "trainer.val_freq=0"])
    rewards = [json.loads(line)["reward/mean"] for line in open(run_dir / "metrics.jsonl")]
    assert len(rewards) == 24
    first, last = sum(rewards[:5]) / 5, sum(rewards[-8:]) / 8
    assert last > 0.5 and last > first + 0.15, rewards
