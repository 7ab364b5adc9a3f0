"""The config's own documentation: each field's docstring (the string literal right under it in the dataclass) and
its default, for `shardrl config` and the schema's test that every field has one. Reads the source; imports no
torch.

    for key, default, doc in describe_keys(Config, "actor.optim"): ...
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
from typing import Any, Iterator

import yaml

from shardrl.config.load import config_keys


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of dataclass `cls`, a field documented in a base class included (the class's own
    wins); a field without one is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # bases first, so a subclass's docstring replaces its base's
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # no source shipped (a zipped or compiled install): no docstrings
            continue
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _walk(section: Any, prefix: str) -> Iterator[tuple[str, Any, str]]:
    docs = field_docs(type(section))
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, key)
        else:
            yield key, value, docs.get(f.name, "")


def describe_keys(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, docstring) of every leaf key of config class `cls` under `prefix` (a section such as
    "actor.optim", or one key; "" for all). The defaults are those of a fresh `cls()`, so a section built with
    other defaults than its class's (the offline trainers' engine) shows the command's own. A ValueError naming the
    closest keys for a prefix that is no key."""
    rows = list(_walk(cls(), ""))
    if not prefix:
        return rows
    chosen = [r for r in rows if r[0] == prefix or r[0].startswith(prefix + ".")]
    if not chosen:
        close = difflib.get_close_matches(prefix, config_keys(cls), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"no config key or section {prefix!r} in {cls.__name__}{hint}")
    return chosen


def format_value(value: Any) -> str:
    """A default as it would be written in YAML or a key=value override (null, true, [a, b], {k: v})."""
    if isinstance(value, float):
        return repr(value)  # 1e-06, not YAML's 1.0e-06
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def format_keys(rows: list[tuple[str, Any, str]], width: int = 100) -> str:
    """`key = default` lines, each with its docstring wrapped and indented under it."""
    out = []
    for key, value, doc in rows:
        out.append(f"{key} = {format_value(value)}")
        if doc:
            out.extend(textwrap.wrap(" ".join(doc.split()), width, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out)
