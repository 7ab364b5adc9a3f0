"""Hugging Face hub ids where a config takes a model folder (`model.path=Qwen/Qwen2.5-0.5B-Instruct`): each is
resolved once, before anything loads, to the snapshot folder of the hub's cache (`HF_HUB_CACHE`), from the cache
when it holds the files, else downloaded; the config then holds the local folder (the run folder's config.yaml
records it) and nothing later reads the hub. Offline (`HF_HUB_OFFLINE=1`) or with the hub unreachable, an id not in
the cache is one error line saying how to download it.

    for line in resolve_hub_paths(cfg): ...   # "model.path=/root/.cache/huggingface/hub/models--Qwen--.../snapshots/<sha>"

Imports `huggingface_hub` (no torch) only when a value is an id.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

Files = Literal["model", "tokenizer", "config"]

MODEL_PATH_KEYS: dict[str, Files] = {
    "model.path": "model",
    "model.tokenizer_path": "tokenizer",
    "critic.model_path": "model",
    "reward.model_path": "model",
    "dpo.ref_model_path": "model",
}
"""Every config key that names a model or tokenizer folder, and what its folder must hold; a key a config class
lacks (critic in `shardrl sft`) is skipped."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[\w]")
_OTHER_FORMATS = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.mlmodel",
                  "onnx/*", "openvino/*", "coreml/*", "original/*"]
"""Files shardrl never reads (other frameworks' weights, Meta's original checkpoints): not downloaded."""
_TORCH_WEIGHTS = ["*.bin", "*.pt", "*.pth"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_hub_id(value: str) -> bool:
    """`org/name` that is no existing path: a hub id (a folder that exists always wins)."""
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value and not os.path.exists(os.path.expanduser(value))


def _offline() -> bool:
    from huggingface_hub import constants

    # (the environment read now too: huggingface_hub reads it once, at its import)
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def _missing(folder: Path, files: Files) -> str | None:
    """What a snapshot folder lacks for `files` (a cache filled in part: `shardrl plan` fetched only config.json,
    or a download was cut short), else None."""
    if files == "tokenizer":
        return None if any((folder / f).is_file() for f in _TOKENIZER_FILES) else "its tokenizer files"
    if not (folder / "config.json").is_file():
        return "config.json"
    if files == "config":
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(s for s in shards if not (folder / s).is_file())
        return f"weight files ({', '.join(absent[:3])})" if absent else None
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    return None if has_weights else "weights (*.safetensors)"


def _patterns(files: Files) -> dict:
    """snapshot_download's file filter for `files` (the same when reading the cache, whose check of a snapshot's
    completeness then asks only for these)."""
    if files == "config":
        return {"allow_patterns": ["config.json", "*.py"]}
    if files == "tokenizer":
        return {"ignore_patterns": _OTHER_FORMATS + _TORCH_WEIGHTS + ["*.safetensors"]}
    return {"ignore_patterns": _OTHER_FORMATS + _TORCH_WEIGHTS}


def _download(repo_id: str, files: Files, cache_dir: str) -> str:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo_id, cache_dir=cache_dir, **_patterns(files))
    if files == "model" and not any(Path(folder).glob("*.safetensors")):  # an older repo of PyTorch weights only
        folder = snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=["pytorch_model*.bin"])
    return folder


def hub_folder(key: str, repo_id: str, files: Files = "model") -> str:
    """The local snapshot folder of hub model `repo_id` (config key `key`, for messages) holding `files`: the
    cache's when complete, else downloaded into the cache. A ValueError in one line when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    cache_dir = _cache_dir()
    how = (f"download it with `hf download {repo_id}` (or `huggingface-cli download {repo_id}`) where the hub is "
           f"reachable, into this cache (HF_HUB_CACHE={cache_dir}), or give a local model folder")
    missing = "it"
    try:
        folder = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True, **_patterns(files))
        missing = _missing(Path(folder), files)
        if missing is None:
            return folder
    except LocalEntryNotFoundError:  # (IncompleteSnapshotError included: a download cut short)
        pass
    except HFValidationError as e:
        raise ValueError(f"{key}={repo_id!r} is no local folder, nor a valid hub id ({e})") from None
    in_cache = (f"is not in the Hugging Face cache ({cache_dir})" if missing == "it"
                else f"is in the Hugging Face cache ({cache_dir}) without {missing}")
    if _offline():
        raise ValueError(f"{key}={repo_id!r} is no local folder, and the hub id {in_cache} while HF_HUB_OFFLINE is "
                         f"set: {how}, or unset HF_HUB_OFFLINE to let shardrl download it")
    log.info("%s=%s: downloading it from the Hugging Face hub into %s", key, repo_id, cache_dir)
    try:
        folder = _download(repo_id, files, cache_dir)
    except GatedRepoError:
        raise ValueError(f"{key}={repo_id!r}: the hub's model is gated; accept its terms on huggingface.co and log "
                         "in (`hf auth login`), or give a local model folder") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{key}={repo_id!r} is no local folder, and the Hugging Face hub has no model of that id "
                         "(or it is private: log in with `hf auth login`)") from None
    except (LocalEntryNotFoundError, OSError) as e:  # (the hub unreachable: no connection, a timeout)
        raise ValueError(f"{key}={repo_id!r} is no local folder, and the hub id {in_cache}; the hub could not be "
                         f"reached ({type(e.__cause__ or e).__name__}): {how}") from None
    if (missing := _missing(Path(folder), files)) is not None:
        raise ValueError(f"{key}={repo_id!r}: the hub's model has no {missing}; is it a Hugging Face transformers "
                         "model?")
    return folder


def _get(cfg: Any, key: str) -> tuple[Any, str] | None:
    *sections, name = key.split(".")
    for part in sections:
        cfg = getattr(cfg, part, None)
    return (cfg, name) if cfg is not None and hasattr(cfg, name) else None


def resolve_hub_paths(cfg: Any, files: Files | None = None, keys: tuple[str, ...] = tuple(MODEL_PATH_KEYS)
                      ) -> list[str]:
    """Every hub id among `cfg`'s model folders (`MODEL_PATH_KEYS`, or `keys`) replaced in `cfg` by its local
    snapshot folder; returns those as `key=folder` overrides (for the ranks a launcher starts). `files` ("config":
    `shardrl plan`, which reads config.json only) overrides what each key's folder must hold."""
    resolved = []
    for key in keys:
        found = _get(cfg, key)
        value = getattr(*found) if found else None
        if not isinstance(value, str) or not is_hub_id(value):
            continue
        folder = hub_folder(key, value, files or MODEL_PATH_KEYS[key])
        setattr(*found, folder)
        log.info("%s=%s is the hub's model, at %s", key, value, folder)
        resolved.append(f"{key}={folder}")
    return resolved
