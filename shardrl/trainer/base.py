"""The loop every trainer shares: `Trainer.fit` (resume, the steps, validation, checkpoints, logging, the HF export)
and what the launcher asks of a trainer class (its config class, its `Plan`, where its ranks go).

    resume (a checkpoint's engines and state) -> for each step: train_step -> [validate] -> [save] -> log
    -> close -> HF export (and LoRA adapters) -> summary (and curve), also after a stop signal (`launch.rank`)

A trainer is a subclass that builds its engines and data in `__init__` and says what one step does (`train_step`),
what it validates, which engines and state its checkpoints hold; torchtitan's `Trainer` and `FluxTrainer` are the
model. Its row in `config.registry` names it for the `shardrl` command and the per-rank entry (`python -m shardrl.launch`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from shardrl.compat.verl.metric_names import with_verl_names
from shardrl.config.schema import config_to_dict
from shardrl.trainer.checkpoint import CheckpointManager, check_resumable
from shardrl.trainer.logger import MetricsLogger
from shardrl.trainer.run_folder import write_results

log = logging.getLogger("shardrl.trainer")


class Placement(NamedTuple):
    """Where this rank's part of a run goes (`Trainer.placement`)."""

    trainer_args: dict = {}
    """Keyword arguments of the trainer's constructor beyond the config, the run folder and the plan."""
    one_node: bool = False
    """The ranks training are laid out as one node of their own (whatever torchrun's nodes)."""


class Trainer(abc.ABC):
    name = ""
    """Its `config.registry` row's name (`shardrl NAME`), and the prefix of an offline trainer's step metrics (`sft/loss`)."""
    config_cls: type = object
    """The config class its command loads."""
    group_size = 1
    """Rows per data item, kept in one micro-batch (2 for a preference pair)."""
    head = "lm"
    demo_without_config = False
    """Without a config file or a model, the command runs the built-in demo (`shardrl train`)."""
    resume_settings: tuple[str, ...] = ()
    """The config keys a checkpoint's steps mean under (the loss and what it is computed from): each checkpoint
    records their values, and a resume under others is refused naming them (`checkpoint.check_resumable`; the
    README's list). Settings of how to go on (the LR, sampling, batch sizes) may change on resume."""

    # ---- what the launcher asks of a trainer class ----------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def build_plan(cls, cfg, nnodes: int, nproc_per_node: int):
        """The run's `Plan` on `nnodes x nproc_per_node` training ranks (a `ValueError` for a layout that cannot
        work)."""

    @classmethod
    def check_launch(cls, cfg, nnodes: int, nproc_per_node: int) -> None:
        """What the launcher checks before it starts any process: the plan of the world it will start."""
        cls.build_plan(cfg, nnodes, nproc_per_node)

    @classmethod
    @contextlib.contextmanager
    def placement(cls, cfg, owns_group: bool):
        """Where this rank's part goes (a `Placement`), for the duration of the run; None where the rank's part
        is done when it is entered (a rank that only generates)."""
        yield Placement()

    # ---- the run ------------------------------------------------------------------------------------
    def __init__(self, cfg, run_dir: Path, plan=None):
        """`plan`: the run's `Plan` (the launcher's); None: built here, for the world torchrun made."""
        self.run_dir, self.rank, self.world = run_dir, dist.get_rank(), dist.get_world_size()
        if plan is None:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            plan = self.build_plan(cfg, self.world // per_node, per_node)
        self.plan, self.cfg, self.layout = plan, plan.config, plan.layout
        self.val_set = None
        self.records: list[dict] = []  # rank 0: the steps logged, for summary.json and the curve
        self.val_generations: list[dict] = []  # rank 0: the last validation's samples, for the logger
        self._resumed_records: list[dict] = []  # a resumed checkpoint's logged steps, when no metrics.jsonl has them
        self._checkpoint_record: dict | None = None  # the resumed checkpoint's own step's record
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", self.cfg.trainer.keep_last)
        # before the subclass claims the folder (rewriting its config.yaml) and loads any model
        resume = self.cfg.trainer.resume
        check_resumable(self.checkpoints.resume_target(resume), self.name, self.recorded_settings(),
                        "set trainer.output_dir to another folder for a new run" if resume == "auto" else
                        f"start a new run without trainer.resume={resume}")

    def recorded_settings(self) -> dict:
        """This run's values of those `resume_settings` that its loss reads, by key."""
        return {key: functools.reduce(getattr, key.split("."), self.cfg) for key in self.resume_settings
                if self.reads_setting(key)}

    def reads_setting(self, key: str) -> bool:
        """Whether this run reads `key` of `resume_settings` (one it never reads may change on resume: it changes
        nothing, and a refusal naming it would name a setting that plays no part)."""
        return True

    def _say(self, text: str) -> None:
        if self.rank == 0:
            for line in text.splitlines():
                log.info(line)

    @abc.abstractmethod
    def train_step(self) -> dict[str, float]:
        """One step: its metrics, reduced over the ranks."""

    def validate(self) -> dict[str, float]:
        """Validation metrics (val/...); rank 0 may keep samples in `val_generations`."""
        return {}

    @abc.abstractmethod
    def checkpoint_engines(self) -> dict:
        """The engines a checkpoint holds, by name."""

    @abc.abstractmethod
    def state_dict(self) -> tuple[dict, dict]:
        """The trainer's own state to save: (global parts, rank 0's; this rank's parts by fixed key)."""

    @abc.abstractmethod
    def load_state(self, ckpt) -> str | None:
        """Restores the state of a loaded checkpoint (sets `step`); a line for the log, or None."""

    @abc.abstractmethod
    def exported_engine(self):
        """The engine `trainer.export_hf` and `export_lora_adapter` write."""

    def before_first_step(self, logger: MetricsLogger) -> None:
        """Work before the first step of the loop (validation before training)."""

    def start(self) -> None:
        """After the resume, before the first step (a batch source's start)."""

    def close(self) -> None:
        """After the loop, however it ended (worker pools)."""

    # ---- the loop -----------------------------------------------------------------------------------
    def save(self, pending: dict | None = None) -> None:
        """A checkpoint of this step; `pending`: its record, logged after the save (it carries the save's time)."""
        extra, rank_extra = self.state_dict()
        # this step's record: a run killed after the checkpoint is complete but before the line reached
        # metrics.jsonl logs it when it resumes
        extra["step_record"] = pending
        if "jsonl" not in self.cfg.trainer.logger:  # no metrics.jsonl: the steps logged so far, for the summary
            extra["records"] = list(self.records) + ([pending] if pending else [])  # of a resumed run (rank 0's)
        record = {"trainer": self.name, "total_steps": self.cfg.trainer.total_steps,
                  "settings": self.recorded_settings()}
        path = self.checkpoints.save(self.step, self.checkpoint_engines(), extra, rank_extra, record)
        self._say(f"saved checkpoint {path}")

    def resume(self) -> None:
        """From `trainer.resume`'s checkpoint, if any."""
        resume, total = self.cfg.trainer.resume, self.cfg.trainer.total_steps
        if resume == "never":
            return
        engines = self.checkpoint_engines()
        ckpt = self.checkpoints.load_latest(engines) if resume == "auto" else self.checkpoints.load(resume, engines)
        if ckpt is None:
            self._say("resume=auto: no complete checkpoint yet, starting fresh")
            return
        note = self.load_state(ckpt)
        self._resumed_records = [r for r in ckpt.extra.get("records", []) if r["step"] <= self.step]
        if Path(ckpt.path).resolve().is_relative_to(Path(self.run_dir).resolve()):  # (this folder's step)
            self._checkpoint_record = ckpt.extra.get("step_record")
        if self.step > total:
            raise ValueError(f"checkpoint {ckpt.path} is at step {self.step}, past trainer.total_steps={total}: "
                             f"there is nothing to train; set trainer.total_steps above {self.step} to go on, or "
                             "start a fresh run in another folder")
        if note:
            self._say(note)
        before = ckpt.record.get("total_steps")
        if before is not None and before != total:  # (`Engine.load` follows this run's schedule)
            self._say(f"trainer.total_steps changed from {before} to {total}: the LR schedule is rebuilt from this "
                      f"run's settings, so from step {self.step} on the LR is a fresh {total}-step run's")
        self._say(f"resumed from {ckpt.path} at step {self.step}" + (
            f": the run is complete (trainer.total_steps={total}); raise it to train on" if self.step == total
            else ""))

    def fit(self) -> Path:
        t = self.cfg.trainer
        self.checkpoints.clean_stale()  # what a crash mid-save or mid-delete left
        self.resume()
        self.start()
        logger = MetricsLogger(self.run_dir, t.logger, t.total_steps, self.step, t.project_name, t.experiment_name,
                               config_to_dict(self.cfg))
        self.records = logger.records
        if not self.records:  # a resumed run without metrics.jsonl: the steps before the checkpoint
            self.records.extend(self._resumed_records)
        last = self._checkpoint_record
        if last is not None and last["step"] == self.step and not any(r["step"] == self.step for r in self.records):
            logger.log(self.step, {k: v for k, v in last.items() if k != "step"}, advance=False)
        try:
            self.before_first_step(logger)
            while self.step < t.total_steps:
                metrics = self.train_step()
                self.step += 1
                end = self.step == t.total_steps
                if self.val_set is not None and t.val_freq and (self.step % t.val_freq == 0 or end):
                    t0 = time.perf_counter()
                    metrics.update(self.validate())
                    metrics["timing/testing_s"] = time.perf_counter() - t0
                    logger.log_generations(self.step, self.val_generations)
                if t.save_freq and (self.step % t.save_freq == 0 or end):
                    t0 = time.perf_counter()
                    self.save(pending={"step": self.step, **metrics})  # logged after, with the save's time
                    metrics["timing/save_checkpoint_s"] = time.perf_counter() - t0
                logger.log(self.step, with_verl_names(metrics, self.step) if t.verl_metric_names else metrics)
        finally:
            logger.close()
            self.close()
        self.export()
        return self.run_dir

    def export(self) -> None:
        """The trained model as a Hugging Face folder (`trainer.export_hf`), its adapters as a peft folder
        (`trainer.export_lora_adapter`)."""
        engine = self.exported_engine()
        if self.cfg.trainer.export_hf:
            path = engine.save_hf(self.run_dir / "hf_model", self.tokenizer)
            self._say(f"wrote the trained model as a Hugging Face model folder: {path}")
        if self.cfg.trainer.export_lora_adapter:
            path = engine.save_lora_adapter(self.run_dir / "lora_adapter")
            self._say(f"wrote the trained adapters as a peft adapter folder: {path}")

    def write_results(self) -> str:
        """Rank 0: summary.json (and the curve) of the steps logged; a sentence saying what was written."""
        return write_results(self.run_dir, self.records, self.cfg.trainer.total_steps)
