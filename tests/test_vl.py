"""Vision-language models in the engine (issue 61): tiny random Qwen2.5-VL and Qwen3-VL (`TINY_VL_MODELS`) on packed
image+text batches give the plain HF model's log-probs, and the same gradients whatever the micro-batch cut and
over two FSDP2 processes, and under Ulysses sequence parallelism (sp=2, and dp=2 x sp=2); the vision tower is
trained, or frozen by `model.freeze_vision_tower`.

fp32 on CPU (gloo). The HF reference runs one row at a time, unpadded, with the model computing its own M-RoPE
positions from the row's ids and image grids: the engine's packed layout (several rows, their images, per-row
positions) must reproduce it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.attention import VISION_ATTN_NAME
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import random_vl_batch, record_grads, run_distributed, tiny_config

pytestmark = pytest.mark.multiproc

# (text tokens, image grids (t, h, w) in patches, response tokens): one image, none, two, a small one
ROWS = [(3, [(1, 4, 6)], 5), (2, [], 4), (1, [(1, 2, 4), (1, 4, 4)], 6), (4, [(1, 2, 2)], 3)]
KINDS = ("qwen2_5_vl", "qwen3_vl")
OPTIM = dict(lr=1e-3, clip_grad=0.0)


def hf_reference(kind: str, batch, model=None) -> list[torch.Tensor]:
    """Per row: the plain HF model's (`model`, or the tiny config's seeded one) log-probs of the row's response
    tokens (the row alone, no padding)."""
    config = load_hf_config(None, tiny_config(kind))
    if model is None:  # HF's own vision attention (SDPA a segment), not the engine's (`use_segments_attention`)
        model = build_causal_lm(config, None, "cpu", torch.float32, seed=0).eval()
        model.model.visual.config._attn_implementation = "sdpa"
    out = []
    for i in range(len(batch)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]  # (1, L)
        images = dict(batch["multi_modal_inputs"][i] or {})
        if images:  # transformers 5.2x reads the placeholders' modality from here
            images["mm_token_type_ids"] = (ids == config.image_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=ids, **images).logits[0].float()  # (L, V)
        logp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append(logp[-int(batch["response_mask"][i].sum()):])
    return out


def pg_loss(outputs, mb, num_tokens, num_seqs):
    return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens), {}


def _engine(kind: str, optim: bool = False, **engine_kwargs):
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear") if engine_kwargs.pop("lora", False) else None
    model = ModelConfig(tiny=tiny_config(kind), freeze_vision_tower=engine_kwargs.pop("freeze", False),
                        use_remove_padding=engine_kwargs.pop("packed", True), **({"lora": lora} if lora else {}))
    return build_engine(model, EngineConfig(param_dtype="float32", **engine_kwargs),
                        OptimConfig(**OPTIM) if optim else None)


def _log_probs(kind: str, engine_kwargs: dict):
    engine = _engine(kind, **engine_kwargs)
    batch = random_vl_batch(engine.hf_config, ROWS)
    return engine.infer_batch(batch)["log_probs"], batch


def _grads(kind: str, engine_kwargs: dict, rows=None):
    engine = _engine(kind, optim=True, **engine_kwargs)
    grads = record_grads(engine)
    batch = random_vl_batch(engine.hf_config, rows or ROWS)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine.train_batch(batch.index(list(range(rank, len(batch), world))), pg_loss)  # a rank's share of the rows
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    return grads[0], {engine.hf_name(n) for n in trained}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [dict(micro_batch_size_per_gpu=2), dict(micro_batch_size_per_gpu=4, packed=False),
                                    dict(use_dynamic_bsz=True, max_token_len_per_gpu=40)],
                         ids=["packed", "padded", "dynamic"])
def test_log_probs_equal_hf_forward(kind, layout):
    log_probs, batch = run_distributed(_log_probs, 1, kind, layout)
    reference = hf_reference(kind, batch)
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for i, ref in enumerate(reference):
        got = log_probs[i, width_p:width_p + ref.numel()]
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
    # the image rows' responses read the images: a row's log-probs move when its pixels do
    assert batch["multi_modal_inputs"][0]["pixel_values"].abs().sum() > 0


def _grads_cut_and_world(kind: str):
    one, trained = _grads(kind, dict(micro_batch_size_per_gpu=1))
    two, _ = _grads(kind, dict(micro_batch_size_per_gpu=2))
    return one, two, trained


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_invariant_to_micro_batch_cut_and_world(kind):
    one, two, trained = run_distributed(_grads_cut_and_world, 1, kind)
    # two processes; rank 1's rows (1 and 3) hold the text-only row: its vision tower idles (no hang) on blanks
    sharded, _ = run_distributed(_grads, 2, kind, dict(micro_batch_size_per_gpu=1))
    assert any(n.startswith("model.visual.") for n in trained)  # the vision tower is trained by default
    assert set(one) == set(two) == set(sharded) == trained
    for name in one:
        scale = one[name].abs().max().item() + 1e-12
        torch.testing.assert_close(two[name], one[name], atol=1e-5 * scale, rtol=0, msg=name)
        torch.testing.assert_close(sharded[name], one[name], atol=1e-5 * scale, rtol=0, msg=name)
    visual = [n for n in one if n.startswith("model.visual.")]
    assert visual and all(one[n].abs().sum() > 0 for n in visual if ".blocks." in n)


def test_frozen_vision_tower_gets_no_gradient():
    grads, trained = run_distributed(_grads, 2, "qwen2_5_vl", dict(micro_batch_size_per_gpu=2, freeze=True))
    assert not any(n.startswith("model.visual.") for n in trained)
    assert not any(n.startswith("model.visual.") for n in grads)
    assert any(n.startswith("model.language_model.") for n in grads)


def _log_probs_and_grads(kind: str, variants: list[dict]) -> list[tuple]:
    """Per engine settings: this rank's data-parallel share of ROWS (its row indices, log-probs and loss mask) and
    the gradients of one step on it (the ranks of a Ulysses group share their rows)."""
    out = []
    for engine_kwargs in variants:
        engine = _engine(kind, optim=True, **engine_kwargs)
        grads = record_grads(engine)
        batch = random_vl_batch(engine.hf_config, ROWS)
        rows = list(range(engine.mesh.dp_rank, len(batch), engine.mesh.dp_size))
        share = batch.index(rows)
        log_probs = engine.infer_batch(share)["log_probs"]
        engine.train_batch(share, pg_loss)
        out.append((rows, log_probs, share["loss_mask"].bool(), grads[0]))
    return out


def assert_same_as_one_process(got: tuple, want: tuple, frozen: bool = False):
    """`got`'s log-probs (at the responses) and gradients are `want`'s, a one-process run's on all of ROWS."""
    (rows, log_probs, scored, grads), (_, ref_log_probs, _, ref_grads) = got, want
    torch.testing.assert_close(log_probs[scored], ref_log_probs[rows][scored], atol=2e-5, rtol=0)
    assert set(grads) == set(ref_grads)
    visual = [n for n in grads if n.startswith("model.visual.")]
    assert not visual if frozen else any(".blocks." in n and grads[n].abs().sum() > 0 for n in visual)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item() + 1e-12
        torch.testing.assert_close(grads[name], ref, atol=1e-5 * scale, rtol=0, msg=name)


SP2 = dict(ulysses_sequence_parallel_size=2)


@pytest.mark.parametrize("kind", KINDS)
def test_ulysses_equals_one_process(kind):
    """sp=2: the vision tower runs on every image on both ranks, each rank's language model on its piece of the
    spliced row. Micro-batches of 1 (row 0's image split between the pieces, row 1 without images idling the tower,
    row 3's image in rank 1's piece alone) and 2 (two rows packed, padded to a multiple of sp); the tower frozen;
    LoRA on the language model."""
    one = run_distributed(_log_probs_and_grads, 1, kind, [dict(micro_batch_size_per_gpu=1),
                                                          dict(micro_batch_size_per_gpu=1, freeze=True),
                                                          dict(micro_batch_size_per_gpu=1, lora=True)])
    sp = run_distributed(_log_probs_and_grads, 2, kind, [dict(micro_batch_size_per_gpu=1, **SP2),
                                                         dict(micro_batch_size_per_gpu=2, **SP2),
                                                         dict(micro_batch_size_per_gpu=1, freeze=True, **SP2),
                                                         dict(micro_batch_size_per_gpu=1, lora=True, **SP2)])
    assert_same_as_one_process(sp[0], one[0])
    assert_same_as_one_process(sp[1], one[0])
    assert_same_as_one_process(sp[2], one[1], frozen=True)
    assert_same_as_one_process(sp[3], one[2], frozen=True)  # LoRA: the adapters' gradients, the tower frozen


def test_ulysses_with_data_parallel_equals_one_process():
    """dp=2 x sp=2 on 4 processes: rank 0's Ulysses group holds rows 0 and 2, rank 2's rows 1 and 3."""
    one, = run_distributed(_log_probs_and_grads, 1, "qwen3_vl", [dict(micro_batch_size_per_gpu=1)])
    four, = run_distributed(_log_probs_and_grads, 4, "qwen3_vl", [dict(micro_batch_size_per_gpu=1, **SP2)])
    assert four[0] == [0, 2]
    assert_same_as_one_process(four, one)


# rows repeating images, as a GRPO group's n samples do: row 1 holds row 0's image (the same objects), row 2 an equal
# copy of it, row 5 row 3's two images; row 4 none
GROUPED = [(3, [(1, 4, 6)], 5), (2, [(1, 4, 6)], 4), (4, [(1, 4, 6)], 3), (1, [(1, 2, 4), (1, 4, 4)], 6), (2, [], 3),
           (3, [(1, 2, 4), (1, 4, 4)], 2)]


def grouped_batch(hf_config):
    batch = random_vl_batch(hf_config, GROUPED)
    images = batch["multi_modal_inputs"]
    images[1], images[5] = images[0], images[3]
    images[2] = {k: v.clone() for k, v in images[0].items()}
    return batch


def _grouped(kind: str, variants: list[dict]) -> list[tuple]:
    """As `_log_probs_and_grads` on GROUPED, with the patches the vision tower read in the log-prob pass."""
    out = []
    for engine_kwargs in variants:
        engine = _engine(kind, optim=True, **engine_kwargs)
        grads = record_grads(engine)
        patches = []
        visual = next(m for n, m in engine.module.named_modules() if n.endswith("model.visual"))
        visual.register_forward_pre_hook(
            lambda m, args, kwargs: patches.append((args[0] if args else kwargs["hidden_states"]).shape[0]),
            with_kwargs=True)
        batch = grouped_batch(engine.hf_config)
        rows = list(range(engine.mesh.dp_rank, len(batch), engine.mesh.dp_size))
        share = batch.index(rows)
        log_probs = engine.infer_batch(share)["log_probs"]
        read = sum(patches)
        engine.train_batch(share, pg_loss)
        out.append(((rows, log_probs, share["loss_mask"].bool(), grads[0]), read))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_rows_repeating_images_run_the_tower_once_for_them(kind):
    """A micro-batch whose rows repeat images runs the vision tower on each distinct image once and splices its
    features into every row holding it: the log-probs are HF's row by row, the gradients those of micro-batches of
    one row (no repeats to find), packed and padded; under Ulysses too (sp=2)."""
    variants = [dict(micro_batch_size_per_gpu=1), dict(micro_batch_size_per_gpu=6),
                dict(micro_batch_size_per_gpu=6, packed=False)]
    (alone, read_alone), (together, read_together), (padded, read_padded) = run_distributed(_grouped, 1, kind, variants)
    # 24 patches an image of row 0 (and 1, 2), 8 + 16 of row 3 (and 5); row 4's micro-batch idles on 4 blank ones
    assert read_alone == 3 * 24 + 2 * 24 + 4
    assert read_together == read_padded == 24 + 24
    batch = grouped_batch(load_hf_config(None, tiny_config(kind)))
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for i, ref in enumerate(hf_reference(kind, batch)):
        torch.testing.assert_close(together[1][i, width_p:width_p + ref.numel()], ref, atol=2e-5, rtol=0)
    assert_same_as_one_process(together, alone)
    assert_same_as_one_process(padded, alone)
    (sp, read_sp), = run_distributed(_grouped, 2, kind, [dict(micro_batch_size_per_gpu=6, **SP2)])
    assert read_sp == 24 + 24
    assert_same_as_one_process(sp, alone)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grids", [[(1, 4, 6), (1, 4, 4), (1, 2, 2)], [(1, 4, 4), (1, 4, 4)], [(1, 2, 2)],
                                   [(1, 2, 2)] * 5, [(1, 6, 6), (1, 2, 10)]],
                         ids=["lengths_mixed", "one_length", "single", "many_small", "edges"])
def test_vision_tower_segments_attention_equals_hf_sdpa(kind, grids):
    """The engine's vision attention (the segments of one length batched: Qwen2.5-VL's windows of 16 and 8 patches
    at a 4 x 6 image's edge, the images of 24, 16 and 4 patches in its full block) gives HF's per-segment SDPA
    features and tower gradients."""
    config = load_hf_config(None, tiny_config(kind))
    ours = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    theirs = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    theirs.model.visual.config._attn_implementation = "sdpa"  # (the tower's own config: `use_segments_attention`)
    assert ours.model.visual.config._attn_implementation == VISION_ATTN_NAME
    assert ours.config.vision_config._attn_implementation == "sdpa"  # (the model's, as HF builds it)
    grid = torch.tensor(grids)
    vision = config.vision_config
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0))
    weights = None
    results = []
    for model in (ours, theirs):
        out = model.model.get_image_features(pixels, grid, return_dict=True)
        features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        flat = torch.cat([f if torch.is_tensor(f) else torch.cat(list(f)) for f in features])
        weights = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)) if weights is None else weights
        (flat * weights).sum().backward()
        results.append((flat.detach(), {n: p.grad for n, p in model.model.visual.named_parameters()}))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5 * (grad.abs().max().item() + 1e-12), rtol=0,
                                   msg=name)


def test_dpo_refuses_a_vision_language_model_by_name(tmp_path):
    """What is not built for a VL model yet is refused with the setting to change, before any model is built: dpo
    (sft reads images: tests/test_vl_sft.py; both rollouts generate with images: tests/test_vl_rollout.py)."""
    from shardrl.launch.rank import run
    from shardrl.testing import save_tiny_vl_model

    save_tiny_vl_model(tmp_path / "vl")
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(ValueError, match="shardrl dpo: 'qwen2_5_vl' is a vision-language model; dpo, kto and rm with "
                                         "images are not built yet"):
        run(None, [f"model.path={tmp_path / 'vl'}", f"data.train_files=[{tmp_path / 'pairs.jsonl'}]",
                   f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=1"], "dpo")
    assert not (tmp_path / "run").exists()
