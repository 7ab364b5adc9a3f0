"""Offload/onload, weight export and the Hugging Face folder an engine writes.

CPU runs (gloo, fp32) check that offloading changes nothing about training, that `export_weights` equals
the unsharded model's weights exactly (HF names, the tied head left out as `save_pretrained` does), and
that a folder written at world 2 loads in plain transformers with the engine's log-probs. The CUDA tests
measure the memory an offload gives back (FSDP2 and FSDP1) and check FSDP1's per-unit export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
from shardrl.engine import build_engine
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.engine.state import state_devices
from shardrl.testing import TINY_MODELS, random_batch, record_grads, run_distributed
from shardrl.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.multiproc

NUM_SEQS, MAX_LEN = 8, 20
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=1.0)
INFER_SEED = 99


def pg_loss(outputs, mb, num_tokens, num_seqs):
    loss = agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens, num_global_seqs=num_seqs)
    return loss, {}


def make_engine(kind: str, tiny: dict | None = None, **engine_kwargs):
    engine_kwargs = dict(dict(param_dtype="float32", micro_batch_size_per_gpu=2), **engine_kwargs)
    return build_engine(ModelConfig(tiny=tiny or TINY_MODELS[kind]), EngineConfig(**engine_kwargs), OptimConfig(**OPTIM))


def rank_batch(engine, vocab_size: int, seed: int):
    """This rank's share of the global batch `seed`, so results do not depend on the layout."""
    return random_batch(NUM_SEQS, MAX_LEN, vocab_size, seed=seed).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]


def gathered_log_probs(engine, vocab_size: int) -> torch.Tensor:
    logp = engine.infer_batch(rank_batch(engine, vocab_size, INFER_SEED))["log_probs"]
    parts = [torch.zeros_like(logp) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(parts, logp.contiguous(), group=engine.dp_group)
    return torch.cat(parts)


def cpu_weights(engine, dtype=None) -> dict[str, torch.Tensor]:
    # at world 1 an exported tensor can be the parameter itself: copy it
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.export_weights(dtype)}


# ---- workers (run on every rank; rank 0's return value comes back) ----------------------------------
def offload_worker(kind: str):
    vocab = TINY_MODELS[kind]["vocab_size"]
    plain = make_engine(kind)
    plain_grads = record_grads(plain)
    plain_losses = [plain.train_batch(rank_batch(plain, vocab, s), pg_loss) for s in (1, 2, 3)]
    plain_weights = cpu_weights(plain)
    del plain

    engine = make_engine(kind, offload_optimizer=True)
    grads = record_grads(engine)
    devices, losses = [], []
    with engine.training():
        losses.append(engine.train_batch(rank_batch(engine, vocab, 1), pg_loss))
    devices.append(("after training phase", state_devices(engine)))
    engine.offload()  # e.g. for a colocated rollout
    devices.append(("after offload", state_devices(engine)))
    engine.offload()  # twice is harmless
    with engine.phase(optimizer=False):
        engine.infer_batch(rank_batch(engine, vocab, INFER_SEED))
    for seed in (2, 3):
        with engine.training():
            devices.append(("in training phase", state_devices(engine)))
            losses.append(engine.train_batch(rank_batch(engine, vocab, seed), pg_loss))
        engine.offload()
        engine.onload()
    return {"plain_losses": plain_losses, "losses": losses, "plain_weights": plain_weights,
            "weights": cpu_weights(engine), "devices": devices, "device": engine.device.type,
            "plain_grads": plain_grads, "grads": grads}


def export_worker(tmp: str):
    out = {}
    tokenizer = build_char_tokenizer()
    for kind in ("qwen2", "llama"):
        vocab = TINY_MODELS[kind]["vocab_size"]
        engine = make_engine(kind)
        res = {"init": cpu_weights(engine), "init_bf16": cpu_weights(engine, torch.bfloat16)}
        engine.train_batch(rank_batch(engine, vocab, 1), pg_loss)
        res["trained"] = cpu_weights(engine)
        full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
        res["full_state_dict"] = {k: v.cpu() for k, v in full.items()}
        res["log_probs"] = gathered_log_probs(engine, vocab)
        engine.save_hf(Path(tmp) / f"{kind}_hf", tokenizer=tokenizer, dtype=torch.float32)
        if kind == "qwen2":  # small shards: several files and an index
            engine.save_hf(Path(tmp) / "qwen2_sharded", dtype=torch.float32, max_shard_bytes=40_000)
            engine.save_hf(Path(tmp) / "qwen2_sharded", dtype=torch.float32, max_shard_bytes=40_000)  # replaces
        out[kind] = res
    return out


# ---- fixtures -----------------------------------------------------------------------------------------
def offload_and_export_worker(kind: str, tmp: str) -> tuple:
    """`offload_worker` then `export_worker`, one after the other on the same processes."""
    return offload_worker(kind), export_worker(tmp)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    return tmp, run_distributed(offload_and_export_worker, 2, "qwen2", str(tmp))  # one spawn of 2 for both


@pytest.fixture(scope="module")
def offload_world2(world2):
    return world2[1][0]


@pytest.fixture(scope="module")
def export_world2(world2):
    tmp, (_, export) = world2
    return tmp, export


def reference_model(kind: str):
    return build_causal_lm(load_hf_config(None, TINY_MODELS[kind]), None, "cpu", torch.float32, seed=0)


def hf_log_probs(model, batch) -> torch.Tensor:
    """Next-token log-probs from a plain HF forward on the padded batch (as the engine defines them)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * (pos > 0)


# ---- offload ------------------------------------------------------------------------------------------
def test_offload_keeps_training_identical(offload_world2):
    res = offload_world2
    for got, want in zip(res["losses"], res["plain_losses"], strict=True):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    # each step's whole gradient (after step 1 it depends on the moved weights and optimizer state)
    assert len(res["grads"]) == len(res["plain_grads"]) == 3
    for step, (got, want) in enumerate(zip(res["grads"], res["plain_grads"])):
        assert got.keys() == want.keys()
        for name, g in want.items():
            assert torch.equal(got[name], g), (step, name)
    assert res["weights"].keys() == res["plain_weights"].keys()
    for name, w in res["plain_weights"].items():
        assert torch.equal(res["weights"][name], w), name


def test_offload_puts_state_on_cpu_and_phases_bring_it_back(offload_world2):
    devices = dict((label, d) for label, d in offload_world2["devices"])
    assert devices["after offload"]["params"] == {"cpu"}
    assert devices["after offload"]["optimizer"] == {"cpu"}
    assert devices["after training phase"]["optimizer"] == {"cpu"}  # offload_optimizer=True
    device = offload_world2["device"]
    assert devices["in training phase"]["params"] == {device}
    assert devices["in training phase"]["optimizer"] == {device}


# ---- export -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_export_equals_unsharded_weights(export_world2, kind):
    _, res = export_world2
    ref = reference_model(kind)
    want = dict(ref.named_parameters())  # a tied head appears once, as model.embed_tokens.weight
    got = res[kind]["init"]
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], w.detach()), name
    for name, w in want.items():
        assert res[kind]["init_bf16"][name].dtype == torch.bfloat16
        assert torch.equal(res[kind]["init_bf16"][name], w.detach().to(torch.bfloat16)), name
    if kind == "llama":
        assert "lm_head.weight" not in got


def bucketed_export_worker(kind: str):
    """Exports of one model on 4 ranks, full shard and HSDP 2x2, with small buckets (several parameters,
    rows that do not split evenly) and with one bucket for all; counts the all-gathers each makes."""
    from shardrl.engine import state

    calls = []
    original = state._all_gather_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    state._all_gather_single = counting
    out = {}
    try:
        for layout, fsdp_size in (("full", -1), ("hsdp", 2)):
            engine = make_engine(kind, fsdp_size=fsdp_size)
            params = list(engine.module.named_parameters())
            for bucket_bytes in (1, 3000, 2**30):
                calls.clear()
                pairs = state.export_fsdp2_weights(params, engine.device, torch.bfloat16, engine.hf_name, bucket_bytes)
                out[layout, bucket_bytes] = ({k: v.clone() for k, v in pairs}, len(calls), len(params))
    finally:
        state._all_gather_single = original
    return out


def bucketed_export_each(kinds: tuple[str, ...]) -> dict:
    """`bucketed_export_worker` for each model kind, one after the other on the same 4 processes."""
    return {kind: bucketed_export_worker(kind) for kind in kinds}


@pytest.fixture(scope="module")
def bucketed_world4():
    return run_distributed(bucketed_export_each, 4, ("qwen2", "llama"))  # both kinds in one spawn of 4


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_bucketed_export_at_world_4_full_shard_and_hsdp(bucketed_world4, kind):
    res = bucketed_world4[kind]
    want = {n: w.detach().to(torch.bfloat16) for n, w in reference_model(kind).named_parameters()}
    for (layout, bucket_bytes), (got, num_gathers, num_params) in res.items():
        assert got.keys() == want.keys(), (layout, bucket_bytes)
        for name, w in want.items():
            assert torch.equal(got[name], w), (layout, bucket_bytes, name)
        # one gather per parameter with 1-byte buckets, fewer with 3 kB ones, one with a 1 GiB bucket
        expected = {1: num_params, 2**30: 1}.get(bucket_bytes)
        assert num_gathers == expected if expected else 1 < num_gathers < num_params, (layout, bucket_bytes)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_export_after_training_equals_full_state_dict(export_world2, kind):
    _, res = export_world2
    full = {k.removeprefix("lm."): v for k, v in res[kind]["full_state_dict"].items()}
    trained = res[kind]["trained"]
    assert set(trained) <= set(full) and set(full) - set(trained) <= {"lm_head.weight"}
    moved = max((trained[k] - res[kind]["init"][k]).abs().max().item() for k in trained)
    assert moved > 1e-4  # the step changed the weights, so the comparison below means something
    for name, w in trained.items():
        assert torch.equal(w, full[name]), name


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_hf_folder_loads_in_transformers_with_same_log_probs(export_world2, kind, tmp_path):
    tmp, res = export_world2
    folder = tmp / f"{kind}_hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    # the file holds what save_pretrained would write for the same model
    reference_model(kind).save_pretrained(tmp_path / "ref")
    with safe_open(folder / "model.safetensors", "pt") as f, safe_open(tmp_path / "ref" / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert f.metadata() == {"format": "pt"}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[kind]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), res[kind]["trained"][name]), name
    batch = random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS[kind]["vocab_size"], seed=INFER_SEED)
    diff = (hf_log_probs(model, batch) - res[kind]["log_probs"]).abs().max().item()
    assert diff < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.encode("12") == build_char_tokenizer().encode("12")
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True
    assert not list(tmp.glob(f".{kind}_hf*"))  # no temporary folder left behind


def test_hf_folder_sharded_with_index(export_world2):
    tmp, res = export_world2
    folder = tmp / "qwen2_sharded"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(res["qwen2"]["trained"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), res["qwen2"]["trained"][name]), name


# ---- CUDA: measured memory, FSDP1 ---------------------------------------------------------------------
GPU_TINY = dict(TINY_MODELS["qwen2"], vocab_size=4096, hidden_size=256, intermediate_size=1024,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def gpu_offload_worker(strategy: str):
    vocab = GPU_TINY["vocab_size"]
    out = {}
    plain = make_engine("qwen2", tiny=GPU_TINY, strategy=strategy)
    out["plain_losses"] = [plain.train_batch(rank_batch(plain, vocab, s), pg_loss)["loss"] for s in (1, 2)]
    out["plain_weights"] = cpu_weights(plain)
    del plain
    torch.cuda.empty_cache()

    engine = make_engine("qwen2", tiny=GPU_TINY, strategy=strategy)
    losses = [engine.train_batch(rank_batch(engine, vocab, 1), pg_loss)["loss"]]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    param_bytes = sum(local(p).numel() * p.element_size() for p in engine.module.parameters())
    optim_bytes = sum(local(v).numel() * v.element_size() for s in engine.optimizer.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.offload()
    after = torch.cuda.memory_allocated()
    out["devices_offloaded"] = state_devices(engine)
    engine.onload()
    out["onloaded"] = torch.cuda.memory_allocated()
    out["devices_onloaded"] = state_devices(engine)
    losses.append(engine.train_batch(rank_batch(engine, vocab, 2), pg_loss)["loss"])
    out.update(losses=losses, weights=cpu_weights(engine), before=before, after=after,
               param_bytes=param_bytes, optim_bytes=optim_bytes)
    out["exported_names"] = sorted(out["weights"])
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_gpu_offload_releases_memory(strategy):
    world = min(2, torch.cuda.device_count())
    res = run_distributed(gpu_offload_worker, world, strategy)
    freed = res["before"] - res["after"]
    held = res["param_bytes"] + res["optim_bytes"]
    print(json.dumps({"strategy": strategy, "world": world, "allocated_before": res["before"],
                      "allocated_after": res["after"], "freed": freed, "params_plus_optim": held}))
    assert freed >= 0.95 * held, f"offload freed {freed} bytes of the {held} params + optimizer state hold"
    assert res["devices_offloaded"]["params"] == {"cpu"} and res["devices_offloaded"]["optimizer"] == {"cpu"}
    assert res["devices_onloaded"]["params"] == {"cuda"} and res["devices_onloaded"]["optimizer"] == {"cuda"}
    assert res["losses"] == pytest.approx(res["plain_losses"], rel=1e-5)
    for name, w in res["plain_weights"].items():
        assert torch.allclose(res["weights"][name], w, atol=1e-6), name
    want = {k for k, _ in build_causal_lm(load_hf_config(None, GPU_TINY), None, "meta", torch.float32).named_parameters()}
    assert set(res["exported_names"]) == want


def gpu_fsdp1_export_worker(tmp: str):
    # llama ties its head to the embedding: at world 2 this also checks that FSDP1 built the same tied
    # model on every rank (ranks > 0 materialize from meta; an untied copy there hangs the first gather)
    engine = make_engine("llama", strategy="fsdp")
    init = cpu_weights(engine)
    engine.save_hf(Path(tmp) / "hf", dtype=torch.float32)
    return {"init": init, "log_probs": gathered_log_probs(engine, TINY_MODELS["llama"]["vocab_size"])}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fsdp1_export_and_hf_folder(tmp_path):
    res = run_distributed(gpu_fsdp1_export_worker, min(2, torch.cuda.device_count()), str(tmp_path))
    want = dict(reference_model("llama").named_parameters())
    assert res["init"].keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(res["init"][name], w.detach()), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    batch = random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS["llama"]["vocab_size"], seed=INFER_SEED)
    # FSDP1 computes in param_dtype=float32 here, but on GPU: TF32 and kernels differ from the CPU reference
    assert (hf_log_probs(model, batch) - res["log_probs"].cpu()).abs().max().item() < 1e-3
