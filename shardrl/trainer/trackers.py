"""The experiment trackers a run's metrics can also go to (`trainer.logger`): TensorBoard, wandb, MLflow, SwanLab
and trackio. Each is an optional package (`pip install 'shardrl[NAME]'`), imported only when named, opened with the
run's project, experiment name and config (as verl opens it), given each step's record, and closed at the end.

Where a tracker's data goes is the package's own setting, as its users know it (wandb's login and `WANDB_*`,
`MLFLOW_TRACKING_URI`, `SWANLAB_MODE` and `SWANLAB_API_KEY`, `TRACKIO_DIR`); the files of this one run that a
tracker writes beside the script go in the run folder instead (TensorBoard's events, wandb's and SwanLab's logs).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, NamedTuple


class Tracker(NamedTuple):
    module: str
    """What is imported: its failing to import is the error `check_sinks_installed` gives before anything loads."""
    extra: str
    """shardrl's extra that installs it: `pip install 'shardrl[<extra>]'`."""
    open: Callable
    """(run_dir, project, experiment, config) -> an object with `log(step, record)` and `close()`."""


def _scalars(record: dict) -> dict:
    """The record's numbers, without its step (which each tracker takes as the step)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class _TensorBoard:
    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, record: dict) -> None:
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        import wandb

        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))

    def log(self, step: int, record: dict) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow takes letters, digits and `_-. :/` in a metric's name; verl's names hold `@` (`val-core/.../mean@4`),
# which verl logs as `_at_`: the same here, so a dashboard made for verl's runs reads these
_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")
_MLFLOW_MAX_PARAM = 6000  # characters of one param's value (MLflow refuses longer ones; config.yaml has it whole)


def mlflow_metric_name(name: str) -> str:
    return _MLFLOW_BAD_CHARS.sub("_", name.replace("@", "_at_"))


def _flat(config: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            flat.update(_flat(v, f"{prefix}{k}/"))
        else:
            flat[f"{prefix}{k}"] = str(v)[:_MLFLOW_MAX_PARAM]
    return flat


class _MLflow:
    """A run in the experiment named `trainer.project_name` of MLflow's tracking store (`MLFLOW_TRACKING_URI`; unset,
    MLflow's default), the config as its params (`actor/optim/lr`, ...)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(experiment_id=mlflow.set_experiment(project).experiment_id, run_name=experiment)
        if config:
            mlflow.log_params(_flat(config))

    def log(self, step: int, record: dict) -> None:
        self.mlflow.log_metrics({mlflow_metric_name(k): v for k, v in _scalars(record).items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class _SwanLab:
    """A SwanLab run in SwanLab's mode (`SWANLAB_MODE`: cloud by default, which needs `SWANLAB_API_KEY` or a login;
    `local` or `offline` keep it on this machine), its log in `<run_dir>/swanlog` unless `SWANLAB_LOG_DIR` is set."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        import swanlab

        # (experiment_name, logdir and the module's log and finish: what every swanlab release has taken)
        self.swanlab = swanlab
        swanlab.init(project=project, experiment_name=experiment, config=config or {},
                     logdir=os.environ.get("SWANLAB_LOG_DIR", str(run_dir / "swanlog")))

    def log(self, step: int, record: dict) -> None:
        self.swanlab.log(_scalars(record), step=step)

    def close(self) -> None:
        self.swanlab.finish()


class _Trackio:
    """A trackio run in the project's local database (`TRACKIO_DIR`, by default in the Hugging Face cache), which
    `trackio show` opens as a dashboard."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=experiment, config=config)

    def log(self, step: int, record: dict) -> None:
        self.trackio.log(_scalars(record), step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKERS = {
    "tensorboard": Tracker("torch.utils.tensorboard", "tensorboard", _TensorBoard),
    "wandb": Tracker("wandb", "wandb", _Wandb),
    "mlflow": Tracker("mlflow", "mlflow", _MLflow),
    "swanlab": Tracker("swanlab", "swanlab", _SwanLab),
    "trackio": Tracker("trackio", "trackio", _Trackio),
}
"""`trainer.logger`'s trackers (beside `console` and `jsonl`, which `logger.MetricsLogger` writes itself)."""
