"""Choices made once at start-up (`shardrl.plan.defaults`): `rollout.backend` and `*.engine.compile` by
device when left null, and whether the old log-probs come from the update's own forward."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardrl.config.schema import ConfigError, load_config
from shardrl.testing import TINY_MODELS
from shardrl.plan.step_plan import old_log_probs_from_update
from shardrl.plan.defaults import KEEP_CACHE_FRACTION, resolve_device_defaults

QWEN2 = transformers.AutoConfig.for_model(**TINY_MODELS["qwen2"])
GPT2 = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2)


@pytest.fixture(params=[False, True], ids=["cpu", "cuda"])
def cuda(request, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: request.param)
    return request.param


def test_nulls_are_resolved_by_device(cuda):
    cfg = load_config(None, [])  # validation does not depend on the device
    assert cfg.rollout.backend is None and cfg.actor.engine.compile is None
    resolved, lines = resolve_device_defaults(cfg, QWEN2)
    assert resolved.rollout.backend == ("fast" if cuda else "hf")
    for section in ("actor", "ref", "critic", "reward"):
        assert getattr(resolved, section).engine.compile is False, section  # a tiny model: off on both
    assert cfg.rollout.backend is None and cfg.actor.engine.compile is None  # a copy: the input is untouched
    assert f"rollout.backend={resolved.rollout.backend} (null: by device, on {'CUDA' if cuda else 'CPU'})" in lines
    why = "on CUDA, the model's 0.00B matmul parameters < 0.5B" if cuda else "off on CPU"
    assert f"actor.engine.compile=false (null: {why}; see EngineConfig.compile)" in lines


def test_compile_is_on_for_large_models_on_cuda_only(cuda):
    big = transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
    resolved, lines = resolve_device_defaults(load_config(None, []), big)
    assert resolved.actor.engine.compile is cuda and resolved.critic.engine.compile is cuda
    if cuda:
        assert "actor.engine.compile=true (null: on CUDA, the model's 1.54B matmul parameters >= 0.5B; " \
               "see EngineConfig.compile)" in lines
    resolved, lines = resolve_device_defaults(load_config(None, ["actor.engine.strategy=fsdp"]), big)
    # FSDP1 has no compile; the reference takes the actor's strategy unless it sets its own
    assert resolved.actor.engine.compile is False and resolved.ref.engine.compile is False
    resolved, lines = resolve_device_defaults(load_config(None, ["actor.engine.strategy=fsdp",
                                                                 "ref.engine.strategy=fsdp2"]), big)
    assert resolved.actor.engine.compile is False and resolved.ref.engine.compile is cuda


def test_explicit_choices_win_and_are_not_logged(cuda):
    cfg = load_config(None, ["rollout.backend=hf", "actor.engine.compile=false", "critic.engine.compile=true"])
    resolved, lines = resolve_device_defaults(cfg, QWEN2)
    assert (resolved.rollout.backend, resolved.actor.engine.compile, resolved.critic.engine.compile) == ("hf", False, True)
    assert not any(line.startswith(("rollout.backend", "actor.engine", "critic.engine")) for line in lines)


def test_cuda_falls_back_where_the_fast_paths_do_not_apply(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a model the fast rollout cannot run: hf, saying why
    resolved, lines = resolve_device_defaults(load_config(None, []), GPT2)
    assert resolved.rollout.backend == "hf"
    assert any("fast rollout cannot run this model" in line and "gpt2" in line for line in lines)
    # FSDP1 does not compile (nor FSDP2 for a model this small)
    resolved, lines = resolve_device_defaults(load_config(None, ["actor.engine.strategy=fsdp"]), QWEN2)
    assert resolved.actor.engine.compile is False and resolved.ref.engine.compile is False


def test_fast_only_keys_need_the_fast_backend(monkeypatch):
    for key, value in [("fast.compile", "true"), ("fast.attention", "triton"), ("fast.sampler", "triton"),
                       ("fast.max_batch", "8"), ("multi_turn.overlap_tools", "true")]:
        with pytest.raises(ConfigError, match=rf"rollout\.{key}=.*: applies to backend=fast only"):
            load_config(None, ["rollout.backend=hf", f"rollout.{key}={value}"])
    # backend null: valid as a config whatever the machine; where it resolves to hf, the key is an error
    cfg = load_config(None, ["rollout.fast.max_batch=8"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout\.fast\.max_batch applies to backend=fast only, and "
                                          r"rollout\.backend=null chose hf on CPU; set rollout\.backend=fast"):
        resolve_device_defaults(cfg, QWEN2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_defaults(cfg, QWEN2)[0].rollout.fast.max_batch == 8


@pytest.mark.parametrize("overrides, reuse, why", [
    (["actor.ppo_mini_batch_size=8"], True, "taken from the update's own forward"),
    (["actor.ppo_mini_batch_size=8", "actor.recompute_old_log_probs=always"], False,
     "actor.recompute_old_log_probs=always"),
    (["actor.ppo_mini_batch_size=4"], False, "2 mini-batches per step"),
    (["actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2"], False, "actor.ppo_epochs=2"),
    (["actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=true"], False, "use_kl_in_reward"),
    (["actor.ppo_mini_batch_size=8", "model.disable_dropout=false"], False, "model.disable_dropout=false"),
    # the rollout correction: truncate's weights come from the update's forward; mask changes the token count
    (["actor.ppo_mini_batch_size=8", "algorithm.rollout_is=true"], True, "no separate forward pass"),
    (["actor.ppo_mini_batch_size=8", "algorithm.rollout_is=true", "algorithm.rollout_is_mode=mask"], False,
     "algorithm.rollout_is_mode=mask"),
    # GAE and the KL loss read no old log-probs before the update: still skipped
    (["actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8",
      "actor.use_kl_loss=true"], True, "no separate forward pass"),
])
def test_when_the_old_log_prob_pass_is_skipped(overrides, reuse, why):
    cfg = load_config(None, ["data.train_batch_size=8", *overrides])
    assert cfg.actor.recompute_old_log_probs in ("auto", "always")
    got, text = old_log_probs_from_update(cfg)
    assert got is reuse and why in text


def test_the_rollout_keeps_its_cache_through_the_update_when_the_ledger_says_it_fits(monkeypatch):
    from shardrl.plan.layout import derive_layout
    from shardrl.plan.memory import phase_ledger, update_and_cache_gib

    big = transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
    # bench/e2e.py's var_512 case: 64 prompts x 8 of 256 + up to 1024 tokens
    cfg = load_config(None, ["data.train_batch_size=64", "rollout.n=8", "actor.ppo_mini_batch_size=64",
                             "data.max_prompt_length=256", "rollout.max_new_tokens=1024",
                             "actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=16384"])
    layout = derive_layout(cfg, 1, 1)
    need = update_and_cache_gib(phase_ledger(cfg, layout, big))
    phases = phase_ledger(cfg, layout, big)["phases"]
    kv = next(i["gib"] for i in phases["gen"]["items"] if i["name"] == "KV cache")
    assert kv == pytest.approx(512 * 1280 * 28 * 2 * 2 * 128 * 2 / 2**30)  # 17.5 GiB: 512 slots x 1280 positions
    assert phases["update"]["total_gib"] + kv < need < phases["update"]["total_gib"] + kv + 1  # + the logits
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    h200 = resolve_device_defaults(cfg, big, (need, 139.8))
    assert h200[0].rollout.free_cache_engine is False
    assert f"rollout.free_cache_engine=false (null: the ledger's update peak plus the rollout's cache, {need:.1f} " \
           "GiB, fits in 80% of the GPU's 140 GiB)" in h200[1]
    # just below and above need / KEEP_CACHE_FRACTION: freed on the smaller GPU
    assert resolve_device_defaults(cfg, big, (need, need / KEEP_CACHE_FRACTION * 0.99))[0].rollout.free_cache_engine
    assert not resolve_device_defaults(cfg, big, (need, need / KEEP_CACHE_FRACTION * 1.01))[0].rollout.free_cache_engine
    # explicit wins; without the numbers, or on CPU, the cache is freed
    explicit = load_config(None, ["rollout.free_cache_engine=true"])
    assert resolve_device_defaults(explicit, big, (need, 139.8))[0].rollout.free_cache_engine is True
    assert resolve_device_defaults(cfg, big)[0].rollout.free_cache_engine is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_defaults(cfg, big, (need, 139.8))[0].rollout.free_cache_engine is True


def test_the_trainer_asks_the_ledger_on_cuda_only(monkeypatch):
    from types import SimpleNamespace

    from shardrl.plan.layout import derive_layout
    from shardrl.plan.memory import phase_ledger, update_and_cache_gib
    from shardrl.plan.defaults import memory_gib

    cfg = load_config(None, [])
    layout = derive_layout(cfg, 1, 1)
    assert memory_gib(cfg, layout, QWEN2, torch.device("cpu")) is None
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    assert memory_gib(cfg, layout, QWEN2, cuda) == (update_and_cache_gib(phase_ledger(cfg, layout, QWEN2)), 80.0)
    assert memory_gib(load_config(None, ["rollout.free_cache_engine=true"]), layout, QWEN2, cuda) is None  # not asked
    assert memory_gib(cfg, layout, GPT2, cuda) is not None  # GPT-2's names: the ledger reads them too


def test_backend_null_picks_fast_for_the_vision_language_models_it_runs(monkeypatch):
    from shardrl.models.tiny import TINY_VL_MODELS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kind, kwargs in TINY_VL_MODELS.items():
        config = transformers.AutoConfig.for_model(**kwargs)
        resolved, lines = resolve_device_defaults(load_config(None, []), config)
        assert resolved.rollout.backend == "fast", (kind, lines)
    resolved, lines = resolve_device_defaults(load_config(None, []), transformers.Qwen2VLConfig())
    assert resolved.rollout.backend == "hf"
    assert any("fast rollout cannot run this model" in line and "'qwen2_vl'" in line for line in lines), lines
