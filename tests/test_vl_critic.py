"""A critic on a vision-language model (issue 61): the engine's `head="value"` runs the VL base (the vision tower, its
features spliced at the placeholders, the decoder with M-RoPE positions) and a value head on its last hidden
states. Its values equal a plain HF forward per row with its images times the head's weights, packed, padded,
dynamic and under Ulysses (sp=2); the value loss's gradients (the tower's included) do not depend on the
micro-batch cut or on 1 vs 2 FSDP2 processes, and the head's gradient is the plain one. fp32 on CPU (gloo);
Qwen2.5-VL and Qwen3-VL tiny configs. PPO (gae) end to end with images: tests/test_vl_train.py."""

from __future__ import annotations

import pytest
import torch

from shardrl.algos.losses import value_loss
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import random_vl_batch, record_grads, run_distributed, tiny_config

pytestmark = pytest.mark.multiproc

# (text tokens, image grids (t, h, w) in patches, response tokens): one image, none, two, a small one
ROWS = [(3, [(1, 4, 6)], 5), (2, [], 4), (1, [(1, 2, 4), (1, 4, 4)], 6), (4, [(1, 2, 2)], 3)]
KINDS = ("qwen2_5_vl", "qwen3_vl")


def critic_batch(hf_config):
    """ROWS with random returns and old values on the responses (a critic's update reads them)."""
    batch = random_vl_batch(hf_config, ROWS)
    g = torch.Generator().manual_seed(1)
    batch["returns"] = torch.randn(batch["input_ids"].shape, generator=g) * batch["loss_mask"]
    batch["old_values"] = torch.zeros(batch["input_ids"].shape)
    return batch


def plain_value_loss(outputs, mb, num_tokens, num_seqs):
    return value_loss(outputs["values"], mb["old_values"], mb["returns"], mb["loss_mask"], None, "token-mean",
                      num_tokens, num_seqs)[0], {}


def _critic(kind: str, optim: bool = False, packed: bool = True, **engine_kwargs):
    model = ModelConfig(tiny=tiny_config(kind), use_remove_padding=packed)
    return build_engine(model, EngineConfig(param_dtype="float32", **engine_kwargs),
                        OptimConfig(lr=1e-3, clip_grad=0.0) if optim else None, head="value")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _values(kind: str, layout: dict):
    engine = _critic(kind, **layout)
    batch = critic_batch(engine.hf_config)
    head = engine.module.value_head
    return engine.infer_batch(batch)["values"], _full(head.weight), _full(head.bias), batch


def hf_hidden_states(kind: str, batch) -> list[torch.Tensor]:
    """Per row: the plain HF VL base model's last hidden states (L, H) of the row alone (no padding), with its
    images; the base's weights are the tiny config's seeded ones, as the engine's."""
    config = load_hf_config(None, tiny_config(kind))
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=0).eval()
    out = []
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]  # (1, L)
        images = dict(batch["multi_modal_inputs"][i] or {})
        if images:  # transformers 5.2x reads the placeholders' modality from here
            images["mm_token_type_ids"] = (ids == config.image_token_id).int()
        with torch.no_grad():
            out.append(model.model(input_ids=ids, **images).last_hidden_state[0].float())
    return out


def reference_values(hidden: list[torch.Tensor], weight, bias, batch) -> list[torch.Tensor]:
    """Per row: the values of its response tokens; token t's value is read at t - 1, the state it was chosen in."""
    out = []
    for i, h in enumerate(hidden):
        num_response = int(batch["response_mask"][i].sum())
        out.append((h @ weight.T + bias).squeeze(-1)[-num_response - 1:-1])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_values_equal_hf_base_times_value_head(kind):
    layouts = [dict(micro_batch_size_per_gpu=2), dict(micro_batch_size_per_gpu=4, packed=False),
               dict(use_dynamic_bsz=True, max_token_len_per_gpu=40)]
    runs = [run_distributed(_values, 1, kind, layout) for layout in layouts]
    # Ulysses sp=2: one data-parallel rank of two sequence pieces (an image's placeholders split between them)
    runs.append(run_distributed(_values, 2, kind, dict(micro_batch_size_per_gpu=1, ulysses_sequence_parallel_size=2)))
    _, weight, bias, batch = runs[0]
    assert weight.abs().sum() > 0  # a random head (`_value_head_init`), not zeros
    reference = reference_values(hf_hidden_states(kind, batch), weight, bias, batch)
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for name, (values, w, _, _) in zip(["packed", "padded", "dynamic", "sp2"], runs):
        torch.testing.assert_close(w, weight)
        for i, ref in enumerate(reference):
            got = values[i, width_p:width_p + ref.numel()]
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=f"{name}, row {i}")
    # the images count: row 0's values differ from those of the same ids with other pixels
    other = critic_batch(load_hf_config(None, tiny_config(kind)))
    other["multi_modal_inputs"][0]["pixel_values"] = torch.randn_like(other["multi_modal_inputs"][0]["pixel_values"])
    moved = reference_values(hf_hidden_states(kind, other), weight, bias, other)[0]
    assert (moved - reference[0]).abs().max() > 1e-3


def _grads(kind: str, layout: dict):
    engine = _critic(kind, optim=True, **layout)
    grads = record_grads(engine)
    batch = critic_batch(engine.hf_config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine.train_batch(batch.index(list(range(rank, len(batch), world))), plain_value_loss)
    return grads[0]


def _grads_cut(kind: str):
    return _grads(kind, dict(micro_batch_size_per_gpu=1)), _grads(kind, dict(micro_batch_size_per_gpu=2))


@pytest.mark.parametrize("kind", KINDS)
def test_value_loss_gradients_invariant_to_micro_batch_cut_and_world(kind):
    one, two = run_distributed(_grads_cut, 1, kind)
    # two processes; rank 1's rows (1 and 3) hold the text-only row: its vision tower idles on a blank image
    sharded = run_distributed(_grads, 2, kind, dict(micro_batch_size_per_gpu=1))
    assert set(one) == set(two) == set(sharded)
    assert {"value_head.weight", "value_head.bias"} <= set(one)
    assert any(n.startswith("model.visual.") and ".blocks." in n and one[n].abs().sum() > 0 for n in one)
    for name in one:
        scale = one[name].abs().max().item() + 1e-12
        torch.testing.assert_close(two[name], one[name], atol=1e-5 * scale, rtol=0, msg=name)
        torch.testing.assert_close(sharded[name], one[name], atol=1e-5 * scale, rtol=0, msg=name)
    # the head's gradient is the plain one: mean over the response tokens of (v - R) * h
    _, weight, bias, batch = run_distributed(_values, 1, kind, dict(micro_batch_size_per_gpu=4))
    hidden = hf_hidden_states(kind, batch)
    values = reference_values(hidden, weight, bias, batch)
    num_tokens = int(batch["loss_mask"].sum())
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    want = torch.zeros_like(weight)
    for i, (h, v) in enumerate(zip(hidden, values)):
        returns = batch["returns"][i, width_p:width_p + v.numel()]
        want += ((v - returns)[:, None] * h[-v.numel() - 1:-1]).sum(0, keepdim=True) / num_tokens
    torch.testing.assert_close(one["value_head.weight"], want, atol=1e-5 * want.abs().max().item(), rtol=0)


def _build_reward_model(kind: str) -> str:
    try:
        build_engine(ModelConfig(tiny=tiny_config(kind)), EngineConfig(param_dtype="float32"), head="score")
    except ValueError as e:
        return str(e)
    return "built"


def test_a_reward_model_on_a_vision_language_model_is_refused_by_name():
    """The score head (a reward model) is not built for a VL model: refused naming what to use instead."""
    message = run_distributed(_build_reward_model, 1, "qwen2_5_vl")
    assert message.startswith("a reward model on the vision-language model 'qwen2_5_vl' is not supported yet")
    assert "reward.model_path" in message and "reward.function_path" in message
