"""The whole GRPO step on a vision-language model (issue 61), shardrl against TRL's `GRPOTrainer` on the same model
folder, prompts with images, group size, batch, lengths, lr and reward, in one call on the GPU machine; and the
fast rollout's generation against HF `generate` with the same images.

    python bench/vl_e2e.py --root /tmp/vl_e2e --out results.jsonl       # Qwen2.5-VL-3B's shape, every part
    python bench/vl_e2e.py --parts shardrl,rollout ...                   # without TRL
    python bench/vl_e2e.py --quick --root /tmp/vl_e2e_cpu                # the tiny shape on the CPU (a check)

Model (`--shape`): a random-init Qwen2.5-VL of a named shape, saved as a model folder with its processor.
`qwen2_5_vl_3b` is Qwen2.5-VL-3B-Instruct's published config (decoder 36 x 2048, 16 heads, 2 KV heads, MLP
11008, vocabulary 151936, tied embeddings, M-RoPE sections 16/24/24; vision tower 32 x 1280, window attention with
full attention at blocks 7, 15, 23 and 31, patch 14, merge 2), its vision token ids as published; `tiny` is
`shardrl.models.tiny.TINY_VL_MODELS["qwen2_5_vl"]`. The tokenizer is word-level (bench/e2e.py's: text "w5 w17" is
ids [5, 17], every id decodes) with the vision tokens at the config's ids (EOS, pad and BOS are ids 2, 0 and 1, in
the config too), so a prompt of k words is k tokens for both systems; the chat template renders a user turn's
image as `<|vision_start|><|image_pad|><|vision_end|>` and its text, nothing else. The image processor is Qwen2-VL's
(PIL) at the shape's patch and merge sizes.

Data (`CASES`, `QUICK_CASES`): prompts x group size n; each prompt one image, `side` pixels square (a colored
square, disc or triangle drawn with PIL on a light background, its place and shade jittered), so every prompt has
(side / (patch x merge))^2 image tokens (256 for the 3B case's 448 px), then `words` random words; the response
limit `new`. Written once as rows in TRL's form (`images` beside a chat prompt whose content is an image part and
a text part; the images PNG files beside the rows), which `shardrl train` reads with `data.image_key=images` and
which TRL's worker turns into its own (a string prompt beside an `images` column of PIL images: TRL puts the image
part first, the same rendering).

Both systems: GRPO, no KL, one optimizer step per rollout, temperature 1, lr 1e-6, bench/e2e.py's reward
(`compute_score`: words in the response mod 5, over 4; in the 3B case a response never ends early in practice, a
random model drawing EOS with probability ~1/vocabulary a token), on CUDA bf16 weights, gradients and AdamW state,
and the case's gradient checkpointing (the 3B case's: without it neither fits one 80 GB card). shardrl: `shardrl
train` with bench/e2e.py's `grpo_overrides` and the model folder (`shardrl_overrides`; the fast rollout on CUDA, hf
on the CPU: `rollout.backend`'s null picks them; `--extra` adds overrides), each system in a process of its own;
its line is bench/e2e.py's `summarize_shardrl` (median step and phase times after the first step, peak memory per
phase, tokens/s per GPU, `mfu_measured` from its metrics, rewards) with the prompt's tokens as the trainer read
them (images' placeholders included) and the rollout backend it took. TRL: `GRPOTrainer` with bench/e2e.py's
`trl_grpo_args` (`trl_args`: HF `generate`, micro-batches of 16 samples), timed by its `timed_trl_train`; its line
adds the mean reward of each generation batch, the prompt's tokens and the image patches of each batch as TRL
built them. No floor line: bench/e2e.py's floor is a text model's.

Rollout (`rollout` part): the step's batch (prompts x n rows, each prompt's image repeated for its n rows), greedy,
`new` tokens a row with no EOS, by the fast rollout (CUDA graphs and its compiled parts on CUDA) and by HF
`generate` (one call, DynamicCache, the placeholders suppressed as shardrl's rollouts do); each after a warm-up run
(the fast rollout's of the same shapes, for its graphs and compilation; HF's of two tokens); new tokens/s, the
fraction of rows whose greedy responses are identical (1.0 in fp32 on the CPU; bf16 near-ties may differ on the
GPU) and, where they differ, how near a tie the two picks were in fp32 (`greedy_agreement`, as bench/rollout.py's
greedy case).

One JSON line per measurement (`--out` appends them). TRL is not a shardrl dependency: a machine without it gets a
`system: "trl"` line whose `error` says to install it (bench/run.py's `vl` set: carry TRL's wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402
from bench.e2e import compute_score, grpo_overrides, summarize_shardrl, timed_trl_train, trl_grpo_args  # noqa: E402

# Qwen2.5-VL-3B-Instruct's config.json, less its token ids (the word tokenizer's) and rope_scaling's old form
QWEN2_5_VL_3B = dict(
    model_type="qwen2_5_vl", tie_word_embeddings=True, image_token_id=151655, video_token_id=151656,
    vision_start_token_id=151652, vision_end_token_id=151653,
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                     rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False, sliding_window=32768,
                     max_window_layers=70, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                     bos_token_id=1, eos_token_id=2, pad_token_id=0),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3, tokens_per_second=2),
)
SHAPES = {"qwen2_5_vl_3b": QWEN2_5_VL_3B, "tiny": "qwen2_5_vl"}  # tiny: TINY_VL_MODELS' (read when used)
# name: prompts, n, words of text, new tokens, image side in pixels, gradient checkpointing (both systems)
CASES = {"qwen2_5_vl_3b": dict(prompts=16, n=8, words=64, new=256, side=448, checkpointing=True)}
QUICK_CASES = {"tiny": dict(prompts=2, n=4, words=8, new=8, side=56, checkpointing=True)}
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3, as bench/e2e.py's
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}")
COLORS = [(220, 40, 40), (40, 170, 40), (40, 70, 220), (230, 200, 40)]


def vl_reward(completions, **kwargs) -> list[float]:
    """TRL's form of `compute_score`: a conversational prompt's completions are [{"role", "content"}] lists."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [compute_score("vl_e2e", t, None) for t in texts]


# ---- assets -------------------------------------------------------------------------------------------
def hf_config(shape: str):
    from shardrl.engine.model import load_hf_config
    from shardrl.models.tiny import TINY_VL_MODELS

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: choose one of {sorted(SHAPES)}")
    kwargs = SHAPES[shape]
    return load_hf_config(None, dict(TINY_VL_MODELS[kwargs] if isinstance(kwargs, str) else kwargs))


def build_processor(config):
    """The word tokenizer with the vision tokens at the config's ids and CHAT_TEMPLATE, and Qwen2-VL's image
    processor at the config's patch and merge sizes (Qwen's own pixel range: 56^2 to 14^2 x 4^2 x 4096)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from shardrl.data.images import image_only_processor

    vocab_size = config.text_config.vocab_size
    vision = {getattr(config, key): name for key, name in VISION_TOKENS.items()}
    vocab = {f"w{i}": i for i in range(len(SPECIAL), vocab_size) if i not in vision}
    vocab.update({t: i for i, t in enumerate(SPECIAL)})
    vocab.update({name: i for i, name in vision.items()})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL + list(vision.values()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False,
                                        extra_special_tokens={"image_token": "<|image_pad|>"})
    tokenizer.chat_template = CHAT_TEMPLATE
    v = config.vision_config
    unit = v.patch_size * v.spatial_merge_size
    images = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                      temporal_patch_size=v.temporal_patch_size,
                                      size={"shortest_edge": unit * unit, "longest_edge": unit * unit * 4096})
    return image_only_processor(images, tokenizer)


def make_model(folder: Path, shape: str, device: str):
    """The shape's random model (seed 0; bf16 on CUDA) and its processor's parts saved in `folder` (kept when
    already there); returns the processor."""
    import torch
    import transformers

    config = hf_config(shape)
    processor = build_processor(config)
    if (folder / "config.json").is_file():
        return processor
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForImageTextToText.from_config(
            config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    return processor


def draw(side: int, rng: random.Random):
    """A `side` px square picture: a square, disc or triangle of one of COLORS on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), tuple(rng.randint(225, 255) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    color = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in rng.choice(COLORS))
    size = rng.randint(side // 3, side // 2)
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    kind = rng.choice(["square", "disc", "triangle"])
    if kind == "square":
        pen.rectangle([x, y, x + size, y + size], fill=color)
    elif kind == "disc":
        pen.ellipse([x, y, x + size, y + size], fill=color)
    else:
        pen.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=color)
    return image


def prepare(root: Path, shape: str, case: dict, device: str) -> dict:
    """The model folder, the prompts' images and `prompts.jsonl` (TRL's row form) under `root`; returns the
    case's numbers with the prompt's tokens (`prompt_len`, images' included) and the image tokens a prompt."""
    processor = make_model(root / "model", shape, device)
    rng = random.Random(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in sorted(i for w, i in processor.tokenizer.get_vocab().items() if w.startswith("w"))]
    rows = []
    for k in range(case["prompts"]):
        draw(case["side"], rng).save(root / "images" / f"{k}.png")
        text = " ".join(rng.choice(words) for _ in range(case["words"]))
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                     "images": [{"path": f"images/{k}.png"}], "data_source": "vl_e2e"})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = processor.image_processor
    image_tokens = (case["side"] // (v.patch_size * v.merge_size)) ** 2
    return dict(case, prompt_len=case["words"] + image_tokens + 2, image_tokens=image_tokens)


def load_items(root: Path, processor):
    """The prompts as shardrl's trainer reads them: ids and `multi_modal_inputs` per prompt."""
    from shardrl.data.images import ImageSettings, load_image_prompts

    items, _ = load_image_prompts([str(root / "prompts.jsonl")], processor, ImageSettings())
    return items


# ---- shardrl ------------------------------------------------------------------------------------------
def shardrl_overrides(root: Path, case: dict, steps: int, cuda: bool, shape: str, extra: list[str]) -> list[str]:
    """bench/e2e.py's GRPO run on the model folder with the prompts' images; on CUDA bf16 master weights and Adam
    state, as TRL's bf16 model (fp32 ones of the 3B shape, 42 GiB with the gradients, leave too little of an 80 GB
    card: `shardrl plan` sizes the update at 84 GiB so), and the case's gradient checkpointing (the 3B case's
    update without it: 223 GiB by the ledger at 16384 tokens a micro-batch, 88 GiB at 4096)."""
    return [f"model.path={root / 'model'}", "data.image_key=images",
            *grpo_overrides(root / "prompts.jsonl", case["prompts"], case["n"], case["prompt_len"], case["new"],
                            steps, f"vl_{shape}"),
            *(["model.dtype=bfloat16"] if cuda else []),
            f"model.gradient_checkpointing={str(case['checkpointing']).lower()}", *extra]


def run_shardrl(root: Path, case: dict, steps: int, cuda: bool, shape: str, extra: list[str], tag: str) -> dict:
    import yaml

    run_dir = root / "runs" / f"shardrl_{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts afresh
    cfg_path = root / "shardrl.yaml"
    cfg_path.write_text(yaml.safe_dump({}))
    overrides = shardrl_overrides(root, case, steps, cuda, shape, extra) + [f"trainer.output_dir={run_dir}"]
    cmd = [sys.executable, "-m", "shardrl.cli", "train", str(cfg_path), "--nproc-per-node", "1", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    metrics_path = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics_path.is_file():
        return dict(system="shardrl", case=shape, gpus=1, tag=tag, error=(proc.stderr or proc.stdout)[-3000:])
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    # the prompt's tokens as the trainer read them (its images' placeholders included), and the rollout it took
    return dict(summarize_shardrl(metrics, shape, 1, tag, wall), rollout_backend=config["rollout"]["backend"],
                prompt_length_mean=statistics.mean(r["prompt/length_mean"] for r in metrics))


# ---- TRL ----------------------------------------------------------------------------------------------
def run_trl(root: Path, case: dict, steps: int, shape: str) -> dict:
    """TRL's GRPOTrainer on the model folder and the same prompts, in this process (`--trl-worker`)."""
    try:
        import trl
    except ImportError:
        return dict(system="trl", case=shape, error="trl is not installed: pip install trl (a GPU machine: carry "
                    "its wheels, see bench/run.py's `vl` set)")
    import datasets
    import torch
    import transformers
    from PIL import Image

    from shardrl.data.images import load_processor

    cuda = torch.cuda.is_available()
    folder = root / "model"
    processor = load_processor(str(folder))
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa")
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    # TRL's own form: a string prompt beside the images (it puts the image part first, as the rows have it)
    data = [{"prompt": [{"role": "user", "content": r["prompt"][0]["content"][1]["text"]}],
             "images": [Image.open(root / im["path"]).convert("RGB") for im in r["images"]]} for r in rows]
    dataset = datasets.Dataset.from_list(data * (steps + 1))  # enough rows for every step
    rewards: list[float] = []

    def reward(completions, **kwargs):
        scores = vl_reward(completions, **kwargs)
        rewards.append(statistics.mean(scores))
        return scores

    reward.__name__ = "vl_reward"
    prompts, n = case["prompts"], case["n"]
    args = trl.GRPOConfig(**trl_args(root, case, steps, cuda))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=processor)
    seen = {"prompt_tokens": [], "image_rows": []}
    inner = trainer._generate_and_score_completions

    def read_batch(*a, **k):  # what TRL generated from and trains on: the prompts' tokens and image patches
        out = inner(*a, **k)
        seen["prompt_tokens"] += out["prompt_mask"].sum(1).tolist()
        seen["image_rows"].append(int(out["pixel_values"].shape[0]) if "pixel_values" in out else 0)
        return out

    trainer._generate_and_score_completions = read_batch
    timed = timed_trl_train(trainer, cuda, prompts * n, case["prompt_len"])
    return dict(system="trl", case=shape, gpus=1, **timed, reward_mean=[round(r, 4) for r in rewards],
                prompt_length_mean=statistics.mean(seen["prompt_tokens"]),
                image_patches_per_batch=seen["image_rows"])


def trl_args(root: Path, case: dict, steps: int, cuda: bool) -> dict:
    """GRPOConfig's arguments: bench/e2e.py's mapping of the same numbers, with the case's gradient checkpointing."""
    return trl_grpo_args(root / "trl_out", case["prompts"], case["n"], case["new"], steps, 1e-6, cuda,
                         gradient_checkpointing=case["checkpointing"])


# ---- the rollout against HF generate ----------------------------------------------------------------------
def rollout_vs_hf(root: Path, case: dict, shape: str) -> list[dict]:
    """Greedy generation of the step's batch (each prompt n times) by the fast rollout and by HF `generate`."""
    import torch
    import transformers

    from bench.rollout import IdTokenizer, timed
    from shardrl.data.images import load_processor
    from shardrl.rollout import SamplingParams, build_rollout

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = root / "model"
    processor = load_processor(str(folder))
    items = [item for item in load_items(root, processor) for _ in range(case["n"])]
    ids = torch.tensor([item["prompt_ids"] for item in items], device=device)  # (equal lengths: no padding)
    mask = torch.ones_like(ids)
    images = [{k: v.to(device) for k, v in item["multi_modal_inputs"].items()} for item in items]
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype,
                                                                     attn_implementation="sdpa").to(device).eval()
    rows, new = len(items), case["new"]
    fast = build_rollout("fast", model.config, IdTokenizer(), device, dtype, micro_batch_size=rows, max_batch=rows)
    fast.load_weights(model.named_parameters())
    greedy = SamplingParams(greedy=True, max_new_tokens=new)
    run_fast = lambda: fast.generate(ids, mask, greedy, multi_modal_inputs=images)  # noqa: E731
    _, fast_warmup_s = timed(run_fast, device)
    out, fast_s = timed(run_fast, device)
    ours = out.response_ids.to(device)
    fast_stats = dict(fast.last_stats)
    fast.release(weights=True)
    del fast
    inputs = dict(pixel_values=torch.cat([im["pixel_values"] for im in images]),
                  image_grid_thw=torch.cat([im["image_grid_thw"] for im in images]),
                  mm_token_type_ids=(ids == model.config.image_token_id).int())

    def run_hf(tokens: int):
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                                               eos_token_id=None, pad_token_id=0,
                                               suppress_tokens=processor_placeholders(model.config))
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **inputs)

    # a short warm-up: HF's dynamic cache compiles nothing, the first call only starts the kernels' libraries
    _, hf_warmup_s = timed(lambda: run_hf(2), device)
    theirs, hf_s = timed(lambda: run_hf(new), device)
    theirs = theirs[:, ids.shape[1]:]
    tokens = rows * new
    agreement = greedy_agreement(model, ids, images, ours[:, :new], theirs)
    common = dict(case=shape, rows=rows, prompt_len=ids.shape[1], image_tokens=case["image_tokens"], new_tokens=new,
                  device=device.type, dtype=str(dtype).removeprefix("torch."))
    return [dict(system="fast", what="rollout", **common, tokens=int(out.response_mask.sum()), seconds=round(fast_s, 4),
                 tokens_per_s=round(int(out.response_mask.sum()) / fast_s, 1), warmup_s=round(fast_warmup_s, 3),
                 images_encoded=fast_stats.get("images"), **agreement),
            dict(system="hf_generate", what="rollout", **common, tokens=tokens, seconds=round(hf_s, 4),
                 tokens_per_s=round(tokens / hf_s, 1), warmup_s=round(hf_warmup_s, 3))]


def greedy_agreement(model, ids, images: list[dict], ours, theirs) -> dict:
    """The fraction of rows whose greedy responses are identical, and where a row's differ, how near a tie the
    two picks were: |logit difference| of the two tokens at the first differing position, in an fp32 forward of
    the row's prompt (its image) and the shared prefix, against the median top-1/top-2 gap of HF's responses'
    first tokens (a tie that the order of a sum decided differs by ~1e-6 of the logits in fp32)."""
    import torch

    with torch.no_grad():
        return _greedy_agreement(model.float(), ids, images, ours, theirs)  # (the model is left in fp32: called last)


def _greedy_agreement(ref, ids, images: list[dict], ours, theirs) -> dict:
    import torch

    same = (ours == theirs).all(1)
    image_token = ref.config.image_token_id
    gaps = []
    for row in (~same).nonzero().flatten().tolist():
        pos = int((ours[row] != theirs[row]).nonzero()[0])
        prefix = torch.cat([ids[row], theirs[row, :pos]])[None]
        logits = ref(input_ids=prefix, mm_token_type_ids=(prefix == image_token).int(),
                     pixel_values=images[row]["pixel_values"].float(), image_grid_thw=images[row]["image_grid_thw"],
                     logits_to_keep=1).logits[0, -1]
        gaps.append(float((logits[ours[row, pos]] - logits[theirs[row, pos]]).abs()))
    first = [ref(input_ids=ids[r:r + 1], mm_token_type_ids=(ids[r:r + 1] == image_token).int(),
                 pixel_values=images[r]["pixel_values"].float(), image_grid_thw=images[r]["image_grid_thw"],
                 logits_to_keep=1).logits[0, -1].topk(2).values for r in range(min(len(ids), 8))]
    typical = sorted(float(v[0] - v[1]) for v in first)
    return dict(identical_to_hf_fraction=float(same.float().mean()), differing_rows=len(gaps),
                fp32_gap_at_difference_max=max(gaps, default=0.0), fp32_top2_gap_median=typical[len(typical) // 2])


def processor_placeholders(config) -> list[int]:
    """The image and video placeholder ids: never generated (shardrl's rollouts suppress them too)."""
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if i is not None]


# ---- driver -------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/vl_e2e")
    p.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)} (default qwen2_5_vl_3b; --quick: tiny)")
    p.add_argument("--parts", default="shardrl,trl,rollout", help="comma list of shardrl, trl, rollout")
    p.add_argument("--steps", type=int, default=4, help="shardrl's steps (the first is warm-up)")
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument("--tag", default="default")
    p.add_argument("--extra", default="", help="extra shardrl overrides, space separated")
    p.add_argument("--quick", action="store_true", help="the tiny shape, 2 steps a system (a CPU check)")
    p.add_argument("--out", default=None)
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = args.shape or ("tiny" if args.quick else "qwen2_5_vl_3b")
    cases = {**CASES, **QUICK_CASES}
    if shape not in cases:
        p.error(f"--shape {shape!r}: choose one of {sorted(cases)}")
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - {"shardrl", "trl", "rollout", "none"}:
        p.error(f"--parts {args.parts!r}: a comma list of shardrl, trl, rollout (none: only write the assets)")
    steps, trl_steps = (2, 2) if args.quick else (args.steps, args.trl_steps)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    case = prepare(root, shape, cases[shape], "cuda" if cuda else "cpu")
    if args.trl_worker:
        print("RESULT " + json.dumps(run_trl(root, case, trl_steps, shape)))
        return

    def emit(rec):
        rec = dict(rec, bench="vl_e2e", quick=args.quick, prompts=case["prompts"], n=case["n"],
                   prompt_len=case["prompt_len"], image_tokens=case["image_tokens"], new=case["new"])
        print(json.dumps(rec), flush=True)
        append_jsonl(args.out, [rec])

    for part in parts:
        if part == "shardrl":
            emit(run_shardrl(root, case, steps, cuda, shape, args.extra.split(), args.tag))
        elif part == "trl":
            cmd = [sys.executable, __file__, "--root", str(root), "--shape", shape, "--trl-worker",
                   "--trl-steps", str(trl_steps)] + (["--quick"] if args.quick else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            emit(json.loads(line[7:]) if line else dict(system="trl", case=shape, error=proc.stderr[-3000:]))
        elif part == "rollout":
            for rec in rollout_vs_hf(root, case, shape):
                emit(rec)


if __name__ == "__main__":
    main()
