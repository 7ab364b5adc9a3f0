"""What every training command's config shares: `TrainerConfig` (run length, checkpoints, logging, launch),
and `CommandConfig`, the base of each command's top config (`Config`, `SFTConfig`, `DPOConfig`, `RMConfig`):
names other frameworks give our keys, the settings nothing reads, and the hint for another command's file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.checks import check_command, check_trainer
from shardrl.config.engine import EngineConfig, LoRAConfig, OptimConfig
from shardrl.config.load import require

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab", "trackio"]


@dataclass
class TrainerConfig:
    total_steps: int | None = 20
    """Training steps (one rollout batch and its updates each); null with total_epochs."""
    total_epochs: int | None = None
    """Passes over the training prompts: the run stops after total_epochs x the steps of one epoch (prompts //
    data.train_batch_size; an epoch's last, short batch is dropped), or at total_steps if that is set too and
    comes first (verl's rule)."""
    output_dir: str | None = None
    """Run folder (config, metrics, checkpoints); None is ./outputs/<experiment_name>/<timestamp>, or with
    resume=auto the newest such folder that has checkpoints."""
    save_freq: int = 0
    """Checkpoint every this many steps; 0 never."""
    export_hf: bool = False
    """At the end of training, write the actor as a Hugging Face model folder, `<run_dir>/hf_model` (weights in
    `model.dtype`, config, tokenizer): what `from_pretrained`, another run's `model.path` or an evaluation loads."""
    export_lora_adapter: bool = False
    """With model.lora: at the end of training, also write the adapters as a peft adapter folder,
    `<run_dir>/lora_adapter`: `AutoPeftModelForCausalLM.from_pretrained(folder)` loads it (its config names the
    base's absolute path), as does `PeftModel.from_pretrained(base, folder)`; export_hf writes the merged model."""
    keep_last: int = 2
    """Checkpoints kept on disk; 0 keeps all."""
    resume: Literal["auto", "never"] | str = "never"
    """Where to start: "auto" (latest checkpoint in output_dir, if any), "never" (fresh), or a checkpoint path."""
    val_freq: int = 0
    """Validate every this many steps; 0 never."""
    val_before_train: bool = False
    """Validate once before the first step (logged as step 0) when data.val_files is given; a resumed run does not."""
    log_val_generations: int = 3
    """Sample generations (prompt, response, reward, ground truth) shown per validation, on the console
    and in `<run_dir>/generations.jsonl` (one line each, with the step); rank 0's first ones. 0 = off."""
    logger: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: `console` (a progress bar), `jsonl` (`<run_dir>/metrics.jsonl`), and the trackers, each an
    extra (`pip install 'shardrl[mlflow]'`): `tensorboard` (`<run_dir>/tensorboard`), `wandb`, `mlflow`
    (`MLFLOW_TRACKING_URI`), `swanlab` (`SWANLAB_MODE`; its log in `<run_dir>/swanlog`) and `trackio` (`TRACKIO_DIR`);
    `shardrl.trainer.trackers` says where each writes."""
    verl_metric_names: bool = False
    """Log each step's metrics under verl's names too (`critic/score/mean`, `response_length/mean`,
    `timing_s/gen`, `timing_per_token_ms/*`, `val-core/<data_source>/reward/mean@n`, ...; `shardrl.compat.verl.metric_names`),
    so that a verl dashboard reads the run; `shardrl train --verl` turns it on."""
    project_name: str = "shardrl"
    """Project name for loggers that group runs."""
    experiment_name: str = "run"
    """Name of this run in the loggers."""
    nnodes: int = 1
    """Nodes the run spans (torchrun --nnodes)."""
    nproc_per_node: int = 1
    """Processes (GPUs) per node (torchrun --nproc-per-node)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run; "auto" picks CUDA when present."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "total_steps", self.total_steps is None or self.total_steps >= 1, "must be >= 1")
        require(self, prefix, "total_epochs", self.total_epochs is None or self.total_epochs >= 1,
                "must be >= 1 or null")
        require(self, prefix, "save_freq", self.save_freq >= 0, "must be >= 0 (0 = never)")
        require(self, prefix, "keep_last", self.keep_last >= 0, "must be >= 0 (0 = keep all)")
        require(self, prefix, "resume", bool(self.resume), 'must be "auto", "never" or a checkpoint path')
        require(self, prefix, "resume",
                self.resume in ("auto", "never") or self.resume.lower() not in ("auto", "never"),
                f'is read as a checkpoint path; did you mean "{self.resume.lower()}"? (the values are lower case)')
        require(self, prefix, "val_freq", self.val_freq >= 0, "must be >= 0 (0 = never)")
        require(self, prefix, "log_val_generations", self.log_val_generations >= 0, "must be >= 0 (0 = off)")
        require(self, prefix, "nnodes", self.nnodes >= 1, "must be >= 1")
        require(self, prefix, "nproc_per_node", self.nproc_per_node >= 1, "must be >= 1")
        check_trainer(self, prefix)


KEY_ALIASES = {
    "learning_rate": "lr", "max_grad_norm": "clip_grad", "grad_clip": "clip_grad", "clip_grad_norm": "clip_grad",
    "adam_epsilon": "eps", "epsilon": "eps", "adam_betas": "betas", "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule", "scheduler": "lr_schedule", "num_warmup_steps": "warmup_steps",
    "lr_warmup_steps": "warmup_steps", "lr_warmup_steps_ratio": "warmup_ratio", "max_steps": "total_steps",
    "total_training_steps": "total_steps", "num_train_epochs": "total_epochs", "epochs": "total_epochs",
    "save_steps": "save_freq", "eval_steps": "val_freq", "test_freq": "val_freq", "save_total_limit": "keep_last",
    "per_device_train_batch_size": "micro_batch_size_per_gpu",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size_per_gpu", "r": "rank", "lora_rank": "rank",
    "lora_alpha": "alpha", "lora_dropout": "dropout", "max_seq_length": "max_length", "max_seq_len": "max_length",
    "model_name_or_path": "path", "enable_gradient_checkpointing": "gradient_checkpointing",
}
"""Names other frameworks (Hugging Face's Trainer, TRL, peft, verl) give a key of ours, by its last part: an unknown
key's error suggests ours in the same section (`actor.optim.learning_rate` -> `actor.optim.lr`), where spelling
alone would point elsewhere (`clip_grad`)."""


class CommandConfig:
    """What the config of each training command (`shardrl.config.registry.TRAINERS`) shares."""

    key_aliases = KEY_ALIASES
    validates_before_train = False
    """Whether trainer.val_before_train is read (`shardrl train` only)."""

    def ignored_settings(self) -> list[str]:
        """Settings this config gives that nothing will read, each as a line to warn with (a run goes on)."""
        lines = []
        validates = self.trainer.val_freq or (self.trainer.val_before_train and self.validates_before_train)
        has_val = self.data.has_val() if hasattr(self.data, "has_val") else bool(self.data.val_files)
        env = getattr(getattr(self, "rollout", None), "env", None)  # (its eval set, if any: not a setting given)
        if has_val and not validates:
            given = (f"data.val_files={self.data.val_files}" if self.data.val_files
                     else f"data.reasoning_gym.val_size={self.data.reasoning_gym.val_size}")
            lines.append(f"{given} is never read: trainer.val_freq=0 turns validation "
                         "off (set trainer.val_freq to validate every that many steps)")
        if validates and not has_val and not env:
            given = (f"trainer.val_freq={self.trainer.val_freq}" if self.trainer.val_freq
                     else "trainer.val_before_train=true")
            lines.append(f"{given} is never used: data.val_files is empty, so there is nothing to validate on (give "
                         "data.val_files=[...] to validate)")
        lora, off = self.model.lora, LoRAConfig()
        if not lora.rank:
            given = [f"model.lora.{k}" for k in ("alpha", "dropout", "target_modules", "use_rslora")
                     if getattr(lora, k) != getattr(off, k)]
            if given:
                lines.append(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but model.lora.rank=0: "
                             "LoRA is off and every weight trains (set model.lora.rank to train adapters)")
        default_budget = EngineConfig().max_token_len_per_gpu
        seen = set()
        for key, engine in self.engines():
            setting = (engine.use_dynamic_bsz, engine.max_token_len_per_gpu)
            if engine.use_dynamic_bsz or engine.max_token_len_per_gpu == default_budget or setting in seen:
                continue  # (a role that took the actor's engine settings is the actor's line)
            seen.add(setting)
            lines.append(f"{key}.max_token_len_per_gpu={engine.max_token_len_per_gpu} is never read: it is the token "
                         f"budget of dynamic micro-batches, and {key}.use_dynamic_bsz=false cuts micro-batches by "
                         f"{key}.micro_batch_size_per_gpu={engine.micro_batch_size_per_gpu} samples instead (set "
                         f"{key}.use_dynamic_bsz=true to cut them by tokens)")
        steps = self.trainer.total_steps
        for key, optim in self.optims():
            # (a warning, not an error: a schedule cut short on purpose is a choice; LR 0 without a word is not)
            if optim.lr_schedule == "cosine" and not optim.min_lr_ratio and steps and optim.total_steps \
                    and optim.total_steps < steps:
                lines.append(f"{key}.total_steps={optim.total_steps} ends the cosine schedule before the run's "
                             f"trainer.total_steps={steps} (each step makes one optimizer step or more): the steps "
                             f"after it train at LR 0 ({key}.min_lr_ratio=0); leave {key}.total_steps unset to "
                             f"span the run, or set {key}.min_lr_ratio for a floor")
        return lines

    def engines(self) -> list[tuple[str, EngineConfig]]:
        """Each engine section of this config and its key."""
        return [("engine", self.engine)]

    def optims(self) -> list[tuple[str, OptimConfig]]:
        """Each optimizer section this run steps, and its key."""
        return [("optim", self.optim)]


def epochs_decide(trainer: TrainerConfig, given: set[str]) -> None:
    """With trainer.total_epochs and no total_steps given, the epochs alone decide the run's length (total_steps'
    default does not cap them)."""
    if trainer.total_epochs is not None and "trainer.total_steps" not in given:
        trainer.total_steps = None


class OfflineCommandConfig(CommandConfig):
    """What an offline trainer's config (`shardrl sft|dpo|rm`) shares: one engine, data from files."""

    def inherit(self, given: set[str]) -> None:
        epochs_decide(self.trainer, given)

    def validate(self, prefix: str) -> None:
        check_command(self, prefix, {"engine": self.engine})
