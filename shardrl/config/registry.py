"""The trainers, one row each: the command's name, the config it reads, what a data row holds and which head the
model gets, and where its trainer lives (a dotted path the command line imports when it runs one, so the config
imports no trainer and no torch). `load_config` reads a command's config and, for a file that is another
command's, says which.

    TRAINERS["dpo"].config   # DPOConfig
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from typing import Iterable, Literal, TypeVar

from shardrl.config.load import load, unknown_keys
from shardrl.config.offline import DPOConfig, KTOConfig, RMConfig, SFTConfig
from shardrl.config.rl import Config

T = TypeVar("T")


@dataclass(frozen=True)
class Trainer:
    name: str
    """The subcommand (`shardrl NAME`) and `shardrl plan --trainer NAME`."""
    config: type
    """The config class the command reads."""
    group_size: int
    """Sequences per data row, kept in one micro-batch (2: a preference pair's chosen and rejected); the RL
    trainer's rows are prompts whose rollout.n responses the step plan groups."""
    head: Literal["lm", "score"]
    """The model's output: the causal LM's vocabulary ("lm", a policy) or one scalar a sequence ("score")."""
    entry: str
    """`module:attribute` of the trainer class, imported by the command line when it runs this command."""
    help: str
    """The subcommand's line in `shardrl --help`."""
    rows: str = "prompts"
    """What a row is called in messages (`data.batch_size=7 pairs cannot be split ...`)."""

    @property
    def offline(self) -> bool:
        """Trains on fixed rows from files (sft, dpo, kto, rm), not on generated responses."""
        return self.name != "train"


TRAINERS = {t.name: t for t in (
    Trainer("train", Config, 1, "lm", "shardrl.trainer.rl:RLTrainer",
            "train (launches torchrun itself with --nproc-per-node > 1)"),
    Trainer("sft", SFTConfig, 1, "lm", "shardrl.trainer.sft:SFTTrainer",
            "supervised fine-tuning on chat data (the keys of config.SFTConfig)", "conversations"),
    Trainer("dpo", DPOConfig, 2, "lm", "shardrl.trainer.dpo:DPOTrainer",
            "preference training: DPO, IPO, SimPO, ... on prompt/chosen/rejected rows (config.DPOConfig)", "pairs"),
    Trainer("kto", KTOConfig, 1, "lm", "shardrl.trainer.kto:KTOTrainer",
            "KTO on unpaired prompt/completion/label rows (config.KTOConfig)", "rows"),
    Trainer("rm", RMConfig, 2, "score", "shardrl.trainer.rm:RMTrainer",
            "a Bradley-Terry reward model on prompt/chosen/rejected rows (config.RMConfig)", "pairs"),
)}
"""Every training command; a new trainer is its module and a row here."""

COMMAND_CONFIGS = {name: t.config for name, t in TRAINERS.items()}
"""The config each training command reads (`shardrl train` also `plan` and `serve`)."""


def other_command_hint(cls: type, path: str, data: dict, error: str) -> str | None:
    """For a file the loader refused with `error`: when its keys are another command's, which command reads it and
    how to run it; else None. A file whose top-level keys are another command's (a `shardrl dpo` file given to
    `shardrl train` has engine, optim and dpo) gets this line instead of the error; one whose top-level keys are
    this command's too but whose keys below them are another's alone (a dpo file of model, data and trainer only:
    data.batch_size is no key of `shardrl train`) gets it after the error, which may be a typo."""
    names = {str(k) for k in data}
    mine = {f.name for f in dataclasses.fields(cls)}
    this = next(c for c, other in COMMAND_CONFIGS.items() if other is cls)
    whole = [c for c, other in COMMAND_CONFIGS.items() if other is not cls and not unknown_keys(other, data)]
    if names <= mine:
        if not unknown_keys(cls, data) or not whole:
            return None
        first, also = _ranked(whole, path)
        return (f"{error} (the file's keys are those of a `shardrl {first}`{also} config: run it with "
                f"`shardrl {first} {path}`, or plan it with `shardrl plan {path}{_plan_flag(first)}`)")
    fits = [c for c, other in COMMAND_CONFIGS.items()
            if other is not cls and names <= {f.name for f in dataclasses.fields(other)}]
    whole = [c for c in fits if c in whole]  # rm.yaml: dpo and rm, not sft
    if not (fits := whole or fits):
        return None
    first, also = _ranked(fits, path)
    foreign = sorted(names - mine)
    return (f"config file {path!r} looks like a `shardrl {first}`{also} config, not a "
            f"`shardrl {this}` one ({', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} no "
            f"`shardrl {this}` key{'' if len(foreign) == 1 else 's'}): run it with `shardrl {first} {path}`, "
            f"or plan it with `shardrl plan {path}{_plan_flag(first)}`")


def _ranked(commands: list[str], path: str) -> tuple[str, str]:
    """The command a file most likely is (the one it is named after: rm.yaml fits sft, dpo and rm, rm first) and
    the others, as " (or `shardrl dpo`, ...)"."""
    named = set(re.split(r"[^a-z]+", os.path.basename(path).lower()))
    first, *others = sorted(commands, key=lambda c: c not in named)
    return first, (f" (or {', '.join(f'`shardrl {c}`' for c in others)})" if others else "")


def _plan_flag(command: str) -> str:
    return "" if command == "train" else f" --trainer {command}"


def load_config(path: str | None = None, overrides: Iterable[str] = (), cls: type[T] = Config) -> T:
    """Defaults of `cls`, then the YAML file at `path`, then `key=value` overrides; validated.

    Raises `ConfigError` (a `ValueError`) naming the dotted key for any bad key, value or file.
    """
    hint = functools.partial(other_command_hint, cls) if cls in COMMAND_CONFIGS.values() else None
    return load(cls, path, overrides, file_hint=hint)
