"""The run's models: the tokenizer, the vocabulary check, and the engines of the roles the step plan names
(actor, reference, critic, reward model), on the run's meshes, built once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from shardrl.config import Config
from shardrl.distributed import ParallelDims
from shardrl.engine import build_engine
from shardrl.engine.model import load_hf_config, require_folder
from shardrl.modelconfig import text_config
from shardrl.step_plan import StepPlan

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(cfg: Config):
    import transformers

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        raise ValueError("no tokenizer: set model.path (a local HF model folder) or model.tokenizer_path")
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    if not any((require_folder(key, path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one "
                         "there with tokenizer.save_pretrained(folder), or set model.tokenizer_path to a folder "
                         "that has one")
    try:
        if _generic_tokenizer(Path(path)):
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _generic_tokenizer(folder: Path) -> bool:
    """Whether the folder's tokenizer is a plain `tokenizer.json` saved by the generic fast class (a tokenizer
    built with the `tokenizers` library, like the demo's). Loaded through AutoTokenizer, such a folder gets the
    tokenizer class of its model type when it holds a config.json (transformers 5: a qwen2 folder's
    Qwen2Tokenizer replaces the pre-tokenizer with its own BPE split and drops the demo's spaces), so it is
    loaded as saved instead."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (ValueError, OSError):
        return False
    return name in ("TokenizersBackend", "PreTrainedTokenizerFast")


def check_vocab_sizes(cfg: Config, tokenizer_size: int) -> None:
    """Every model that reads the tokenizer's ids (policy, critic, reward model) has an embedding row for
    each: a token id past the vocabulary fails only mid-run (an index error, or a CUDA device assert)."""
    tokenizer_at = cfg.model.tokenizer_path or cfg.model.path
    plan = StepPlan.from_config(cfg)
    models = [("model.path", cfg.model.path, cfg.model.tiny, "causal_lm")]
    if plan.needs_critic and cfg.critic.model_path:
        models.append(("critic.model_path", cfg.critic.model_path, None, "causal_lm"))
    if plan.reward_model:
        models.append(("reward.model_path", cfg.reward.model_path, None, "seq_cls"))
    for key, path, tiny, task in models:
        config = load_hf_config(path, tiny, cfg.model.trust_remote_code, task)
        vocab = getattr(text_config(config), "vocab_size", None)
        if vocab is not None and vocab < tokenizer_size:
            where = f"{key}={path!r}" if path else "model.tiny"
            raise ValueError(
                f"{where} has a vocabulary of {vocab} tokens, smaller than the tokenizer's {tokenizer_size} "
                f"(from {tokenizer_at!r}): ids >= {vocab} have no embedding. Use the tokenizer made for this model "
                f"(model.tokenizer_path), or grow the model's embeddings to match: "
                f"model.resize_token_embeddings({tokenizer_size}); model.save_pretrained(folder)")


@dataclasses.dataclass
class Roles:
    """The engines of a run; a role the plan leaves out is None."""

    actor: object
    parallel_dims: ParallelDims
    ref: object = None
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
        if plan.uses_ref:
            roles.ref = build_engine(cfg.model, cfg.ref.engine, None, mesh=meshes(cfg.ref.engine))
        if plan.needs_critic:
            critic_model = cfg.model if cfg.critic.model_path is None else dataclasses.replace(
                cfg.model, path=cfg.critic.model_path, tiny=None)
            roles.critic = build_engine(critic_model, cfg.critic.engine, cfg.critic.optim, head="value",
                                        total_steps=total * num_updates["critic"], mesh=meshes(cfg.critic.engine))
        return roles

    def add_reward_model(self, cfg: Config) -> None:
        """The reward model's engine (`reward.model_path`), forward-only, with a score head."""
        meshes = self.parallel_dims.for_engine
        rm_cfg = dataclasses.replace(cfg.model, path=cfg.reward.model_path, tiny=None)
        self.reward_model = build_engine(rm_cfg, cfg.reward.engine, None, head="score", mesh=meshes(cfg.reward.engine))
