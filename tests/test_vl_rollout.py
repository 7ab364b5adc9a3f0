"""The HF rollout generates for a vision-language model (issue 61): each prompt's images go to HF `generate`
(repeated for its n samples), greedy output equals HF `generate` called on each prompt alone, and the sampled
tokens' log-probs equal the engine's recomputation on the same images. Tiny random Qwen2.5-VL and Qwen3-VL, CPU,
fp32; prompts rendered by the tiny processor from PIL images (one image, none, two), left-padded together."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

from shardrl.data.images import ImageSettings, image_messages, process_images
from shardrl.data.prompts import collate_prompts
from shardrl.engine.model import PolicyModel, build_causal_lm, load_hf_config
from shardrl.rollout import SamplingParams, build_rollout
from shardrl.testing import tiny_config, tiny_vl_processor

KINDS = ("qwen2_5_vl", "qwen3_vl")
# (text, images as (width, height, color)): the placeholders stand where the images go
PROMPTS = [("<image>what color? ", [(56, 84, (250, 0, 0))]), ("no picture here", []),
           ("a <image> and <image>", [(28, 56, (0, 200, 0)), (64, 32, (0, 0, 255))])]


def vl_setup(kind: str, seed: int = 0):
    config = load_hf_config(None, tiny_config(kind))
    processor = tiny_vl_processor(config, patch_size=config.vision_config.patch_size)
    items = []
    for text, images in PROMPTS:
        pictures = [Image.new("RGB", (w, h), color) for w, h, color in images]
        messages = image_messages([{"role": "user", "content": text}], len(pictures))
        items.append({**process_images(processor, messages, pictures, ImageSettings()), "data_source": "",
                      "extra": {}, "index": len(items)})
    prompts = collate_prompts(items, processor.tokenizer.pad_token_id)
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=seed).eval()
    rollout = build_rollout("hf", config, processor.tokenizer, "cpu", torch.float32, micro_batch_size=2)
    rollout.load_weights(model.named_parameters())
    return model, rollout, prompts, [item["multi_modal_inputs"] for item in items]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hf_generate_per_prompt(kind):
    model, rollout, prompts, images = vl_setup(kind, seed=1)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    out = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), multi_modal_inputs=images)
    image_id = model.config.image_token_id
    for b in range(len(PROMPTS)):
        row = ids[b][mask[b].bool()][None]  # (1, L): the prompt alone, unpadded
        kwargs = dict(images[b] or {})
        with torch.no_grad():
            ref = model.generate(input_ids=row, mm_token_type_ids=(row == image_id).int(), max_new_tokens=12,
                                 do_sample=False, eos_token_id=rollout.stop_ids, pad_token_id=rollout.pad_id,
                                 suppress_tokens=rollout.placeholder_ids,
                                 **kwargs)[0, row.shape[1]:]
        length = int(out.response_mask[b].sum())
        assert out.response_ids[b, :length].tolist() == ref[:length].tolist(), b
        assert length == len(ref) or ref[length - 1] in rollout.stop_ids
    # the images steer the generation: the same prompts with other pixels answer otherwise
    dark = [{**im, "pixel_values": im["pixel_values"] * 0 - 1} if im else None for im in images]
    other = rollout.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=12), multi_modal_inputs=dark)
    assert not torch.equal(other.sampled_log_probs[0], out.sampled_log_probs[0])
    assert torch.equal(other.response_ids[1], out.response_ids[1])  # (the text-only prompt reads no image)


def test_placeholders_are_never_sampled():
    """An image placeholder in a response would ask the vision tower for an image the row lacks (the engine's
    recomputation fails on it); the rollout never samples one. (That the recorded log-probs keep the placeholders'
    mass, the model's whole distribution, is the engine-recomputation test's.)"""
    model, rollout, prompts, images = vl_setup("qwen2_5_vl", seed=3)
    sampling = SamplingParams(n=16, temperature=5.0, max_new_tokens=16, seed=0)  # near uniform: ~1 in 64 a token
    placeholders = torch.tensor(rollout.placeholder_ids)

    def sampled_placeholders() -> int:
        out = rollout.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images)
        return int(torch.isin(out.response_ids[out.response_mask.bool()], placeholders).sum())

    assert sampled_placeholders() == 0
    rollout.placeholder_ids = []  # what the sampler would draw without the suppression
    assert sampled_placeholders() > 3


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_log_probs_equal_engine_recomputation(kind):
    model, rollout, prompts, images = vl_setup(kind, seed=2)
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


def test_images_are_checked_against_the_prompts_and_the_model():
    model, rollout, prompts, images = vl_setup("qwen2_5_vl")
    sampling = SamplingParams(greedy=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="multi_modal_inputs has 2 entries for 3 prompts"):
        rollout.generate(prompts["input_ids"], prompts["attention_mask"], sampling, multi_modal_inputs=images[:2])
    text = load_hf_config(None, tiny_config("qwen2"))
    text_rollout = build_rollout("hf", text, rollout.tokenizer, "cpu", torch.float32)
    ids = prompts["input_ids"].clamp(max=text.vocab_size - 1)
    with pytest.raises(ValueError, match="prompts with images, but the rollout.s .qwen2. model is not a vision"):
        text_rollout.generate(ids, prompts["attention_mask"], sampling, multi_modal_inputs=images)
    with pytest.raises(ValueError, match=r"rollout.backend=fast: 'qwen2_5_vl' is a vision-language model; the fast "
                                         r"rollout's image prefill .* set rollout.backend=hf"):
        build_rollout("fast", model.config, rollout.tokenizer, "cpu", torch.float32)
