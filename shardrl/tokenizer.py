"""A tiny local tokenizer and tiny model configs, for tests and the demo (no model hub needed).

The tokenizer is character level: a `tokenizers` WordLevel model whose words are single characters,
so `decode(encode(s)) == s` for any `s` over the alphabet. Ids are fixed: `<pad>`=0, `<bos>`=1,
`<eos>`=2, `<unk>`=3, then the alphabet in order. Encoding adds no special tokens; prompts get their
structure from the chat template, which renders messages as "role: content\\n" lines.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config

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


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `alphabet` (default: digits, a-z, space, `+-*=?.,:()#`, newline).

    Characters outside the alphabet encode to `<unk>`. Left padding, since prompts are batched for generation.
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


def tiny_model_config(
    kind: str = "qwen2",
    *,
    vocab_size: int,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    **overrides,
) -> PretrainedConfig:
    """A Llama- or Qwen2-shaped config small enough for CPU tests: hidden 64, 2 layers, 4 heads (2 KV).

    The special-token ids default to those of `build_char_tokenizer`; pass the tokenizer's own ids otherwise.
    Any config field can be overridden by keyword, e.g. `tie_word_embeddings=True`.
    """
    config_classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if kind not in config_classes:
        raise ValueError(f"unknown model kind {kind!r}; known kinds: {sorted(config_classes)}")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    fields.update(overrides)
    return config_classes[kind](**fields)
