"""What a run leaves behind whatever its loggers (summary.json, the reward curve), and how validation cuts
its prompts into rounds (`data.val_batch_size`); fast, without a model."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from shardrl.config.schema import load_config
from shardrl.trainer.run_folder import write_results
from shardrl.trainer.logger import MetricsLogger
from shardrl.trainer.run_folder import summarize
from shardrl.trainer.validation import validate

STEPS = [{"reward/mean": r, "actor/loss": 0.5} for r in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0)]


def log_steps(run_dir: Path, sinks: list[str], steps=STEPS, start_step: int = 0) -> MetricsLogger:
    logger = MetricsLogger(run_dir, sinks, total_steps=len(steps), start_step=start_step)
    for i, metrics in enumerate(steps[start_step:], start=start_step + 1):
        logger.log(i, {**metrics, **({"val/reward_mean": 0.75} if i == 4 else {})})
    logger.close()
    return logger


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """torch.utils.tensorboard replaced by a recorder (the real package is an optional extra)."""
    scalars = []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, key, value, step):
            scalars.append((key, value, step))

        def close(self):
            pass

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return scalars


@pytest.mark.parametrize("sinks", [["console"], ["tensorboard"], [], ["jsonl"], ["console", "jsonl"]])
def test_every_logger_alone_gives_the_summary_and_the_curve(sinks, tmp_path, fake_tensorboard):
    logger = log_steps(tmp_path, sinks)
    assert [r["step"] for r in logger.records] == list(range(1, 9))
    assert (tmp_path / "metrics.jsonl").exists() == ("jsonl" in sinks)
    if "tensorboard" in sinks:
        assert ("reward/mean", 0.4, 3) in fake_tensorboard
    said = write_results(tmp_path, logger.records, 8)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # first and last 2 steps (8 // 4): (0 + 0.2) / 2 and (1 + 1) / 2; the last validation seen was at step 4
    assert summary == pytest.approx({"steps": 8, "reward_first": 0.1, "reward_last": 1.0, "first_last_window": 2,
                                     "val_last": 0.75})
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    assert said.startswith("8 of 8 steps; summary ")


def test_a_resumed_run_with_jsonl_summarises_the_whole_run(tmp_path):
    log_steps(tmp_path, ["jsonl"], STEPS[:5])  # steps 1..5, then a resume from a checkpoint at step 3
    logger = log_steps(tmp_path, ["jsonl"], STEPS, start_step=3)
    assert [r["step"] for r in logger.records] == list(range(1, 9))
    assert summarize(logger.records)["reward_first"] == pytest.approx(0.1)


def test_no_step_done_writes_an_empty_summary_and_no_curve(tmp_path):
    assert write_results(tmp_path, [], 20).startswith("0 of 20 steps")
    assert json.loads((tmp_path / "summary.json").read_text()) == {}
    assert not (tmp_path / "reward_curve.png").exists()


def run_validate(num_prompts: int, dp: int, rank: int, *overrides: str) -> list[list[int]]:
    """The prompt ids each generate round of `validation.validate` got on one rank (dp > 1: this rank's view)."""
    cfg = load_config(None, ["trainer.log_val_generations=0", *overrides])  # no sample generations kept
    val_set = [{"id": i, "data_source": "d"} for i in range(num_prompts)]
    rounds = []
    generate = lambda items, sampling: rounds.append([it["id"] for it in items]) or {  # noqa: E731
        "prompt_index": torch.arange(len(items))}
    score = lambda batch: (torch.ones(len(batch["prompt_index"])), {})  # noqa: E731
    assert validate(cfg, val_set, generate, score, rank, dp)[0]["val/reward_mean"] == pytest.approx(1.0)
    return rounds


def test_val_batch_size_sets_the_prompts_of_one_validation_round():
    # 7 prompts, val_batch_size 3 on one rank: rounds of 3, 3, 1 (rollout.micro_batch_size=64 used to decide)
    assert run_validate(7, 1, 0, "data.val_batch_size=3") == [[0, 1, 2], [3, 4, 5], [6]]
    # global: 4 prompts per round over 2 ranks are 2 per rank; rank 0 holds 0, 2, 4, 6 of the 7
    assert run_validate(7, 2, 0, "data.val_batch_size=4") == [[0, 2], [4, 6]]
    # rank 1 holds 1, 3, 5 and repeats one so both ranks run the same rounds
    assert run_validate(7, 2, 1, "data.val_batch_size=4") == [[1, 3], [5, 1]]
    # null: the whole set in one round (the rollout still cuts its generate calls by micro_batch_size)
    assert run_validate(7, 1, 0, "rollout.micro_batch_size=2") == [list(range(7))]


def test_validation_of_multi_turn_rollouts_reports_tool_use_over_the_real_prompts():
    calls = {0: 0, 1: 2, 2: 1, 3: 0, 4: 1}
    errors = {0: 0, 1: 1, 2: 0, 3: 0, 4: 1}

    def validate_on(dp: int, rank: int) -> dict:
        cfg = load_config(None, ["trainer.log_val_generations=0", "data.val_batch_size=2"])
        generate = lambda items, sampling: {  # noqa: E731
            "prompt_index": torch.arange(len(items)),
            "num_tool_calls": torch.tensor([float(calls[it["id"]]) for it in items]),
            "num_tool_errors": torch.tensor([float(errors[it["id"]]) for it in items])}
        score = lambda batch: (batch["num_tool_calls"].clone(), {})  # noqa: E731
        metrics = validate(cfg, [{"id": i, "data_source": "d"} for i in range(5)], generate, score, rank, dp,
                           multi_turn=True)[0]
        assert metrics.pop("val/d/reward_mean@1") == metrics["val/reward_mean"]  # one data source
        metrics.pop("val/d/pass@1")
        return metrics

    # one rank, rounds of 2, 2, 1: 3 of 5 call a tool, one of them cleanly; 4 calls
    assert validate_on(1, 0) == pytest.approx({"val/reward_mean": 0.8, "val/multi_turn/tool_call_rate": 0.6,
                                            "val/multi_turn/clean_call_rate": 0.2,
                                            "val/multi_turn/num_tool_calls_mean": 0.8})
    # rank 1 of 2 holds prompts 1 and 3 and repeats prompt 1 to run as many rounds as rank 0: not counted
    assert validate_on(2, 1) == pytest.approx({"val/reward_mean": 1.0, "val/multi_turn/tool_call_rate": 0.5,
                                            "val/multi_turn/clean_call_rate": 0.0,
                                            "val/multi_turn/num_tool_calls_mean": 1.0})


def fake_validation(dp: int, rank: int, n: int, dp_group=None) -> dict:
    """`validate` on 7 prompts of two data sources with n responses each, every response scored by a rule of its
    prompt and its place in the group: prompt i's j-th response scores 1 when (i + j) % 3 == 0."""
    cfg = load_config(None, ["trainer.log_val_generations=0", "data.val_batch_size=4", f"rollout.val_kwargs.n={n}",
                             "rollout.val_kwargs.temperature=1.0"])
    val_set = [{"id": i, "data_source": "a" if i < 4 else "b/c"} for i in range(7)]
    seen = []

    def generate(items, sampling):
        seen.append((sampling.n, sampling.temperature))
        index = torch.arange(len(items)).repeat_interleave(sampling.n)  # (prompts x n,)
        return {"prompt_index": index, "id": torch.tensor([items[i]["id"] for i in index.tolist()]),
                "j": torch.arange(len(index)) % sampling.n}

    score = lambda batch: (((batch["id"] + batch["j"]) % 3 == 0).float(), {})  # noqa: E731
    metrics = validate(cfg, val_set, generate, score, rank, dp, dp_group)[0]
    assert set(seen) == {(n, 1.0)}
    return metrics


def test_validation_samples_n_and_reports_each_data_source():
    m = fake_validation(1, 0, n=3)
    # every prompt has exactly one of its 3 responses with (i + j) % 3 == 0: mean 1/3, pass@3 = 1 for all
    assert m == pytest.approx({"val/reward_mean": 1 / 3, "val/a/reward_mean@3": 1 / 3, "val/a/pass@3": 1.0,
                               "val/b/c/reward_mean@3": 1 / 3, "val/b/c/pass@3": 1.0})
    m = fake_validation(1, 0, n=1)
    # n=1: prompts 0 and 3 score (source a: 2 of 4), prompt 6 (source b/c: 1 of 3)
    assert m == pytest.approx({"val/reward_mean": 3 / 7, "val/a/reward_mean@1": 0.5, "val/a/pass@1": 0.5,
                               "val/b/c/reward_mean@1": 1 / 3, "val/b/c/pass@1": 1 / 3})


def _validation_on_two_ranks(ns: tuple[int, ...]) -> list[dict]:
    import torch.distributed as dist

    return [fake_validation(2, dist.get_rank(), n, dist.group.WORLD) for n in ns]


@pytest.mark.multiproc
def test_validation_metrics_do_not_depend_on_the_ranks():
    from shardrl.testing import run_distributed

    ns = (1, 2)  # both on the same two processes, one after the other
    for n, got in zip(ns, run_distributed(_validation_on_two_ranks, 2, ns), strict=True):
        assert got == pytest.approx(fake_validation(1, 0, n)), n


def test_a_metrics_file_cut_short_drops_its_last_line_and_resumes(tmp_path, caplog):
    from shardrl.cli import main as cli_main
    from shardrl.metrics import read_metrics

    log_steps(tmp_path, ["jsonl"], STEPS[:3])
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 4, "rew')  # a full disk writes exactly this
    with caplog.at_level("WARNING"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert f"{path}: dropped its last line, 16 characters cut short" in caplog.text
    assert cli_main(["plot", str(tmp_path)]) == 0 and (tmp_path / "reward_curve.png").is_file()
    # a resumed run (from step 3) rewrites the file whole: the cut line is gone, the next steps follow
    log_steps(tmp_path, ["jsonl"], STEPS[:5], start_step=3)
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3, 4, 5]
    # a broken line that is not the last is no cut-short write: an error naming the file and the line
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON object"):
        read_metrics(path)


def test_plot_draws_the_loss_of_a_run_without_rewards(tmp_path, monkeypatch, capsys):
    """`shardrl plot` on an sft/dpo/rm run drew an empty reward chart (and matplotlib's no-legend warning)."""
    import warnings

    import matplotlib.axes

    from shardrl.cli import main as cli_main
    from shardrl.trainer.plot import choose_curves

    drawn, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: drawn.append((a, k)) or plot(ax, *a, **k))
    log_steps(tmp_path, ["jsonl"], [{"dpo/loss": loss, "rewards/accuracies": 0.5} for loss in (0.7, 0.6, 0.4)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "val/loss": 0.5}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli_main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "loss_curve.png").is_file() and not (tmp_path / "reward_curve.png").exists()
    assert [(list(a[0]), list(a[1]), k["label"]) for a, k in drawn] == [
        ([1, 2, 3], [0.7, 0.6, 0.4], "train loss (dpo/loss)"), ([3], [0.5], "validation loss")]
    assert choose_curves([{"step": 1, "reward/mean": 0.2, "actor/loss": 1.0}], tmp_path)[0] == "reward"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing/step_s": 1.0}) + "\n")
    capsys.readouterr()
    assert cli_main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert (f"error: {tmp_path / 'metrics.jsonl'} holds no reward (reward/mean) and no loss (sft/loss, dpo/loss, kto/loss, "
            "rm/loss) to plot" in capsys.readouterr().err) and not (tmp_path / "x.png").exists()


def test_a_full_disk_while_logging_names_the_metrics_file(tmp_path):
    import errno

    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=2)

    class FullDisk:
        name = logger._jsonl.name

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    logger._jsonl.close()
    logger._jsonl = FullDisk()
    with pytest.raises(OSError) as e:
        logger.log(1, {"reward/mean": 0.5})
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "metrics.jsonl") in str(e.value)
