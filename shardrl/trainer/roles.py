"""The run's models: the vocabulary and teacher-tokenizer checks, and the engines of the roles the step plan names
(actor, reference, teacher, critic, reward model), on the run's meshes, built once."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from shardrl.config.schema import Config, ConfigError, LoRAConfig
from shardrl.distributed import ParallelDims
from shardrl.engine import build_engine
from shardrl.engine.model import check_tiny_shape, load_hf_config
from shardrl.models.config import text_config
from shardrl.plan.step_plan import StepPlan
from shardrl.trainer.teachers import Teachers


class ModelPath(NamedTuple):
    """A model a run loads, by the config key that names its folder (`path`; None: `tiny`, model.tiny)."""

    key: str
    path: str | None
    tiny: dict | None = None
    task: str = "causal_lm"
    """`load_hf_config`'s: "causal_lm", or "seq_cls" (a reward model)."""
    new_head_ok: bool = False


def check_vocab_sizes(cfg: Config, tokenizer_size: int, plan: StepPlan | None = None,
                      reward_tokenizer_size: int | None = None) -> None:
    """The RL run's models that read the tokenizer's ids (policy, critic, reward model): `check_vocabularies`.
    `plan`: the run's step plan (None: derived from `cfg`); `reward_tokenizer_size`: the reward model's own
    tokenizer's, when it reads its own ids (`shardrl.rewards.model_inputs`), else None."""
    plan = plan or StepPlan.from_config(cfg)
    models = [ModelPath("model.path", cfg.model.path, cfg.model.tiny)]
    if plan.needs_critic and cfg.critic.model_path:
        models.append(ModelPath("critic.model_path", cfg.critic.model_path))
    if plan.uses_teacher:
        models += [ModelPath(cfg.teacher.key(path), path) for path in cfg.teacher.paths()]
    reward_model = ModelPath("reward.model_path", cfg.reward.model_path, task="seq_cls")
    if plan.reward_model and reward_tokenizer_size is None:
        models.append(reward_model)
    check_vocabularies(cfg, models, tokenizer_size)
    if plan.reward_model and reward_tokenizer_size is not None:
        check_vocabularies(cfg, [reward_model], reward_tokenizer_size, tokenizer_at=cfg.reward.model_path)


def check_vocabularies(cfg: Config, models: list[ModelPath], tokenizer_size: int,
                       tokenizer_at: str | None = None) -> None:
    """Every model in `models` is a model folder (its errors name its key) with an embedding row for each of the
    tokenizer's ids: a token id past the vocabulary fails only mid-run (an index error, or a CUDA device assert).
    `tokenizer_at`: where the tokenizer came from (default: the policy's)."""
    tokenizer_at = tokenizer_at or cfg.model.tokenizer_path or cfg.model.path
    for m in models:
        config = load_hf_config(m.path, m.tiny, cfg.model.trust_remote_code, m.task, m.new_head_ok, key=m.key)
        if m.tiny:  # heads that do not cut the width fail only at the first forward, as a tensor-size error
            check_tiny_shape(text_config(config), "head_dim" in m.tiny)
        vocab = getattr(text_config(config), "vocab_size", None)
        if vocab is not None and vocab < tokenizer_size:
            where = f"{m.key}={m.path!r}" if m.path else "model.tiny"
            raise ValueError(
                f"{where} has a vocabulary of {vocab} tokens, smaller than the tokenizer's {tokenizer_size} "
                f"(from {tokenizer_at!r}): ids >= {vocab} have no embedding. Use the tokenizer made for this model "
                f"(model.tokenizer_path), or grow the model's embeddings to match: "
                f"model.resize_token_embeddings({tokenizer_size}); model.save_pretrained(folder)")


def check_teacher_tokenizer(cfg: Config, tokenizer) -> None:
    """The teacher scores the student's token ids as they are, so its tokenizer must encode as the policy's
    (`same_tokenization`); a teacher folder without a tokenizer is taken to share the policy's."""
    from shardrl.tokenizer import folder_tokenizer, same_tokenization

    for path in cfg.teacher.paths():
        own = folder_tokenizer(path, cfg.model.trust_remote_code)
        if own is not None and not same_tokenization(own, tokenizer):
            raise ConfigError(f"{cfg.teacher.key(path)}={path!r} has a tokenizer that encodes unlike the policy's: "
                              "on-policy distillation needs the same tokenizer (cross-tokenizer alignment is not "
                              "supported); pick a teacher of the policy's family")
    if cfg.algorithm.opd.top_k:  # the teacher's top k is taken among the ids the student can score
        student = text_config(load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code)).vocab_size
        for path in cfg.teacher.paths():
            key = cfg.teacher.key(path)
            teacher = text_config(load_hf_config(path, None, cfg.model.trust_remote_code, key=key)).vocab_size
            if cfg.algorithm.opd.top_k > min(teacher, student):
                raise ConfigError(
                    f"algorithm.opd.top_k={cfg.algorithm.opd.top_k} is more than the {min(teacher, student)} tokens "
                    f"{key}={path!r} ({teacher} output tokens) and the policy ({student}) share: set "
                    f"algorithm.opd.top_k to at most {min(teacher, student)} (8 to 64 is usual)")


def build_reference(model, engine_cfg, mesh, path: str | None = None, actor=None):
    """A frozen, forward-only policy with the policy's model settings (`model`): the model at `path` (a DPO/KTO
    ref_model_path, the distillation teacher) without the policy's adapters, or (None) the starting policy: with
    LoRA the `actor` engine with its adapters off (no second copy of the base), else a second copy of model.path."""
    if path is None and model.lora.rank > 0:
        return AdaptersOff(actor)
    if path is not None:
        model = dataclasses.replace(model, path=path, tiny=None, lora=LoRAConfig())
    return build_engine(model, engine_cfg, None, mesh=mesh)


class AdaptersOff:
    """The reference policy of a LoRA actor: the actor's own model with its adapters off (no second copy of the
    base, as verl does)."""

    def __init__(self, actor):
        self.actor = actor

    def infer_batch(self, batch, **kwargs):
        with self.actor.adapters_off():
            return self.actor.infer_batch(batch, **kwargs)

    def __getattr__(self, name):  # offload/onload, mesh, hf_config: the actor's
        if name == "actor":
            raise AttributeError(name)
        return getattr(self.actor, name)


@dataclasses.dataclass
class Roles:
    """The engines of a run; a role the plan leaves out is None."""

    actor: object
    parallel_dims: ParallelDims
    ref: object = None
    teacher: object = None
    critic: object = None
    reward_model: object = None

    @property
    def mesh(self):
        return self.actor.mesh

    def trained(self) -> dict:
        """The engines with an optimizer, by name (what a checkpoint holds)."""
        return {k: v for k, v in (("actor", self.actor), ("critic", self.critic)) if v is not None}

    @classmethod
    def build(cls, cfg: Config, plan: StepPlan, num_updates: dict[str, int]) -> Roles:
        """The trained and log-prob roles (the reward model: `add_reward_model`) on the run's meshes.
        `num_updates`: optimizer steps per training step, by role (the LR schedule's length)."""
        dims = ParallelDims.from_config(cfg)  # the run's meshes, built once
        meshes, total = dims.for_engine, cfg.trainer.total_steps
        roles = cls(build_engine(cfg.model, cfg.actor.engine, cfg.actor.optim, total_steps=total * num_updates["actor"],
                                 mesh=meshes(cfg.actor.engine)), dims)
        no_lora = dataclasses.replace(cfg.model, lora=LoRAConfig())  # the policy's adapters are the policy's only
        if plan.uses_ref:
            roles.ref = build_reference(cfg.model, cfg.ref.engine, meshes(cfg.ref.engine), actor=roles.actor)
        if plan.uses_teacher:  # a reference at another path (one per teacher folder)
            teacher_mesh = meshes(cfg.teacher.engine)
            roles.teacher = Teachers(cfg, lambda path: build_reference(cfg.model, cfg.teacher.engine, teacher_mesh,
                                                                       path))
        if plan.needs_critic:
            critic_model = dataclasses.replace(no_lora, override_config=cfg.critic.model_override_config)
            if cfg.critic.model_path is not None:
                critic_model = dataclasses.replace(critic_model, path=cfg.critic.model_path, tiny=None)
            roles.critic = build_engine(critic_model, cfg.critic.engine, cfg.critic.optim, head="value",
                                        total_steps=total * num_updates["critic"], mesh=meshes(cfg.critic.engine))
        return roles

    def add_reward_model(self, cfg: Config) -> None:
        """The reward model's engine (`reward.model_path`), forward-only, with a score head."""
        meshes = self.parallel_dims.for_engine
        rm_cfg = dataclasses.replace(cfg.model, path=cfg.reward.model_path, tiny=None, lora=LoRAConfig(),
                                     override_config={})  # the policy's overrides are the policy's
        self.reward_model = build_engine(rm_cfg, cfg.reward.engine, None, head="score", mesh=meshes(cfg.reward.engine))
