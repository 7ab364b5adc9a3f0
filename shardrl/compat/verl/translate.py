"""verl's command lines in shardrl: `shardrl train --verl key=value ...` takes the `key=value` lines of a
`python3 -m verl.trainer.main_ppo` script and runs them as native overrides.

`VERL_KEYS` (`shardrl.compat.verl.keys`) is the one table: each verl key (its full dotted name) -> a `Rule` saying which shardrl key it sets and
how its value converts, or why it is dropped (it tunes vLLM/SGLang, Ray or a kernel shardrl does not have, and
changes no number of the run) or refused (it would change the run, and shardrl cannot do it). A key not in the
table is refused by its full verl name. verl's value conventions are converted: a string file list, -1 for
off/all, `resume_mode`, `do_sample`, `kl_ctrl.type`, `rollout.name`. Keys the command line does not give take
verl's default where it differs from shardrl's (`VERL_DEFAULTS`: a verl script relies on them), and roles take the
actor's settings as verl's config does (`Config.inherit`). The translated native overrides are printed at
start-up so that a user can move to them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from typing import Any

import yaml

from shardrl.compat.verl.defaults import VERL_PPO_DEFAULTS
from shardrl.compat.verl.keys import DICT_KEYS, VERL_DEFAULTS, VERL_KEYS


class VerlKeyError(ValueError):
    """A verl key or value shardrl cannot run; the message names the full verl key."""


@dataclasses.dataclass
class Translation:
    overrides: list[str]
    """The native `key=value` overrides, in the table's order."""
    dropped: dict[str, str]
    """verl keys given and dropped -> why."""
    command: str = "train"
    """The shardrl command that runs them (sft: `shardrl.compat.verl.sft`)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """How a verl key given was read where verl's meaning is not a plain copy (a global micro-batch divided)."""

    def describe(self) -> str:
        lines = [f"verl command line as shardrl overrides (run these natively with `shardrl {self.command} "
                 "KEY=VALUE ...`):"]
        lines += [f"  {o}" for o in self.overrides]
        if self.dropped:
            lines.append("dropped verl keys (they change nothing here):")
            lines += [f"  {k}: {why}" for k, why in self.dropped.items()]
        if self.notes:
            lines.append("notes:")
            lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class _HydraLikeLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading scalars closer to Hydra's (OmegaConf's): no dates or times (an experiment
    named 2025-01-31 stays a string), no sexagesimal numbers (12:30), only true/false as booleans (yes, no, on,
    off stay strings)."""


_HydraLikeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                           "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _regexp, _first in (
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("tag:yaml.org,2002:int", r"^[-+]?(?:0|[1-9][0-9_]*)$", "-+0123456789"),
        ("tag:yaml.org,2002:float", r"^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"
                                    r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$", "-+0123456789.")):
    _HydraLikeLoader.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))


def _read_value(text: str):
    return yaml.load(text, Loader=_HydraLikeLoader) if text.strip() else None


def parse_verl_args(args: list[str]) -> dict[str, Any]:
    """verl's `key=value` arguments (Hydra's `+key=value` too) -> {key: value}, values read as YAML as Hydra does."""
    given: dict[str, Any] = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key or key.startswith("~"):
            raise VerlKeyError(f"bad verl argument {arg!r}: expected key=value (Hydra's ~key deletion is not supported)")
        try:
            value = _read_value(text)
        except yaml.YAMLError as e:
            raise VerlKeyError(f"bad verl argument {arg!r}: cannot read {text!r} ({e})") from None
        if isinstance(value, str) and _FLOAT.fullmatch(value):  # PyYAML reads 1e-6 as a string; Hydra as a float
            value = float(value)
        if isinstance(value, str) and "${" in value:
            raise VerlKeyError(f"verl argument {arg!r} is a Hydra interpolation; give the value itself")
        given[key] = value
    return given


VERL_CONFIG_NAMES = {
    "ppo_trainer": ("verl.trainer.main_ppo", "run it with `shardrl train --verl`"),
    "ppo_megatron_trainer": ("verl.trainer.main_ppo on Megatron", "shardrl trains with FSDP only"),
    "sft_trainer": ("verl.trainer.fsdp_sft_trainer", "run it with `shardrl sft --verl`"),
    "sft_trainer_engine": ("verl.trainer.sft_trainer", "run verl's fsdp_sft_trainer command line with "
                                                       "`shardrl sft --verl`"),
    "generation": ("verl.trainer.main_generation", "offline generation is not a training run"),
    "evaluation": ("verl.trainer.main_eval", "offline evaluation is not a training run"),
}
"""verl's own config names (verl/trainer/config at verl b178a3cd) -> (the entry point whose config it is, how
shardrl runs such a command line), as a script names them with --config-name and no --config-path, or
`--config-path=config`: Hydra resolves a relative config path against the folder of verl's entry point, so both
name verl's own tree. The entry's own (ppo_trainer for main_ppo, sft_trainer
for fsdp_sft_trainer) is verl's defaults (`VERL_PPO_DEFAULTS`, the SFT table's), which the translation applies
itself; another is refused by whose it is."""

MEGATRON = ("{what}: shardrl trains with FSDP only; run verl's FSDP script of the job (no --config-name, or "
            "--config-name=ppo_trainer) with actor_rollout_ref.actor.strategy=fsdp2 and without the *.megatron.* keys")


def config_file_args(config_path: str | None, config_name: str | None, own: str = "ppo_trainer") -> list[str]:
    """The keys of verl's `--config-path DIR --config-name NAME` YAML as key=value arguments (they come before the
    command line's, which win). Its Hydra `defaults:` (verl's ppo_trainer, whose defaults shardrl applies itself)
    and `hydra:` sections are left out; a `${...}` interpolation is refused. A name of verl's own tree
    (`VERL_CONFIG_NAMES`) with no config path, or `--config-path=config`, is resolved against it as Hydra does
    (`own`: the entry point's default config, e.g. sft_trainer for `shardrl sft --verl`); a Megatron config is
    refused by its name, before anything is read."""
    name = (config_name or own).removesuffix(".yaml")  # (the entry point's default name)
    if "megatron" in name:
        raise VerlKeyError(MEGATRON.format(what=f"--config-name={config_name} is verl's Megatron trainer"))
    verl_tree = config_path is None or os.path.normpath(config_path) == "config"
    if verl_tree and name in VERL_CONFIG_NAMES:
        if name != own:
            (entry, how), (own_entry, _) = VERL_CONFIG_NAMES[name], VERL_CONFIG_NAMES[own]
            raise VerlKeyError(f"--config-name={config_name} is verl's config of {entry}, not of {own_entry}: {how}")
        return []
    ours = ", ".join(VERL_CONFIG_NAMES)
    if config_path is None:
        raise VerlKeyError(f"--config-name={config_name}: verl's config tree has no {name!r} (verl's: {ours}); give "
                           "--config-path DIR for a config of your own")
    path = os.path.join(os.path.expanduser(config_path), f"{name}.yaml")
    if not os.path.isfile(path):
        also = f" (and verl's config tree, which --config-path={config_path} names, has {ours})" if verl_tree else ""
        raise VerlKeyError(f"--config-path {config_path!r} --config-name {config_name!r}: no file {path!r}{also}")
    with open(path) as f:
        data = yaml.load(f, Loader=_HydraLikeLoader) or {}
    for entry in data.get("defaults") or []:  # a config composed on verl's Megatron trainer
        if "megatron" in str(entry):
            raise VerlKeyError(MEGATRON.format(what=f"{path}: its defaults name {entry!r}, verl's Megatron trainer"))
    args = []

    def walk(node, prefix):
        for key, value in node.items():
            full = f"{prefix}.{key}" if prefix else str(key)
            if not prefix and key in ("defaults", "hydra"):
                continue
            if isinstance(value, dict) and value:
                walk(value, full)
            elif isinstance(value, str) and "${" in value:
                raise VerlKeyError(f"{path}: {full}={value!r} is a Hydra interpolation; give the value itself")
            else:
                args.append(f"{full}={json.dumps(value)}")
    walk(data, "")
    return args


def translate(args: list[str]) -> Translation:
    """verl's `key=value` arguments as shardrl overrides; a `VerlKeyError` naming the full verl key of every key
    shardrl does not know and every value it cannot run, all in one message."""
    given = parse_verl_args(args)
    for key in [k for k in given if k.startswith(tuple(f"{d}." for d in DICT_KEYS)) and k not in VERL_KEYS]:
        section = next(d for d in DICT_KEYS if key.startswith(f"{d}."))  # Hydra's +dict.key=value, at any depth
        *inner, name = key[len(section) + 1:].split(".")
        node, path = given.setdefault(section, {}), section
        for part in inner:
            if not isinstance(node, dict):
                break
            node, path = node.setdefault(part, {}), f"{path}.{part}"
        if not isinstance(node, dict):
            raise VerlKeyError(f"verl key {key}: {path} is {node!r}, not a mapping")
        node[name] = given.pop(key)
    at_default = {}  # given keys dropped before the rules: at verl's default, or an engine's argument
    refused = []
    for key in [k for k in given if k not in VERL_KEYS]:
        value = given.pop(key)
        if _is_megatron(key, value):
            raise VerlKeyError(f"verl key {key}: Megatron is not supported (shardrl trains with FSDP2/FSDP1)")
        if key.startswith(ENGINE_KWARGS_PREFIX):  # free-form: any of the inference engine's own arguments
            at_default[key] = ("an inference engine's own argument (verl passes engine_kwargs to vLLM/SGLang); "
                               "shardrl generates with its own rollout (rollout.backend)")
        elif key.startswith(DROPPED_PREFIXES) and key in VERL_PPO_DEFAULTS:
            at_default[key] = "a profiler, Ray or reward-model-server setting; shardrl has none of these"
        elif key in VERL_PPO_DEFAULTS and _same(value, VERL_PPO_DEFAULTS[key]):
            at_default[key] = f"at verl's default ({VERL_PPO_DEFAULTS[key]!r}): no shardrl setting needed"
        elif key in VERL_PPO_DEFAULTS:
            refused.append(f"{key}={value!r} (verl's default {VERL_PPO_DEFAULTS[key]!r}; shardrl has no such setting, "
                           "so only verl's default runs)")
        else:
            close = difflib.get_close_matches(key, sorted({*VERL_KEYS, *VERL_PPO_DEFAULTS}), n=1, cutoff=0.8)
            refused.append(f"{key} (verl has no such key" + (f"; did you mean {close[0]}?)" if close else ")"))
    defaults = {k: v for k, v in VERL_DEFAULTS.items() if k not in given}
    if not given.get("data.val_files"):  # nothing to validate on: verl's val_before_train would only be warned about
        defaults.pop("trainer.val_before_train", None)
    values = {**defaults, **given}
    out: dict[str, Any] = {}
    dropped_keys: dict[str, str] = dict(at_default)
    applies = []
    for key, value in values.items():
        rule = VERL_KEYS[key]
        try:
            if value is None and rule.target is not None:  # null: verl's "unset"; shardrl's default, unless the
                try:                                        # conversion gives null a meaning (keep all, no limit)
                    converted = rule.convert(None) if rule.convert else None
                except (TypeError, ValueError, AttributeError):
                    converted = None
                if converted is not None or (rule.convert is not None and _means_none(rule)):
                    out[rule.target] = converted
                continue
            if rule.apply is not None:
                applies.append((key, rule, value))
            elif rule.drop is not None:
                if key in given:
                    dropped_keys[key] = rule.drop
            elif rule.refuse is not None:
                if value not in rule.neutral:
                    raise ValueError(rule.refuse)
            else:
                out[rule.target] = rule.convert(value) if rule.convert else value
        except (ValueError, TypeError) as e:
            refused.append(f"{key}={value!r}: {e}")
    notes = []
    for key, rule, value in applies:  # after the plain keys: they may override them (filter_overlong_prompts)
        try:
            if (note := rule.apply(value, out, values)) is not None:
                notes.append(note)
        except (ValueError, TypeError) as e:
            refused.append(f"{key}={value!r}: {e}")
    if refused:  # every one at once: a script is fixed in one pass, not one refusal a run
        listed = f": {refused[0]}" if len(refused) == 1 else f" ({len(refused)}):" + "".join(f"\n  - {r}"
                                                                                             for r in refused)
        raise VerlKeyError(f"verl key(s) shardrl cannot run{listed}\nThe verl keys shardrl takes are listed in "
                           "shardrl/compat/verl/keys.py (README, 'For verl users')")
    out["trainer.verl_metric_names"] = True  # the run logs verl's names too: a verl dashboard reads it
    out["rollout.multi_turn.reward_text"] = "conversation"  # verl's reward reads the whole response
    return Translation([f"{k}={json.dumps(v, default=str)}" for k, v in out.items()], dropped_keys, notes=notes)


ENGINE_KWARGS_PREFIX = "actor_rollout_ref.rollout.engine_kwargs."
"""verl's dicts of arguments for the rollout's engine (vllm, sglang, trtllm): its geo3k script sets
`+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True`."""
DROPPED_PREFIXES = ("global_profiler.", "actor_rollout_ref.actor.profiler.", "actor_rollout_ref.ref.profiler.",
                    "actor_rollout_ref.rollout.profiler.", "critic.profiler.", "reward_model.profiler.",
                    "ray_kwargs.", "reward_model.rollout.", "transfer_queue.")


def _is_megatron(key: str, value) -> bool:
    return ".megatron." in f".{key}." or (key.endswith("strategy") and value == "megatron")


def _same(value, default) -> bool:
    """Whether `value` is verl's default (a `${...}` default: whatever it refers to, taken as given)."""
    if isinstance(default, str) and default.startswith("${"):
        return False
    return value == default or (isinstance(default, (int, float)) and isinstance(value, (int, float))
                                and float(value) == float(default))


def _means_none(rule) -> bool:
    """Whether a rule's conversion returns None for null on purpose (an optional shardrl key such as
    optim.total_steps or trainer.output_dir)."""
    return rule.target in ("actor.optim.total_steps", "critic.optim.total_steps", "trainer.output_dir",
                           "model.tokenizer_path", "reward.function_path")


def native_hint(key: str) -> str | None:
    """For an unknown native key that is verl's name (`trainer.test_freq`, `actor.clip_ratio`, with or without
    `actor_rollout_ref.`): the shardrl key to use, or why there is none; None when `key` is no verl name."""
    def short(verl_key: str) -> str:
        return verl_key.removeprefix("actor_rollout_ref.")
    matches = [k for k in VERL_KEYS if key in (k, short(k))]
    if not matches and key.count(".") >= 1:  # a section's key under another role: `optim.lr_warmup_steps_ratio`
        tail = ".".join(key.split(".")[-2:])
        matches = [k for k in VERL_KEYS if short(k).endswith("." + tail) and short(k).split(".")[0] == key.split(".")[0]]
        # (under another of verl's roles or sections, not a typo'd one: `foo.optim.lr` is no verl name)
        sections = {part for k in VERL_KEYS for part in short(k).split(".")[:-1]}
        if key.split(".")[0] in sections:
            matches = matches or [k for k in VERL_KEYS if short(k).endswith("." + tail)]
    if not matches:
        return None
    verl_key = matches[0]
    rule = VERL_KEYS[verl_key]
    name = f"{key!r} is verl's name" + (f" ({verl_key})" if verl_key != key else "")
    if rule.target:
        target = rule.target
        # the same key under the role the user wrote (critic.optim.x, not actor.optim.x)
        user_root, target_root = key.split(".")[0], target.split(".")[0]
        if user_root != target_root and user_root in ("actor", "critic", "ref") and target_root in ("actor", "critic"):
            target = user_root + target[len(target_root):]
        return f"{name}; shardrl's is {target!r}"
    if rule.apply is not None:
        return f"{name}; shardrl's is {rule.hint}" if rule.hint else f"{name}; `shardrl train --verl` translates it"
    if rule.drop is not None:
        return f"{name}; shardrl has none: {rule.drop}"
    return f"{name}; shardrl has none: {rule.refuse}"
