"""The offline trainers' configs: `SFTConfig` (`shardrl sft`), `DPOConfig` (`shardrl dpo`), `KTOConfig`
(`shardrl kto`) and `RMConfig` (`shardrl rm`), with their data (`OfflineDataConfig` and its kinds) and loss
settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.checks import check_reward_model_trainer
from shardrl.config.command import OfflineCommandConfig, TrainerConfig
from shardrl.config.engine import EngineConfig, ModelConfig, OptimConfig
from shardrl.config.images import ImageDataConfig
from shardrl.config.load import require
from shardrl.config.names import PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES, SMOOTHED_LOSSES

PreferenceLossName = Literal[tuple(PREFERENCE_LOSSES)]


@dataclass
class OfflineDataConfig:
    """The data of an offline trainer (`shardrl sft`, `dpo`, `rm`): rows from files, a fixed number a step."""

    train_files: list[str] = field(default_factory=list)
    """Files of rows (parquet / jsonl / json)."""
    val_files: list[str] = field(default_factory=list)
    """Files whose loss (and, for pairs, accuracy) is reported as val/* every trainer.val_freq steps."""
    max_length: int = 1024
    """Tokens of one sequence at most (prompt and completion; each of a pair's two)."""
    truncation: Literal["error", "drop", "right"] = "error"
    """A sequence over max_length: raise, drop the row, or cut it on the right."""
    skip_bad_rows: bool = False
    """Drop (and count) rows that cannot be trained on instead of raising."""
    batch_size: int = 32
    """Rows per optimizer step (global: conversations, or preference pairs); the engine cuts them into
    micro-batches."""
    shuffle: bool = True
    """Shuffle the rows each epoch."""
    seed: int = 0
    """Seed of the shuffle."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_length", self.max_length >= 2, "must be >= 2")
        require(self, prefix, "batch_size", self.batch_size >= 1, "must be >= 1 (rows)")


@dataclass
class SFTDataConfig(OfflineDataConfig, ImageDataConfig):
    messages_key: str = "messages"
    """Column holding a chat: a list of {role, content} messages; every assistant turn is trained on."""
    prompt_key: str = "prompt"
    """Without a messages column: the prompt (a string, or a list of messages), context only (its assistant turns
    are not trained on). A dotted name that is no column reads a field of a dict column (`extra_info.question`)."""
    response_key: str | None = None
    """Without a messages column: the assistant's reply, the only part trained on. None: `response`, or in a row
    without one `completion` (TRL's prompt-completion column); a name: that column only (a dotted name as
    prompt_key)."""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        self.validate_images(prefix)


@dataclass
class PreferenceDataConfig(OfflineDataConfig):
    prompt_key: str = "prompt"
    """The prompt (a string, or a list of messages); a row without it holds two whole conversations in chosen and
    rejected, and the prompt is the messages they share."""
    chosen_key: str = "chosen"
    """The preferred completion (a string, or a list of messages)."""
    rejected_key: str = "rejected"
    """The other completion."""


@dataclass
class SFTConfig(OfflineCommandConfig):
    """`shardrl sft`: supervised fine-tuning on the same engine, run folder and loggers as `shardrl train`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (and its tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching (dynamic by default: packed micro-batches of up to
    max_token_len_per_gpu tokens)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The optimizer and its schedule."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Conversations and batch size."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""


@dataclass
class DPOSettings:
    loss_type: PreferenceLossName = "sigmoid"
    """`shardrl.algos.preference.PREFERENCE_LOSSES`, TRL's names: sigmoid (DPO), ipo, hinge, robust, exo_pair,
    nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, sigmoid_norm, simpo (reference-free)."""
    beta: float = 0.1
    """The inverse temperature of the implicit reward (TRL's `beta`)."""
    label_smoothing: float = 0.0
    """The share of pairs assumed mislabelled: conservative DPO's eps for sigmoid and simpo (as TRL before 1.0 and
    its CPO trainer; TRL 1.x's sigmoid ignores it), rDPO's for robust, EXO's eps for exo_pair (> 0, e.g. 1e-3)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (TRL's `simpo_gamma`)."""
    rpo_alpha: float = 0.0
    """RPO: adds this times the NLL (a token mean of -log p) of the batch's chosen completions to the loss (TRL's
    `rpo_alpha`, in TRL 1.x loss_type=[..., "sft"] with this weight); 0: off."""
    ref_model_path: str | None = None
    """The reference policy's folder or hub id; None: model.path (the policy before training). Unused by simpo."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "beta", self.beta > 0, "must be > 0")
        require(self, prefix, "label_smoothing", 0 <= self.label_smoothing < 0.5, "must be in [0, 0.5)")
        require(self, prefix, "label_smoothing", self.loss_type != "exo_pair" or self.label_smoothing > 0,
                "must be > 0 with loss_type=exo_pair (EXO's eps; its paper suggests 1e-3)")
        require(self, prefix, "rpo_alpha", self.rpo_alpha >= 0, "must be >= 0 (0: no NLL term)")


@dataclass
class DPOConfig(OfflineCommandConfig):
    """`shardrl dpo`: offline preference training (DPO, IPO, SimPO) on prompt/chosen/rejected rows."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train (and its tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching of the policy and the reference (a pair's two sequences always
    share a micro-batch; micro_batch_size_per_gpu counts pairs)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """The optimizer and its schedule."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs and batch size (pairs)."""
    dpo: DPOSettings = field(default_factory=DPOSettings)
    """The loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""

    def ignored_settings(self) -> list[str]:
        lines = super().ignored_settings()
        s = self.dpo
        if s.ref_model_path and s.loss_type in REFERENCE_FREE_LOSSES:
            lines.append(f"dpo.ref_model_path={s.ref_model_path!r} is never read: dpo.loss_type={s.loss_type} is "
                         "reference-free (no reference model is loaded); drop it, or set dpo.loss_type=sigmoid "
                         "(or another loss with a reference) to train against it")
        if s.label_smoothing and s.loss_type not in SMOOTHED_LOSSES:
            lines.append(f"dpo.label_smoothing={s.label_smoothing} is never read: dpo.loss_type={s.loss_type} has no "
                         f"label smoothing (the losses with it: {', '.join(SMOOTHED_LOSSES)})")
        if s.simpo_gamma != DPOSettings.simpo_gamma and s.loss_type != "simpo":
            lines.append(f"dpo.simpo_gamma={s.simpo_gamma} is never read: it is SimPO's margin, and dpo.loss_type="
                         f"{s.loss_type} has none; drop it, or set dpo.loss_type=simpo")
        return lines


@dataclass
class RMSettings:
    center_rewards_coefficient: float = 0.0
    """Adds this times (r_chosen + r_rejected)^2 to each pair's loss, keeping rewards near zero (TRL's name)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "center_rewards_coefficient", self.center_rewards_coefficient >= 0, "must be >= 0")


@dataclass
class RMConfig(OfflineCommandConfig):
    """`shardrl rm`: a Bradley-Terry reward model (a scalar head on a causal LM) on prompt/chosen/rejected rows;
    its HF export (trainer.export_hf) is a sequence classifier that `reward.model_path` loads."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to start from: a causal LM (its LM head is replaced by a new scalar head) or a reward model."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching (a pair's two sequences share a micro-batch;
    micro_batch_size_per_gpu counts pairs)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The optimizer and its schedule."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs and batch size (pairs)."""
    rm: RMSettings = field(default_factory=RMSettings)
    """The loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""

    def validate(self, prefix: str) -> None:
        check_reward_model_trainer(self, prefix)


@dataclass
class UnpairedDataConfig(OfflineDataConfig):
    prompt_key: str = "prompt"
    """The prompt (a string, or a list of messages)."""
    completion_key: str = "completion"
    """The completion (a string, or a list of messages)."""
    label_key: str = "label"
    """true: the completion is desirable, false: undesirable (TRL's unpaired preference format)."""


@dataclass
class KTOSettings:
    beta: float = 0.1
    """The inverse temperature of the implicit reward (TRL's `beta`)."""
    desirable_weight: float = 1.0
    """The weight of a desirable row's loss (TRL's; raise it when desirable rows are fewer)."""
    undesirable_weight: float = 1.0
    """The weight of an undesirable row's loss (TRL's)."""
    ref_model_path: str | None = None
    """The reference policy's folder or hub id; None: model.path (the policy before training)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "beta", self.beta > 0, "must be > 0")
        for name in ("desirable_weight", "undesirable_weight"):
            require(self, prefix, name, getattr(self, name) >= 0, "must be >= 0")


@dataclass
class KTOConfig(OfflineCommandConfig):
    """`shardrl kto`: KTO (Ethayarajh et al. 2024) on unpaired rows: prompt, completion, and a desirable label."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train (and its tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching of the policy and the reference."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """The optimizer and its schedule."""
    data: UnpairedDataConfig = field(default_factory=UnpairedDataConfig)
    """Unpaired rows and batch size (rows; at least 2 a rank, for the KL estimate's mismatched pairs)."""
    kto: KTOSettings = field(default_factory=KTOSettings)
    """The loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""
