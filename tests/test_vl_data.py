"""Prompt rows with images (issue 61, `shardrl.data.images`): verl's parquet (an `images` column of bytes or paths
beside a chat prompt with `<image>` placeholders) and TRL's rows (`{"type": "image"}` content parts) become the same
token ids and image inputs through the model's processor; bad images stop the load naming the row, or are dropped
and counted."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from shardrl.data.images import ImageSettings, image_name, load_image_prompts
from shardrl.engine.model import load_hf_config
from shardrl.testing import tiny_config, tiny_vl_processor


@pytest.fixture(scope="module")
def processor():
    return tiny_vl_processor(load_hf_config(None, tiny_config("qwen2_5_vl")))


def png(width: int, height: int, color=(200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_verl_and_trl_rows_make_the_same_inputs(processor, tmp_path):
    (tmp_path / "b.png").write_bytes(png(56, 84, (0, 0, 255)))
    verl = [{"data_source": "geo", "prompt": [{"role": "user", "content": "<image>count? <image>"}],
             "images": [{"bytes": png(60, 90)}, {"path": "b.png"}]},
            {"prompt": [{"role": "user", "content": "no image"}], "images": []}]
    trl = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count? "},
                                                    {"type": "image"}]}],
            "images": [png(60, 90), str(tmp_path / "b.png")]}]
    write_parquet(tmp_path / "verl.parquet", verl)
    (tmp_path / "trl.jsonl").write_text(json.dumps({**trl[0], "images": [{"path": "b.png"}, "b.png"]}) + "\n")
    items, stats = load_image_prompts([str(tmp_path / "verl.parquet")], processor, ImageSettings())
    assert stats == {"rows": 2, "dropped_bad_images": 0, "dropped_too_long": 0}
    first = items[0]
    grid = first["multi_modal_inputs"]["image_grid_thw"]
    # 60x90 -> 56x84 (multiples of 28): a 4 x 6 patch grid; 56x84 stays: the same
    assert grid.tolist() == [[1, 6, 4], [1, 6, 4]]
    assert first["multi_modal_inputs"]["pixel_values"].shape == (48, 3 * 2 * 14 * 14)
    assert first["prompt_ids"].count(124) == 2 * 24 // 4 and first["prompt_ids"].count(126) == 2
    assert items[1]["multi_modal_inputs"] is None and 124 not in items[1]["prompt_ids"]
    # how validation's log names them: the row's path, or the image's number where the row held bytes
    assert first["image_names"] == ["<image bytes #1>", "b.png"] and items[1]["image_names"] == []
    assert image_name({"bytes": b"...", "path": "cat.jpg"}, 3) == "cat.jpg"  # (HF datasets keeps both)
    # TRL's parts render the same prompt; the images are the same pixels (here both are the blue one)
    trl_items, _ = load_image_prompts([str(tmp_path / "trl.jsonl")], processor, ImageSettings())
    assert trl_items[0]["prompt_ids"] == first["prompt_ids"]
    torch.testing.assert_close(trl_items[0]["multi_modal_inputs"]["pixel_values"][24:],
                               first["multi_modal_inputs"]["pixel_values"][24:])
    # max_pixels: the processor shrinks each image to at most 28 x 28 pixels -> one merged patch (4 patches)
    small, _ = load_image_prompts([str(tmp_path / "verl.parquet")], processor, ImageSettings(max_pixels=28 * 28))
    assert small[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert small[0]["prompt_ids"].count(124) == 2


def test_bad_images_are_refused_naming_the_row_or_dropped_and_counted(processor, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "<image>a"}], "images": [{"bytes": png(28, 28)}]},
            {"prompt": [{"role": "user", "content": "<image>b"}], "images": [{"bytes": b"not an image"}]},
            {"prompt": [{"role": "user", "content": "<image>c"}], "images": [{"bytes": png(300, 300)}]},
            {"prompt": [{"role": "user", "content": "<image><image>d"}], "images": [{"bytes": png(28, 28)}]}]
    path = str(tmp_path / "rows.parquet")
    write_parquet(path, rows)
    with pytest.raises(ValueError, match=r"rows.parquet: row 2: image 1 cannot be read \(UnidentifiedImageError.*set "
                                         r"data.bad_images=drop"):
        load_image_prompts([path], processor, ImageSettings())
    write_parquet(path, [rows[0], rows[2]])
    with pytest.raises(ValueError, match=r"row 2: image 1 is 300x300 = 90000 pixels, more than "
                                         r"data.max_image_pixels=10000"):
        load_image_prompts([path], processor, ImageSettings(max_image_pixels=10_000))
    write_parquet(path, [rows[0], rows[3]])
    with pytest.raises(ValueError, match=r"row 2: the messages place 2 image\(s\) .* but the row has 1"):
        load_image_prompts([path], processor, ImageSettings())
    write_parquet(path, rows)
    items, stats = load_image_prompts([path], processor, ImageSettings(bad_images="drop", max_image_pixels=10_000))
    assert stats == {"rows": 1, "dropped_bad_images": 3, "dropped_too_long": 0}
    assert [item["prompt"][0]["content"] for item in items] == ["<image>a"]


def test_a_prompt_too_long_with_its_images_is_dropped_and_counted_or_refused(processor, tmp_path):
    """A cut would split an image's placeholders from its pixels: too long is dropped (counted) or refused (112 x 112
    pixels: 16 merged patches, 15 placeholders more than the 28 x 28 image's one)."""
    rows = [{"prompt": [{"role": "user", "content": "<image>a"}], "images": [{"bytes": png(28, 28)}]},
            {"prompt": [{"role": "user", "content": "<image>b"}], "images": [{"bytes": png(112, 112)}]}]
    path = str(tmp_path / "rows.parquet")
    write_parquet(path, rows)
    short = len(load_image_prompts([path], processor, ImageSettings())[0][0]["prompt_ids"])
    items, stats = load_image_prompts([path], processor, ImageSettings(), max_prompt_length=short)
    assert [i["prompt_ids"][-2:] for i in items] == [items[0]["prompt_ids"][-2:]] and stats["dropped_too_long"] == 1
    with pytest.raises(ValueError, match=rf"row 2: the prompt is {short + 15} tokens with its images' placeholders, "
                                         rf"more than max_prompt_length={short}; a prompt with images is not cut"):
        load_image_prompts([path], processor, ImageSettings(), max_prompt_length=short, truncation="left")
