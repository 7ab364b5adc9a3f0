"""The image columns of a vision-language model's data (issue 61), shared by `shardrl train`'s prompts
(`DataConfig`) and `shardrl sft`'s conversations (`SFTDataConfig`); read by `shardrl.data.images`."""

from __future__ import annotations

from dataclasses import dataclass

from shardrl.config.load import require


@dataclass
class ImageDataConfig:
    image_key: str = "images"
    """A vision-language model's rows: the column holding each row's images (verl's data.image_key), a list of
    {"bytes"} / {"path"} dicts, paths or bytes, one per `<image>` placeholder (or {"type": "image"} part) of the
    row's messages (`shardrl.data.images`). A text model refuses rows with images there (it would see their text
    alone)."""
    min_pixels: int | None = None
    """A vision-language model's processor resizes smaller images up to this many pixels; null: the processor's."""
    max_pixels: int | None = None
    """The processor resizes larger images down to this many pixels (fewer image tokens); null: the processor's."""
    max_image_pixels: int | None = None
    """An image of more raw pixels than this (before any resize) is a bad image; null: no limit beyond PIL's
    decompression-bomb guard."""

    def validate_images(self, prefix: str) -> None:
        for name in ("min_pixels", "max_pixels", "max_image_pixels"):
            require(self, prefix, name, getattr(self, name) is None or getattr(self, name) >= 1, "must be >= 1 or null")
