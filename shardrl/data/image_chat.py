"""Supervised rows with images (issue 61): what `shardrl sft` trains a vision-language model on.

A row is an SFT row of `data.chat` (a `messages` chat, or a `prompt` and its `response` / `completion`) beside an
images column (`ImageSettings.image_key`), the images placed as `data.images` places a prompt's: verl's `<image>`
placeholders in string contents (its multimodal SFT data), or TRL's content lists of {"type": "image"} and
{"type": "text", "text": ...} parts (its vision SFT data).

The chat is rendered turn by turn as `data.chat.tokenize_chat` renders a text chat, the loss on the assistant's
replies only, by the processor's chat template, which writes one placeholder token an image. Each placeholder is
then expanded to its image's merged-patch count (t * h * w / merge^2 of its grid), as the processor expands a
prompt's; the placeholders are never loss tokens. An item is a text row's {"input_ids", "loss_mask"} with its
`multi_modal_inputs` ({"pixel_values", "image_grid_thw"}, None for a row without images) and `keep_length`, the
tokens up to its last placeholder, which a right cut (truncation=right) must keep: a cut through the placeholders
would leave pixels without their tokens.
"""

from __future__ import annotations

import os

from shardrl.data.chat import ChatDataset, load_rows, row_messages, tokenize_chat
from shardrl.data.images import (BadImage, ImageSettings, _resize_range, check_resize_range, checked_messages,
                                 placed_images, row_images)


class ProcessorChat:
    """A processor as `data.chat.tokenize_chat` reads a tokenizer: the processor's chat template (it renders image
    parts) and its tokenizer's `encode`."""

    def __init__(self, processor):
        self.processor = processor
        self.chat_template = getattr(processor, "chat_template", None) or processor.tokenizer.chat_template

    def apply_chat_template(self, messages, **kwargs):
        return self.processor.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def image_token(processor) -> int:
    """The id of the processor's image placeholder token (`<|image_pad|>` in Qwen)."""
    token = getattr(processor, "image_token_id", None)
    return int(token if token is not None else processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def _as_text(messages) -> object:
    """`messages` with each content list read as its text parts, for `data.chat.row_messages`'s checks."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "content": "".join(p.get("text") or "" for p in m["content"] if isinstance(p, dict))}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


def _chat(row: dict, keys: tuple) -> tuple[list[dict], int, list[str]]:
    """`row_messages` of a row whose contents may be lists of parts: its checks run on the text, and the
    messages keep their parts."""
    messages_key, prompt_key, _ = keys
    checked, train_from, names = row_messages({k: _as_text(v) if k in (messages_key, prompt_key) else v
                                               for k, v in row.items()}, *keys)
    given = row[messages_key] if messages_key in row else row[prompt_key]
    given = given if isinstance(given, list) else []
    return [{**m, "content": g["content"]} if isinstance(g, dict) and isinstance(g.get("content"), list) else m
            for m, g in zip(checked, given + checked[len(given):])], train_from, names


def expand_placeholders(ids: list[int], mask: list[int], token: int, counts: list[int]
                        ) -> tuple[list[int], list[int], int]:
    """(ids, mask, keep_length): the k-th `token` repeated `counts[k]` times, each out of the loss; keep_length is
    the length up to the last placeholder (0 without one)."""
    found = ids.count(token)
    if found != len(counts):
        raise BadImage(f"the chat template writes {found} image placeholder token(s) for the row's {len(counts)} "
                       "image(s); use a template that renders each {'type': 'image'} part as the processor's "
                       "image token")
    out_ids, out_mask, keep, k = [], [], 0, 0
    for i, m in zip(ids, mask):
        if i == token:
            out_ids += [token] * counts[k]
            out_mask += [0] * counts[k]
            keep, k = len(out_ids), k + 1
        else:
            out_ids.append(i)
            out_mask.append(m)
    return out_ids, out_mask, keep


def tokenize_image_chat(processor, settings: ImageSettings, folder: str, row, keys: tuple) -> dict:
    """One SFT row with images as {"input_ids", "loss_mask", "multi_modal_inputs", "keep_length"}, or a
    ValueError naming what is wrong (a `BadImage` for its images)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    messages, train_from, names = _chat(row, keys)
    images = row_images(row, settings, folder)
    messages = placed_images(checked_messages(messages, keys[0]), row, len(images), settings)
    ids, mask = tokenize_chat(ProcessorChat(processor), messages, train_from, names)
    inputs = None
    if images:
        out = processor.image_processor(images=images, return_tensors="pt", **_resize_range(processor, settings))
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    merge = getattr(processor.image_processor, "merge_size", 1)
    counts = [int(grid.prod()) // merge ** 2 for grid in inputs["image_grid_thw"]] if inputs else []
    ids, mask, keep = expand_placeholders(ids, mask, image_token(processor), counts)
    return {"input_ids": ids, "loss_mask": mask, "multi_modal_inputs": inputs, "keep_length": keep}


def load_image_chat_dataset(files: list[str], processor, settings: ImageSettings, max_length: int,
                            truncation: str = "error", skip_bad_rows: bool = False, messages_key: str = "messages",
                            prompt_key: str = "prompt", response_key: str | None = None) -> ChatDataset:
    """`data.chat.load_chat_dataset` for a vision-language model: each row's images read and its chat rendered
    by `processor` (`tokenize_image_chat`). A bad image (`data.images`: unreadable, a count unlike the
    placeholders', over `settings.max_image_pixels`) makes a bad row: an error naming the file, row and image, or
    with skip_bad_rows dropped and counted as the other bad rows are."""
    check_resize_range(processor, settings)

    def reader(path: str):
        folder = os.path.dirname(os.path.abspath(path))
        return lambda row, keys: tokenize_image_chat(processor, settings, folder, row, keys)
    return load_rows(files, reader, (messages_key, prompt_key, response_key), "sft", max_length, truncation,
                     skip_bad_rows)
