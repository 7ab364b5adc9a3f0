"""What users get wrong with image rows (issue 61), and what they are told: a transparent image is put on white as
the processor and verl put it, a mistyped data.image_key or a relative path that is not there is said as such, an
image over data.max_image_pixels is refused from its header, prompts all too long with their images name the fix,
a text model (policy, critic or SFT) given image rows is refused instead of training on their text alone."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from shardrl.data.image_chat import load_image_chat_dataset
from shardrl.data.images import ImageSettings, load_image_prompts
from shardrl.engine.model import load_hf_config
from shardrl.testing import tiny_config, tiny_vl_processor

PROMPT = [{"role": "user", "content": "<image>color?"}]


@pytest.fixture(scope="module")
def processor():
    return tiny_vl_processor(load_hf_config(None, tiny_config("qwen2_5_vl")))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_parquet(path, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_transparent_images_are_put_on_white_as_the_processor_puts_them(processor, tmp_path):
    """A red square on a transparent (black under the alpha) background, as RGBA, LA and palette PNGs: the rows'
    pixels are the processor's own of the image as given (transformers composites it on white); PIL's plain
    convert("RGB") would keep the black under the alpha."""
    rgba = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    rgba.paste((220, 20, 20, 255), (14, 14, 42, 42))
    gray = Image.new("LA", (56, 56), (0, 0))
    gray.paste((90, 255), (14, 14, 42, 42))
    palette = rgba.convert("RGB").quantize(colors=4)
    palette.info["transparency"] = palette.getpixel((0, 0))  # the background's index
    opaque = Image.new("RGB", (56, 56), (30, 200, 30))
    images = {"rgba": rgba, "la": gray, "palette": palette, "gray": opaque.convert("L"), "jpeg": opaque}
    rows = [{"prompt": PROMPT, "images": [{"bytes": encoded(image, "JPEG" if name == "jpeg" else "PNG")}]}
            for name, image in images.items()]
    items, _ = load_image_prompts([write_parquet(tmp_path / "rows.parquet", rows)], processor, ImageSettings())
    for (name, image), item in zip(images.items(), items):
        given = Image.open(io.BytesIO(encoded(image, "JPEG" if name == "jpeg" else "PNG")))
        expected = processor.image_processor(images=[given], return_tensors="pt")["pixel_values"]
        assert torch.equal(item["multi_modal_inputs"]["pixel_values"], expected), name
    # the transparent background is white, not black: the mean pixel is brighter than the opaque red square's
    white = processor.image_processor(images=[Image.new("RGB", (56, 56), "white")], return_tensors="pt")
    corner = items[0]["multi_modal_inputs"]["pixel_values"][0]  # the first patch: the top-left corner, background
    assert torch.allclose(corner, white["pixel_values"][0])


def test_a_photo_with_an_exif_rotation_is_read_upright(processor, tmp_path):
    """A 56 x 28 JPEG tagged "rotate 90" (EXIF orientation 6, as a phone stores a portrait photo) is 28 wide and 56
    high upright, as HF datasets' Image column and transformers' load_image show it: a 4 x 2 patch grid, not 2 x 4."""
    photo = Image.new("RGB", (56, 28), "red")
    exif = photo.getexif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", exif=exif)
    rows = [{"prompt": PROMPT, "images": [{"bytes": buffer.getvalue()}]}]
    items, _ = load_image_prompts([write_parquet(tmp_path / "rows.parquet", rows)], processor, ImageSettings())
    assert items[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 2]]


def test_a_missing_image_column_and_a_missing_relative_path_are_said_as_such(processor, tmp_path):
    (tmp_path / "red.png").write_bytes(encoded(Image.new("RGB", (28, 28), "red")))
    path = write_parquet(tmp_path / "rows.parquet", [{"prompt": PROMPT, "images": [{"path": "red.png"}]}])
    with pytest.raises(ValueError, match=r"row 1: the messages place 1 image\(s\) .* but the row has 0; the row "
                                         r"has no 'pictures' column \(data.image_key\); its columns are "
                                         r"\['images', 'prompt'\]"):
        load_image_prompts([path], processor, ImageSettings(image_key="pictures"))
    sft = write_parquet(tmp_path / "sft.parquet", [{"prompt": "<image>a", "response": "b", "images": ["red.png"]}])
    with pytest.raises(ValueError, match=r"no 'pictures' column \(data.image_key\)"):
        load_image_chat_dataset([sft], processor, ImageSettings(image_key="pictures"), max_length=200)
    # a path relative to the working directory, not to the data file's folder
    (tmp_path / "data").mkdir()
    moved = write_parquet(tmp_path / "data" / "rows.parquet", [{"prompt": PROMPT, "images": ["red.png"]}])
    with pytest.raises(ValueError, match=r"row 1: image 1 cannot be read: no file '.*/data/red.png' \(a relative "
                                         r"path is read from the data file's folder, '.*/data', not the working"):
        load_image_prompts([moved], processor, ImageSettings())


def test_images_given_as_data_uris_urls_or_inside_their_parts(processor, tmp_path):
    """A data URI (OpenAI's image_url form) is read; a URL, an image inside its content part (as HF chat templates
    take it) and a literal placeholder token in the text are refused naming the row and what to do; an OpenAI
    {"type": "image_url"} part counts as a placeholder (the Qwen-VL templates render it as one)."""
    import base64
    import json

    red = encoded(Image.new("RGB", (28, 28), "red"))
    uri = "data:image/png;base64," + base64.b64encode(red).decode()
    plain = write_parquet(tmp_path / "plain.parquet", [{"prompt": PROMPT, "images": [{"bytes": red}]}])
    expected = load_image_prompts([plain], processor, ImageSettings())[0][0]["multi_modal_inputs"]["pixel_values"]

    def load(row):
        path = tmp_path / "row.jsonl"
        path.write_text(json.dumps(row) + "\n")
        return load_image_prompts([str(path)], processor, ImageSettings())[0]

    assert torch.equal(load({"prompt": PROMPT, "images": [uri]})[0]["multi_modal_inputs"]["pixel_values"], expected)
    with pytest.raises(ValueError, match=r"row 1: image 1 is a URL \('https://example.com/cat.png'\): images are not "
                                         r"downloaded"):
        load({"prompt": PROMPT, "images": ["https://example.com/cat.png"]})
    for part in ({"type": "image", "image": uri}, {"type": "image_url", "image_url": {"url": uri}}):
        with pytest.raises(ValueError, match=r"row 1: the messages place 1 image\(s\) .* but the row has 0; an image "
                                             r"inside its part .* is not read"):
            load({"prompt": [{"role": "user", "content": [part, {"type": "text", "text": "color?"}]}]})
    with pytest.raises(ValueError, match=r"row.jsonl: row 1: the processor refuses it: Found 1 <\|image_pad\|> "
                                         r"tokens"):
        load({"prompt": [{"role": "user", "content": "<|image_pad|>color?"}]})


def test_rows_dropped_for_a_bad_image_say_why(processor, tmp_path, caplog):
    """data.bad_images=drop counts the rows it leaves out and says the first one's fault: a mistyped data.image_key
    drops every row, and a bare count would not say so."""
    red = {"bytes": encoded(Image.new("RGB", (28, 28), "red"))}
    rows = [{"prompt": PROMPT, "images": [red]}, {"prompt": PROMPT, "images": [{"bytes": b"junk"}]}]
    path = write_parquet(tmp_path / "rows.parquet", rows)
    with caplog.at_level("WARNING", logger="shardrl.data.images"):
        items, stats = load_image_prompts([path], processor, ImageSettings(bad_images="drop"))
    assert len(items) == 1 and stats["dropped_bad_images"] == 1
    assert "dropped 1 row(s) with a bad image (data.bad_images=drop) of 2; the first: " in caplog.text
    assert "rows.parquet: row 2: image 1 cannot be read" in caplog.text
    with pytest.raises(ValueError, match=r"no usable prompts in .*: every row has a bad image \(data.bad_images=drop "
                                         r"dropped 2\), the first: .*rows.parquet: row 1: .* no 'pictures' column"):
        load_image_prompts([path], processor, ImageSettings(bad_images="drop", image_key="pictures"))


def test_an_image_over_max_image_pixels_is_refused_from_its_header(processor, tmp_path):
    """A 3000 x 3000 PNG cut short: its header says its size, so it is refused as too large before any decode (a
    decode of the whole image first would fail as truncated, or hold its pixels)."""
    big = encoded(Image.new("RGB", (3000, 3000), "blue"))
    rows = [{"prompt": PROMPT, "images": [{"bytes": big[:2000]}]}]
    path = write_parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(ValueError, match=r"row 1: image 1 is 3000x3000 = 9000000 pixels, more than "
                                         r"data.max_image_pixels=1000000; fix the row, or set data.bad_images=drop"):
        load_image_prompts([path], processor, ImageSettings(max_image_pixels=1_000_000))


def test_prompts_all_too_long_with_their_images_name_the_shortest_and_the_fix(processor, tmp_path):
    rows = [{"prompt": PROMPT, "images": [{"bytes": encoded(Image.new("RGB", (56, 56), "red"))}]}] * 2
    path = write_parquet(tmp_path / "rows.parquet", rows)
    length = len(load_image_prompts([path], processor, ImageSettings())[0][0]["prompt_ids"])
    with pytest.raises(ValueError, match=rf"every one is longer than max_prompt_length=8 with its images' "
                                         rf"placeholders, the shortest {length} tokens; raise data.max_prompt_length, "
                                         r"or lower data.max_pixels"):
        load_image_prompts([path], processor, ImageSettings(), max_prompt_length=8)


def test_a_min_pixels_above_max_pixels_is_refused_naming_both(processor, tmp_path):
    """The processor would resize every image up to min_pixels, past max_pixels: 12544 is the tiny processor's own
    max (16 merged patches of 28 x 28)."""
    rows = [{"prompt": PROMPT, "response": "b", "images": [{"bytes": encoded(Image.new("RGB", (56, 56)))}]}]
    path = write_parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(ValueError, match=r"data.min_pixels=100000 is more than the processor's max_pixels 12544: "
                                         r"every image would be resized up past max_pixels"):
        load_image_prompts([path], processor, ImageSettings(min_pixels=100_000, bad_images="drop"))
    with pytest.raises(ValueError, match=r"data.min_pixels=2000 is more than data.max_pixels=1000"):
        load_image_chat_dataset([path], processor, ImageSettings(min_pixels=2000, max_pixels=1000), max_length=200)
    assert len(load_image_prompts([path], processor, ImageSettings(min_pixels=1000, max_pixels=2000))[0]) == 1


def test_sft_image_rows_cut_through_their_placeholders_say_so(processor, tmp_path):
    row = {"prompt": "<image>a", "response": "bbbb", "images": [{"bytes": encoded(Image.new("RGB", (56, 56)))}]}
    path = write_parquet(tmp_path / "rows.parquet", [row])
    full = load_image_chat_dataset([path], processor, ImageSettings(), max_length=200).items[0]
    keep, length = full["keep_length"], len(full["input_ids"])
    with pytest.raises(ValueError, match=rf"row 1 has {length} tokens, more than data.max_length=4; raise it, or its "
                                         rf"images' placeholders end at token {keep}, so no right cut keeps them"):
        load_image_chat_dataset([path], processor, ImageSettings(), max_length=4)
    with pytest.raises(ValueError, match=rf"no usable rows .*: 1 row\(s\) longer than data.max_length=4 "
                                         rf"\(truncation=right cuts .* nor through its images' placeholders\), the "
                                         rf"shortest {length}"):
        load_image_chat_dataset([path], processor, ImageSettings(), max_length=4, truncation="right")


def test_a_text_model_given_image_rows_is_refused_not_trained_on_their_text(tmp_path):
    from shardrl.config.registry import load_config
    from shardrl.testing import save_char_model
    from shardrl.trainer.datasets import load_datasets

    tokenizer = save_char_model(tmp_path / "text")
    image = {"bytes": encoded(Image.new("RGB", (28, 28), "red"))}
    rows = write_parquet(tmp_path / "rows.parquet", [{"prompt": PROMPT, "images": []}, {"prompt": PROMPT,
                                                                                       "images": [image]}])
    cfg = load_config(None, [f"model.path={tmp_path / 'text'}", f"data.train_files=[{rows}]"])
    with pytest.raises(ValueError, match=r"prompt 2 has images \(its 'images' column, data.image_key\) but model.path="
                                         r".* \('qwen2'\) is a text model"):
        load_datasets(cfg, tokenizer, load_hf_config(str(tmp_path / "text"), None))


def test_sft_of_a_text_model_given_image_rows_is_refused_not_trained_on_their_text(tmp_path):
    from shardrl.data.chat import load_chat_dataset
    from shardrl.testing import save_char_model

    tokenizer = save_char_model(tmp_path / "text")
    image = {"bytes": encoded(Image.new("RGB", (28, 28), "red"))}
    rows = write_parquet(tmp_path / "sft.parquet", [{"prompt": "a", "response": "b", "images": [image]}])
    with pytest.raises(ValueError, match=r"sft.parquet: row 1: the row has images .* but the model is a text model"):
        load_chat_dataset([rows], tokenizer, 200, skip_bad_rows=True, image_key="images")  # (not dropped as bad)
    # rows whose image column is empty are text rows
    empty = write_parquet(tmp_path / "empty.parquet", [{"prompt": "a", "response": "b", "images": []}])
    assert len(load_chat_dataset([empty], tokenizer, 200, image_key="images")) == 1


def test_a_text_critic_on_a_vision_language_policy_is_refused(tmp_path):
    from shardrl.config.registry import load_config
    from shardrl.testing import _save_qwen2, save_tiny_vl_model
    from shardrl.trainer.datasets import check_vision_run

    processor = save_tiny_vl_model(tmp_path / "vl")
    _save_qwen2(tmp_path / "text", processor.tokenizer, 0, {})  # the policy's vocabulary: only its kind differs
    base = [f"model.path={tmp_path / 'vl'}", "algorithm.adv_estimator=gae"]
    policy = load_hf_config(str(tmp_path / "vl"), None)
    with pytest.raises(ValueError, match=r"critic.model_path=.* is a text model \('qwen2'\) but the policy "
                                         r"'qwen2_5_vl' reads images"):
        check_vision_run(load_config(None, [*base, f"critic.model_path={tmp_path / 'text'}"]), policy)
    check_vision_run(load_config(None, base), policy)  # unset: the critic is the policy's VL model
    check_vision_run(load_config(None, [*base, f"critic.model_path={tmp_path / 'vl'}"]), policy)


def test_verls_geo3k_script_engine_argument_is_dropped_with_its_reason():
    """verl's examples/grpo_trainer/run_qwen2_5_vl-7b.sh adds a vLLM engine argument with Hydra's `+`; any key of
    the engine_kwargs dicts is the engine's own, not a verl key shardrl lacks."""
    from shardrl.compat.verl.translate import translate

    out = translate(["+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
                     "actor_rollout_ref.rollout.engine_kwargs.sglang.anything=1", "data.image_key=images"])
    assert set(out.dropped) >= {"actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",
                                "actor_rollout_ref.rollout.engine_kwargs.sglang.anything"}
    assert "vLLM/SGLang" in out.dropped["actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache"]
    assert not any("engine_kwargs" in line for line in out.overrides)


@pytest.mark.parametrize("kind", ["pairs", "unpaired"])
def test_preference_rows_with_images_are_refused_for_a_text_model(tmp_path, kind):
    """dpo, kto and rm read no images: a row holding some (TRL's `images` column) is refused, not trained as its text
    alone; the same rows without the column load."""
    from shardrl.data.chat import load_preference_dataset, load_unpaired_dataset
    from shardrl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    row = ({"prompt": "a", "chosen": "b", "rejected": "c"} if kind == "pairs" else
           {"prompt": "a", "completion": "b", "label": True})
    load = load_preference_dataset if kind == "pairs" else load_unpaired_dataset
    (tmp_path / "plain.jsonl").write_text(json.dumps(row) + "\n")
    assert len(load([str(tmp_path / "plain.jsonl")], tok, 64).items) == 1
    (tmp_path / "images.jsonl").write_text(json.dumps({**row, "images": [{"path": "x.png"}]}) + "\n")
    with pytest.raises(ValueError, match=r"images.jsonl: row 1: the row has images \(its 'images' column\) but the "
                                         r"model is a text model: .* shardrl dpo, kto and rm do not read images yet"):
        load([str(tmp_path / "images.jsonl")], tok, 64, skip_bad_rows=True)  # (not dropped as a bad row)
