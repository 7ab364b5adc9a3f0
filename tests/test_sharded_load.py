"""Sharded loading (`model.load_weights=sharded`): every rank reads only its own slices of the safetensors
files, and the engine ends with exactly the parameters and buffers of the old path (rank 0 loads the whole
model and broadcasts it): untied and tied heads, a critic's new value head, an index of several files,
bf16 files into fp32 master weights, HSDP, CPU-offloaded parameters, and a vocabulary that does not
split evenly."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardrl.config.schema import ConfigError, load_config
from shardrl.testing import TINY_MODELS, run_distributed

pytestmark = pytest.mark.multiproc

# Gemma 2: a non-persistent buffer (`embed_scale`) in a module that also holds a parameter
GEMMA2 = dict(model_type="gemma2", vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _save_folder(folder: Path, kind: str, dtype: torch.dtype, max_shard_size: str | None) -> None:
    from shardrl.engine.model import build_causal_lm, load_hf_config

    config = load_hf_config(None, GEMMA2 if kind == "gemma2" else TINY_MODELS[kind])
    model = build_causal_lm(config, None, "cpu", torch.float32, seed=3, attn_implementation="eager").to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)


def _engine_state(engine) -> dict[str, torch.Tensor]:
    state = {name: t.detach().float().cpu().clone() for name, t in engine.export_weights()}  # every rank gathers
    state.update({f"buffer:{n}": b.detach().float().cpu().clone() for n, b in engine.module.named_buffers()})
    return state


def _compare() -> dict:
    import shardrl.engine.base as base
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    cpu_builds = []
    real_build = base.build_causal_lm

    def counting_build(config, path, device, *args, **kwargs):
        if str(device) != "meta":
            cpu_builds.append(path)
        return real_build(config, path, device, *args, **kwargs)

    base.build_causal_lm = counting_build
    cases = {  # name: (model kind, file dtype, shards, head, engine kwargs)
        "qwen2": ("qwen2", torch.float32, None, "lm", {}),
        "llama_tied_hsdp": ("llama", torch.float32, None, "lm", {"fsdp_size": 1}),
        "qwen2_bf16_index": ("qwen2", torch.bfloat16, "20KB", "lm", {}),
        "critic": ("qwen2", torch.float32, None, "value", {}),
        "llama_offload": ("llama", torch.float32, None, "lm", {"offload_params": True}),
        "gemma2": ("gemma2", torch.float32, None, "lm", {"model.attn_implementation": "eager",
                                                         "model.use_remove_padding": False}),
    }
    out: dict = {"cases": {}}
    paths = [tempfile.mkdtemp(prefix="sharded_load_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    root = Path(paths[0])
    for name, (kind, dtype, shards, head, kwargs) in cases.items():
        folder = root / name
        if dist.get_rank() == 0:
            _save_folder(folder, kind, dtype, shards)
        dist.barrier()
        states, builds = {}, {}
        for mode in ("rank0", "sharded"):
            cpu_builds.clear()
            model_kw = {k[len("model."):]: v for k, v in kwargs.items() if k.startswith("model.")}
            engine_kw = {k: v for k, v in kwargs.items() if not k.startswith("model.")}
            engine = build_engine(ModelConfig(path=str(folder), load_weights=mode, **model_kw),
                                  EngineConfig(param_dtype="float32", **engine_kw), OptimConfig(lr=1e-3), head=head)
            states[mode], builds[mode] = _engine_state(engine), len(cpu_builds)
            del engine
        diffs = {k: float((states["sharded"][k] - v).abs().max()) for k, v in states["rank0"].items()}
        out["cases"][name] = dict(keys_equal=sorted(states["sharded"]) == sorted(states["rank0"]),
                                  max_diff=max(diffs.values()), num_keys=len(diffs),
                                  builds=builds, files=len(list(folder.glob("*.safetensors"))))
    # a tiny config (no folder): random init from the seed, rank 0's, as before
    cpu_builds.clear()
    tiny = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(param_dtype="float32"), None)
    out["tiny_builds"] = len(cpu_builds)
    out["tiny_norm"] = float(sum(t.double().norm() for t in _engine_state(tiny).values()))
    base.build_causal_lm = real_build
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
    return out


def test_sharded_load_gives_the_parameters_of_rank0_load():
    out = run_distributed(_compare, 2)
    for name, case in out["cases"].items():
        assert case["keys_equal"] and case["num_keys"] > 10, (name, case)
        assert case["max_diff"] == 0.0, (name, case)
        # the old path built the whole model on rank 0's CPU; the sharded one on no rank (rank 0 here)
        assert case["builds"] == {"rank0": 1, "sharded": 0}, (name, case)
    assert out["cases"]["qwen2_bf16_index"]["files"] > 1
    assert out["tiny_builds"] == 1 and out["tiny_norm"] > 0


def _random_shard_stats():
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import TINY_MODELS

    tiny = dict(TINY_MODELS["qwen2"], initializer_range=0.05)
    out = {}
    for layout, kw in (("sharded", {}), ("replicated", {"fsdp_size": 1})):
        engine = build_engine(ModelConfig(tiny=tiny, load_weights="random_shards"), EngineConfig(**kw), OptimConfig())
        full = dict(engine.export_weights())
        q = engine.module.lm.model.layers[0].self_attn.q_proj.weight.to_local()
        local = [torch.empty_like(q) for _ in range(dist.get_world_size())]
        dist.all_gather(local, q.contiguous())
        out[layout] = {"sharded": engine.sharded_load, "norm": float(full["model.norm.weight"].sub(1).abs().max()),
                       "q_std": float(full["model.layers.0.self_attn.q_proj.weight"].std()),
                       "q_bias": float(full["model.layers.0.self_attn.q_proj.bias"].abs().max()),
                       "layers_differ": not torch.equal(full["model.layers.0.mlp.up_proj.weight"],
                                                        full["model.layers.1.mlp.up_proj.weight"]),
                       "ranks_equal": torch.equal(local[0], local[1])}
    return out


@pytest.mark.multiproc
def test_random_shards_draw_each_ranks_shard_on_its_device():
    """model.load_weights=random_shards: no rank builds the whole model; norms 1, biases 0, weights normal with
    the config's initializer_range, each tensor drawn apart; the two replicas of HSDP (fsdp_size=1) hold the same
    values, the two shards of FSDP different ones; with a model folder it is a config error."""
    stats = run_distributed(_random_shard_stats, 2)
    for layout, s in stats.items():
        assert s["sharded"] and s["norm"] == 0 and s["q_bias"] == 0 and s["layers_differ"], layout
        assert 0.045 < s["q_std"] < 0.055, layout
    assert stats["replicated"]["ranks_equal"] and not stats["sharded"]["ranks_equal"]
    with pytest.raises(ConfigError, match="model.load_weights"):
        load_config(None, ["model.path=/x", "model.load_weights=random_shards"])
    with pytest.raises(ConfigError, match="needs FSDP2"):
        load_config(None, ['model.tiny={"model_type": "qwen2"}', "model.load_weights=random_shards",
                           "actor.engine.strategy=fsdp"])
