"""A tiny vision-language model learns to name a color it sees (issue 61), on the CPU, in minutes.

Makes, under OUT (default outputs/vl_colors): a tiny random Qwen2.5-VL folder (a 2-block vision tower, a
2-layer 64-wide decoder, the character tokenizer, `shardrl.testing.tiny_vl_processor`'s processor), and
train/val parquet files in verl's multimodal form: a chat prompt "<image>color?" beside an `images` column
holding a PNG drawn with PIL, a square of red, green or blue (its shade jittered, a few noisy pixels); the
answer is the color's word (`reward.py`: 1 for the right word, exactly).

The model's warm-up (`--warmup-steps` supervised steps) teaches the answer's *format* only: its labels are a
color word drawn at random, whatever the image shows, so after it the model answers one of the three words
and EOS, right about a third of the time. Reading the image is left to GRPO, which lifts the mean reward
from ~0.33 towards 1.

    python examples/vl_colors/prepare.py && shardrl train examples/vl_colors/cpu.yaml
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import torch

COLORS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}
PROMPT = [{"role": "user", "content": "<image>color?"}]
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)  # head_dim 8: mrope_section

REWARD = '''"""The vl_colors reward: 1 when the response is the color's word (spaces around it ignored), else 0."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)
'''


def draw(color: tuple[int, int, int], rng: random.Random, size: int = 56) -> bytes:
    """A PNG: a `size` x `size` square of `color`, its shade jittered (each channel +-30), with a few pixels of
    noise. (A small square on a background is a harder task: the 2x2 merged patches then read mostly
    background, and this tiny tower learns it far slower than a CPU run allows.)"""
    from PIL import Image

    shade = tuple(min(255, max(0, c + rng.randint(-30, 30))) for c in color)
    image = Image.new("RGB", (size, size), shade)
    for _ in range(20):
        image.putpixel((rng.randrange(size), rng.randrange(size)), tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def rows(count: int, rng: random.Random) -> list[dict]:
    out = []
    for k in range(count):
        name = list(COLORS)[k % len(COLORS)]
        out.append({"data_source": "vl_colors", "prompt": PROMPT, "images": [{"bytes": draw(COLORS[name], rng)}],
                    "reward_model": {"ground_truth": name}})
    return out


def format_warmup(model, processor, train: list[dict], steps: int, seed: int, batch_size: int = 24) -> None:
    """Supervised steps on a prompt -> a color word drawn at random (not the image's), EOS: the answer's format."""
    from shardrl.data.images import ImageSettings, image_messages, load_image, process_images

    rng = random.Random(seed)
    tok = processor.tokenizer
    items = [process_images(processor, image_messages(PROMPT, 1), [load_image(row["images"][0])], ImageSettings())
             for row in train[:4 * batch_size]]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, labels, pixels, grids = [], [], [], []
        for item in rng.sample(items, batch_size):
            answer = tok.encode(rng.choice(list(COLORS)), add_special_tokens=False) + [tok.eos_token_id]
            ids.append(item["prompt_ids"] + answer)
            labels.append([-100] * len(item["prompt_ids"]) + answer)
            pixels.append(item["multi_modal_inputs"]["pixel_values"])
            grids.append(item["multi_modal_inputs"]["image_grid_thw"])
        width = max(map(len, ids))  # right-padded: the images' placeholders sit at the same place in every row
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
        input_ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
        targets = torch.tensor([t + [-100] * (width - len(t)) for t in labels])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=targets, pixel_values=torch.cat(pixels),
                     image_grid_thw=torch.cat(grids),
                     mm_token_type_ids=(input_ids == model.config.image_token_id).int()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def prepare(out: Path, warmup_steps: int = 60, num_train: int = 300, num_val: int = 30, seed: int = 0) -> Path:
    """The model folder, train.parquet, val.parquet and reward.py under `out` (reused when already there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers

    from shardrl.engine.model import load_hf_config
    from shardrl.testing import tiny_config, tiny_vl_processor

    if (out / "model" / "model.safetensors").is_file() and (out / "val.parquet").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train, val = rows(num_train, rng), rows(num_val, rng)
    pq.write_table(pa.Table.from_pylist(train), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(val), out / "val.parquet")
    (out / "reward.py").write_text(REWARD)
    kwargs = dict(tiny_config("qwen2_5_vl"))
    kwargs["text_config"] = {**kwargs["text_config"], **DECODER}
    kwargs["vision_config"] = {**kwargs["vision_config"], "out_hidden_size": DECODER["hidden_size"]}  # (the merger's)
    config = load_hf_config(None, kwargs)
    processor = tiny_vl_processor(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        format_warmup(model, processor, train, warmup_steps, seed)
    model.save_pretrained(out / "model")
    processor.tokenizer.save_pretrained(out / "model")
    processor.image_processor.save_pretrained(out / "model")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/vl_colors"))
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(prepare(args.out, args.warmup_steps, seed=args.seed))
