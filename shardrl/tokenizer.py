"""Tokenizers: a run's own (`load_tokenizer`), and a tiny local one for tests and the demo (no model hub
needed).

The tiny tokenizer is character level: a `tokenizers` WordLevel model whose words are single characters,
so `decode(encode(s)) == s` for any `s` over the alphabet. Ids are fixed: `<pad>`=0, `<bos>`=1,
`<eos>`=2, `<unk>`=3, then the alphabet in order. Encoding adds no special tokens; prompts get their
structure from the chat template, which renders messages as "role: content\\n" lines.
"""

from __future__ import annotations

import string

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3

# "#" is beyond the brief's list so GSM8K-style "#### 42" answers can be spelled too.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " " + "+-*=?.,:()#" + "\n"

# Jinja: one "role: content" line per message, then "assistant: " when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer(alphabet: str | None = None, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `alphabet` (default: digits, a-z, space, `+-*=?.,:()#`, newline).

    Characters outside the alphabet encode to `<unk>`. Left padding, since prompts are batched for generation.
    `add_bos`: `tokenizer("x")` starts with `<bos>`, as Llama's and Gemma's do (tests of plain-text rows).
    """
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    if not chars:
        raise ValueError("alphabet is empty; give at least one character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character, newline included, is its own pre-token; Fuse joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A",
                                                           special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


FAST_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")
"""transformers' `_decode` of a tokenizers-backed tokenizer (5.x, 4.x): the backend's decode, then the clean-up of
spaces where `clean_up_tokenization_spaces` is set."""


def decode_rows(tokenizer, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`tokenizer.decode(row)` of each row of ids (plain lists of ints), faster. transformers' base `decode` (every
    fast tokenizer's) is a type check of the ids, which walks every id in Python, then `_decode`; for 512 rows of ~550
    ids the check took about three quarters of `batch_decode`'s time (on 2 cores), the backend's one-row decodes the
    rest. So: where `_decode` is transformers' own for a tokenizers backend and cleans up no spaces, it is the
    backend's decode alone, and the rows go to the backend's `decode_batch` (the same decode, run over the rows on
    every core); else, where `decode` is the base one, to `_decode` directly; a tokenizer with a `decode` of its own
    is called as it is."""
    decode = getattr(getattr(type(tokenizer), "decode", None), "__qualname__", "")
    inner = getattr(getattr(type(tokenizer), "_decode", None), "__qualname__", "")
    if decode != "PreTrainedTokenizerBase.decode" or not inner:
        return [tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if inner in FAST_DECODES and backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode_batch(rows, skip_special_tokens=skip_special_tokens)
    return [tokenizer._decode(row, skip_special_tokens=skip_special_tokens) for row in rows]


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token the tokenizer's chat template writes right after an assistant's message (e.g.
    `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), found by rendering a two-turn chat; None without a
    template or without a special token there (the template above ends a turn with a newline)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    reply = "shardrl-reply-marker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}],
                                             tokenize=False)
    except Exception:  # a template that refuses this chat (e.g. it demands a system turn) tells nothing
        return None
    if not isinstance(text, str) or reply not in text:
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tail = tokenizer(text.split(reply, 1)[1], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if i in special), None)


def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end a response: EOS, and the chat template's end-of-turn token when it is another one
    (a base model's tokenizer may keep `<|endoftext|>` as EOS while its template ends turns with `<|im_end|>`:
    a chat-prompted model ends its reply with the latter). EOS first; empty when there is neither."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    turn_end = end_of_turn_token_id(tokenizer)
    return ids + [turn_end] if turn_end is not None and turn_end not in ids else ids


# ---- a run's tokenizer ----------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(cfg):
    """The run's tokenizer (`model.tokenizer_path`, else `model.path`), left-padding, with a pad token."""
    from shardrl.config.userfile import refuse_gguf_folder, require_folder

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        raise ValueError("no tokenizer: set model.path (a local HF model folder) or model.tokenizer_path")
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    if not any((require_folder(key, path) / name).is_file() for name in TOKENIZER_FILES):
        refuse_gguf_folder(key, Path(path))
        raise ValueError(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one "
                         "there with tokenizer.save_pretrained(folder), or set model.tokenizer_path to a folder "
                         "that has one")
    tok = _from_folder(path, cfg.model.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if cfg.model.chat_template is not None:
        tok.chat_template = read_chat_template(cfg.model.chat_template)
    return tok


def folder_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer saved in a model folder (a reward model's own), or None when the folder holds none."""
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return _from_folder(path, trust_remote_code)


def _from_folder(path: str, trust_remote_code: bool):
    import transformers

    try:
        if _generic_tokenizer(Path(path)):
            return transformers.PreTrainedTokenizerFast.from_pretrained(path)
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def same_tokenization(a, b) -> bool:
    """Whether two tokenizers turn text into the same ids: the same `tokenizers` model, normalizer, pre-tokenizer
    and added tokens (a fast tokenizer's JSON, less its padding and truncation state), else the same vocabulary.
    Two tokenizers of one size can still differ (Qwen's and another BPE's), so the size alone says nothing."""
    def spec(tok):
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            return tok.get_vocab()
        data = json.loads(backend.to_str())
        data.pop("padding", None), data.pop("truncation", None)
        return data
    return spec(a) == spec(b)


def read_chat_template(value: str) -> str:
    """`model.chat_template`: a Jinja template's text, or the path of a file holding one."""
    if "{%" in value or "{{" in value:  # a template, not a file name
        return _compiled(value, "model.chat_template")
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"model.chat_template={value!r} is neither a file nor a Jinja template (no '{{%' or '{{{{'); "
                         "give the template's text or the path of a file holding it")
    text = path.read_text()
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"model.chat_template={value!r}: the file holds no Jinja template (no '{{%' or '{{{{')")
    return _compiled(text, f"model.chat_template={value!r}")


def _compiled(template: str, key: str) -> str:
    """`template`, checked to compile as transformers compiles a chat template: a syntax error is the setting's,
    said once now (rendered, it would fail every row as if each row were bad)."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as e:
        line = f" at line {e.lineno} of the template" if getattr(e, "lineno", None) else ""
        raise ValueError(f"{key} is not a valid Jinja template: {e.message or e}{line}; fix the template") from None
    return template


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
