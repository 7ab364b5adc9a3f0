"""How typed config dataclasses are filled, checked and saved; the schema itself is `shardrl.config.schema`.

The dataclasses are the only schema. A YAML file (nested mappings -> nested dataclasses) and then
`key=value` overrides with dotted keys fill them; every value is coerced to its field's annotation:

- int -> float, and a string such as "1e-5" -> float (PyYAML reads `1e-5` as a string);
- int also takes an integral float or string ("2e4" -> 20000); bool takes only a bool;
- `X | None` takes null; `Literal[...]` takes one of its choices; a str field takes an override's
  text as typed (`experiment_name=123` -> "123");
- a dataclass field takes a mapping (merged into its defaults); `list[T]` / `dict[K, V]` are checked
  element-wise; plain `dict` / `list` / `Any` are taken as-is, and a dotted override may reach
  inside a plain dict field (`model.tiny.hidden_size=64`).

After filling, `validate_config` re-checks every field's type and calls each section's
`validate(prefix)`, children first; `prefix` is the section's dotted key ("actor.optim", or "" for
the root) so messages name the full key. Every user mistake is a `ConfigError` (a `ValueError`). A key that
moved stays readable where a section's `renamed_keys` says it went (old name -> new dotted name under the
section), with a one-line deprecation note; `moved_key` names a key that no longer works and where it went.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import os
import re
import types
import typing
from typing import Any, Callable, Iterable, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
log = logging.getLogger(__name__)

OVERRIDE_FORM = "expected key=value with a dotted key, e.g. actor.optim.lr=1e-5"


class ConfigError(ValueError):
    """A config value, key, override or file that cannot be used; the message names the key."""


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def require(section: Any, prefix: str, name: str, ok: bool, requirement: str) -> None:
    """Raise `ConfigError` naming `prefix.name` and its value unless `ok`.

    `name` may be dotted (`"data.train_batch_size"`) for checks that span sections.
    """
    if ok:
        return
    value = section
    for part in name.split("."):
        value = getattr(value, part)
    raise ConfigError(f"invalid config value {join_key(prefix, name)}={value!r}: {requirement}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest(value: int, valid: list[int]) -> str:
    """The closest valid values below and above `value`, for an error message ("4 or 6")."""
    below = max((v for v in valid if v < value), default=None)
    above = min((v for v in valid if v > value), default=None)
    return " or ".join(str(v) for v in (below, above) if v is not None)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


@functools.lru_cache(maxsize=None)
def config_keys(cls: type) -> tuple[str, ...]:
    """Every dotted key of a config dataclass, sections included (`actor`, `actor.engine`, ...)."""
    keys: list[str] = []
    for name, tp in _hints(cls).items():
        keys.append(name)
        if dataclasses.is_dataclass(tp):
            keys.extend(f"{name}.{sub}" for sub in config_keys(tp))
    return tuple(keys)


def _unknown_key(key: str, cls: type, prefix: str) -> ConfigError:
    known_name = getattr(cls, "unknown_key_hint", None)  # another framework's name for one of ours
    hint = known_name(key) if known_name else None
    if hint:
        return ConfigError(f"unknown config key {key!r}: {hint}")
    candidates = [join_key(prefix, k) for k in config_keys(cls)]
    parent, _, leaf = key.rpartition(".")
    ours = getattr(cls, "key_aliases", {}).get(leaf)  # HF's `learning_rate` is closer to `clip_grad` than to `lr`
    close = [join_key(parent, ours)] if ours and join_key(parent, ours) in candidates else []
    close = close or difflib.get_close_matches(key, candidates, n=1)
    if not close:  # `lr=1e-5` at the root: offer the keys that end the same way
        close = [c for c in candidates if c.rsplit(".", 1)[-1] in (leaf, ours)][:3]
    if close:
        hint = "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        here = sorted(_hints(cls))
        hint = f"; valid keys{f' under {prefix!r}' if prefix else ''}: {', '.join(here)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]" if args else origin.__name__
    return getattr(tp, "__name__", repr(tp))


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"config key {key!r} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def coerce(value: Any, tp: Any, key: str, raw: str | None = None) -> Any:
    """`value` converted to annotation `tp`, or a `ConfigError` naming `key`.

    `raw` is an override's text, used as-is when a str field gets a YAML scalar of another type.
    """
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(key, value, tp)
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: keep X's own, more precise, message
            return coerce(value, options[0], key, raw)
        for option in options:
            try:
                return coerce(value, option, key, raw)
            except ConfigError:
                pass
        raise _type_error(key, value, tp)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        choices = ", ".join(repr(a) for a in args)
        close = difflib.get_close_matches(value, [str(a) for a in args], n=1) if isinstance(value, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"config key {key!r} must be one of {choices}; got {value!r}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, key)
        raise ConfigError(f"config key {key!r} is a section ({tp.__name__}); give it a mapping, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, (float, str)):
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None and number.is_integer():
                return int(number)
        raise _type_error(key, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        if raw is not None and isinstance(value, (int, float, bool)):
            return raw.strip()
        raise _type_error(key, value, tp)
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, value, tp)
        item = args[0] if args else Any
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        if not args:
            return dict(value)
        return {coerce(k, args[0], key): coerce(v, args[1], join_key(key, str(k))) for k, v in value.items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _type_error(key, value, tp)


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """`cls()` with a nested mapping merged in; missing keys keep their defaults, unknown keys are errors.

    Merging into the defaults (rather than building each section afresh) keeps a parent's own
    defaults for a section, e.g. the critic's lr of 1e-5. Config classes therefore need a default
    for every field.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config section {prefix or cls.__name__!r} must be a mapping, got {data!r}")
    section = cls()
    _merge(section, data, prefix)
    return section


def _merge(section: Any, data: dict, prefix: str, scope: tuple[type, str] | None = None) -> None:
    scope = scope or (type(section), prefix)
    _refuse_old_and_new(type(section), data, prefix)
    for name, value in data.items():
        name = str(name)
        if "." in name and all(name.split(".")):
            raise _dotted_in_yaml(section, name, value, prefix, scope)
        _set(section, [name], value, None, prefix, scope)


def _refuse_old_and_new(cls: type, data: dict, prefix: str) -> None:
    """A mapping that sets a deprecated key and the key it moved to (`max_batch: 8` and `fast: {max_batch: 16}`)
    is refused: one of the two would be dropped without a word, by the order of the lines."""
    for old, new in getattr(cls, "renamed_keys", {}).items():
        if old not in data:
            continue
        value: Any = data
        for part in new.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            raise ConfigError(f"config keys {join_key(prefix, old)!r} and {join_key(prefix, new)!r} are both set: "
                              f"they are one setting ({old!r} is its deprecated name); keep {new!r} only")


_MISSING = object()


def _dotted_in_yaml(section: Any, name: str, value: Any, prefix: str, scope: tuple[type, str]) -> ConfigError:
    """The error for a dotted key inside YAML (`model.lora.rank: 4`): YAML keys nest, dots are for overrides. Read
    as one key it is unknown, and the nearest known key is itself; so the message shows it nested."""
    parts = name.split(".")
    try:  # on a copy: is it a key at all, and which?
        _set(copy.deepcopy(section), parts, value, None, prefix, scope)
    except ConfigError as e:
        if str(e).startswith("unknown config key"):
            return ConfigError(f"{e} (and in a YAML file keys nest, one level per line; dots are for key=value "
                               "overrides)")
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    where = f" under {prefix!r}" if prefix else ""
    return ConfigError(f"config key {name!r}{where} is dotted, but in a YAML file keys nest: write "
                       f"{parts[0]}: {_flow(nested[parts[0]])} "
                       f"(or {', '.join(p + ':' for p in parts)} each on a line of its own, indented under the one "
                       f"before); dotted keys are for key=value overrides ({join_key(prefix, name)}={_flow(value)})")


def _flow(value: Any) -> str:
    """`value` as one line of YAML (`{lora: {rank: 4}}`)."""
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()


def _set(section: Any, parts: list[str], value: Any, raw: str | None, prefix: str, scope: tuple[type, str]) -> None:
    """Set the field at dotted path `parts` below `section` (whose own key is `prefix`).

    `scope` is the (class, key) the walk started from; unknown-key suggestions search all of it, so a
    typo in a section name (`actor.engin.fsdp_size`) is matched too.
    """
    name, rest = parts[0], parts[1:]
    key = join_key(prefix, name)
    full_key = join_key(key, ".".join(rest)) if rest else key
    hints = _hints(type(section))
    renamed = getattr(type(section), "renamed_keys", {}).get(name)
    if name not in hints and renamed:  # an old key that still works where it moved to, with a note
        log.warning("config key %r is deprecated: it is %r now (it still works, for a while)", key,
                    join_key(prefix, renamed))
        _set(section, renamed.split(".") + rest, value, raw, prefix, scope)
        return
    if name not in hints:
        moved = getattr(type(section), "moved_key", None)
        where = moved(name, prefix) if moved else None
        if where:
            raise ConfigError(f"config key {key!r} is no longer here: {where}")
        raise _unknown_key(full_key, *scope)
    tp, current = hints[name], getattr(section, name)
    if rest and dataclasses.is_dataclass(current):
        _set(current, rest, value, raw, key, scope)
    elif rest and (isinstance(current, dict) or (current is None and _allows_dict(tp))):
        if current is None:
            current = {}
            setattr(section, name, current)
        for part in rest[:-1]:
            current = current.setdefault(part, {})
            if not isinstance(current, dict):
                raise ConfigError(f"cannot set {full_key!r}: {part!r} inside {key!r} is not a mapping")
        current[rest[-1]] = value
    elif rest:
        raise ConfigError(f"cannot set {full_key!r}: {key!r} holds a value of type {_type_name(tp)}, not a section")
    elif dataclasses.is_dataclass(current) and (value is None or isinstance(value, dict)):
        # `actor.optim={lr: 1e-5}` changes lr and keeps the rest; an empty YAML section is None
        _merge(current, value or {}, key, scope)
    else:
        setattr(section, name, coerce(value, tp, key, raw))


def _allows_dict(tp: Any) -> bool:
    return any(a is dict or typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp)))


def apply_override(cfg: Any, override: str) -> None:
    """Apply one `dotted.key=value` override in place; the value is read as YAML (`1e-5`, `[1,2]`, `null`)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"bad override {override!r}: {OVERRIDE_FORM}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {override!r}: cannot read the value {text!r} as YAML ({e})") from None
    _set(cfg, key.split("."), value, text, "", (type(cfg), ""))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last,
    so a second `actor:` section would silently replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping (first on line {seen[key] + 1}, "
                    f"again on line {key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> dict:
    """The top-level mapping of a YAML file (empty file -> {}), or a `ConfigError` naming the path (and the line
    of a key given twice)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path!r}")
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys at the top level, got "
                          f"{type(data).__name__}")
    return data


def validate_config(cfg: Any, prefix: str = "") -> None:
    """Re-check every field's type (normalising e.g. int -> float) and run each `validate(prefix)`."""
    for name, tp in _hints(type(cfg)).items():
        key = join_key(prefix, name)
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            validate_config(value, key)
        else:
            setattr(cfg, name, coerce(value, tp, key))
    if hasattr(cfg, "validate"):
        cfg.validate(prefix)


def unknown_keys(cls: type, data: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a nested mapping that `cls` has no field for (a plain dict field takes any key below it)."""
    hints, unknown = _hints(cls), []
    for name, value in data.items():
        key = join_key(prefix, str(name))
        if str(name) not in hints and str(name) not in getattr(cls, "renamed_keys", {}):
            unknown.append(key)
        elif str(name) in hints and dataclasses.is_dataclass(hints[str(name)]) and isinstance(value, dict):
            unknown += unknown_keys(hints[str(name)], value, key)
    return unknown


def given_keys(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys a nested mapping sets, sections included (`{"ref": {"engine": {...}}}` -> ref, ref.engine,
    ...)."""
    keys = set()
    for name, value in data.items():
        key = join_key(prefix, str(name))
        keys.add(key)
        if isinstance(value, dict):
            keys |= given_keys(value, key)
    return keys


def load(cls: type[T], path: str | None = None, overrides: Iterable[str] = (),
         file_hint: Callable[[str, dict, str], str | None] | None = None) -> T:
    """Defaults of `cls`, then the YAML file at `path`, then `overrides` in order; validated.

    A config class with `inherit(given)` gets the set of keys the file and the overrides gave, before validation,
    to fill the others from its own values (the reference takes the actor's engine settings it does not set).
    `file_hint(path, data, error)`, for a file `cls` refuses with `error`, may say what the file is instead (another
    command's config); its line replaces the error."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got the string {overrides!r}")
    data = read_yaml(path) if path is not None else {}
    try:
        cfg = from_dict(cls, data) if path is not None else cls()
    except ConfigError as e:
        hint = file_hint(path, data, str(e)) if file_hint else None  # a `shardrl dpo` file given to `shardrl train`
        if hint:
            raise ConfigError(hint) from None
        raise
    given = given_keys(data)
    for override in overrides:
        apply_override(cfg, override)
        key, _, text = override.partition("=")
        given.add(key.strip())
        value = yaml.safe_load(text)  # readable: apply_override read it
        if isinstance(value, dict):
            given |= given_keys(value, key.strip())
    if hasattr(cfg, "inherit"):
        cfg.inherit(given)
    expand_home(cfg)
    validate_config(cfg)
    return cfg


PATH_FIELDS = re.compile(r"(path|_dir|_files|entrypoint|^resume|^env)$")
"""Config fields that name files or folders (model.path, trainer.output_dir, data.train_files, rollout.env, ...)."""


def expand_home(cfg: Any) -> None:
    """`~` at the start of a path field (`PATH_FIELDS`) is the home folder, as a shell would read it (a YAML file or
    a quoted override keeps it: the run went to a folder named "~" under the current one)."""
    def expand(value):
        if isinstance(value, str) and (value == "~" or value.startswith("~/")):
            return os.path.expanduser(value)
        if isinstance(value, list):
            return [expand(v) for v in value]
        return value

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            expand_home(value)
        elif PATH_FIELDS.search(f.name):
            setattr(cfg, f.name, expand(value))


def config_to_dict(cfg: Any) -> dict:
    """A plain nested dict of a config (only YAML-safe types), e.g. for a run folder or a logger."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str) -> None:
    """Write the resolved config as YAML; `load(type(cfg), path)` reads it back equal."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)
