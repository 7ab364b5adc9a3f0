"""Supervised fine-tuning on the RL trainer's engine and run folder: `shardrl sft CONFIG [key=value ...]`.

    conversations (this rank's share of data.batch_size) -> engine.train_batch (packed, dynamic micro-batches;
    the loss is the token mean of -log p over the assistant's tokens of the whole global batch) -> metrics over
    the dp ranks -> checkpoint every k steps -> validation loss every k steps -> HF export at the end

A step is one optimizer step. The parts are the RL trainer's: the engine (`engine.build_engine` on the run's
`ParallelDims`), the loader (`data.PromptLoader` over conversations), the run folder and its lock, the loggers,
and checkpoints (DCP, resumable at another world size, each dp rank's loader position global). Left out: sequence
packing across conversations (the engine packs them per micro-batch), loss weights per turn, and LoRA.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.algos.aggregate import agg_loss, masked_metric
from shardrl.chat_data import collate_chats, load_chat_dataset
from shardrl.checkpoint import CheckpointManager
from shardrl.config import SFTConfig, config_to_dict, load_config
from shardrl.data import PromptLoader
from shardrl.distributed import ParallelDims, init_distributed
from shardrl.engine import build_engine
from shardrl.metrics import Sum, SumCount, reduce_metrics
from shardrl.tokenizer import load_tokenizer
from shardrl.trainer.generation import the_device
from shardrl.trainer.logger import MetricsLogger, check_sinks_installed
from shardrl.trainer.run_folder import claim_run_dir, prepare_run_dir, release_run_dir, write_summary

log = logging.getLogger(__name__)


def sft_loss(outputs, mb, num_tokens, num_seqs):
    """The micro-batch's share of the global token mean of -log p over the loss tokens."""
    mask = mb["loss_mask"]
    return agg_loss(-outputs["log_probs"], mask, "token-mean", num_tokens), {}


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, run_dir: Path):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, dist.get_rank()
        self.device = the_device()
        self.tokenizer = load_tokenizer(cfg)
        d = cfg.data

        def load(files):
            return load_chat_dataset(files, self.tokenizer, d.max_length, d.truncation, d.skip_bad_rows,
                                     d.messages_key, d.prompt_key, d.response_key)
        self.train_set = load(d.train_files)  # the cheap checks before any model loads
        self.val_set = load(d.val_files) if d.val_files else None
        self.mesh = ParallelDims().for_engine(cfg.engine)
        if d.batch_size % self.mesh.dp_size:
            raise ValueError(f"data.batch_size={d.batch_size} does not divide over {self.mesh.dp_size} data-parallel "
                             f"ranks; use a multiple of {self.mesh.dp_size}")
        claim_run_dir(cfg, run_dir)  # the run can start: its folder is made and locked only now
        self.engine = build_engine(cfg.model, cfg.engine, cfg.optim, total_steps=cfg.trainer.total_steps,
                                   mesh=self.mesh)
        self.loader = PromptLoader(self.train_set, d.batch_size, d.shuffle, d.seed, dp_rank=self.mesh.dp_rank,
                                   dp_size=self.mesh.dp_size)
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.trainer.keep_last)
        self.step, self.records = 0, []
        self.pad_id = self.tokenizer.pad_token_id

    def _say(self, text: str) -> None:
        if self.rank == 0:
            log.info(text)

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = collate_chats(next(self.loader), self.pad_id)
        with self.engine.training():
            metrics = self.engine.train_batch(batch, sft_loss)
        seconds = time.perf_counter() - t0
        tokens = reduce_metrics({"t": Sum(float(batch["attention_mask"].sum()))}, self.mesh.dp_group)["t"]
        return {f"sft/{k}" if "/" not in k else k: v for k, v in metrics.items()} | {
            "timing/step_s": seconds, "perf/total_num_tokens": tokens,
            "perf/tokens_per_s_per_gpu": tokens / seconds / dist.get_world_size()}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """The token mean of -log p over every validation conversation's loss tokens (all ranks)."""
        dp, r = self.mesh.dp_size, self.mesh.dp_rank
        items = [self.val_set[i] for i in range(r, len(self.val_set), dp)] or [self.val_set[0]]  # every rank runs
        real = len(range(r, len(self.val_set), dp))
        out = self.engine.infer_batch(collate_chats(items, self.pad_id))
        mask = collate_chats(items, self.pad_id)["loss_mask"][:real].float()
        total, count = masked_metric(-out["log_probs"][:real].cpu(), mask)
        return reduce_metrics({"val/loss": SumCount(float(total), float(count))}, self.mesh.dp_group)

    def save(self) -> None:
        extra = {"step": self.step, "loader": self.loader.state_dict(), "records": list(self.records)}
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
        self._resumed = []
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
                if self.val_set is not None and t.val_freq and (self.step % t.val_freq == 0 or self.step == t.total_steps):
                    metrics.update(self.validate())
                logger.log(self.step, metrics)
                if t.save_freq and (self.step % t.save_freq == 0 or self.step == t.total_steps):
                    self.save()
        finally:
            logger.close()
        if t.export_hf:
            self._say(f"wrote the model as a Hugging Face folder: {self.engine.save_hf(self.run_dir / 'hf_model', self.tokenizer)}")
        return self.run_dir


def run_sft(config: str | None, overrides: list[str]) -> Path:
    """`shardrl sft` on this rank (the process group from torchrun's environment, or one process)."""
    cfg = load_config(config, overrides, cls=SFTConfig)
    check_sinks_installed(cfg.trainer.logger)
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    owns_group = not dist.is_initialized()
    init_distributed()
    try:
        run_dir = prepare_run_dir(cfg)
        failed = True
        try:
            trainer = SFTTrainer(cfg, run_dir)
            trainer.fit()
            if dist.get_rank() == 0:
                write_summary(run_dir, trainer.records)
                log.info("run folder %s; %d of %d steps", run_dir, trainer.step, cfg.trainer.total_steps)
            failed = False
        finally:
            release_run_dir(run_dir, failed)
        return run_dir
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def sft_main(args) -> int:
    """The `shardrl sft` subcommand: launches torchrun itself with --nproc-per-node > 1."""
    from shardrl.trainer.main import _failed_ranks_status, _setup_logging

    _setup_logging()
    nproc = args.nproc_per_node or 1
    if nproc > 1 and "RANK" not in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run as torchrun

        load_config(args.config, args.overrides, cls=SFTConfig)  # a bad config: one error before any process
        argv = [f"--nproc-per-node={nproc}", "--nnodes=1", "--standalone", "-m", "shardrl.trainer.sft"]
        try:
            torchrun(parse_args(argv + ([args.config] if args.config else []) + list(args.overrides)))
        except ChildFailedError as e:
            return _failed_ranks_status(e)
        return 0
    run_sft(args.config, list(args.overrides))
    return 0


def _rank_main(argv: list[str]) -> int:
    """A rank torchrun started: a user's mistake is one `error:` line from rank 0 and exit status 2."""
    from shardrl.trainer.main import _die_with_launcher, _setup_logging

    _die_with_launcher()
    _setup_logging()
    try:
        run_sft(argv[0] if argv and "=" not in argv[0] else None, [a for a in argv if "=" in a])
    except ValueError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # torchrun ... -m shardrl.trainer.sft CONFIG key=value ...
    sys.exit(_rank_main(sys.argv[1:]))
