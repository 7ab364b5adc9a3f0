"""Prompt rows with images (issue 61): verl's and TRL's multimodal rows, made into token ids and the model's image
inputs by the model's processor (`AutoProcessor`: its tokenizer, chat template and image processor).

Two row forms are read:
- verl's (examples/data_preprocess/geo3k.py): an `images` column, a list of {"bytes": ...} or {"path": ...} dicts
  (or paths, relative ones read from the data file's folder, data:image/...;base64 URIs, or raw bytes), beside a
  chat `prompt` whose string contents hold one `<image>` placeholder per image, in order;
- TRL's: `images` beside messages whose content is a list of parts, `{"type": "image"}` where an image goes and
  `{"type": "text", "text": ...}`.
Either becomes messages with image parts, rendered by the processor's chat template; the processor resizes each
image into [min_pixels, max_pixels] (Qwen's own rule: `smart_resize` keeps the aspect, sides multiples of the patch
x merge size) and expands each image's placeholder to its merged-patch count. A row's `multi_modal_inputs` is its
`pixel_values` (patches, patch dim) and `image_grid_thw` (images, 3), what the engine's batch field carries
(`shardrl.engine.vision`).

A bad image (unreadable bytes or path, a count of images unlike the placeholders', or more raw pixels than
`max_image_pixels`) is a ValueError naming the file, row and image (`bad_images="error"`, the default: a data set
with broken images is usually a preprocessing bug worth seeing), or its row is dropped and counted
(`bad_images="drop"`: the count is in the stats and logged once, with the first row's fault). URLs are not
downloaded, and images inside content parts are not read (both refused by name). Images are read as HF datasets
and transformers read them: an EXIF rotation applied, a transparent part on white.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import re
from dataclasses import dataclass
from typing import Literal

from shardrl.data.messages import check_messages
from shardrl.data.prompts import PromptDataset, _extra_fields, _short_repr, read_rows

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
"""verl's placeholder for an image inside a string content."""


@dataclass
class ImageSettings:
    image_key: str = "images"
    """The column holding a row's images (verl's data.image_key)."""
    min_pixels: int | None = None
    """The processor resizes smaller images up to this many pixels; None: the processor's own."""
    max_pixels: int | None = None
    """The processor resizes larger images down to this many pixels (fewer image tokens); None: the processor's own."""
    max_image_pixels: int | None = None
    """An image with more raw pixels than this (width x height, before any resize) is a bad image; None: no limit
    beyond PIL's own decompression-bomb guard (an image that large is unreadable)."""
    bad_images: Literal["error", "drop"] = "error"
    """A row with a bad image: "error" stops the load naming the row; "drop" leaves the row out and counts it."""


ORIENTATION = 0x0112
"""The EXIF tag of a photo's rotation (1: upright)."""


class BadImage(ValueError):
    """What is wrong with one of a row's images (the caller adds the file and row)."""


def load_image(value, folder: str = ".", max_image_pixels: int | None = None):
    """A PIL RGB image from a row's entry: a PIL image, raw bytes, {"bytes": ...}, {"path": ...} / {"image": ...},
    or a path (relative paths against `folder`, the data file's; a file:// prefix is dropped). An image of more
    raw pixels than `max_image_pixels` is a `BadImage`, said from its header before it is decoded. A photo with an
    EXIF orientation is turned upright."""
    from PIL import Image, ImageOps

    if isinstance(value, dict):
        data = value.get("bytes")
        value = data if data is not None else value.get("path") or value.get("image")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str) and value.startswith("data:"):  # a data URI (OpenAI's image_url form)
            header, _, data = value.partition(",")
            if not header.endswith(";base64"):
                raise BadImage(f"is a data URI without base64 data ({_short_repr(value)})")
            image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        elif isinstance(value, str) and value.startswith(("http://", "https://")):
            raise BadImage(f"is a URL ({_short_repr(value)}): images are not downloaded; save it and give its path "
                           "or its bytes")
        elif isinstance(value, str):
            path = value[len("file://"):] if value.startswith("file://") else value
            if not os.path.isabs(path) and not os.path.exists(os.path.join(folder, path)):
                raise BadImage(f"cannot be read: no file {_short_repr(os.path.join(folder, path), 200)} (a relative "
                               f"path is read from the data file's folder, {folder!r}, not the working directory; "
                               "bytes are given as {'bytes': ...} or a data:image/...;base64, URI, not bare base64)")
            image = Image.open(path if os.path.isabs(path) else os.path.join(folder, path))
        else:
            raise BadImage(f"is {_short_repr(value)}, not image bytes, a path, or a dict of one")
        if max_image_pixels and image.width * image.height > max_image_pixels:
            raise BadImage(f"is {image.width}x{image.height} = {image.width * image.height} pixels, more than "
                           f"data.max_image_pixels={max_image_pixels}")
        image.load()
        if image.getexif().get(ORIENTATION, 1) != 1:  # a camera's rotation tag, shown upright as HF datasets'
            image = ImageOps.exif_transpose(image)   # Image column and transformers' load_image show it
    except BadImage:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # (PIL's UnidentifiedImageError is an OSError)
        raise BadImage(f"cannot be read ({type(e).__name__}: {e})") from None
    return as_rgb(image)


def as_rgb(image):
    """`image` in RGB, a transparent part on white: what transformers' `convert_to_rgb` (the Qwen-VL image
    processors' do_convert_rgb) and verl's qwen_vl_utils make of it. PIL's own convert("RGB") drops the alpha and
    keeps the colour under it, often black: a drawing on a transparent background would turn all black."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def image_messages(messages: list[dict], num_images: int) -> list[dict]:
    """The messages with image parts where the images go: verl's `<image>` placeholders in string contents become
    {"type": "image"} parts, TRL's content lists pass through. The parts must number `num_images`."""
    out, found, inline = [], 0, False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = [{"type": "image"} if piece == IMAGE_PLACEHOLDER else {"type": "text", "text": piece}
                     for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content) if piece]
            message = {**message, "content": parts}
        if isinstance(message.get("content"), list):
            image_parts = [p for p in message["content"] if _is_image_part(p)]
            found += len(image_parts)
            inline = inline or any(set(p) - {"type", "text"} for p in image_parts)
        out.append(message)
    if found != num_images:
        where = ("; an image inside its part ({'type': 'image', 'image' / 'url' / 'path': ...}) is not read: give "
                 "the row's images, in order, in its image column") if inline else ""
        raise BadImage(f"the messages place {found} image(s) ({IMAGE_PLACEHOLDER!r} in a content string, or "
                       f"{{'type': 'image'}} parts) but the row has {num_images}{where}")
    return out


def _is_image_part(part) -> bool:
    """Whether a content part is one the Qwen-VL chat templates render as an image: {"type": "image"} (TRL's),
    OpenAI's {"type": "image_url"}, or a part holding an "image" / "image_url"."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part
                                       or "image_url" in part)


def _resize_range(processor, settings: ImageSettings) -> dict:
    """The processor's `size` argument: its own {shortest_edge, longest_edge} pixels (Qwen's), the settings' where
    set; {} for a processor without one."""
    size = dict(getattr(processor.image_processor, "size", None) or {})
    size.update({k: v for k, v in (("shortest_edge", settings.min_pixels), ("longest_edge", settings.max_pixels)) if v})
    return {"size": size} if size else {}


def check_resize_range(processor, settings: ImageSettings) -> None:
    """A ValueError where the resize range is empty: the processor makes an image at least min_pixels, so one
    above its max_pixels would give every image more placeholders than max_pixels allows."""
    size = _resize_range(processor, settings).get("size", {})
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    if low and high and low > high:
        def said(key: str, value: int) -> str:
            return f"data.{key}={value}" if getattr(settings, key) else f"the processor's {key} {value}"
        raise ValueError(f"{said('min_pixels', low)} is more than {said('max_pixels', high)}: every image would be "
                         "resized up past max_pixels; lower data.min_pixels or raise data.max_pixels")


def process_images(processor, messages: list[dict], images: list, settings: ImageSettings) -> dict:
    """{"prompt_ids": [...], "prompt_text": str, "multi_modal_inputs": {"pixel_values", "image_grid_thw"} or None}
    of one row's image messages (`image_messages`) and its PIL images."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=images or None, return_tensors="pt", **_resize_range(processor, settings))
    inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if images else None
    return {"prompt_ids": out["input_ids"][0].tolist(), "prompt_text": text, "multi_modal_inputs": inputs}


def checked_messages(messages, key: str) -> list[dict]:
    """`messages` after `check_messages`'s checks of roles and shapes, a content list read as its text parts."""
    if not isinstance(messages, list):
        return check_messages(messages, key)  # (its error for a prompt that is not messages)
    as_text = [{**m, "content": "".join(p.get("text") or "" for p in m["content"] if isinstance(p, dict))}
               if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
    check_messages(as_text, key)
    return messages


def _image_values(row: dict, settings: ImageSettings) -> list:
    values = row.get(settings.image_key) or []
    return list(values) if isinstance(values, (list, tuple)) else [values]


def image_name(value, number: int) -> str:
    """How a log names a row's image `number` (1-based): the path the row gives (a {"bytes", "path"} dict's path,
    as HF datasets' image column keeps the file name beside the bytes), else `<image bytes #number>`."""
    if isinstance(value, dict):
        value = value.get("path") or value.get("image") or value.get("bytes")
    if isinstance(value, str):
        return value
    return f"<image bytes #{number}>"


def image_names(row: dict, settings: ImageSettings) -> list[str]:
    """The names of the row's images (`image_name`), in order."""
    return [image_name(value, k) for k, value in enumerate(_image_values(row, settings), start=1)]


def row_images(row: dict, settings: ImageSettings, folder: str) -> list:
    values = _image_values(row, settings)
    images = []
    for k, value in enumerate(values, start=1):
        try:
            images.append(load_image(value, folder, settings.max_image_pixels))
        except BadImage as e:
            raise BadImage(f"image {k} {e}") from None
    return images


def placed_images(messages: list[dict], row: dict, num_images: int, settings: ImageSettings) -> list[dict]:
    """`image_messages`, its count error naming `settings.image_key` where the row has no such column (a
    mistyped data.image_key makes every row's images go missing)."""
    try:
        return image_messages(messages, num_images)
    except BadImage as e:
        if settings.image_key in row:
            raise
        raise BadImage(f"{e}; the row has no {settings.image_key!r} column (data.image_key); its columns are "
                       f"{sorted(row)}") from None


def load_image_prompts(files: list[str], processor, settings: ImageSettings, prompt_key: str = "prompt",
                       max_prompt_length: int | None = None, truncation: str = "drop") -> tuple[list[dict], dict]:
    """Items {"prompt_ids", "prompt_text", "multi_modal_inputs", "prompt", "data_source", "extra", "image_names",
    "index"} of the files' rows (`extra`: the row's other columns but the images, as a text row's; `image_names`:
    how logs name its images, `image_name`), and stats {"rows",
    "dropped_bad_images", "dropped_too_long"}. A bad image stops the load or drops its row
    (`ImageSettings.bad_images`). A prompt of more than `max_prompt_length` tokens (image placeholders included) is
    dropped and counted (`truncation="drop"`) or refused: a cut would split an image's placeholders from its
    pixels."""
    if settings.bad_images not in ("error", "drop"):
        raise ValueError(f"bad_images={settings.bad_images!r}: choose 'error' or 'drop'")
    check_resize_range(processor, settings)
    items, dropped, too_long, shortest_too_long, first_bad = [], 0, 0, None, None
    for path in files:
        folder = os.path.dirname(os.path.abspath(path))
        for number, row in read_rows(path):
            if not isinstance(row, dict) or prompt_key not in row:
                raise ValueError(f"{path}: row {number}: no {prompt_key!r} column (a chat prompt beside "
                                 f"{settings.image_key!r})")
            prompt = row[prompt_key]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                images = row_images(row, settings, folder)
                messages = placed_images(checked_messages(messages, prompt_key), row, len(images), settings)
                try:
                    item = process_images(processor, messages, images, settings)
                except ValueError as e:  # (a literal placeholder token in the text, say)
                    raise BadImage(f"the processor refuses it: {str(e).rstrip('.')}") from None
            except BadImage as e:
                if settings.bad_images == "error":
                    raise ValueError(f"{path}: row {number}: {e}; fix the row, or set data.bad_images=drop to leave "
                                     "such rows out (counted)") from None
                dropped += 1
                first_bad = first_bad or f"{path}: row {number}: {e}"
                continue
            if max_prompt_length is not None and len(item["prompt_ids"]) > max_prompt_length:
                if truncation != "drop":
                    raise ValueError(f"{path}: row {number}: the prompt is {len(item['prompt_ids'])} tokens with its "
                                     f"images' placeholders, more than max_prompt_length={max_prompt_length}; a prompt "
                                     "with images is not cut (its placeholders must match its pixels): raise "
                                     "data.max_prompt_length, lower data.max_pixels, or set data.truncation=drop")
                too_long += 1
                shortest_too_long = min(shortest_too_long or len(item["prompt_ids"]), len(item["prompt_ids"]))
                continue
            data_source = row.get("data_source")
            extra = {k: v for k, v in _extra_fields(row, prompt_key).items() if k != settings.image_key}
            items.append({**item, "prompt": prompt, "data_source": "default" if data_source is None else str(data_source),
                          "extra": extra, "image_names": image_names(row, settings), "index": len(items)})
    if dropped and not items and not too_long:
        raise ValueError(f"no usable prompts in {files}: every row has a bad image (data.bad_images=drop dropped "
                         f"{dropped}), the first: {first_bad}")
    if dropped:
        logger.warning("dropped %d row(s) with a bad image (data.bad_images=drop) of %d; the first: %s", dropped,
                       dropped + len(items) + too_long, first_bad)
    if too_long and not items:
        raise ValueError(f"no usable prompts in {files}: every one is longer than max_prompt_length="
                         f"{max_prompt_length} with its images' placeholders, the shortest {shortest_too_long} "
                         f"tokens{f' ({dropped} more dropped for a bad image)' if dropped else ''}; raise "
                         "data.max_prompt_length, or lower data.max_pixels (fewer placeholders an image)")
    if too_long:
        logger.warning("dropped %d row(s) longer than max_prompt_length=%s tokens with their images", too_long,
                       max_prompt_length)
    return items, {"rows": len(items), "dropped_bad_images": dropped, "dropped_too_long": too_long}


def load_image_dataset(files: list[str], processor, settings: ImageSettings, prompt_key: str,
                       max_prompt_length: int, truncation: str) -> PromptDataset:
    """The RL trainer's prompt set of image rows (`load_image_prompts`), as a text set's `PromptDataset`."""
    items, stats = load_image_prompts(files, processor, settings, prompt_key, max_prompt_length, truncation)
    if not items:
        raise ValueError(f"no usable prompts in {files} (stats: {stats})")
    logger.info("loaded %d prompts with images from %d file(s): %s", len(items), len(files), stats)
    return PromptDataset(items, stats, files)


def load_processor(path: str, trust_remote_code: bool = False):
    """The model folder's processor (`AutoProcessor`): its tokenizer, chat template and image processor. Where
    transformers cannot build the whole processor (a Qwen-VL processor needs a video processor, whose class
    needs torchvision), one without video is made from the folder's tokenizer and image processor: prompts with
    images need no more."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ImportError, ValueError, OSError, TypeError, AttributeError) as e:
        processor, why = None, f"{type(e).__name__}: {e}"
    else:
        why = f"AutoProcessor gave a {type(processor).__name__}"
    if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
        return processor
    try:
        images = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:
        raise ValueError(f"model folder {path!r} has no image processor (preprocessor_config.json) for its image "
                         f"rows ({e}); save the model's processor there (processor.save_pretrained)") from None
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    logger.info("the image processor and tokenizer of %s without a video processor (%s)", path, why.split("\n")[0])
    return image_only_processor(images, tokenizer)


def image_only_processor(image_processor, tokenizer):
    """A Qwen-VL processor of `image_processor` and `tokenizer` (its chat template) without a video processor."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):  # the Qwen2/2.5/3-VL processors expand image placeholders alike
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=tokenizer.chat_template)
