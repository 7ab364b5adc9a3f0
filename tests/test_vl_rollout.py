"""The rollouts generate for a vision-language model (issue 61): the HF rollout hands each prompt's images to HF
`generate` (repeated for its n samples); the fast one runs the vision tower once per prompt, splices its output
at the placeholders and decodes at the M-RoPE positions. For both, greedy output equals HF `generate` called on
each prompt alone, and the sampled tokens' log-probs equal the engine's recomputation on the same images; the
fast rollout's prefix cache and its sharing of equal prompts key on the image too. Tiny random Qwen2.5-VL and
Qwen3-VL, CPU, fp32; prompts rendered by the tiny processor from PIL images (one image, none, two), left-padded
together."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from shardrl.data.images import ImageSettings, image_messages, process_images
from shardrl.data.prompts import collate_prompts
from shardrl.engine.model import PolicyModel, build_causal_lm, load_hf_config
from shardrl.rollout import SamplingParams, build_rollout
from shardrl.testing import tiny_config, tiny_vl_processor

KINDS = ("qwen2_5_vl", "qwen3_vl")
BACKENDS = ("hf", "fast")
# (text, images as (width, height, color)): the placeholders stand where the images go; color None: noise (each
# patch its own features)
PROMPTS = [("<image>what color? ", [(56, 84, (250, 0, 0))]), ("no picture here", []),
           ("a <image> and <image>", [(28, 56, (0, 200, 0)), (64, 32, (0, 0, 255))])]


def picture(width: int, height: int, color) -> Image.Image:
    if color is not None:
        return Image.new("RGB", (width, height), color)
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(width * height))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def vl_setup(kind: str, seed: int = 0, backend: str = "hf", prompts=PROMPTS, config: dict | None = None,
             **rollout_kwargs):
    config = load_hf_config(None, config or tiny_config(kind))
    processor = tiny_vl_processor(config, patch_size=config.vision_config.patch_size)
    items = []
    for text, images in prompts:
        pictures = [picture(w, h, color) for w, h, color in images]
        messages = image_messages([{"role": "user", "content": text}], len(pictures))
        items.append({**process_images(processor, messages, pictures, ImageSettings()), "data_source": "",
                      "extra": {}, "index": len(items)})
    prompts = collate_prompts(items, processor.tokenizer.pad_token_id)
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=seed).eval()
    rollout = build_rollout(backend, config, processor.tokenizer, "cpu", torch.float32, micro_batch_size=2,
                            **rollout_kwargs)
    rollout.load_weights(model.named_parameters())
    return model, rollout, prompts, [item["multi_modal_inputs"] for item in items]


def hf_greedy(model, rollout, ids: torch.Tensor, images: dict | None, max_new_tokens: int) -> list[int]:
    """HF `generate`'s greedy response to one unpadded prompt (1, L), the placeholders suppressed."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=rollout.stop_ids,
                             pad_token_id=rollout.pad_id, suppress_tokens=rollout.placeholder_ids, **(images or {}))
    return out[0, ids.shape[1]:].tolist()


def assert_equals_reference(out, ref: list[int], row: int, stop_ids) -> None:
    """Row `row` of a rollout's output is `ref` cut where the rollout cuts (at EOS)."""
    length = int(out.response_mask[row].sum())
    assert out.response_ids[row, :length].tolist() == ref[:length], row
    assert length == len(ref) or ref[length - 1] in stop_ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hf_generate_per_prompt(kind, backend):
    model, rollout, prompts, images = vl_setup(kind, seed=1, backend=backend)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    out = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), multi_modal_inputs=images)
    for b in range(len(PROMPTS)):
        row = ids[b][mask[b].bool()][None]  # (1, L): the prompt alone, unpadded
        assert_equals_reference(out, hf_greedy(model, rollout, row, images[b], 12), b, rollout.stop_ids)
    # the images steer the generation: the same prompts with other pixels answer otherwise
    dark = [{**im, "pixel_values": im["pixel_values"] * 0 - 1} if im else None for im in images]
    other = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), multi_modal_inputs=dark)
    assert not torch.equal(other.sampled_log_probs[0], out.sampled_log_probs[0])
    assert torch.equal(other.response_ids[1], out.response_ids[1])  # (the text-only prompt reads no image)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", [SamplingParams(n=16, temperature=5.0, max_new_tokens=16, seed=0),
                                      SamplingParams(n=16, temperature=5.0, top_p=0.999, max_new_tokens=16, seed=0)],
                         ids=["sample", "top_p"])
def test_placeholders_are_never_sampled(backend, sampling):
    """An image placeholder in a response would ask the vision tower for an image the row lacks (the engine's
    recomputation fails on it); the rollout never samples one. (That the recorded log-probs keep the placeholders'
    mass, the model's whole distribution, is the engine-recomputation test's.) Near uniform sampling: ~1 in 64 a
    token; plain and truncated (the fast rollout's two torch sampling paths)."""
    placeholders = None

    def sampled_placeholders(suppress: bool) -> int:
        model, rollout, prompts, images = vl_setup("qwen2_5_vl", seed=3, backend=backend)
        nonlocal placeholders
        placeholders = torch.tensor(rollout.placeholder_ids)
        if not suppress:  # what the sampler would draw without the suppression (before the fast one's first call)
            rollout.placeholder_ids = []
        out = rollout.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images)
        return int(torch.isin(out.response_ids[out.response_mask.bool()], placeholders).sum())

    assert sampled_placeholders(True) == 0
    assert sampled_placeholders(False) > 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_log_probs_equal_engine_recomputation(kind, backend):
    model, rollout, prompts, images = vl_setup(kind, seed=2, backend=backend)
    sampling = SamplingParams(n=3, temperature=0.8, top_k=20, max_new_tokens=10, seed=4)
    out = rollout.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images)
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    batch = out.to_batch()
    loss_mask = batch["loss_mask"].bool()
    assert loss_mask.sum() > 40
    lm = copy.deepcopy(model)
    lm.config.use_cache = False
    policy = PolicyModel(lm, chunk_size=7).eval()
    row_images = [images[i] for i in out.prompt_index.tolist()]  # each prompt's images for its n samples
    with torch.no_grad():
        engine_lp = policy(batch["input_ids"], batch["attention_mask"], remove_padding=True,
                           temperature=sampling.logprob_temperature, images=row_images)["log_probs"]
    got = batch["sampled_log_probs"]
    torch.testing.assert_close(got[loss_mask], engine_lp[loss_mask], atol=2e-5, rtol=0)
    # the recomputation without the images is another number: the rollout's log-probs did read them
    with torch.no_grad():
        blind = policy(batch["input_ids"], batch["attention_mask"], remove_padding=True,
                       temperature=sampling.logprob_temperature,
                       images=[{**im, "pixel_values": im["pixel_values"] + 1} if im else None
                               for im in row_images])["log_probs"]
    assert (blind[loss_mask] - got[loss_mask]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_images_are_checked_against_the_prompts_and_the_model(backend):
    model, rollout, prompts, images = vl_setup("qwen2_5_vl", backend=backend)
    sampling = SamplingParams(greedy=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="multi_modal_inputs has 2 entries for 3 prompts"):
        rollout.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images[:2])
    text = load_hf_config(None, tiny_config("qwen2"))
    text_rollout = build_rollout(backend, text, rollout.tokenizer, "cpu", torch.float32)
    ids = prompts["input_ids"].clamp(max=text.vocab_size - 1)
    with pytest.raises(ValueError, match="prompts with images, but the rollout.s .qwen2. model is not a vision"):
        text_rollout.generate(ids, prompts["attention_mask"], sampling, multi_modal_inputs=images)


def test_fast_rollout_refuses_what_it_cannot_do_with_images():
    import transformers

    with pytest.raises(ValueError, match=r"the fast rollout runs the vision-language models \['qwen2_5_vl', "
                                         r"'qwen3_vl'\], not 'qwen2_vl'; use rollout.backend=hf"):
        build_rollout("fast", transformers.Qwen2VLConfig(), None, "cpu", torch.float32)
    model, rollout, _, _ = vl_setup("qwen2_5_vl", backend="fast")
    with pytest.raises(ValueError, match="sampler='triton' cannot keep a vision-language model's image placeholders"):
        build_rollout("fast", model.config, rollout.tokenizer, "cpu", torch.float32, sampler="triton")


def prompt_rows(prompts) -> list[torch.Tensor]:
    return [prompts["input_ids"][b][prompts["attention_mask"][b].bool()][None] for b in range(len(prompts["input_ids"]))]


@pytest.mark.parametrize("block_size", [4, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_rollout_runs_the_tower_once_per_prompt(kind, block_size):
    """The n samples of a prompt share one vision-tower run, admitted together or not: 2 slots for 9 rows, so a
    prompt's later samples are prefilled again (past its cached blocks at block size 4, whole at 64) and read the
    tower's output kept for them. Every sample is the prompt's greedy answer."""
    model, rollout, prompts, images = vl_setup(kind, seed=1, backend="fast", max_batch=2, block_size=block_size)
    out = rollout.generate(prompts["input_ids"], prompts["attention_mask"],
                           SamplingParams(n=3, greedy=True, max_new_tokens=8), multi_modal_inputs=images)
    num_images = sum(len(pictures) for _, pictures in PROMPTS)
    assert rollout.last_stats["admissions"] >= 4  # (the samples were admitted apart)
    assert rollout.last_stats["images"] == num_images == rollout.totals["images"] == 3
    for b, row in enumerate(prompt_rows(prompts)):
        ref = hf_greedy(model, rollout, row, images[b], 8)
        for j in range(3):
            assert_equals_reference(out, ref, 3 * b + j, rollout.stop_ids)


def test_fast_rollout_reads_deepstack_features_joined_over_the_images(monkeypatch):
    """Some transformers versions give Qwen3-VL's deepstack features as one (all images' tokens, hidden) tensor per
    layer, not split per image as the main features are: the fast rollout's greedy output is HF's either way."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    split = Qwen3VLModel.get_image_features

    def joined(self, *args, **kwargs):
        out = split(self, *args, **kwargs)
        out.deepstack_features = [layer if torch.is_tensor(layer) else torch.cat(layer)  # (joined already in some)
                                  for layer in out.deepstack_features]
        return out

    monkeypatch.setattr(Qwen3VLModel, "get_image_features", joined)
    model, rollout, prompts, images = vl_setup("qwen3_vl", seed=1, backend="fast")
    out = rollout.generate(prompts["input_ids"], prompts["attention_mask"],
                           SamplingParams(greedy=True, max_new_tokens=8), multi_modal_inputs=images)
    monkeypatch.undo()
    for b, row in enumerate(prompt_rows(prompts)):
        assert_equals_reference(out, hf_greedy(model, rollout, row, images[b], 8), b, rollout.stop_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_fast_rollout_prefix_cache_and_shared_prefills_key_on_the_image(kind):
    """Two prompts with the same ids and other pixels share nothing from the image on: in one call, not one
    prefill (each its own tower run and answer); in a later call with a third image, no cached block from the
    image's first on, while the blocks of the text before it are read from the cache."""
    same_text = [("and <image> what color? ", [(56, 84, (250, 0, 0))]), ("and <image> what color? ", [(56, 84, (0, 0, 250))])]
    model, rollout, prompts, images = vl_setup(kind, seed=1, backend="fast", prompts=same_text, block_size=4)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    assert torch.equal(ids[0], ids[1])
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    out = rollout.generate(ids, mask, greedy, multi_modal_inputs=images)
    rows = prompt_rows(prompts)
    assert rollout.last_stats["images"] == 2
    assert not torch.equal(out.sampled_log_probs[0], out.sampled_log_probs[1])
    for b in range(2):
        assert_equals_reference(out, hf_greedy(model, rollout, rows[b], images[b], 8), b, rollout.stop_ids)
    green = {**images[0], "pixel_values": images[0]["pixel_values"] * 0 + 0.3}
    again = rollout.generate(ids[:1], mask[:1], greedy, multi_modal_inputs=[green])
    first_placeholder = rows[0][0].tolist().index(model.config.image_token_id)
    assert again.response_ids.shape[0] == 1 and rollout.last_stats["cached_tokens"] == first_placeholder // 4 * 4 > 0
    assert_equals_reference(again, hf_greedy(model, rollout, rows[0], green, 8), 0, rollout.stop_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_fast_rollout_prefills_past_a_cached_prefix_that_ends_inside_an_image(kind):
    """A prompt whose cached prefix (another prompt's blocks: the same text and image, other words after it) ends
    inside the image prefills the rest of its placeholders with the matching rows of the tower's output, at their
    M-RoPE positions, and answers as HF `generate` does."""
    texts = [("<image>what color? ", [(56, 84, None)]), ("<image>which shape? ", [(56, 84, None)])]
    model, rollout, prompts, images = vl_setup(kind, seed=1, backend="fast", prompts=texts)
    rows = [row[0].tolist() for row in prompt_rows(prompts)]
    image_id = model.config.image_token_id
    first, last = rows[0].index(image_id), len(rows[0]) - rows[0][::-1].index(image_id)  # [first, last)
    diverge = next(i for i, (x, y) in enumerate(zip(*rows)) if x != y)
    # a block size whose last block shared by the two prompts ends inside the image
    size = next(s for s in range(2, 16) if first < diverge // s * s < last)
    model, rollout, prompts, images = vl_setup(kind, seed=1, backend="fast", prompts=texts, block_size=size)
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    rollout.generate(prompts["input_ids"][:1], prompts["attention_mask"][:1], greedy, multi_modal_inputs=images[:1])
    out = rollout.generate(prompts["input_ids"][1:], prompts["attention_mask"][1:], greedy,
                           multi_modal_inputs=images[1:])
    assert first < rollout.last_stats["cached_tokens"] == diverge // size * size < last
    row = torch.tensor(rows[1])[None]
    assert_equals_reference(out, hf_greedy(model, rollout, row, images[1], 8), 0, rollout.stop_ids)
    # and its log-probs are those of a prefill of the whole prompt
    _, fresh, _, _ = vl_setup(kind, seed=1, backend="fast", prompts=texts, block_size=size)
    whole = fresh.generate(prompts["input_ids"][1:], prompts["attention_mask"][1:], greedy,
                           multi_modal_inputs=images[1:])
    assert fresh.last_stats["cached_tokens"] == 0
    torch.testing.assert_close(out.sampled_log_probs, whole.sampled_log_probs, atol=1e-5, rtol=0)


def test_fast_rollout_keeps_the_rope_delta_of_a_row_it_moves():
    """Compaction moves the rows left decoding into the first slots: each keeps its prompt's M-RoPE delta (a
    per-slot offset of the decode positions). Limits 2, 12, 12: the first row ends early, the third moves."""
    model, rollout, prompts, images = vl_setup("qwen2_5_vl", seed=1, backend="fast", max_batch=3, min_width=1,
                                               width_step=1, sync_every=2)
    order = [2, 1, 0]  # the two-image prompt last: it is the one that moves
    ids, mask = prompts["input_ids"][order], prompts["attention_mask"][order]
    out = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), max_new_tokens=[2, 12, 12],
                           multi_modal_inputs=[images[b] for b in order])
    assert rollout.last_stats["compactions"] >= 1
    for row, b in enumerate(order):
        ref = hf_greedy(model, rollout, prompt_rows(prompts)[b], images[b], 12)
        assert_equals_reference(out, ref[: 2 if row == 0 else 12], row, rollout.stop_ids)
    # and its log-probs are those of a rollout that never moves it
    _, still, _, _ = vl_setup("qwen2_5_vl", seed=1, backend="fast", max_batch=3)
    kept = still.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), max_new_tokens=[2, 12, 12],
                          multi_modal_inputs=[images[b] for b in order])
    assert still.last_stats["compactions"] == 0
    torch.testing.assert_close(out.sampled_log_probs, kept.sampled_log_probs, atol=1e-5, rtol=0)


def head_dim_16(kind: str) -> dict:
    """The tiny config with a decoder head dim of 16, the Triton decode kernel's smallest."""
    config = tiny_config(kind)
    text = dict(config["text_config"], hidden_size=64)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 2, 4])  # (head_dim / 2 frequencies)
    if "head_dim" in text:
        text["head_dim"] = 16
    return dict(config, text_config=text, vision_config=dict(config["vision_config"], out_hidden_size=64))


def check_triton_paths() -> None:
    """Run in Triton's interpreter (TRITON_INTERPRET=1): the fast rollout with the Triton decode attention, its
    cascade (a prompt's samples read their shared blocks together) and its prefill from cached blocks gives the
    tokens and log-probs of the SDPA one (itself checked against HF above)."""
    from shardrl.rollout import FastRollout
    from shardrl.rollout.fast.attention import TritonDecodeAttention

    sampling = SamplingParams(n=3, temperature=0.8, max_new_tokens=6, seed=4)
    for kind in KINDS:
        model, sdpa, prompts, images = vl_setup(kind, seed=1, backend="fast", config=head_dim_16(kind),
                                                attention="sdpa", block_size=4)
        triton = FastRollout(model.config, sdpa.tokenizer, "cpu", torch.float32, micro_batch_size=2,
                             attention="triton", block_size=4)
        triton.load_weights(model.named_parameters())
        assert isinstance(triton._block.attention, TritonDecodeAttention) and triton.cascade
        want = sdpa.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images)
        for call in range(2):  # (6 slots, 9 rows: the later rows, then the second call, read cached blocks)
            got = triton.generate(prompts["input_ids"], prompts["attention_mask"], sampling,
                                  multi_modal_inputs=images)
            assert torch.equal(got.response_ids, want.response_ids), (kind, call)
            torch.testing.assert_close(got.sampled_log_probs, want.sampled_log_probs, atol=1e-5, rtol=0)
            assert triton.last_stats["cascade_steps"] > 0 and triton.last_stats["cached_tokens"] > 0
    print("triton vl paths: ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_fast_rollout_triton_paths_in_interpreter():
    root = Path(__file__).parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "triton vl paths: ok" in run.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_rollout_on_cuda_with_graphs_matches_hf_and_eager(kind, attention):
    """On a GPU in fp32, with CUDA graphs and the compiled parts (the CUDA defaults): greedy output equals HF
    `generate` on each prompt alone (on the CPU), and sampled output equals the eager rollout's (no graphs, no
    compile) token for token, with its log-probs."""
    from shardrl.rollout import FastRollout

    model, hf, prompts, images = vl_setup(kind, seed=1, config=head_dim_16(kind))
    ids, mask = prompts["input_ids"], prompts["attention_mask"]

    def fast(**kwargs):
        rollout = FastRollout(model.config, hf.tokenizer, "cuda", torch.float32, micro_batch_size=2,
                              attention=attention, max_batch=4, sync_every=4, seq_bucket=32, **kwargs)
        rollout.load_weights(model.named_parameters())
        return rollout

    def cpu(out):
        return type(out)(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(out).items()})

    graphed, eager = fast(), fast(cuda_graphs=False, compile=False)
    out = cpu(graphed.generate(ids.cuda(), mask.cuda(), SamplingParams(greedy=True, max_new_tokens=12),
                               multi_modal_inputs=images))
    assert graphed._graphs
    for b in range(len(PROMPTS)):
        row = ids[b][mask[b].bool()][None]
        assert_equals_reference(out, hf_greedy(model, hf, row, images[b], 12), b, hf.stop_ids)
    sampled = SamplingParams(n=3, temperature=0.9, max_new_tokens=16, seed=2)
    a = cpu(graphed.generate(ids.cuda(), mask.cuda(), sampled, multi_modal_inputs=images))
    b = cpu(eager.generate(ids.cuda(), mask.cuda(), sampled, multi_modal_inputs=images))
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.sampled_log_probs, b.sampled_log_probs, atol=1e-4, rtol=0)


if __name__ == "__main__":
    check_triton_paths()
