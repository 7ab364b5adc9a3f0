"""The loop the offline trainers share (`shardrl sft`, `dpo`, `kto`, `rm`): rows from files, no rollout.

    rows (this rank's share of data.batch_size) -> collate -> [forward-only passes: a reference's log-probs]
    -> engine.train_batch(loss_fn, group_size) -> metrics over the dp ranks -> checkpoint every k steps
    -> validation every k steps -> HF export at the end

A step is one optimizer step; the loop around it (resume, validation, checkpoints, logging, export) is
`trainer.base.Trainer.fit`, the RL trainer's. The parts are the RL trainer's: the engine on the run's `ParallelDims`, the loader
(`data.PromptLoader` over tokenized rows), the run folder and its lock, the loggers, and checkpoints (DCP,
resumable at another world size, the loader's position global). A trainer says how its rows load and collate,
its loss, and its validation numbers; `group_size` rows stay in one micro-batch (2 for a preference pair).
Ctrl-C, a bad config and a failed rank behave as in `shardrl train`.
"""

from __future__ import annotations

import abc
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.batch import Batch
from shardrl.data.chat import collate_pairs, load_preference_dataset
from shardrl.data.prompts import PromptLoader
from shardrl.distributed import ParallelDims
from shardrl.engine import build_engine
from shardrl.engine.model import load_hf_config
from shardrl.metrics import Sum, reduce_metrics
from shardrl.models.config import check_context
from shardrl.models.vision import is_vision_language, refuse_vision_language
from shardrl.plan.plan import Plan
from shardrl.rollout.build import the_device
from shardrl.tokenizer import load_tokenizer
from shardrl.trainer.base import Trainer
from shardrl.trainer.datasets import model_processor
from shardrl.trainer.roles import ModelPath, build_reference, check_vocabularies
from shardrl.trainer.run_folder import claim_run_dir
from shardrl.trainer.state import resolve_total_epochs

log = logging.getLogger(__name__)


class OfflineTrainer(Trainer):
    def __init__(self, cfg, run_dir: Path, plan=None):
        super().__init__(cfg, run_dir, plan)
        cfg = self.cfg
        self.device = the_device()
        self.tokenizer = load_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id
        d = cfg.data
        for line in cfg.ignored_settings():
            if self.rank == 0:
                log.warning(line)
        if not d.train_files:
            raise ValueError("data.train_files is empty; give the files to train on (jsonl, json or parquet), "
                             "e.g. data.train_files=[rows.jsonl]")
        model_config = load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code,
                                      "seq_cls" if self.head == "score" else "causal_lm", new_head_ok=True,
                                      override=cfg.model.override_config)
        self.processor = self.image_processor(model_config)
        self.train_set = self.load_rows(d.train_files)  # the cheap checks before any model loads
        self.val_set = self.load_rows(d.val_files) if d.val_files else None
        longest = max(len(item[ids]) for dataset in filter(None, (self.train_set, self.val_set))
                      for item in dataset.items for ids in ("input_ids", "chosen_ids", "rejected_ids") if ids in item)
        check_context(model_config, longest, "the longest sequence of the data",
                      f"model.path={cfg.model.path!r}" if cfg.model.path else "model.tiny",
                      f"lower data.max_length={d.max_length} with data.truncation=drop or right")
        check_vocabularies(cfg, self.model_paths(), len(self.tokenizer))
        if cfg.trainer.total_epochs is not None:  # before the LR schedule reads total_steps
            self._say(resolve_total_epochs(cfg.trainer, len(self.train_set), d.batch_size))
        self.parallel_dims = ParallelDims()
        self.mesh = self.parallel_dims.for_engine(cfg.engine)
        claim_run_dir(cfg, run_dir)  # the run can start: its folder is made and locked only now
        self.engine = build_engine(cfg.model, cfg.engine, cfg.optim, head=self.head,
                                   total_steps=cfg.trainer.total_steps, mesh=self.mesh)
        self.build_more()
        self.loader = PromptLoader(self.train_set, d.batch_size, d.shuffle, d.seed, dp_rank=self.mesh.dp_rank,
                                   dp_size=self.mesh.dp_size)
        self.step = 0

    @classmethod
    def build_plan(cls, cfg, nnodes: int, nproc_per_node: int) -> Plan:
        return Plan.for_offline(cfg, cls.name, nnodes, nproc_per_node)

    def image_processor(self, model_config):
        """A vision-language model's processor (None for a text model), for a trainer that `reads_images`; the
        others refuse the model by name."""
        if not is_vision_language(model_config):
            return None
        if not self.reads_images:
            refuse_vision_language(model_config, f"shardrl {self.name}", "offline")
        return model_processor(self.cfg.model, self.tokenizer)  # (load_tokenizer has found a folder)

    # ---- what a trainer says ------------------------------------------------------------------------
    reads_images = False
    """Whether the trainer reads a vision-language model's image rows (`shardrl sft`); the others refuse one."""

    @abc.abstractmethod
    def load_rows(self, files: list[str]):
        """The tokenized rows of `files` (a `data.chat.ChatDataset`)."""

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

    def build_reference(self, ref_model_path: str | None):
        """The reference policy, forward-only on the policy's layout: `ref_model_path`'s model, or (None) the
        starting policy: the base with its adapters off under LoRA, else a second copy of model.path."""
        return build_reference(self.cfg.model, self.cfg.engine, self.mesh, ref_model_path, actor=self.engine)

    def model_paths(self) -> list[ModelPath]:
        """The models the run loads (`build_more`'s too), checked before any loads."""
        task = "seq_cls" if self.head == "score" else "causal_lm"
        return [ModelPath("model.path", self.cfg.model.path, self.cfg.model.tiny, task, new_head_ok=True)]

    # ---- the loop -----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.before_update(self.collate(next(self.loader)))
        with self.engine.training():
            metrics = self.engine.train_batch(batch, self.loss_fn(), group_size=self.group_size)
        seconds = time.perf_counter() - t0
        tokens = reduce_metrics({"t": Sum(float(batch["attention_mask"].sum()))}, self.mesh.dp_group,
                                same_keys=True)["t"]
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

    def checkpoint_engines(self) -> dict:
        return {"model": self.engine}

    def state_dict(self) -> tuple[dict, dict]:
        return {"step": self.step, "loader": self.loader.state_dict()}, {}

    def load_state(self, ckpt) -> None:
        self.step = int(ckpt.extra["step"])
        if self.step <= self.cfg.trainer.total_steps:  # (past it: `resume` says so)
            self.loader.load_state_dict(ckpt.extra["loader"])

    def exported_engine(self):
        return self.engine


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
