"""The engine's vision tower against HF's own (from a hostile reading of the VL changes): rows repeating images
(their features computed once) give the gradients of the plain HF model run row by row, Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (packed, padded and dynamic micro-batches, a distinct image whose first patch equals another's); the
segments' attention's work does not grow with the number of segment lengths (its numbers against HF's SDPA:
tests/test_vl.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.attention import segments_attention_forward
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import random_vl_batch, record_grads, run_distributed, tiny_config

pytestmark = pytest.mark.multiproc

QWEN2_VL = dict(
    model_type="qwen2_vl", tie_word_embeddings=False, image_token_id=124, video_token_id=125,
    vision_start_token_id=126, vision_end_token_id=127,
    text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                     bos_token_id=None, eos_token_id=2, pad_token_id=0),
    vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2))
KINDS = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": tiny_config("qwen2_5_vl"), "qwen3_vl": tiny_config("qwen3_vl")}


def pg_loss(outputs, mb, num_tokens, num_seqs):
    return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens), {}


# rows repeating images: 1 holds 0's (same objects), 2 an equal copy, 5 holds 3's two images; 4 none; 6 a different
# image of 0's size whose first patch equals 0's
GROUPED = [(3, [(1, 4, 6)], 5), (2, [(1, 4, 6)], 4), (4, [(1, 4, 6)], 3), (1, [(1, 2, 4), (1, 4, 4)], 6), (2, [], 3),
           (3, [(1, 2, 4), (1, 4, 4)], 2), (2, [(1, 4, 6)], 4)]


def grouped_batch(hf_config):
    batch = random_vl_batch(hf_config, GROUPED)
    images = batch["multi_modal_inputs"]
    images[1], images[5] = images[0], images[3]
    images[2] = {k: v.clone() for k, v in images[0].items()}
    images[6]["pixel_values"][0] = images[0]["pixel_values"][0]
    return batch


def _engine(kind, **kw):
    model = ModelConfig(tiny=KINDS[kind], use_remove_padding=kw.pop("packed", True))
    return build_engine(model, EngineConfig(param_dtype="float32", **kw), OptimConfig(lr=1e-3, clip_grad=0.0))


def _grouped_grads(kind: str, variants: list[dict]):
    out = []
    for kw in variants:
        engine = _engine(kind, **kw)
        grads = record_grads(engine)
        batch = grouped_batch(engine.hf_config)
        log_probs = engine.infer_batch(batch)["log_probs"]
        engine.train_batch(batch, pg_loss)
        out.append((log_probs, grads[0]))
    return out


def hf_per_row_grads(kind: str):
    """The plain HF model (HF's own SDPA vision attention), each row alone: log-probs and the token-mean loss's
    gradients summed over the rows."""
    config = load_hf_config(None, KINDS[kind])
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    model.model.visual.config._attn_implementation = "sdpa"
    batch = grouped_batch(config)
    total = int(batch["loss_mask"].sum())
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    log_probs = []
    for i in range(len(batch)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        images = dict(batch["multi_modal_inputs"][i] or {})
        if images:
            images["mm_token_type_ids"] = (ids == config.image_token_id).int()
        logits = model(input_ids=ids, **images).logits[0].float()
        logp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        n = int(batch["response_mask"][i].sum())
        adv = batch["advantages"][i, width_p:width_p + n]
        (-(logp[-n:] * adv).sum() / total).backward()
        log_probs.append(logp[-n:].detach())
    return log_probs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(KINDS))
def test_repeated_images_gradients_equal_plain_hf_per_row(kind):
    variants = [dict(micro_batch_size_per_gpu=7), dict(micro_batch_size_per_gpu=7, packed=False),
                dict(use_dynamic_bsz=True, max_token_len_per_gpu=200)]
    got = run_distributed(_grouped_grads, 1, kind, variants)
    ref_lp, ref = hf_per_row_grads(kind)
    config = load_hf_config(None, KINDS[kind])
    batch = grouped_batch(config)
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for v, (log_probs, grads) in enumerate(got):
        for i, lp in enumerate(ref_lp):
            torch.testing.assert_close(log_probs[i, width_p:width_p + lp.numel()], lp, atol=2e-5, rtol=0)
        assert any(n.startswith("model.visual.blocks.") for n in grads)
        for name, r in ref.items():
            scale = r.abs().max().item() + 1e-12
            torch.testing.assert_close(grads[name], r, atol=1e-5 * scale, rtol=0, msg=f"{v} {name}")


class _Materialized(TorchDispatchMode):
    """Counts the elements of the new tensors every op (forward and backward) writes: views and in-place ops
    write none of their own."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and not any(r.alias_info for r in func._schema.returns):
            self.elements += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def _hf_per_segment(query, key, value, bounds):
    """HF's own path for a non-flash vision attention (`Qwen2_5_VLVisionAttention.forward`): torch.split at the
    segments' bounds, SDPA a segment, joined."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    splits = [torch.split(t, lengths, dim=2) for t in (query, key, value)]
    return torch.cat([F.scaled_dot_product_attention(q, k, v).transpose(1, 2) for q, k, v in zip(*splits)], 1)


def test_segments_attention_work_stays_linear_with_many_segment_lengths():
    """Segments of 40 lengths (a full-attention layer over 40 images of different sizes) materialize a fixed number
    of whole (N, H, D) tensors in forward and backward, as HF's per-segment loop does: a put and three gathers a
    length group made about 11 a group (449 here), slower than HF's loop at many image sizes (on the CPU, 50-200
    lengths: 3.2 s against HF's 0.37 s, 67 s against 4.2 s)."""
    bounds = [0]
    for i in range(40):  # 40 images of distinct sizes: 4, 5, ..., 43 patches
        bounds.append(bounds[-1] + 4 + i)
    n, heads, dim = bounds[-1], 2, 8
    cu = torch.tensor(bounds, dtype=torch.int32)
    counts = {}
    for name, attend in (("ours", lambda q, k, v: segments_attention_forward(None, q, k, v, None,
                                                                              cu_seq_lens_q=cu)[0]),
                         ("hf", lambda q, k, v: _hf_per_segment(q, k, v, bounds))):
        q, k, v = (torch.randn(1, heads, n, dim, generator=torch.Generator().manual_seed(s), requires_grad=True)
                   for s in range(3))
        with _Materialized() as mode:
            attend(q, k, v).sum().backward()
        counts[name] = mode.elements / (n * heads * dim)  # in whole (N, H, D) tensors
    assert counts["hf"] < 10
    assert counts["ours"] <= 4 * counts["hf"], (  # (a gather once, groups split, one inverse permutation: ~23)
        f"forward + backward materialize {counts['ours']:.0f} whole (N, H, D) tensors for 40 segment lengths; "
        f"HF's per-segment loop {counts['hf']:.0f}")
