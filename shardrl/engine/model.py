"""Building the Hugging Face causal LM an engine trains, and the thin module that turns it into an
RL policy (per-token log-probs), a critic (per-token values) or a reward model (per-sequence scores).

The engine builds the model on the meta device; weights come in after sharding (`shardrl.engine.loading`:
each rank reads its own slices, or rank 0 reads them all and broadcasts).

`PolicyModel.forward` is three steps, each readable alone: the batch's tokens laid out for the decoder
(`packed_tokens` / `padded_tokens`: packing and the way back to (B, T)), this rank's piece of them under
sequence parallelism (`split_sequence`), and a head on the decoder's hidden states (`score_head`,
`value_outputs`, `log_prob_outputs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers

from shardrl.engine.attention import ATTN_NAME, attention_kwargs, use_segments_attention
from shardrl.engine.logprob import (chunked_log_probs, chunked_log_probs_at, chunked_log_probs_top1, chunked_top_k,
                                    nonzero_known, pack, shift_to_scored_token, unpack)
from shardrl.engine.microbatch import RowSizes
from shardrl.engine.moe import RouterReplay, load_balancing_loss
from shardrl.engine.vision import (embedded_inputs, idle_vision_tower, micro_batch_images, vision_decoder_inputs,
                                   vision_sequence_piece)
from shardrl.models.vision import is_vision_language, vision_family
from shardrl.models.families import is_moe
from shardrl.engine.ulysses import gather_seq, pad_to_multiple
from shardrl.models.config import text_config
from shardrl.config.userfile import refuse_gguf_folder, require_folder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_tiny_keys(model_type: str, kwargs: dict, key: str = "model.tiny") -> None:
    """A `ConfigError` for a key of `model.tiny` (or of `key`, another mapping of config kwargs) that is a near miss
    of one its model type's config class takes (hiden_size for hidden_size): HF's config classes keep any unknown
    kwarg as an attribute, so a typo would silently leave the default size. Other unknown keys pass: model code
    reads optional attributes (head_dim, rope_theta) that no config signature lists."""
    import difflib
    import inspect

    from shardrl.config.load import ConfigError

    try:
        default = transformers.AutoConfig.for_model(model_type)
    except ValueError as e:
        if key != "model.tiny":  # a remote-code model type: no class to check against
            return
        raise ConfigError(f"invalid config value model.tiny: model_type {model_type!r} is not a model type "
                          f"transformers knows ({e})") from None
    known = set(default.to_dict()) | set(inspect.signature(type(default).__init__).parameters)
    known |= set(inspect.signature(transformers.PretrainedConfig.__init__).parameters)
    known |= set(getattr(type(default), "attribute_map", {}))
    # a class-level name (a property such as the legacy rope_scaling) is the class's own, not a stray kwarg
    unknown = [k for k in kwargs if k not in known and not hasattr(type(default), k)]
    misses = {k: close[0] for k in unknown if (close := difflib.get_close_matches(k, known, 1, 0.85))}
    if misses:
        hints = ", ".join(f"{k!r} -> {v!r}" for k, v in sorted(misses.items()))
        raise ConfigError(f"invalid config value {key}: {sorted(misses)} are not keys of the {model_type!r} "
                          f"config ({type(default).__name__}); did you mean {hints}?")


def check_tiny_shape(config, explicit_head_dim: bool) -> None:
    """A `ConfigError` for a `model.tiny` whose heads do not cut its width: the model would fail at its first
    forward with a tensor-size mismatch."""
    from shardrl.config.load import ConfigError

    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return
    if not explicit_head_dim and hidden % heads:
        raise ConfigError(f"invalid config value model.tiny: hidden_size={hidden} is not a multiple of "
                          f"num_attention_heads={heads} (each head is hidden_size / num_attention_heads wide); "
                          "change one of them, or give head_dim")
    if isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ConfigError(f"invalid config value model.tiny: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")


def load_hf_config(path: str | None, tiny: dict | None, trust_remote_code: bool = False, task: str = "causal_lm",
                   new_head_ok: bool = False, key: str = "model.path", override: dict | None = None,
                   override_key: str = "model.override_config"):
    """The HF config of a local model folder, or one built from `tiny` (kwargs incl. `model_type`); `key` is the
    config key that gave `path`, for the messages (dpo.ref_model_path, critic.model_path, reward.model_path).
    `override` (the config key `override_key`, e.g. model.override_config): config attributes set over the loaded
    ones (`override_hf_config`).

    `task` "causal_lm" (policies, critics) accepts any model `AutoModelForCausalLM` builds (Qwen2ForCausalLM,
    GPT2LMHeadModel, ...); "seq_cls" (reward models) accepts *ForSequenceClassification ones with one label, and
    with `new_head_ok` (a reward model about to be trained) a causal LM too, whose LM head gives way to a new
    one-label score head."""
    config = _read_hf_config(path, tiny, trust_remote_code, task, new_head_ok, key)
    if override:
        override_hf_config(config, override, override_key)
    return config


def override_hf_config(config, override: dict, key: str = "model.override_config") -> None:
    """Sets `override`'s attributes on the HF `config` as verl's `update_model_config` does for its
    model.override_config: a mapping key by key into the sub-config (text_config) or mapping (rope_scaling) it
    names. transformers 5 keeps the rotary settings in `rope_parameters`: rope_theta is set there, where the model
    reads it, and rope_scaling's legacy `type` is its `rope_type`. A near miss of a config key (a typo, which HF
    would keep as an attribute nothing reads) is refused."""
    check_tiny_keys(getattr(config, "model_type", ""), {k: v for k, v in override.items() if not isinstance(v, dict)},
                    key)
    for name, value in override.items():
        current, rope = getattr(config, name, None), getattr(config, "rope_parameters", None)
        if isinstance(value, dict) and isinstance(current, transformers.PretrainedConfig):
            override_hf_config(current, value, f"{key}.{name}")
        elif isinstance(value, dict):
            merged = {**(current if isinstance(current, dict) else {}), **value}
            if "type" in value and name in ("rope_scaling", "rope_parameters"):
                merged["rope_type"] = value["type"]
            setattr(config, name, merged)
        elif isinstance(rope, dict) and name in rope and name not in vars(config):
            rope[name] = value
        else:
            setattr(config, name, value)


def _read_hf_config(path: str | None, tiny: dict | None, trust_remote_code: bool, task: str, new_head_ok: bool,
                    key: str):
    if path is None:
        if not tiny:
            raise ValueError("model.path is not set; give a local Hugging Face model folder (or model.tiny for a test model)")
        kwargs = dict(tiny)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.tiny needs a 'model_type' (e.g. 'qwen2' or 'llama')")
        check_tiny_keys(model_type, kwargs)
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        if task == "causal_lm" and causal_lm_class_name(config) is None and not is_vision_language(config):
            raise ValueError(f"model.tiny: AutoModelForCausalLM builds no {model_type!r} model; "
                             "shardrl trains causal LMs")
        if task == "seq_cls":
            config.num_labels = 1
        return config
    folder = require_folder(key, path)
    if not (folder / "config.json").is_file():
        refuse_gguf_folder(key, folder)
        raise ValueError(f"{key}={path!r} has no config.json; is it a Hugging Face model folder?")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        if e.errno is not None:  # (the disk's: said as it is)
            raise
        raise ValueError(f"{key}={path!r}: its config.json cannot be read ({e}); copy or save the model "
                         "folder again") from None
    archs = getattr(config, "architectures", None) or []
    if task == "seq_cls" and new_head_ok and archs and all(a.endswith("ForCausalLM") for a in archs):
        config.num_labels = 1  # a reward model to train from a causal LM: a new score head (said where it's built)
        return config
    if task == "seq_cls":
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"model folder {path!r} holds a {', '.join(archs)}, not a sequence classifier "
                             "(*ForSequenceClassification); a reward model must be a sequence-classification model "
                             "with one label")
    elif not is_vision_language(config):  # any class AutoModelForCausalLM builds (GPT-2's is GPT2LMHeadModel)
        causal_lm = causal_lm_class_name(config)
        if causal_lm is None or (archs and not any(a.endswith("ForCausalLM") or a == causal_lm for a in archs)):
            holds = ", ".join(archs) or f"{config.model_type!r} model"
            builds = f", here a {causal_lm}" if causal_lm else ""
            raise ValueError(f"model folder {path!r} holds a {holds}, not a causal LM (a model AutoModelForCausalLM "
                             f"builds{builds}); shardrl trains causal language models")
    if task == "seq_cls" and getattr(config, "num_labels", 1) != 1:
        raise ValueError(f"reward model {path!r} has {config.num_labels} labels; a reward model has one")
    return config


def disable_dropout(config) -> list[str]:
    """Sets the config's dropout probabilities (`*dropout*`, `*pdrop`, and Mixtral's router_jitter_noise, a random
    scaling of the router's input in training) to 0; returns the names it changed."""
    changed = []
    for name, value in vars(config).items():
        noisy = "dropout" in name or name.endswith("pdrop") or name == "router_jitter_noise"
        if noisy and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def causal_lm_class_name(config) -> str | None:
    """The name of the class `AutoModelForCausalLM` builds for `config` (remote code included), or None."""
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return auto_map["AutoModelForCausalLM"].rsplit(".", 1)[-1]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    return name if isinstance(name, str) else None


def check_model_weights(path: str) -> None:
    """A model folder must hold weights (safetensors or PyTorch .bin files) to build a model from it."""
    folder = Path(path)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise ValueError(f"model folder {path!r} has a config.json but no weights (*.safetensors or "
                         "pytorch_model*.bin); write them with model.save_pretrained(folder)")
    for file in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem is not None:
            raise ValueError(f"weights file {str(file)!r} is corrupt ({problem}); copy or save it again")


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a .safetensors file's header and size (a truncated or garbled file), else None.
    Reads only the header: 8 bytes of length, then that much JSON naming each tensor's byte range."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"its header claims {n} bytes but the file has {size}"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"its header is not JSON: {e}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ranges = [v.get("data_offsets") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if len(ranges) != len(header) - ("__metadata__" in header) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in ranges):
        return "its header does not describe tensors"
    end = 8 + n + max((r[1] for r in ranges), default=0)
    if end > size:
        return f"truncated: its tensors end at byte {end} but the file has {size} bytes"
    return None


def _shape_mismatches(auto, config, path, limit: int = 2) -> list[str]:
    """The first `limit` tensors of the folder's safetensors files whose shapes are not what `config` builds."""
    from safetensors import safe_open

    with torch.device("meta"):
        wanted = {n: tuple(t.shape) for n, t in auto.from_config(config).state_dict().items()}
    found = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                mine = wanted.get(name) or next((v for k, v in wanted.items() if k.endswith("." + name)
                                                 or name.endswith("." + k)), None)
                shape = tuple(f.get_slice(name).get_shape())
                if mine is not None and mine != shape:
                    found.append(f"{name} has shape {shape} in {file.name}, {mine} by config.json")
                    if len(found) == limit:
                        return found
    return found


def build_causal_lm(config, path: str | None, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                    attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                    sequence_classification: bool = False) -> nn.Module:
    """The model with real weights (from `path`, or a seeded random init) on `device` ('meta' for none). A
    vision-language model is HF's image-text-to-text class; `attn_implementation` is its decoder's, its vision
    tower's SDPA over each image or window (bidirectional: the packed causal kernel is not for it), the segments of
    one length in one call (`use_segments_attention`)."""
    kwargs = dict(attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    auto = transformers.AutoModelForSequenceClassification if sequence_classification else transformers.AutoModelForCausalLM
    if is_vision_language(config) and not sequence_classification:
        auto = transformers.AutoModelForImageTextToText
        kwargs["attn_implementation"] = {"": attn_implementation, "text_config": attn_implementation,
                                         "vision_config": "sdpa"}
    if str(device) == "meta":
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype, **kwargs)
        use_segments_attention(model)
        return model
    if path is not None:
        from safetensors import SafetensorError

        try:
            with torch.random.fork_rng(devices=[]):  # a head the files lack (a new score head) starts from `seed`
                torch.manual_seed(seed)
                if sequence_classification and _is_causal_lm_folder(config):
                    model = _with_new_score_head(auto, path, config, dtype, kwargs)
                else:
                    model = auto.from_pretrained(path, config=config, dtype=dtype, **kwargs)
        except SafetensorError as e:  # a garbled file whose header still reads
            raise ValueError(f"cannot read the weights in model folder {path!r}: {e}; copy or save them again") from e
        except RuntimeError as e:  # transformers' refusal of weights of other shapes than config.json says
            if "mismatched" not in str(e) and "size mismatch" not in str(e):
                raise
            shapes = _shape_mismatches(auto, config, path)
            raise ValueError(f"the weights in model folder {path!r} do not fit its config.json"
                             f"{': ' + '; '.join(shapes) if shapes else ''}; its config.json is not the one the "
                             "weights were saved with (copy both from the same model)") from None
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=dtype, **kwargs)
    use_segments_attention(model)
    return model.to(device)


def _is_causal_lm_folder(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return bool(archs) and all(a.endswith("ForCausalLM") for a in archs)


def _with_new_score_head(auto, path: str, config, dtype: torch.dtype, kwargs: dict) -> nn.Module:
    """A sequence classifier from a causal LM's folder: transformers' load report (lm_head unexpected, score
    missing, "consider training") is what building a reward model means, so it is silenced and said in one line;
    a key missing or left over beyond the two heads is still warned about."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    head = {name for name, _ in model.named_children() if name in ("score", "classifier")}
    missing = sorted(k for k in info["missing_keys"] if k.split(".")[0] not in head)
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith("lm_head."))
    if missing or unexpected:
        log.warning("loading the reward model from %s: %d weight(s) not in its files, initialized at random (%s); "
                    "%d weight(s) in its files unused (%s)", path, len(missing), ", ".join(missing[:5]) or "-",
                    len(unexpected), ", ".join(unexpected[:5]) or "-")
    hidden = getattr(text_config(config), "hidden_size", "hidden")
    log.info("a new score head (%s -> 1) on %s; its lm_head is not used", hidden, path)
    return model


def decoder_block_classes(model: nn.Module) -> set[type]:
    """The classes of the repeated decoder blocks (what FSDP wraps one by one)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} (no _no_split_modules match)")
    return classes


def untied_head(lm: nn.Module) -> nn.Module | None:
    """The model's output projection (lm_head) where it is a weight of its own, not the input embedding's; else None."""
    out, into = lm.get_output_embeddings(), lm.get_input_embeddings()
    return out if out is not None and out.weight is not into.weight else None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    classes = decoder_block_classes(model)
    return [m for m in model.modules() if type(m) in classes]


HEADS = ("lm", "value", "score")


class PolicyModel(nn.Module):
    """An HF model with one of three heads (`HEADS`), returning per-token or per-sequence outputs:
    "lm" -> `log_probs` (B, T) (and `entropy`), "value" -> `values` (B, T) from a new linear head,
    "score" -> `scores` (B,) from a sequence classifier's head at each sequence's last token.

    This module, not the HF model, is the FSDP root: its forward runs the decoder and then the output
    projection in chunks, so the root's parameters (embeddings, final norm, lm_head) are gathered by FSDP's
    own hooks. Its state dict keys are the HF names behind a `lm.` (or `value_head.`) prefix.
    """

    def __init__(self, lm: nn.Module, head: str = "lm", chunk_size: int = 1024):
        super().__init__()
        self.lm = lm
        self.head = head
        self.chunk_size = chunk_size
        self.value_head = nn.Linear(text_config(lm.config).hidden_size, 1, bias=True) if head == "value" else None
        unread = untied_head(lm) if head == "value" else None
        if unread is not None:
            # a critic never reads its own lm_head: not trained, so no AdamW state a checkpoint would lack for it
            # (a resumed optimizer makes state for every parameter it trains) and no gradient memory
            unread.requires_grad_(False)
        self.router_replay = RouterReplay(lm) if is_moe(lm.config) else None  # see `forward`'s routed_experts
        self.vision = is_vision_language(lm.config)

    sp_group = None
    """The Ulysses sequence-parallel group when sp > 1 (set by the engine); None otherwise."""

    def forward(self, input_ids, attention_mask, remove_padding: bool = True,
                temperature: float = 1.0, with_entropy: bool = False,
                score_from: int | None = None, routed_experts: torch.Tensor | None = None,
                record_routing: bool = False, count_replay: bool = True,
                images: list | None = None, with_top1: bool = False, top_k: int = 0,
                distill_ids: torch.Tensor | None = None, top_k_vocab: int | None = None,
                sizes: RowSizes | None = None) -> dict[str, torch.Tensor]:
        """`score_from`: the "lm" head scores only the tokens at columns >= score_from (the responses of an RL
        batch, whose prompts fill the columns before), the others reading 0; None scores every token. The
        output projection over the vocabulary then skips the prompts' positions: with 256-token prompts and
        256-token responses that is half its work.

        A mixture of experts: `record_routing` adds `routed_experts` (B, T, L, k), the experts each token was
        routed to in each of the L MoE layers; `routed_experts` given replays them (`RouterReplay`) until the
        caller's `router_replay.end()` (after the backward), counting mismatches when `count_replay`.

        A vision-language model: `images`, each row's `multi_modal_inputs` (`shardrl.engine.vision`), run through
        the vision tower and spliced at the rows' placeholders; the decoder rotates by M-RoPE positions.

        Distillation: `top_k` (forward only, a teacher) adds `top_k_ids` (int32) and `top_k_log_probs` (B, C, k), at
        each token the k likeliest tokens of the distribution that scores it and their log-probs (among the ids below
        `top_k_vocab` when given: a student's vocabulary; normalized over the whole row); `distill_ids` (B, C, k)
        (a student) adds `distill_log_probs` (B, C, k), this model's log-probs of those ids at each token,
        differentiable. Both sit on the token they score, as `log_probs` do, over the last C columns: those from
        `score_from` on (the responses) when given, else all T.

        `sizes`: the micro-batch's `RowSizes` as the host read them (for `score_from`'s columns): the layout is then
        made without a host sync (a vision-language model's is not: its positions are M-RoPE's)."""
        layout = packed_tokens if remove_padding else padded_tokens
        tokens = layout(input_ids, attention_mask, score_from if self.head == "lm" else None,
                        None if self.vision else sizes)
        if distill_ids is not None:  # each position's ids are those of the token it predicts: the next one's (the
            # next real token in the layout; the last position's are never read: the next sequence starts there)
            full = F.pad(distill_ids.long(), (0, 0, input_ids.shape[1] - distill_ids.shape[1], 0))  # (B, T, k)
            tokens.distill_targets = full.flatten(0, 1)[F.pad(tokens.flat_index[1:], (0, 1))]  # (N, k)
        if self.vision:
            tokens.decoder_inputs = vision_decoder_inputs(self.lm, tokens.decoder_inputs, input_ids, attention_mask,
                                                          tokens.flat_index, remove_padding,
                                                          micro_batch_images(images, input_ids.device))
        routing = self._routing(tokens, routed_experts, record_routing, attention_mask, count_replay)
        aux = self.training and self.router_replay is not None and self.router_replay.capture_logits
        if aux:
            self.router_replay.logits = []
        try:
            with routing:
                outputs = self._forward_tokens(tokens, temperature, with_entropy, input_ids.shape, record_routing,
                                               remove_padding, with_top1, top_k, top_k_vocab)
            if score_from is not None and self.head == "lm":  # (B, T, k) -> the responses' columns
                for name in ("top_k_ids", "top_k_log_probs", "distill_log_probs"):
                    if name in outputs:
                        outputs[name] = outputs[name][:, score_from:].clone()  # (not a view: FSDP2's hooks)
            if "top_k_ids" in outputs:
                outputs["top_k_ids"] = outputs["top_k_ids"].int()
            if aux:
                outputs["router_aux_loss"] = load_balancing_loss(
                    self.lm, self.router_replay.logits, None if remove_padding else attention_mask)
        finally:  # (no logits kept past the forward: a checkpoint's recompute in backward collects none)
            if aux:
                self.router_replay.logits = None
        return outputs

    def _routing(self, tokens: Tokens, routed_experts: torch.Tensor | None, record: bool, attention_mask,
                 count: bool):
        if routed_experts is None and not record:
            return contextlib.nullcontext()
        if self.router_replay is None or not self.router_replay.routers:
            raise ValueError("router replay (routed_experts) needs a mixture-of-experts model with HF's top-k routers")
        if self.sp_group is not None:
            raise ValueError("router replay with ulysses_sequence_parallel_size > 1 is not supported; set it to 1")
        if routed_experts is not None:
            real = attention_mask.bool().flatten()[tokens.flat_index]
            return self.router_replay.replay(routed_experts.flatten(0, 1)[tokens.flat_index], real, count)
        return self.router_replay.recording()

    def _forward_tokens(self, tokens: Tokens, temperature: float, with_entropy: bool, shape,
                        record_routing: bool, remove_padding: bool, with_top1: bool = False,
                        top_k: int = 0, top_k_vocab: int | None = None) -> dict[str, torch.Tensor]:
        varlen = text_config(self.lm.config)._attn_implementation == ATTN_NAME
        if self.sp_group is not None and not varlen:  # any other attention would see only this rank's piece
            raise RuntimeError(
                f"sequence parallel forward with attention {self.lm.config._attn_implementation!r}, not "
                f"{ATTN_NAME!r}: something changed this model's config (share a copy of it instead)")
        # a VL micro-batch without images still runs the tower (see its doc), first, as the others' does
        idle = idle_vision_tower(self.lm, tokens.targets.device) if self.vision and \
            "pixel_values" not in tokens.decoder_inputs else None
        # a VL model's base runs its vision tower and splices the images in before its decoder
        decoder = self.lm.base_model if self.head == "score" or self.vision else self.lm.get_decoder()
        if self.sp_group is not None:
            tokens = split_sequence(tokens, self.sp_group, self.lm if self.vision else None)
            if self.vision:  # the piece's inputs are embeddings, the images already spliced in
                decoder = self.lm.get_submodule(vision_family(self.lm.config).language_model)
        elif varlen and remove_padding:  # (a VL model's 4-row positions: the first row is the text one)
            tokens.decoder_inputs.update(attention_kwargs(tokens.decoder_inputs["position_ids"][0],
                                                          lengths=tokens.seq_lengths))
        if self.vision and self.sp_group is None and "image_copies" in tokens.decoder_inputs:
            # rows repeating images (a GRPO group's): the tower ran once over the distinct ones, spliced in here
            tokens.decoder_inputs = embedded_inputs(self.lm, tokens.decoder_inputs)
            decoder = self.lm.get_submodule(vision_family(self.lm.config).language_model)
        hidden = decoder(**tokens.decoder_inputs, use_cache=False).last_hidden_state.flatten(0, 1)  # (n_local, H)
        if idle is not None:
            hidden = hidden + idle.to(hidden.dtype)
        if self.head == "score":
            return self.score_head(hidden, tokens)
        if self.head == "value":
            return self.value_outputs(hidden, tokens)
        outputs = self.log_prob_outputs(hidden, tokens, temperature, with_entropy, with_top1)
        if top_k:
            outputs.update(self.top_k_outputs(hidden, tokens, temperature, top_k, top_k_vocab))
        if record_routing:
            experts = self.router_replay.stacked()  # (N, L, k)
            full = experts.new_zeros((shape[0] * shape[1], *experts.shape[1:]))
            full[tokens.flat_index] = experts
            outputs["routed_experts"] = full.view(*shape, *experts.shape[1:])
        return outputs

    # ---- heads: (n_local, H) hidden states -> outputs in the batch's shape ----------------------------
    def score_head(self, hidden: torch.Tensor, tokens: Tokens) -> dict[str, torch.Tensor]:
        """The sequence classifier's score at each sequence's last token: `scores` (B,). The head runs in (at
        least) fp32: a bf16 output is a scalar rounded to 2-3 digits (chosen and rejected scores of a pair tied,
        the margin 0), where the log-probs' softmax reads its logits only after the upcast."""
        head = self.lm.score
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        bias = None if head.bias is None else head.bias.to(dtype)
        scores = F.linear(hidden.to(dtype), head.weight.to(dtype), bias).squeeze(-1)
        return {"scores": tokens.whole(scores)[tokens.ends]}

    def value_outputs(self, hidden: torch.Tensor, tokens: Tokens) -> dict[str, torch.Tensor]:
        """`values` (B, T); the value of token t is read at t-1, the state from which token t was chosen."""
        values = tokens.whole(self.value_head(hidden).squeeze(-1).float())  # (N,)
        return {"values": tokens.restore(shift_to_scored_token(values, tokens.seq_start))}

    def log_prob_outputs(self, hidden: torch.Tensor, tokens: Tokens, temperature: float,
                         with_entropy: bool, with_top1: bool = False) -> dict[str, torch.Tensor]:
        """`log_probs` (B, T) of each token under the policy (and its `entropy`), the output projection
        run in chunks so the (tokens, vocab) logits never exist whole. `with_top1` (forward only): also `top1`
        (B, T), 1.0 where the token is the argmax of the logits that score it (a distillation teacher's
        agreement with the samples). A distillation student (`tokens.distill_targets`): also `distill_log_probs`
        (B, T, k), its log-probs of its teacher's top-k ids, from the same chunks of logits."""
        head = self.lm.get_output_embeddings()
        softcap = getattr(text_config(self.lm.config), "final_logit_softcapping", None)  # Gemma 2
        # only the positions that predict a scored token run (the rest read 0); under sp each rank holds a piece: all
        idx = tokens.needed_index()
        pick = (lambda x: x) if idx is None else (lambda x: x[idx])  # noqa: E731
        at = None
        if tokens.distill_targets is not None:
            logp, entropy, at = chunked_log_probs_at(pick(hidden), head.weight, head.bias, pick(tokens.targets),
                                                     pick(tokens.distill_targets), temperature, self.chunk_size,
                                                     with_entropy, softcap)
            top1 = None
        else:
            score = chunked_log_probs_top1 if with_top1 else lambda *args: (*chunked_log_probs(*args), None)
            logp, entropy, top1 = score(pick(hidden), head.weight, head.bias, pick(tokens.targets), temperature,
                                        self.chunk_size, with_entropy, softcap)
        if idx is not None:  # out of place: differentiable
            n = hidden.shape[0]
            back = lambda v: None if v is None else v.new_zeros((n, *v.shape[1:])).index_put((idx,), v)  # noqa: E731
            logp, entropy, top1, at = back(logp), back(entropy), back(top1), back(at)
        extra = {"entropy": entropy, "top1": None if top1 is None else top1.float()}
        outputs = {"log_probs": self._scored(logp, tokens)}
        for name, value in extra.items():
            if value is not None:
                outputs[name] = self._scored(value, tokens)
        if at is not None:
            outputs["distill_log_probs"] = self._scored(at, tokens)
        return outputs

    @staticmethod
    def _scored(per_position: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        """(n_local,) or (n_local, k) values computed at each position -> (B, T) or (B, T, k) on the token they score
        (a column at a time through the 1-D layout)."""
        if per_position.dim() == 1:
            return tokens.restore(shift_to_scored_token(tokens.whole(per_position), tokens.seq_start))
        return torch.stack([PolicyModel._scored(per_position[:, j], tokens) for j in range(per_position.shape[1])], -1)

    def top_k_outputs(self, hidden: torch.Tensor, tokens: Tokens, temperature: float, top_k: int,
                      top_k_vocab: int | None = None) -> dict[str, torch.Tensor]:
        """A distillation teacher's `top_k_ids` and `top_k_log_probs` (B, T, k) on the token they score (`forward`).
        Only the positions whose next token is scored run the head."""
        head = self.lm.get_output_embeddings()
        softcap = getattr(text_config(self.lm.config), "final_logit_softcapping", None)
        idx = tokens.needed_index()
        h = hidden if idx is None else hidden[idx]
        ids, logp = chunked_top_k(h, head.weight, head.bias, top_k, temperature, self.chunk_size, softcap, top_k_vocab)
        outputs = {}
        for name, value in {"top_k_ids": ids, "top_k_log_probs": logp}.items():
            if idx is not None:
                value = value.new_zeros((hidden.shape[0], value.shape[1])).index_put((idx,), value)
            outputs[name] = self._scored(value, tokens)
        return outputs


# ---- the batch's tokens as the decoder sees them ------------------------------------------------------
@dataclass
class Tokens:
    """A micro-batch's tokens laid out for the decoder on this rank, and the way back to the batch's shape.

    N counts every position of the layout: the real tokens of the batch packed into one row (padding
    removed), or the B*T positions of the padded batch. With sequence parallelism a rank holds n_local =
    N/sp of them (after padding N to a multiple of sp) and `whole` gathers per-position results back."""

    decoder_inputs: dict
    """Keyword arguments of the HF decoder's forward (input_ids, position_ids, attention mask or varlen
    boundaries)."""
    targets: torch.Tensor
    """(n_local,) the token each of this rank's positions predicts."""
    seq_start: torch.Tensor
    """(N,) True at the first token of every sequence."""
    ends: torch.Tensor
    """(B,) the flat index, among the N, of each sequence's last token."""
    restore: Callable[[torch.Tensor], torch.Tensor]
    """(N,) per position -> (B, T), zeros at padding."""
    sp_group: object = None
    """The Ulysses group the positions are split over; None when this rank holds all N."""
    needed: torch.Tensor | None = None
    """(N,) True at the positions whose next token is scored (`PolicyModel.forward`'s `score_from`); None: all."""
    flat_index: torch.Tensor | None = None
    """(N,) each position's index among the batch's B*T."""
    distill_targets: torch.Tensor | None = None
    """(n_local, k) a distillation student's ids to score at each position (`PolicyModel.forward`'s `distill_ids`)."""
    num_needed: int | None = None
    """How many of `needed` are True, as the host knows it (`RowSizes.needed`); None: not known."""
    seq_lengths: tuple[int, ...] | None = None
    """Each row's real tokens, as the host knows them (`RowSizes.lengths`; packed layout only); None: not known."""

    def needed_index(self) -> torch.Tensor | None:
        """The positions whose next token is scored, in order (None: all of them; or under sp, where each rank
        holds a piece); from `num_needed` without a host sync where the host knows it."""
        if self.needed is None or self.sp_group is not None:
            return None
        if self.num_needed is None:
            return self.needed.nonzero().squeeze(-1)
        return nonzero_known(self.needed, self.num_needed)

    def whole(self, per_position: torch.Tensor) -> torch.Tensor:
        """(n_local,) -> (N,)."""
        if self.sp_group is None:
            return per_position
        return gather_seq(per_position, self.sp_group)[: self.seq_start.numel()]


def packed_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, score_from: int | None = None,
                  sizes: RowSizes | None = None) -> Tokens:
    """Padding removed: the real tokens of all rows in one row of N, positions restarting per sequence.
    `score_from`: see `PolicyModel.forward` (sets `Tokens.needed`); `sizes`: the rows' sizes as the host knows
    them (then nothing is read back from the device)."""
    packed = pack(input_ids, attention_mask, None if sizes is None else sizes.num_tokens)
    ids, pos = packed.input_ids[0], packed.position_ids[0]  # (N,)
    seq_start = pos == 0
    # the last token of a sequence: the next one starts another, or the row ends (one "end" in an empty row)
    last = torch.cat([seq_start[1:], seq_start.new_ones(1)])
    ends = last.nonzero().squeeze(-1) if sizes is None else nonzero_known(last, max(sizes.num_sequences, 1))  # (B,)
    needed = None
    if score_from is not None:
        needed = _predicts_scored(_scored_columns(attention_mask, score_from).flatten()[packed.flat_index], seq_start)
    return Tokens(decoder_inputs=dict(input_ids=ids[None], position_ids=pos[None]), targets=F.pad(ids[1:], (0, 1)),
                  seq_start=seq_start, ends=ends, restore=lambda x: unpack(x, packed), needed=needed,
                  flat_index=packed.flat_index, num_needed=None if sizes is None else sizes.needed,
                  seq_lengths=None if sizes is None else sizes.lengths)


def padded_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, score_from: int | None = None,
                  sizes: RowSizes | None = None) -> Tokens:
    """The padded (B, T) batch as it is, with an attention mask; N = B*T. `score_from`, `sizes`: as for
    `packed_tokens`."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    shape, keep = input_ids.shape, attention_mask.float()
    seq_start = position_ids.flatten() == 0
    needed = None
    if score_from is not None:
        needed = _predicts_scored(_scored_columns(attention_mask, score_from).flatten(), seq_start)
    return Tokens(
        decoder_inputs=dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids),
        targets=F.pad(input_ids.flatten()[1:], (0, 1)), seq_start=seq_start,
        ends=_row_ends(attention_mask), restore=lambda x: x.view(shape) * keep.to(x.dtype), needed=needed,
        flat_index=torch.arange(input_ids.numel(), device=input_ids.device),
        num_needed=None if sizes is None else sizes.needed)


def split_sequence(tokens: Tokens, group, vision_lm: nn.Module | None = None) -> Tokens:
    """Ulysses sequence parallelism: this rank's contiguous piece of the packed row (padded to a multiple
    of sp). The varlen attention gets the whole row's sequence boundaries; its all-to-all trades the
    sequence split for a head split. `vision_lm`: the VL model whose row this is (4-row positions, images), whose
    language model then takes the piece's embeddings (`vision_sequence_piece`)."""
    ids, pos = tokens.decoder_inputs["input_ids"][0], tokens.decoder_inputs["position_ids"][0]  # (N,)
    if vision_lm is not None:  # (4, 1, N): the text positions first
        pos = pos[0]
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    ids_p, pos_p = pad_to_multiple(ids, pos, sp)
    targets_p, _ = pad_to_multiple(tokens.targets, pos_p[: tokens.targets.numel()], sp)
    piece = ids_p.numel() // sp
    local = slice(r * piece, (r + 1) * piece)
    if vision_lm is not None:
        inputs = vision_sequence_piece(vision_lm, tokens.decoder_inputs, ids_p, pos_p, local, group)
    else:
        inputs = dict(input_ids=ids_p[local][None], position_ids=pos_p[local][None],
                      **attention_kwargs(pos_p[None], group))
    distill = tokens.distill_targets
    if distill is not None:  # padded as the targets, with token 0
        distill = F.pad(distill, (0, 0, 0, ids_p.numel() - distill.shape[0]))[local]
    return dataclasses.replace(tokens, decoder_inputs=inputs, targets=targets_p[local], sp_group=group,
                               distill_targets=distill)


def _predicts_scored(scored: torch.Tensor, seq_start: torch.Tensor) -> torch.Tensor:
    """(N,) True at the positions whose next position is `scored` (N,) in the same sequence: the positions
    whose output `shift_to_scored_token` moves onto a scored token."""
    return F.pad(scored[1:] & ~seq_start[1:], (0, 1))


def _scored_columns(attention_mask: torch.Tensor, score_from: int) -> torch.Tensor:
    """(B, T) True at the real tokens at columns >= score_from."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return attention_mask.bool() & (columns >= score_from)


def _row_ends(attention_mask: torch.Tensor) -> torch.Tensor:
    """Flat (B*T) index of each row's last real token."""
    t = attention_mask.shape[1]
    last = t - 1 - attention_mask.flip(-1).long().argmax(-1)  # (B,)
    return torch.arange(attention_mask.shape[0], device=attention_mask.device) * t + last


def strip_prefix(name: str) -> str:
    """The HF name of a PolicyModel parameter (drops `lm.` and FSDP1 wrapper names)."""
    name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    return name[len("lm."):] if name.startswith("lm.") else name
