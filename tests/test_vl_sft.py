"""`shardrl sft` with images (issue 61): verl's and TRL's supervised rows with images become the processor's ids
(each image's placeholders expanded, never a loss token) and the loss mask of the assistant's replies; the engine's
SFT step on an image batch is a plain HF forward's loss and gradients (the model run one row at a time with its
images), whatever the micro-batch cut; a short run on colored squares learns."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from shardrl.data.chat import collate_chats
from shardrl.data.image_chat import load_image_chat_dataset
from shardrl.data.images import ImageSettings
from shardrl.engine.model import load_hf_config
from shardrl.testing import run_distributed, tiny_config, tiny_vl_processor

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}


def png(width: int, height: int, color=(200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor():
    return tiny_vl_processor(load_hf_config(None, tiny_config("qwen2_5_vl")))


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def mixed_rows(folder) -> list[dict]:
    """verl's messages (`<image>` in a string), TRL's parts, a prompt/response row with two images, a row without
    images, and a second assistant turn after an image (images by path: JSON holds no bytes)."""
    for name, size in (("blue", (56, 84)), ("tall", (28, 56)), ("wide", (60, 30)), ("red", (40, 40))):
        (folder / f"{name}.png").write_bytes(png(*size, COLORS.get(name, (90, 90, 90))))
    return [
        {"messages": [{"role": "user", "content": "<image>color?"}, {"role": "assistant", "content": "blue"}],
         "images": [{"path": "blue.png"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
         "images": ["blue.png"]},
        {"prompt": "a<image>b<image>?", "response": "two", "images": ["tall.png", {"path": "wide.png"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "images": []},
        {"messages": [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes"}],
         "images": [{"path": "red.png"}]},
    ]


def test_verl_and_trl_rows_give_the_processors_ids_and_train_the_replies_only(processor, tmp_path):
    items = load_image_chat_dataset([write_jsonl(tmp_path / "rows.jsonl", mixed_rows(tmp_path))], processor,
                                    ImageSettings(), max_length=200).items
    verl, trl, two, plain, turns = items
    assert verl["input_ids"] == trl["input_ids"] and verl["loss_mask"] == trl["loss_mask"]
    torch.testing.assert_close(verl["multi_modal_inputs"]["pixel_values"], trl["multi_modal_inputs"]["pixel_values"])
    # the whole chat through the processor (its own placeholder expansion) gives the same ids
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]},
            {"role": "assistant", "content": "blue"}]
    text = processor.apply_chat_template(chat, tokenize=False)
    whole = processor(text=[text], images=[Image.open(tmp_path / "blue.png").convert("RGB")], return_tensors="pt")
    assert verl["input_ids"] == whole["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert verl["input_ids"].count(image_id) == 6 * 4 // 4  # 56 x 84 pixels: a 6 x 4 grid of 14-pixel patches

    def trained(item):
        return processor.tokenizer.decode([i for i, m in zip(item["input_ids"], item["loss_mask"]) if m])
    assert [trained(item) for item in items] == ["blue", "blue", "two", "hello", "redyes"]
    # two images: both grids, both expansions, in order; the placeholders end before the reply
    assert two["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 2], [1, 2, 4]]
    assert two["input_ids"].count(image_id) == 2 + 2
    assert two["keep_length"] == max(i for i, t in enumerate(two["input_ids"]) if t == image_id) + 1
    assert plain["multi_modal_inputs"] is None and plain["keep_length"] == 0 and image_id not in plain["input_ids"]
    batch = collate_chats(items, processor.tokenizer.pad_token_id)
    assert [row is None for row in batch["multi_modal_inputs"]] == [False, False, False, True, False]


def test_bad_images_and_cuts_through_placeholders(processor, tmp_path):
    rows = [{"prompt": "<image>a", "response": "b", "images": [{"bytes": png(28, 28)}]},
            {"prompt": "<image>a", "response": "b", "images": [{"bytes": b"not an image"}]},
            {"prompt": "<image><image>a", "response": "b", "images": [{"bytes": png(28, 28)}]}]
    path = write_parquet(tmp_path / "rows.parquet", rows)  # (verl's form: bytes in a parquet column)
    with pytest.raises(ValueError, match=r"rows.parquet: row 2: image 1 cannot be read .*data.skip_bad_rows=true"):
        load_image_chat_dataset([path], processor, ImageSettings(), max_length=200)
    data = load_image_chat_dataset([path], processor, ImageSettings(), max_length=200, skip_bad_rows=True)
    assert len(data) == 1 and data.stats["bad"] == 2
    # truncation=right keeps a row whose cut falls after its placeholders, and drops one cut through them
    long_reply = {"prompt": "<image>a", "response": "b" * 30, "images": [{"bytes": png(56, 56)}]}
    path = write_parquet(tmp_path / "long.parquet", [long_reply])
    full = load_image_chat_dataset([path], processor, ImageSettings(), max_length=200).items[0]
    keep, reply = full["keep_length"], full["loss_mask"].index(1)
    assert 0 < keep < reply
    cut = load_image_chat_dataset([path], processor, ImageSettings(), max_length=reply + 2, truncation="right")
    assert cut.stats["truncated"] == 1 and cut.items[0]["input_ids"] == full["input_ids"][:reply + 2]
    # a cut through a later turn's image (its earlier reply still trained) drops the row: no pixels without tokens
    later = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "<image>c"}, {"role": "assistant", "content": "d"}],
             "images": [{"bytes": png(56, 56)}]}
    path = write_parquet(tmp_path / "later.parquet", [later])
    full = load_image_chat_dataset([path], processor, ImageSettings(), max_length=200).items[0]
    assert full["loss_mask"].index(1) < full["keep_length"] - 1
    cut = load_image_chat_dataset([path], processor, ImageSettings(), max_length=full["keep_length"],
                                  truncation="right")
    assert cut.stats["truncated"] == 1  # the cut right after the placeholders keeps them all
    with pytest.raises(ValueError, match=r"no usable rows .*'too_long': 1"):
        load_image_chat_dataset([path], processor, ImageSettings(), max_length=full["keep_length"] - 1,
                                truncation="right")


def _sft_step(layouts: dict, rows_path: str, kind: str) -> dict:
    """The engine's SFT loss and gradients per layout on the rows, and a plain HF forward's: the model run on one
    row at a time with its images, -log p summed over the loss tokens, divided by the batch's loss tokens."""
    import torch.nn.functional as F

    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.model import build_causal_lm
    from shardrl.testing import record_grads
    from shardrl.trainer.sft import sft_loss

    config = load_hf_config(None, tiny_config(kind))
    processor = tiny_vl_processor(config)
    items = load_image_chat_dataset([rows_path], processor, ImageSettings(), max_length=200).items
    batch = collate_chats(items, processor.tokenizer.pad_token_id)
    out = {}
    for name, engine_kwargs in layouts.items():
        engine = build_engine(ModelConfig(tiny=tiny_config(kind)), EngineConfig(param_dtype="float32", **engine_kwargs),
                              OptimConfig(lr=1e-3, clip_grad=0.0))
        grads = record_grads(engine)
        metrics = engine.train_batch(batch, sft_loss)
        out[name] = {"loss": metrics["loss"], "grads": grads[0], "micro": metrics["num_micro_batches"]}
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    total = batch["loss_mask"].sum()
    loss = 0.0
    for item in items:
        ids, mask = torch.tensor([item["input_ids"]]), torch.tensor(item["loss_mask"][1:], dtype=torch.bool)
        images = dict(item["multi_modal_inputs"] or {})
        if images:  # transformers 5.2x reads the placeholders' modality from here
            images["mm_token_type_ids"] = (ids == config.image_token_id).int()
        logits = model(input_ids=ids, **images).logits[0, :-1].float()  # (L - 1, V)
        nll = -F.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        loss = loss + nll[mask].sum() / total
    loss.backward()
    out["plain"] = {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_the_sft_step_on_images_is_a_plain_hf_forwards_loss_and_gradients_whatever_the_cut(tmp_path, kind):
    path = write_jsonl(tmp_path / "rows.jsonl", mixed_rows(tmp_path))
    layouts = {"micro_1": {"micro_batch_size_per_gpu": 1}, "micro_2": {"micro_batch_size_per_gpu": 2},
               "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}}
    out = run_distributed(_sft_step, 1, layouts, path, kind)
    plain = out.pop("plain")
    assert sorted(o["micro"] for o in out.values()) != [out["micro_1"]["micro"]] * 3  # the cuts differ
    assert any(name.startswith("model.visual.") and grad.abs().sum() > 0 for name, grad in plain["grads"].items())
    for name, o in out.items():
        assert o["loss"] == pytest.approx(plain["loss"], rel=1e-5), name
        assert set(o["grads"]) == set(plain["grads"])
        for key, grad in plain["grads"].items():
            torch.testing.assert_close(o["grads"][key], grad, atol=1e-5 * float(grad.abs().max()) + 1e-7, rtol=1e-4,
                                       msg=f"{name}: {key}")


@pytest.mark.multiproc
def test_sft_on_images_learns_and_exports(tmp_path):
    import transformers

    from shardrl.cli import main
    from shardrl.testing import save_tiny_vl_model

    save_tiny_vl_model(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": "<image>color?"}, {"role": "assistant", "content": name}],
             "images": [{"bytes": png(28, 28, rgb)}]} for name, rgb in COLORS.items()] * 2
    path = write_parquet(tmp_path / "colors.parquet", rows)
    run_dir = tmp_path / "run"
    assert main(["sft", f"model.path={tmp_path / 'model'}", f"data.train_files=[{path}]", f"data.val_files=[{path}]",
                 "data.batch_size=6", "engine.param_dtype=float32", "optim.lr=1e-2", "trainer.total_steps=12",
                 "trainer.val_freq=6", "trainer.logger=[jsonl]", f"trainer.output_dir={run_dir}",
                 "trainer.device=cpu", "trainer.export_hf=true"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 13))
    losses = [r["sft/loss"] for r in records]
    assert losses[-1] < 0.5 * losses[0], losses
    val = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(run_dir / "hf_model")
    assert any(name.startswith("model.visual.") for name, _ in hf.named_parameters())


def test_sft_on_a_vision_language_model_whose_folder_has_no_image_processor_is_refused_naming_it(tmp_path):
    from shardrl.launch.rank import run
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "text")  # a tokenizer, no preprocessor_config.json
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"model folder .*text' has no image processor \(preprocessor_config.json\)"):
        run(None, [f"model.tiny={json.dumps(tiny_config('qwen2_5_vl'))}", f"model.tokenizer_path={tmp_path / 'text'}",
                   f"data.train_files=[{path}]", f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=1"],
            "sft")
    assert not (tmp_path / "run").exists()
