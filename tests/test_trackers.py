"""The trackers `trainer.logger` names beside console and jsonl, as verl's and TRL's scripts name them: MLflow, SwanLab
and trackio, each with its real package in its local mode (a run's metrics read back from what the package wrote);
each skips where its package is not installed. A missing package is one error naming its extra, and verl's
`trainer.logger` values translate to them."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from shardrl.config.load import ConfigError
from shardrl.config.schema import load_config
from shardrl.trainer.logger import check_sinks_installed
from shardrl.trainer.trackers import mlflow_metric_name

REWARDS = (0.25, 0.5, 0.75)

# a run's logger, in a process of its own: each tracker keeps its run (and trackio its folder) process-wide
LOG_THREE_STEPS = """
import sys
from pathlib import Path
from shardrl.trainer.logger import MetricsLogger

logger = MetricsLogger(Path(sys.argv[1]), [sys.argv[2]], total_steps=3, project="shardrl-test", experiment="tiny",
                       config={"actor": {"optim": {"lr": 0.001}}, "trainer": {"logger": [sys.argv[2]]}})
for step, reward in enumerate((0.25, 0.5, 0.75), start=1):
    logger.log(step, {"reward/mean": reward, "val-core/arith/reward/mean@4": reward / 2, "note": "not a number"})
logger.close()
"""


def log_three_steps(sink: str, run_dir: Path, **env: str) -> None:
    import os

    run_dir.mkdir()
    done = subprocess.run([sys.executable, "-c", LOG_THREE_STEPS, str(run_dir), sink], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]


def test_mlflow_gets_the_config_and_every_step(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    store = (tmp_path / "mlruns").as_uri()  # a file store: MLflow's local store that needs no database package
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 asks for it)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    log_three_steps("mlflow", tmp_path / "run", MLFLOW_TRACKING_URI=store)
    client = mlflow.tracking.MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("shardrl-test").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.params["actor/optim/lr"] == "0.001" and run.data.params["trainer/logger"] == "['mlflow']"
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert history("reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    # verl's `@` as verl logs it to MLflow, which refuses it in a name
    assert history("val-core/arith/reward/mean_at_4") == [(1, 0.125), (2, 0.25), (3, 0.375)]
    assert "note" not in run.data.metrics and "step" not in run.data.metrics


def test_swanlab_offline_writes_every_step_in_the_run_folder(tmp_path):
    pytest.importorskip("swanlab")
    log_three_steps("swanlab", tmp_path / "run", SWANLAB_MODE="offline")
    [record] = (tmp_path / "run" / "swanlog").glob("run-*/run-*.swanlab")  # (swanlab's own binary log)
    data = record.read_bytes()
    assert b"reward/mean" in data and all(struct.pack("<d", r) in data for r in REWARDS)
    [config] = (tmp_path / "run" / "swanlog").glob("run-*/files/config.yaml")
    assert "0.001" in config.read_text()


def test_trackio_writes_every_step_in_its_local_database(tmp_path):
    pytest.importorskip("trackio")
    log_three_steps("trackio", tmp_path / "run", TRACKIO_DIR=str(tmp_path / "trackio"))
    db = sqlite3.connect(tmp_path / "trackio" / "shardrl-test.db")
    rows = db.execute("select step, metrics from metrics where run_name = 'tiny' order by step").fetchall()
    assert [(step, json.loads(m)["reward/mean"]) for step, m in rows] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert all("note" not in json.loads(m) for _, m in rows)
    [(config,)] = db.execute("select config from configs where run_name = 'tiny'").fetchall()
    assert json.loads(config)["actor"] == {"optim": {"lr": 0.001}}


@pytest.mark.parametrize("sink", ["mlflow", "swanlab", "trackio"])
def test_each_tracker_is_a_logger_and_a_missing_one_names_its_extra(sink, monkeypatch):
    assert load_config(None, [f"trainer.logger=[console, {sink}]"]).trainer.logger == ["console", sink]
    monkeypatch.setitem(sys.modules, sink, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ConfigError, match=rf"'{sink}' needs a package .* pip install 'shardrl\[{sink}\]'"):
        check_sinks_installed(["console", sink])


def test_verl_logger_values_translate_to_the_trackers():
    from shardrl.compat.verl.keys import loggers

    assert loggers(["console", "mlflow", "swanlab", "trackio"]) == ["console", "mlflow", "swanlab", "trackio",
                                                                    "jsonl"]
    with pytest.raises(ValueError, match="'clearml'.*shardrl has console, wandb, tensorboard, mlflow, swanlab, "
                                         "trackio"):
        loggers(["clearml"])


def test_mlflow_metric_names_keep_what_mlflow_takes():
    assert mlflow_metric_name("val-core/openai/gsm8k/reward/mean@4") == "val-core/openai/gsm8k/reward/mean_at_4"
    assert mlflow_metric_name("timing/step_s") == "timing/step_s"
    assert mlflow_metric_name("val/a+b (x)") == "val/a_b _x_"
