"""`shardrl train`'s config, `Config`: the RL roles, the rollout, the prompts (`DataConfig`), the reward
(`RewardConfig`, with `OverlongBufferConfig`), the algorithm and the run."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.algorithm import (ActorConfig, AlgorithmConfig, AsyncConfig, CriticConfig, RefConfig,
                                      TeacherConfig)
from shardrl.config.checks import check_reward, check_rl
from shardrl.config.command import CommandConfig, TrainerConfig, epochs_decide
from shardrl.config.engine import EngineConfig, ModelConfig, OptimConfig
from shardrl.config.load import require
from shardrl.config.names import ADVANTAGE_ESTIMATORS
from shardrl.config.rollout import RolloutConfig


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt files (parquet / jsonl) to train on."""
    val_files: list[str] = field(default_factory=list)
    """Prompt files to validate on."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string or a chat message list)."""
    max_prompt_length: int = 256
    """Prompt length limit in tokens."""
    truncation: Literal["error", "drop", "left", "right"] = "drop"
    """Over-long prompts: raise, drop the row, or cut tokens from the left / right."""
    skip_bad_rows: bool = False
    """Skip (and count) rows without a usable prompt instead of raising."""
    train_batch_size: int = 8
    """Prompts per training step (global)."""
    gen_batch_size: int | None = None
    """Prompts per generation batch (global) of DAPO's dynamic sampling (algorithm.filter_groups), drawn from the
    training set until the step's kept groups fill data.train_batch_size (verl's data.gen_batch_size); larger
    than train_batch_size, fewer batches a step. None: train_batch_size. Without dynamic sampling every prompt
    drawn is trained on, so it must be left unset (or equal train_batch_size)."""
    val_batch_size: int | None = None
    """Prompts per validation round over all ranks (ceil(this / dp) per rank: weight sync, greedy generation and
    scoring); None takes the whole validation set in one round. The rollout still cuts a round into generate
    calls of `rollout.micro_batch_size` prompts."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 0
    """Seed of the shuffle."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_prompt_length", self.max_prompt_length >= 1, "must be >= 1")
        require(self, prefix, "train_batch_size", self.train_batch_size >= 1, "must be >= 1 (prompts)")
        require(self, prefix, "gen_batch_size", self.gen_batch_size is None or self.gen_batch_size >= 1,
                "must be >= 1 (prompts) or null")
        require(self, prefix, "val_batch_size", self.val_batch_size is None or self.val_batch_size >= 1,
                "must be >= 1 or null")


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong reward shaping: add a soft length penalty to each response's reward."""
    len: int = 16
    """Tokens before the length limit over which the penalty grows from 0 to -penalty_factor (reached by a
    response cut at the limit). The limit is the response budget (`RolloutConfig.response_budget`):
    rollout.max_new_tokens; for multi-turn rollouts, the conversation's budget
    rollout.multi_turn.max_response_tokens (model and tool tokens together, not the per-turn limit); for agent
    episodes, rollout.agent.max_response_tokens."""
    penalty_factor: float = 1.0
    """The penalty at the limit."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "len", self.len >= 1, "must be >= 1 (tokens)")
        require(self, prefix, "penalty_factor", self.penalty_factor >= 0, "must be >= 0")


@dataclass
class RewardConfig:
    function_path: str | None = None
    """Python file defining the reward function; None uses the built-in rule-based scorers."""
    function_name: str = "compute_score"
    """Name of the reward function in `function_path`."""
    reward_kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the reward function on every call (verl's custom_reward_function.reward_kwargs),
    e.g. {method: flexible}; the function must take them."""
    model_path: str | None = None
    """Reward model folder or hub id (a *ForSequenceClassification with one label), scored through a forward-only
    engine, instead of a function. A folder holding a tokenizer that encodes unlike the policy's reads each
    conversation decoded and re-tokenized with that tokenizer and its chat template (as verl's
    reward_model.model.input_tokenizer); otherwise it reads the policy's ids."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine of the reward model (forward only)."""
    num_workers: int = 0
    """Processes (per rank) that score samples in parallel, for slow reward functions; 0 scores in the training
    process. Each worker imports the reward file itself."""
    timeout_s: float | None = None
    """Time limit of one sample's reward, in seconds: past it the sample scores like a failing one (on_error_score,
    counted in reward/num_errors and reward/num_timeouts) and its worker is replaced. Scores in worker processes
    (at least one, whatever num_workers says); None: no limit."""
    on_error_score: float = 0.0
    """Score given when the reward function raises on a sample (or returns no finite float32 number); a step
    where it fails on every sample of every rank stops the run with the first failure."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong penalty (verl's reward_model.overlong_buffer), `shardrl.algos.dapo`."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of every response cut at the length limit (it never ended: no end of sequence,
    no stop string), TRL's name. A reward model trained on finished replies has never seen the last token of a
    cut one, and RL learns to write to the limit when that token scores well; None: no penalty."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "num_workers", self.num_workers >= 0, "must be >= 0 (0: score in the training process)")
        require(self, prefix, "timeout_s", self.timeout_s is None or self.timeout_s > 0, "must be > 0 (seconds) or null")
        require(self, prefix, "missing_eos_penalty", self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
                "must be >= 0 (it is subtracted) or null")
        check_reward(self, prefix)


@dataclass
class Config(CommandConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (and tokenizer)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen teacher of on-policy distillation (algorithm.adv_estimator=opd)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (GAE only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and batch size."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function or model."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and in-reward KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, checkpoints, logging, launch."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Disaggregated placement and asynchronous (off-policy) generation."""

    @staticmethod
    def unknown_key_hint(key: str) -> str | None:
        """The native key for a verl name (`trainer.test_freq` -> `trainer.val_freq`), for the unknown-key error."""
        from shardrl.compat.verl.translate import native_hint

        return native_hint(key)

    INHERITED = {"ref": ("engine",), "teacher": ("engine",), "reward": ("engine",),
                 "critic": ("engine", "ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "shuffle")}
    """What a role takes from the actor unless set for it (verl's `oc.select` defaults): every engine setting
    (dtype, micro-batching, dynamic batches, sharding, offload, sequence parallel) and the critic's loop."""

    def inherit(self, given: set[str]) -> None:
        """Let total_epochs alone decide the run's length unless total_steps is given too; fill each role's
        `INHERITED` settings that `given` (the keys the file and overrides set) does not name from the actor's:
        with an fp32 actor the reference computes in fp32 too, so the on-policy KL is 0."""
        epochs_decide(self.trainer, given)
        for role, names in self.INHERITED.items():
            section = getattr(self, role)
            for name in names:
                value = getattr(self.actor, name)
                if name == "engine":
                    for f in dataclasses.fields(EngineConfig):
                        if f"{role}.engine.{f.name}" not in given:
                            setattr(section.engine, f.name, copy.deepcopy(getattr(value, f.name)))
                elif f"{role}.{name}" not in given:
                    setattr(section, name, value)

    validates_before_train = True

    def rollout_correction(self) -> bool:
        """Whether the loss corrects for the sampler/trainer mismatch (`algorithm.rollout_is`; null: on with
        rollout.quantization=fp8, whose sampler differs more from the trainer, off otherwise)."""
        if self.algorithm.rollout_is is None:
            return self.rollout.quantization == "fp8"
        return self.algorithm.rollout_is

    def engines(self) -> list[tuple[str, EngineConfig]]:
        return [(f"{role}.engine", getattr(self, role).engine) for role in ("actor", "ref", "teacher", "critic",
                                                                                "reward")]

    def optims(self) -> list[tuple[str, OptimConfig]]:
        critic = ADVANTAGE_ESTIMATORS[self.algorithm.adv_estimator].needs_critic
        return [("actor.optim", self.actor.optim), *([("critic.optim", self.critic.optim)] if critic else [])]

    def ignored_settings(self) -> list[str]:
        lines = super().ignored_settings()
        mt = self.rollout.multi_turn
        if not mt.enable and (mt.tools or mt.interaction_path or mt.tool_config_path):
            given = ("rollout.multi_turn.tools" if mt.tools else "rollout.multi_turn.interaction_path"
                     if mt.interaction_path else "rollout.multi_turn.tool_config_path")
            lines.append(f"{given} is set but rollout.multi_turn.enable=false: the rollout is single-turn and uses no "
                         "tools (set rollout.multi_turn.enable=true)")
        if self.teacher.paths() and self.algorithm.adv_estimator != "opd":
            given = "teacher.model_path" if self.teacher.model_path else "teacher.by_data_source"
            lines.append(f"{given} is set but algorithm.adv_estimator={self.algorithm.adv_estimator}: no "
                         "teacher is built (set algorithm.adv_estimator=opd to distill from it)")
        return lines

    def validate(self, prefix: str) -> None:
        check_rl(self, prefix)
