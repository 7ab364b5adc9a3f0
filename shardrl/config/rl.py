"""`shardrl train`'s config, `Config`: the RL roles, the rollout, the prompts (`DataConfig`), the reward
(`RewardConfig`, with `OverlongBufferConfig`), the algorithm and the run."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.algorithm import ActorConfig, AlgorithmConfig, AsyncConfig, CriticConfig, RefConfig
from shardrl.config.command import CommandConfig, TrainerConfig, epochs_decide
from shardrl.config.engine import EngineConfig, ModelConfig
from shardrl.config.names import ADVANTAGE_ESTIMATORS
from shardrl.config.load import divisors, nearest, require
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
        require(self, prefix, "val_batch_size", self.val_batch_size is None or self.val_batch_size >= 1,
                "must be >= 1 or null")


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong reward shaping: add a soft length penalty to each response's reward."""
    len: int = 16
    """Tokens before the length limit over which the penalty grows from 0 to -penalty_factor (reached by a
    response cut at the limit). The limit is rollout.max_new_tokens; for multi-turn rollouts, the conversation's
    budget rollout.multi_turn.max_response_tokens (model and tool tokens together, not the per-turn limit)."""
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
    """Reward model folder (a *ForSequenceClassification with one label, same tokenizer as the policy),
    scored through a forward-only engine, instead of a function."""
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
        require(self, prefix, "model_path", not (self.model_path and self.function_path),
                "cannot be set together with reward.function_path; choose a reward model or a function")
        require(self, prefix, "num_workers", self.num_workers >= 0, "must be >= 0 (0: score in the training process)")
        require(self, prefix, "timeout_s", self.timeout_s is None or self.timeout_s > 0, "must be > 0 (seconds) or null")
        require(self, prefix, "num_workers", not (self.model_path and (self.num_workers or self.timeout_s)),
                "and reward.timeout_s apply to reward functions; a reward model (reward.model_path) scores on the "
                "GPU: drop them")
        require(self, prefix, "reward_kwargs", not self.reward_kwargs or bool(self.function_path),
                "is passed to your reward function only; set reward.function_path too, or drop reward_kwargs")
        require(self, prefix, "missing_eos_penalty", self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
                "must be >= 0 (it is subtracted) or null")


@dataclass
class Config(CommandConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (and tokenizer)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
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

    INHERITED = {"ref": ("engine",), "critic": ("engine", "ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "shuffle"),
                 "reward": ("engine",)}
    """What a role takes from the actor unless set for it (verl's `oc.select` defaults): every engine setting
    (dtype, micro-batching, dynamic batches, sharding, offload, sequence parallel) and the critic's loop."""

    def inherit(self, given: set[str]) -> None:
        """Let total_epochs alone decide the run's length unless total_steps is given too; fill each role's `INHERITED` settings that `given` (the keys the file and overrides set) does not name
        from the actor's: with an fp32 actor the reference computes in fp32 too, so the on-policy KL is 0."""
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

    def engines(self) -> list[tuple[str, EngineConfig]]:
        return [(f"{role}.engine", getattr(self, role).engine) for role in ("actor", "ref", "critic", "reward")]

    def ignored_settings(self) -> list[str]:
        lines = super().ignored_settings()
        mt = self.rollout.multi_turn
        if not mt.enable and (mt.tools or mt.interaction_path or mt.tool_config_path):
            given = ("rollout.multi_turn.tools" if mt.tools else "rollout.multi_turn.interaction_path"
                     if mt.interaction_path else "rollout.multi_turn.tool_config_path")
            lines.append(f"{given} is set but rollout.multi_turn.enable=false: the rollout is single-turn and uses no "
                         "tools (set rollout.multi_turn.enable=true)")
        return lines

    def validate(self, prefix: str) -> None:
        require(self, prefix, "trainer.export_lora_adapter", not self.trainer.export_lora_adapter
                or self.model.lora.rank > 0, "needs model.lora.rank > 0 (there are no adapters to write)")
        if self.model.lora.rank > 0:  # (the engine refuses these too; here `shardrl plan` does, before any ledger)
            require(self, prefix, "actor.engine.strategy", self.actor.engine.strategy == "fsdp2",
                    "must be fsdp2 with model.lora (FSDP1's flat parameters cannot hold a frozen base beside "
                    "trained adapters)")
            require(self, prefix, "actor.engine.offload_params", not self.actor.engine.offload_params,
                    "is not supported with model.lora (the frozen base is stored in param_dtype already, half an fp32 "
                    "model): set it false")
        for role in ("actor", "ref", "critic"):
            require(self, prefix, "model.load_weights", self.model.load_weights != "random_shards"
                    or getattr(self, role).engine.strategy == "fsdp2",
                    f"random_shards needs FSDP2 (each rank draws its own shards); {role}.engine.strategy is fsdp")
        require(self, prefix, "rollout.lora_sync", self.rollout.lora_sync in (None, "full")
                or self.async_rl.rollout_ranks == 0, "unmerged and merged sync a colocated rollout; rollout ranks of "
                "their own (async_rl.rollout_ranks > 0) receive the merged model whole: set full or drop it")
        batch = self.data.train_batch_size
        estimator = ADVANTAGE_ESTIMATORS[self.algorithm.adv_estimator]
        for section in ("actor", "critic") if estimator.needs_critic else ("actor",):
            mini = getattr(self, section).ppo_mini_batch_size
            require(self, prefix, f"{section}.ppo_mini_batch_size", mini <= batch and batch % mini == 0,
                    f"must divide data.train_batch_size={batch} (both count prompts); nearest valid: "
                    f"{nearest(mini, divisors(batch))}")
        group_baseline = [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.group_baseline]
        require(self, prefix, "rollout.n", not estimator.group_baseline or self.rollout.n >= 2,
                f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} compares responses within a prompt's "
                "group, so it needs rollout.n >= 2")
        require(self, prefix, "algorithm.filter_groups.enable",
                not self.algorithm.filter_groups.enable or estimator.group_baseline,
                f"drops groups whose rewards are all equal, which only a group baseline ({', '.join(group_baseline)}) "
                f"leaves without advantage; set algorithm.adv_estimator to one, or filter_groups.enable=false")
        if self.async_rl.rollout_ranks:
            require(self, prefix, "async_rl.partial_rollout", not (self.async_rl.partial_rollout
                                                               and self.rollout.multi_turn.enable),
                    "is not supported with rollout.multi_turn.enable (weights change between generate calls "
                    "only there, i.e. between turns); set one of them to false")
            require(self, prefix, "algorithm.filter_groups.enable", not self.algorithm.filter_groups.enable,
                    "dynamic sampling is not supported with async_rl.rollout_ranks > 0 (the rollout ranks generate "
                    "one batch per step); set filter_groups.enable=false or async_rl.rollout_ranks=0")
            require(self, prefix, "trainer.val_freq", self.trainer.val_freq == 0 or not self.data.val_files,
                    "validation is not supported with async_rl.rollout_ranks > 0 (the training ranks hold no "
                    "rollout); set trainer.val_freq=0 or async_rl.rollout_ranks=0")
        require(self, prefix, "trainer.total_epochs", self.trainer.total_epochs is None or not self.async_rl.rollout_ranks,
                "is not supported with async_rl.rollout_ranks > 0 (the rollout ranks do not read the training set); "
                "set trainer.total_steps")
        require(self, prefix, "algorithm.rollout_is", self.async_rl.max_staleness == 0 or self.algorithm.rollout_is,
                f"async_rl.max_staleness={self.async_rl.max_staleness} trains on samples of an older policy: set "
                "algorithm.rollout_is=true so the loss weighs them by the sampler's log-probs (the behaviour "
                "policy), or async_rl.max_staleness=0")
        ob, mt = self.reward.overlong_buffer, self.rollout.multi_turn
        # the limit a response is shaped against: a conversation's budget for multi-turn rollouts
        limit_key, limit = (("rollout.multi_turn.max_response_tokens", mt.max_response_tokens) if mt.enable
                            else ("rollout.max_new_tokens", self.rollout.max_new_tokens))
        require(self, prefix, "reward.overlong_buffer.len", not ob.enable or ob.len <= limit,
                f"must be <= {limit_key}={limit} (the penalty spans the last len tokens before it); lower it or "
                f"raise {limit_key}")
