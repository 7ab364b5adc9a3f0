"""`shardrl train` with no config (the built-in demo) visibly learns: the mean reward of the first steps
is under 0.2 and that of the last steps over 0.8, as its metrics.jsonl records; and it ends with a model folder
that the README's lines load and generate from."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

from shardrl.launch.overrides import resolve_overrides
from shardrl.launch.rank import run


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


def test_demo_learns_with_lora(tmp_path, monkeypatch):
    """The demo with rank-16 LoRA adapters (the base frozen, the reference its adapters off, the fast rollout
    reading the actor's own base and synced by the adapters alone): 120 steps raise the mean train reward and the
    greedy validation reward."""
    monkeypatch.chdir(tmp_path)
    run_dir = run(None, resolve_overrides(None, [
        "trainer.logger=[jsonl]", "model.lora.rank=16", "model.lora.alpha=32", "actor.optim.lr=2e-3",
        "rollout.backend=fast",
        "trainer.total_steps=120", "trainer.val_freq=120", "trainer.val_before_train=true"]))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    val = [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
    assert len(rewards) == 120 and len(val) == 2
    assert sum(rewards[-20:]) / 20 > sum(rewards[:10]) / 10 + 0.1, rewards
    assert val[-1] > val[0] + 0.1, val
    config = (run_dir / "config.yaml").read_text()
    assert "lora_sync: unmerged" in config, "the run's rollout was not synced by its adapters"


def test_the_demo_exports_a_model_transformers_loads_and_generates_with(tmp_path, monkeypatch):
    """The demo ends by writing its model as a Hugging Face folder, `<run folder>/hf_model`, which the README's
    three lines load with transformers and generate from."""
    import torch
    import transformers

    monkeypatch.chdir(tmp_path)
    run_dir = run(None, resolve_overrides(None, ["trainer.logger=[jsonl]", "trainer.total_steps=1",
                                                 "trainer.val_freq=0"]))
    folder = run_dir / "hf_model"
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    snippet = readme.split("The demo ends by writing", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert '"outputs/demo/<time>/hf_model"' in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace('"outputs/demo/<time>/hf_model"', repr(str(folder))), {})
    assert re.fullmatch(r"3\+4=\d\n?", printed.getvalue()), printed.getvalue()  # (one step: a digit, maybe not 7)
    # the weights trained, not the demo's starting model
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "demo_assets" / "model")
    name, trained = next(iter(model.state_dict().items()))
    assert trained.dtype == torch.float32 and not torch.equal(trained, start.state_dict()[name])
