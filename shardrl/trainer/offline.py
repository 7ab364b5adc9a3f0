"""The loop the offline trainers share (`shardrl sft`, `shardrl dpo`, `shardrl rm`): rows from files, no rollout.

    rows (this rank's share of data.batch_size) -> collate -> [forward-only passes: a reference's log-probs]
    -> engine.train_batch(loss_fn, group_size) -> metrics over the dp ranks -> checkpoint every k steps
    -> validation every k steps -> HF export at the end

A step is one optimizer step. The parts are the RL trainer's: the engine on the run's `ParallelDims`, the loader
(`data.PromptLoader` over tokenized rows), the run folder and its lock, the loggers, and checkpoints (DCP,
resumable at another world size, the loader's position global). A trainer says how its rows load and collate,
its loss, and its validation numbers; `group_size` rows stay in one micro-batch (2 for a preference pair).
Ctrl-C, a bad config and a failed rank behave as in `shardrl train`.
"""

from __future__ import annotations

import abc
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.batch import Batch
from shardrl.data.chat import collate_pairs, load_preference_dataset
from shardrl.trainer.checkpoint import CheckpointManager
from shardrl.config.schema import config_to_dict, load_config
from shardrl.data.prompts import PromptLoader
from shardrl.distributed import ParallelDims, init_distributed
from shardrl.engine import build_engine
from shardrl.engine.model import load_hf_config
from shardrl.plan.layout import derive_offline_layout
from shardrl.metrics import Sum, reduce_metrics
from shardrl.models.config import check_context
from shardrl.tokenizer import load_tokenizer
from shardrl.rollout.build import the_device
from shardrl.trainer.logger import MetricsLogger, check_sinks_installed
from shardrl.trainer.roles import ModelPath, check_vocabularies
from shardrl.trainer.state import resolve_total_epochs
from shardrl.trainer.run_folder import claim_run_dir, prepare_run_dir, release_run_dir, write_summary

log = logging.getLogger(__name__)


class OfflineTrainer(abc.ABC):
    name = ""
    """The subcommand and the prefix of the step's engine metrics (`sft/loss`)."""
    module = ""
    """The module torchrun starts on each rank (`python -m ...`)."""
    config_cls: type = object
    group_size = 1
    """Rows per data item, kept in one micro-batch."""
    head = "lm"

    def __init__(self, cfg, run_dir: Path):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, dist.get_rank()
        self.device = the_device()
        self.tokenizer = load_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id
        d = cfg.data
        world = dist.get_world_size()  # the layout as torchrun made it, checked as `shardrl plan --trainer` does
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.layout = derive_offline_layout(cfg, self.name, world // per_node, per_node)
        for line in cfg.ignored_settings():
            if self.rank == 0:
                log.warning(line)
        if not d.train_files:
            raise ValueError("data.train_files is empty; give the files to train on (jsonl, json or parquet), "
                             "e.g. data.train_files=[rows.jsonl]")
        self.train_set = self.load_rows(d.train_files)  # the cheap checks before any model loads
        self.val_set = self.load_rows(d.val_files) if d.val_files else None
        longest = max(len(item[ids]) for dataset in filter(None, (self.train_set, self.val_set))
                      for item in dataset.items for ids in ("input_ids", "chosen_ids", "rejected_ids") if ids in item)
        model_config = load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code,
                                      "seq_cls" if self.head == "score" else "causal_lm", new_head_ok=True)
        check_context(model_config, longest, "the longest sequence of the data",
                      f"model.path={cfg.model.path!r}" if cfg.model.path else "model.tiny",
                      f"lower data.max_length={d.max_length} with data.truncation=drop or right")
        check_vocabularies(cfg, self.model_paths(), len(self.tokenizer))
        if cfg.trainer.total_epochs is not None:  # before the LR schedule reads total_steps
            line = resolve_total_epochs(cfg.trainer, len(self.train_set), d.batch_size)
            if self.rank == 0:
                log.info(line)
        self.parallel_dims = ParallelDims()
        self.mesh = self.parallel_dims.for_engine(cfg.engine)
        claim_run_dir(cfg, run_dir)  # the run can start: its folder is made and locked only now
        self.engine = build_engine(cfg.model, cfg.engine, cfg.optim, head=self.head,
                                   total_steps=cfg.trainer.total_steps, mesh=self.mesh)
        self.build_more()
        self.loader = PromptLoader(self.train_set, d.batch_size, d.shuffle, d.seed, dp_rank=self.mesh.dp_rank,
                                   dp_size=self.mesh.dp_size)
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.trainer.keep_last)
        self.step, self.records, self._resumed = 0, [], []

    # ---- what a trainer says ------------------------------------------------------------------------
    @abc.abstractmethod
    def load_rows(self, files: list[str]):
        """The tokenized rows of `files` (a `chat_data.ChatDataset`)."""

    @abc.abstractmethod
    def collate(self, items: list[dict]) -> Batch:
        """A batch of rows, `group_size` consecutive rows to an item."""

    @abc.abstractmethod
    def loss_fn(self):
        """The engine's loss function (`Engine.train_batch`)."""

    def before_update(self, batch: Batch) -> Batch:
        """Forward-only passes the loss needs (a reference's log-probs), added to `batch`."""
        return batch

    @abc.abstractmethod
    def evaluate(self, batch: Batch, real_rows: int) -> dict:
        """Validation metrics (`shardrl.metrics` values) of `batch`, of which the first `real_rows` rows count."""

    def build_more(self) -> None:
        """Engines beyond the trained one (a reference model)."""

    def model_paths(self) -> list[ModelPath]:
        """The models the run loads (`build_more`'s too), checked before any loads."""
        task = "seq_cls" if self.head == "score" else "causal_lm"
        return [ModelPath("model.path", self.cfg.model.path, self.cfg.model.tiny, task, new_head_ok=True)]

    # ---- the loop -----------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.rank == 0:
            log.info(text)

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.before_update(self.collate(next(self.loader)))
        with self.engine.training():
            metrics = self.engine.train_batch(batch, self.loss_fn(), group_size=self.group_size)
        seconds = time.perf_counter() - t0
        tokens = reduce_metrics({"t": Sum(float(batch["attention_mask"].sum()))}, self.mesh.dp_group)["t"]
        return {f"{self.name}/{k}" if "/" not in k else k: v for k, v in metrics.items()} | {
            "timing/step_s": seconds, "perf/total_num_tokens": tokens,
            "perf/tokens_per_s_per_gpu": tokens / seconds / dist.get_world_size()}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """`evaluate` over every validation row, each dp rank its share (every rank runs, even with none)."""
        dp, r = self.mesh.dp_size, self.mesh.dp_rank
        mine = range(r, len(self.val_set), dp)
        items = [self.val_set[i] for i in mine] or [self.val_set[0]]
        metrics = self.evaluate(self.before_update(self.collate(items)), len(mine) * self.group_size)
        return reduce_metrics({f"val/{k}": v for k, v in metrics.items()}, self.mesh.dp_group)

    def save(self) -> None:
        extra = {"step": self.step, "loader": self.loader.state_dict(), "records": list(self.records),
                 "trainer": self.name}
        self._say(f"saved checkpoint {self.checkpoints.save(self.step, {'model': self.engine}, extra, {})}")

    def maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        if resume == "never":
            return
        ckpt = (self.checkpoints.load_latest({"model": self.engine}) if resume == "auto"
                else self.checkpoints.load(resume, {"model": self.engine}))
        if ckpt is None:
            self._say("resume=auto: no complete checkpoint yet, starting fresh")
            return
        made_by = ckpt.extra.get("trainer", "sft")
        if made_by != self.name:
            raise ValueError(f"checkpoint {ckpt.path} was written by `shardrl {made_by}`, not `shardrl {self.name}`; "
                             "resume it with the trainer that wrote it, or start from its HF export")
        self.step = int(ckpt.extra["step"])
        if self.step > self.cfg.trainer.total_steps:
            raise ValueError(f"checkpoint {ckpt.path} is at step {self.step}, past trainer.total_steps="
                             f"{self.cfg.trainer.total_steps}; raise it to go on")
        self.loader.load_state_dict(ckpt.extra["loader"])
        self._resumed = [r for r in ckpt.extra.get("records", []) if r["step"] <= self.step]
        self._say(f"resumed from {ckpt.path} at step {self.step}")

    def fit(self) -> Path:
        t = self.cfg.trainer
        self.checkpoints.clean_stale()
        self.maybe_resume()
        logger = MetricsLogger(self.run_dir, t.logger, t.total_steps, self.step, t.project_name, t.experiment_name,
                               config_to_dict(self.cfg))
        self.records = logger.records
        if not self.records:
            self.records.extend(self._resumed)
        try:
            while self.step < t.total_steps:
                metrics = self.train_step()
                self.step += 1
                last = self.step == t.total_steps
                if self.val_set is not None and t.val_freq and (self.step % t.val_freq == 0 or last):
                    metrics.update(self.validate())
                logger.log(self.step, metrics)
                if t.save_freq and (self.step % t.save_freq == 0 or last):
                    self.save()
        finally:
            logger.close()
        if t.export_hf:
            path = self.engine.save_hf(self.run_dir / "hf_model", self.tokenizer)
            self._say(f"wrote the model as a Hugging Face folder: {path}")
        if t.export_lora_adapter:
            path = self.engine.save_lora_adapter(self.run_dir / "lora_adapter")
            self._say(f"wrote the trained adapters as a peft adapter folder: {path}")
        return self.run_dir


class PairTrainer(OfflineTrainer):
    """An offline trainer on preference pairs (`shardrl dpo`, `shardrl rm`): rows of prompt/chosen/rejected,
    each a chosen and a rejected sequence kept in one micro-batch."""

    group_size = 2

    def load_rows(self, files):
        d = self.cfg.data
        return load_preference_dataset(files, self.tokenizer, d.max_length, d.truncation, d.skip_bad_rows,
                                       d.prompt_key, d.chosen_key, d.rejected_key)

    def collate(self, items):
        return collate_pairs(items, self.pad_id)


def run_offline(trainer_cls: type[OfflineTrainer], config: str | None, overrides: list[str]) -> Path:
    """One offline trainer on this rank (the process group from torchrun's environment, or one process)."""
    from shardrl.trainer.main import RunInterrupted, _was_interrupted

    cfg = load_config(config, overrides, cls=trainer_cls.config_cls)
    check_sinks_installed(cfg.trainer.logger)
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    owns_group = not dist.is_initialized()
    init_distributed()
    try:
        run_dir = prepare_run_dir(cfg)
        failed = True
        try:
            trainer = trainer_cls(cfg, run_dir)
            try:
                trainer.fit()
            except BaseException as e:  # Ctrl-C: rank 0 still writes the summary of the steps done
                if not _was_interrupted(e):
                    raise
                done = ""
                if dist.get_rank() == 0:
                    write_summary(run_dir, trainer.records)
                    done = f"{len(trainer.records)} of {cfg.trainer.total_steps} steps; summary {run_dir / 'summary.json'}"
                raise RunInterrupted(done) from None
            if dist.get_rank() == 0:
                write_summary(run_dir, trainer.records)
                log.info("run folder %s; %d of %d steps", run_dir, trainer.step, cfg.trainer.total_steps)
            failed = False
        finally:  # a run that failed before writing anything leaves no folder behind
            release_run_dir(run_dir, failed)
        return run_dir
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def offline_main(trainer_cls: type[OfflineTrainer], args) -> int:
    """`shardrl sft|dpo|rm`: launches torchrun itself with --nproc-per-node > 1; Ctrl-C is one line and 130."""
    from shardrl.trainer import main as m

    m._setup_logging()
    nproc = args.nproc_per_node or 1
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {nproc}: must be >= 1")
    if nproc > 1 and "RANK" not in os.environ:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run as torchrun

        cfg = load_config(args.config, args.overrides, cls=trainer_cls.config_cls)  # a bad config: one error first
        derive_offline_layout(cfg, trainer_cls.name, 1, nproc)  # so is a batch that does not divide
        m.warn_oversubscribed(nproc, cfg.trainer.device)
        argv = [f"--nproc-per-node={nproc}", "--nnodes=1", "--standalone", "-m", trainer_cls.module]
        for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
            logging.getLogger(name).addFilter(m._not_about_sigint)
        m._quiet_interrupted_finalizers()
        try:
            torchrun(parse_args(argv + ([args.config] if args.config else []) + list(args.overrides)))
        except ChildFailedError as e:
            return m._failed_ranks_status(e)
        except (SignalException, KeyboardInterrupt) as e:
            return m.launcher_interrupted_exit(e)
        return 0
    main_thread = threading.current_thread() is threading.main_thread()
    m.reset_stop_signal()
    previous = m.catch_stop_signals() if main_thread else {}
    try:
        run_offline(trainer_cls, args.config, list(args.overrides))
    except BaseException as e:
        if not m._was_interrupted(e):
            raise
        print(m._interrupted_line(e if isinstance(e, KeyboardInterrupt) else KeyboardInterrupt()), file=sys.stderr)
        return m.interrupted_exit()
    finally:
        m.restore_signals(previous)
    return 0


def rank_main(trainer_cls: type[OfflineTrainer], argv: list[str]) -> int:
    """A rank torchrun started: a user's mistake is one `error:` line from rank 0 and exit status 2."""
    from shardrl.trainer import main as m

    m._die_with_launcher()
    m._setup_logging()
    rank0 = int(os.environ.get("RANK", 0)) == 0
    m.catch_stop_signals()
    try:
        run_offline(trainer_cls, argv[0] if argv and "=" not in argv[0] else None, [a for a in argv if "=" in a])
    except BaseException as e:
        if m._was_interrupted(e):
            if rank0:
                print(m._interrupted_line(e if isinstance(e, KeyboardInterrupt) else KeyboardInterrupt()),
                      file=sys.stderr)
            return m.interrupted_exit()
        if isinstance(e, ValueError):
            if rank0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        if m._peer_gone(e):
            return 1
        raise
    finally:
        try:
            m.end_of_run_signals()
        except KeyboardInterrupt:  # (a SIGTERM landing just before it: the run is over, it only exits)
            pass
    return 0
