"""LoRA (`model.lora`): the engine's adapter gradients equal a plain peft model's in a loop written here, however
the batch is cut or sharded (world 1/2, micro-batches, dynamic batches, sp=2); only the adapters train, the base is
frozen in param_dtype; the reference is the base (adapters off); the export is the merged model; bad input is one
line naming the key."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardrl.algos.aggregate import agg_loss
from shardrl.config.schema import ConfigError, EngineConfig, LoRAConfig, ModelConfig, OptimConfig, load_config
from shardrl.engine import build_engine
from shardrl.engine.loading import copy_full_into
from shardrl.engine.lora import LORA_MARK
from shardrl.engine.model import build_causal_lm, load_hf_config
from shardrl.testing import TINY_MODELS, random_batch, record_grads, run_distributed

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_SEQS, MAX_LEN = 8, 20
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.0, clip_grad=0.0)


def make_batch():
    return random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS["qwen2"]["vocab_size"], seed=1)


def adapter_values(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Random A and B for every adapter (B != 0, so that A has a gradient too), by HF name."""
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in sorted(shapes.items())}


def loss_fn(outputs, mb, num_tokens, num_seqs):
    return agg_loss(-outputs["log_probs"] * mb["advantages"], mb["loss_mask"], "token-mean",
                    num_global_tokens=num_tokens, num_global_seqs=num_seqs), {}


def peft_reference(values: dict[str, torch.Tensor] | None = None):
    """The plain loop: peft's own get_peft_model on the HF model, the padded batch, full logits, backward.
    Returns the adapters' gradients by HF name, and the model's log-probs after one SGD-free forward."""
    from peft import LoraConfig, get_peft_model

    config = load_hf_config(None, TINY_MODELS["qwen2"])
    base = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    named = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if p.requires_grad}
    if values is None:
        return {n: p.shape for n, p in named.items()}
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(values[name])
    batch = make_batch()
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    agg_loss(-logp * batch["advantages"], batch["loss_mask"], "token-mean").backward()
    return {n: p.grad.detach().clone() for n, p in named.items()}


def engine_grads(layouts: dict[str, dict], values: dict[str, torch.Tensor]) -> dict:
    """On every rank: each layout's one train_batch on this rank's share; the adapters' whole gradients, the
    trained parameters' names, the base's dtype."""
    out = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, engine_kwargs in layouts.items():
        model_cfg = ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK, alpha=ALPHA,
                                                                         target_modules=TARGETS))
        engine = build_engine(model_cfg, EngineConfig(param_dtype="float32", **engine_kwargs), OptimConfig(**OPTIM))
        with torch.no_grad():
            for n, p in engine.module.named_parameters():
                if LORA_MARK in n:
                    copy_full_into(p, values[engine.hf_name(n)])
        steps = record_grads(engine)
        engine.train_batch(make_batch().chunk(engine.mesh.dp_size)[engine.mesh.dp_rank], loss_fn)
        trained = sorted(engine.hf_name(n) for n, p in engine.module.named_parameters() if p.requires_grad)
        out[name] = {"grads": steps[0], "trained": trained, "optimizer_params": sum(
            len(g["params"]) for g in engine.optimizer.param_groups)}
    assert rank < world
    return out


LAYOUTS_1 = {"micro1": dict(micro_batch_size_per_gpu=1), "micro4": dict(micro_batch_size_per_gpu=4),
             "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=48)}
LAYOUTS_2 = {"dp2_micro2": dict(micro_batch_size_per_gpu=2), "dp2_dynamic": dict(use_dynamic_bsz=True,
                                                                                 max_token_len_per_gpu=40),
             "sp2_micro1": dict(micro_batch_size_per_gpu=1, ulysses_sequence_parallel_size=2)}


@pytest.mark.multiproc
def test_adapter_gradients_equal_a_plain_peft_loop_however_the_batch_is_cut():
    values = adapter_values(peft_reference())
    want = peft_reference(values)
    assert len(want) == 2 * len(TARGETS) * TINY_MODELS["qwen2"]["num_hidden_layers"]
    assert all(float(g.abs().max()) > 0 for g in want.values())  # A and B both get gradients
    scale = max(float(g.abs().max()) for g in want.values())
    runs = {**run_distributed(engine_grads, 1, LAYOUTS_1, values), **run_distributed(engine_grads, 2, LAYOUTS_2, values)}
    for name, run in runs.items():
        assert run["trained"] == sorted(want) and run["optimizer_params"] == len(want), name  # the adapters only
        assert sorted(run["grads"]) == sorted(want), name
        for key, g in want.items():
            torch.testing.assert_close(run["grads"][key], g, rtol=0, atol=1e-5 * scale, msg=f"{name} {key}")


def _reference_and_export(values):
    model_cfg = ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK, alpha=ALPHA,
                                                                     target_modules=TARGETS))
    engine = build_engine(model_cfg, EngineConfig(param_dtype="bfloat16"), OptimConfig(**OPTIM))
    base_dtypes = {p.dtype for n, p in engine.module.named_parameters() if not p.requires_grad}
    lora_dtypes = {p.dtype for n, p in engine.module.named_parameters() if p.requires_grad}
    batch = make_batch()
    at_init = engine.infer_batch(batch)["log_probs"]
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if LORA_MARK in n:
                copy_full_into(p, values[engine.hf_name(n)])
    adapted = engine.infer_batch(batch)["log_probs"]
    with engine.adapters_off():
        base = engine.infer_batch(batch)["log_probs"]
    merged = {k: v.float() for k, v in engine.export_weights()}
    return {"base_dtypes": base_dtypes, "lora_dtypes": lora_dtypes, "at_init": at_init, "adapted": adapted,
            "base": base, "merged": merged}


@pytest.mark.multiproc
def test_the_base_is_frozen_in_bf16_the_reference_is_the_base_and_the_export_merges():
    values = adapter_values(peft_reference())
    got = run_distributed(_reference_and_export, 2, values)
    assert got["base_dtypes"] == {torch.bfloat16} and got["lora_dtypes"] == {torch.float32}
    torch.testing.assert_close(got["at_init"], got["base"], rtol=0, atol=0)  # B starts at 0: the base model
    assert float((got["adapted"] - got["base"]).abs().max()) > 1e-3
    # the export is a plain HF model: the adapted model's log-probs, with HF names only
    config = load_hf_config(None, TINY_MODELS["qwen2"])
    plain = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    assert set(got["merged"]) == set(plain.state_dict()) - {"lm_head.weight"} or set(got["merged"]) == set(
        plain.state_dict())
    plain.load_state_dict(got["merged"], strict=False)
    batch = make_batch()
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = plain(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    logp = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = batch["loss_mask"][:, 1:].bool()
    # bf16 base: the merged weights are rounded to bf16 once, the engine adds the adapters' product unrounded
    assert float((logp - got["adapted"][:, 1:]).abs()[real].max()) < 0.05


def test_bad_lora_settings_are_one_line_naming_the_key():
    for override, message in (("model.lora.rank=-1", "model.lora.rank=-1: must be >= 0"),
                              ("model.lora.target_modules=[]", "model.lora.target_modules=[]: must name"),
                              ("model.lora.target_modules=[lm_head]", "cannot hold the output head")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, [override])


def _build_errors(cases: list[tuple[dict, dict]]) -> list[str | None]:
    """Builds an engine for each (lora kwargs, engine kwargs), one after the other on this process: the error each
    build raised, as "Type: message" (None for a build that went through)."""
    errors = []
    for model_kwargs, engine_kwargs in cases:
        try:
            build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(**model_kwargs)),
                         EngineConfig(**engine_kwargs), OptimConfig())
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


@pytest.mark.multiproc
def test_lora_that_cannot_run_is_refused_when_the_engine_is_built():
    cases = {r"model.lora.target_modules=\['qkv'\]: \['qkv'\] match no linear layer of the model; its linear layers "
             r"are \['down_proj', 'gate_proj', 'k_proj'": (dict(rank=4, target_modules=["qkv"]), {})}
    errors = run_distributed(_build_errors, 1, list(cases.values()))
    for message, error in zip(cases, errors, strict=True):
        assert error is not None and re.search(message, error), (message, error)


def test_a_lora_run_trains_with_the_base_as_reference_and_exports_a_merged_model(tmp_path):
    """`shardrl train model.lora.rank=...` on the demo: no reference engine is built (the actor with its adapters
    off is the reference), so the KL loss of the first update is exactly 0 (B starts at 0) and later ones are not;
    the HF export is a plain HF model (the merge itself: test_the_base_is_frozen_in_bf16_...)."""
    import json

    import transformers

    from shardrl.cli import main
    from shardrl.testing import small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    run_dir = tmp_path / "run"
    reward = tmp_path / "parity.py"  # rewards that differ within a group, so that the first update moves
    reward.write_text("def compute_score(solution_str, ground_truth):\n    return float(len(solution_str) % 2)\n")
    args = small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", "trainer.total_steps=2", "model.lora.rank=8",
                          "model.lora.alpha=16", "actor.optim.lr=1e-2", "actor.use_kl_loss=true",
                          "actor.ppo_mini_batch_size=4", "trainer.export_hf=true", f"reward.function_path={reward}",
                          "trainer.export_lora_adapter=true", "actor.engine.param_dtype=float32")
    assert main(["train", *args]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["actor/grad_norm"] > 0 and records[0]["actor/kl_loss"] == 0.0 and records[1]["actor/kl_loss"] > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert not any("lora" in n or "base_layer" in n for n, _ in model.named_parameters())
    saved = json.loads((run_dir / "hf_model" / "config.json").read_text())
    assert saved["model_type"] == "qwen2"
    # the peft adapter folder on the base model gives the merged model's log-probs
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(assets / "model")
    adapted = PeftModel.from_pretrained(base, run_dir / "lora_adapter").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match=r"trainer.export_lora_adapter=True: needs model.lora.rank > 0"):
        load_config(None, ["trainer.export_lora_adapter=true"])


def _save_lora(path, values):
    model_cfg = ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    engine = build_engine(model_cfg, EngineConfig(param_dtype="float32"), OptimConfig(**OPTIM))
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if LORA_MARK in n:
                copy_full_into(p, values[engine.hf_name(n)])
    engine.train_batch(make_batch().chunk(engine.mesh.dp_size)[engine.mesh.dp_rank], loss_fn)
    engine.save(path)
    return {k: v.float() for k, v in engine.export_weights()}


def _load_lora(path, lora: bool, alpha: float = ALPHA):
    model_cfg = ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK if lora else 0, alpha=alpha,
                                                                     target_modules=TARGETS))
    engine = build_engine(model_cfg, EngineConfig(param_dtype="float32"), OptimConfig(**OPTIM))
    engine.load(path)
    return {k: v.float() for k, v in engine.export_weights()}, engine.global_step


def _load_lora_three_ways(path):
    """On this process, one engine after another loads the checkpoint: with the saved LoRA settings (its weights
    and step), without model.lora, and with another alpha (the error each of those two raised, "Type: message",
    or None)."""
    loaded = _load_lora(path, True)
    errors = []
    for lora, alpha in ((False, ALPHA), (True, ALPHA * 2)):
        try:
            _load_lora(path, lora, alpha)
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return loaded, errors


@pytest.mark.multiproc
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_at_another_world_size(tmp_path):
    import torch.distributed.checkpoint as dcp

    values = adapter_values(peft_reference())
    saved = run_distributed(_save_lora, 2, str(tmp_path / "ckpt"), values)
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("model.")]
    assert keys and all(LORA_MARK in k for k in keys)  # no base weight: it is the model folder's
    moments = [k for k in meta if k.startswith("optimizer.state.")]
    assert moments and all(LORA_MARK in k for k in moments)  # AdamW state of the adapters only
    # the three loads at world 1 run on one process, one engine after the other
    (loaded, step), (no_lora, other_alpha) = run_distributed(_load_lora_three_ways, 1, str(tmp_path / "ckpt"))
    assert step == 1 and sorted(loaded) == sorted(saved)
    for k in saved:
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=1e-6)
    assert no_lora is not None and re.search(r"holds LoRA adapters, but this run has no model.lora", no_lora), no_lora
    # another scale would change the trained policy without a shape to tell: the checkpoint's settings are checked
    assert other_alpha is not None and re.search(rf"other LoRA settings: model.lora.alpha={float(ALPHA)!r} in the "
                                                 rf"checkpoint, {float(ALPHA) * 2!r} here", other_alpha), other_alpha


def test_the_memory_ledger_counts_the_frozen_base_and_the_adapters():
    from shardrl.plan.layout import derive_layout
    from shardrl.plan.memory import model_numbers, phase_ledger

    shapes = peft_reference()
    num_adapters = sum(s.numel() for s in shapes.values())
    config = load_hf_config(None, TINY_MODELS["qwen2"])
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    numbers = model_numbers(config, lora=lora)
    assert numbers["trained"] == num_adapters and numbers["total"] == model_numbers(config)["total"]
    overrides = [f"model.tiny={TINY_MODELS['qwen2']}".replace("'", '"'), f"model.lora.rank={RANK}",
                 f"model.lora.target_modules={TARGETS}", "actor.use_kl_loss=true"]
    cfg = load_config(None, overrides)
    items = {i["name"]: i["gib"] * 2**30 for i in phase_ledger(cfg, derive_layout(cfg, 1, 2), config)["phases"]
             ["update"]["items"]}
    p = numbers["total"]
    assert items["actor params"] == pytest.approx((p * 2 + num_adapters * 4) / 2)  # bf16 base, fp32 adapters, 2 shards
    assert items["actor optimizer state"] == pytest.approx(2 * num_adapters * 4 / 2)
    assert items["actor grads"] == pytest.approx(num_adapters * 4 / 2)
    assert "ref params" not in items  # the reference is the actor with its adapters off
    full = load_config(None, overrides[:1] + ["actor.use_kl_loss=true"])
    full_items = {i["name"] for i in phase_ledger(full, derive_layout(full, 1, 2), config)["phases"]["update"]["items"]}
    assert "ref params" in full_items
    # the rollout: one GPU reads the actor's base (only the adapters are its own); on two it holds a copy
    for lora_sync, world, want in (("unmerged", 1, num_adapters * 4), ("unmerged", 2, num_adapters * 4 + p * 2),
                                   ("merged", 1, p * 2), ("merged", 2, p * 4), ("full", 1, p * 2)):
        cfg = load_config(None, overrides + [f"rollout.lora_sync={lora_sync}", "rollout.backend=fast"])
        gen = phase_ledger(cfg, derive_layout(cfg, 1, world), config)["phases"]["gen"]["items"]
        rollout = sum(i["gib"] for i in gen if i["name"].startswith("rollout")) * 2**30
        assert rollout == pytest.approx(want), (lora_sync, world)
    # a base stored in fp32 cannot be read by the bf16 rollout: it holds a copy
    cfg = load_config(None, overrides + ["rollout.lora_sync=unmerged", "rollout.backend=fast",
                                         "actor.engine.param_dtype=float32"])
    gen = phase_ledger(cfg, derive_layout(cfg, 1, 1), config)["phases"]["gen"]["items"]
    assert sum(i["gib"] for i in gen if i["name"].startswith("rollout")) * 2**30 == pytest.approx(num_adapters * 4 + p * 2)


def _base_storage_after_forwards() -> dict:
    """At world 1 (the blocks stay gathered after a forward: accumulate_unsharded): the base tensors the engine
    lends the rollout, taken right after an inference forward, then after a train step (where the rollout reads
    them next)."""
    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK, alpha=ALPHA,
                                                                                target_modules=TARGETS)),
                          EngineConfig(param_dtype="float32"), OptimConfig(**OPTIM))
    batch = make_batch()
    with torch.no_grad():
        engine.infer_batch(batch)
    lent = engine.local_base_weights()
    values = {n: t.clone() for n, t in lent.items()}
    engine.train_batch(batch, loss_fn)  # (its last backward reshards: gathered buffers are freed here)
    return dict(alive=all(t.untyped_storage().nbytes() > 0 for t in lent.values()),
                same=all(torch.equal(t, values[n]) for n, t in lent.items()), count=len(lent))


@pytest.mark.multiproc
def test_the_base_lent_to_the_rollout_is_the_sharded_storage_not_a_gathered_copy():
    """The rollout reads what `local_base_weights` lends for the whole run: the params' own storage, not the
    gathered buffers a forward leaves (freed, or overwritten, at the next reshard)."""
    got = run_distributed(_base_storage_after_forwards, 1)
    assert got["count"] > 0 and got["alive"] and got["same"], got


SYNC_PROMPTS = ["1+2=", "hello world ", "ab", "what is 7*6? "]


def _sync_runs(modes: list[str]) -> dict:
    """On every rank: a LoRA engine with random adapters, and for each `modes` entry a fast rollout synced by
    `LoRASync` (or, for "full", by the whole merged export), then the adapters changed and synced again; the
    greedy tokens and sampled log-probs after each sync, whether the rollout read the engine's own base
    tensors, and how many base tensors each sync moved."""
    from shardrl.rollout import FastRollout, SamplingParams
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.generation import LoRASync, export_for_rollout

    tok = build_char_tokenizer()
    model_cfg = ModelConfig(tiny=dict(TINY_MODELS["qwen2"], vocab_size=len(tok)),
                            lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    engine = build_engine(model_cfg, EngineConfig(param_dtype="float32"), OptimConfig(**OPTIM))
    shapes = {engine.hf_name(n): p.shape for n, p in engine.module.named_parameters() if LORA_MARK in n}
    adapters = [adapter_values(shapes), {n: v.flip(0) * 2 for n, v in adapter_values(shapes).items()}]
    enc = tok(SYNC_PROMPTS, padding=True, return_tensors="pt")
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    moved: dict[str, list[int]] = {}
    base_calls = []
    real_base_weights = engine.base_weights
    engine.base_weights = lambda dtype=None: (base_calls.append(1), real_base_weights(dtype))[1]
    out = {"shared": {}, "moved": moved}
    for mode in modes:
        rollout = FastRollout(engine.hf_config, tok, "cpu", torch.float32, lazy_weights=mode != "full")
        sync = LoRASync(engine, rollout, mode, torch.float32) if mode != "full" else None
        results = []
        base_calls.clear()
        for values in adapters:
            # an update between syncs (its adapters then replaced): the base must stay where the rollout reads it
            engine.train_batch(random_batch(4, 12, len(tok), seed=2).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank],
                               loss_fn)
            with torch.no_grad():
                for n, p in engine.module.named_parameters():
                    if LORA_MARK in n:
                        copy_full_into(p, values[engine.hf_name(n)])
            if sync is None:
                rollout.load_weights(export_for_rollout(engine, torch.device("cpu")))
            else:
                sync.sync()
            res = rollout.generate(enc["input_ids"], enc["attention_mask"], greedy)
            results.append((res.response_ids, res.sampled_log_probs))
        moved[mode] = len(base_calls)
        local = engine.local_base_weights()
        q = dict(rollout.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
        out["shared"][mode] = local is not None and q.data_ptr() == local["model.layers.0.self_attn.q_proj.weight"].data_ptr()
        out[mode] = results
    return out


@pytest.mark.multiproc
def test_adapter_only_sync_gives_the_rollout_the_merged_models_samples():
    """The fast rollout synced by the adapters alone (unmerged: added at run time over the engine's own base
    tensors at world 1; merged: written into the rollout's weights) samples exactly what it samples from the
    whole merged export, after a first sync and after a second with other adapters; the base moves once at
    most (world 2: copied once, as no rank holds it whole)."""
    for world in (1, 2):
        run = run_distributed(_sync_runs, world, ["full", "unmerged", "merged"])
        want = run["full"]
        assert not torch.equal(want[0][0], want[1][0])  # the second adapters change what is sampled
        for mode in ("unmerged", "merged"):
            for (ids, logp), (want_ids, want_logp) in zip(run[mode], want):
                assert torch.equal(ids, want_ids), (world, mode)
                torch.testing.assert_close(logp, want_logp, rtol=0, atol=2e-5, msg=f"world {world} {mode}")
        assert run["moved"] == {"full": 0, "unmerged": 0 if world == 1 else 1, "merged": 1}, world
        assert run["shared"] == {"full": False, "unmerged": world == 1, "merged": False}, world


def _cuda_sync_diffs() -> dict:
    """On one GPU: a bf16 LoRA engine with random adapters, three fast rollouts (CUDA graphs, compiled) synced
    the three ways; per way, the mean |sampled log-prob - the engine's| over the sampled tokens, and whether the
    unmerged rollout read the engine's own base."""
    from shardrl.rollout import FastRollout, SamplingParams
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.generation import LoRASync, export_for_rollout

    tok = build_char_tokenizer()
    device = torch.device("cuda", torch.cuda.current_device())
    tiny = dict(TINY_MODELS["qwen2"], vocab_size=len(tok), hidden_size=64, num_attention_heads=4, initializer_range=0.3)
    engine = build_engine(ModelConfig(tiny=tiny, lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear")),
                          EngineConfig(param_dtype="bfloat16"), OptimConfig(**OPTIM))
    shapes = {engine.hf_name(n): p.shape for n, p in engine.module.named_parameters() if LORA_MARK in n}
    adapters = [adapter_values(shapes), {n: v.flip(0) * 2 for n, v in adapter_values(shapes).items()}]
    enc = tok(SYNC_PROMPTS * 4, padding=True, return_tensors="pt")
    sampling = SamplingParams(temperature=1.0, n=4, max_new_tokens=24, seed=3)
    out = {}
    for mode in ("full", "unmerged", "merged"):
        rollout = FastRollout(engine.hf_config, tok, device, torch.bfloat16, lazy_weights=mode != "full")
        sync = LoRASync(engine, rollout, mode, torch.bfloat16) if mode != "full" else None
        diffs, samples = [], []
        for values in adapters:  # the second sync writes over tensors the captured graphs read
            engine.train_batch(random_batch(4, 12, len(tok), seed=2), loss_fn)
            with torch.no_grad():
                for n, p in engine.module.named_parameters():
                    if LORA_MARK in n:
                        copy_full_into(p, values[engine.hf_name(n)].to(device))
            if sync is None:
                rollout.load_weights(export_for_rollout(engine, device))
            else:
                sync.sync()
            batch = rollout.generate(enc["input_ids"].to(device), enc["attention_mask"].to(device), sampling).to_batch()
            batch = batch.to("cpu")
            with torch.no_grad():
                logp = engine.infer_batch(batch)["log_probs"].cpu()
            m = batch["loss_mask"].bool()
            diffs.append(float((logp[m] - batch["sampled_log_probs"][m]).abs().mean()))
            samples.append(batch["input_ids"])
        out[mode] = diffs
        out[f"{mode}_changed"] = not torch.equal(samples[0], samples[1])
        if mode == "unmerged":
            q = dict(rollout.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
            out["shared"] = q.data_ptr() == engine.local_base_weights()["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_adapter_only_sync_samples_as_close_to_the_trainer_as_the_merged_export():
    """bf16 on one GPU (CUDA graphs, torch.compile): the rollout synced by its adapters alone samples log-probs as
    close to the trainer's recomputation as the rollout given the whole merged model (rollout/logprob_abs_diff);
    unmerged, it reads the trainer's own base tensors. So again after a second sync, into the tensors the captured
    graphs read."""
    diffs = run_distributed(_cuda_sync_diffs, 1)
    assert diffs["shared"]
    for i in range(2):  # after the first sync, and after a second (a train step and other adapters between)
        assert 0 < diffs["full"][i] < 0.1, diffs  # bf16 sampling against a recomputation (0.05-0.06 on an H200)
        for mode in ("unmerged", "merged"):
            assert diffs[mode][i] <= 1.5 * diffs["full"][i] + 1e-3, diffs
    assert diffs["full_changed"] and diffs["unmerged_changed"] and diffs["merged_changed"], diffs


def test_lora_sync_left_null_takes_merged_where_the_ledger_says_the_copy_fits(monkeypatch):
    """null: full where the merged model is loaded whole anyway (hf backend, rollout ranks of their own),
    unmerged on CPU, and on CUDA merged where the ledger's peak with the copy fits the GPU, else unmerged; an
    explicit unmerged with rollout ranks of their own is refused."""
    from types import SimpleNamespace

    from shardrl.plan.layout import derive_layout
    from shardrl.plan.defaults import lora_sync_choice

    config = load_hf_config(None, TINY_MODELS["qwen2"])
    base = [f"model.tiny={TINY_MODELS['qwen2']}".replace("'", '"'), f"model.lora.rank={RANK}"]
    cpu = torch.device("cpu")
    cfg = load_config(None, base + ["rollout.backend=fast"])
    layout = derive_layout(cfg, 1, 1)
    assert lora_sync_choice(cfg, layout, config, cpu)[0] == "unmerged"
    assert lora_sync_choice(load_config(None, base), layout, config, cpu)[0] == "full"  # null backend: hf on CPU
    hf = load_config(None, base + ["rollout.backend=hf"])
    assert lora_sync_choice(hf, layout, config, cpu)[0] == "full"
    split = load_config(None, base + ["rollout.backend=fast", "async_rl.rollout_ranks=1"])
    assert lora_sync_choice(split, derive_layout(split, 1, 2), config, cpu)[0] == "full"
    with pytest.raises(ConfigError, match="rollout.lora_sync"):
        load_config(None, base + ["rollout.backend=fast", "async_rl.rollout_ranks=1", "rollout.lora_sync=unmerged"])
    for gib, want in ((80.0, "merged"), (1e-4, "unmerged")):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, gib=gib: SimpleNamespace(
            total_memory=gib * 2**30))
        choice, why = lora_sync_choice(cfg, layout, config, torch.device("cuda", 0))
        assert choice == want and re.search(r"\d (GiB|MiB|KiB|B)\b", why), (gib, choice, why)


def test_the_ledger_counts_a_kept_cache_through_prep_and_the_update():
    """rollout.free_cache_engine=false: the KV cache and sampler logits stay through prep and the update (what
    the 7B and 32B runs held: bench/RESULTS.md, "LoRA"); freed, they are the generation phase's alone."""
    from shardrl.plan.layout import derive_layout
    from shardrl.plan.memory import phase_ledger, update_and_cache_gib

    config = load_hf_config(None, TINY_MODELS["qwen2"])
    base = [f"model.tiny={TINY_MODELS['qwen2']}".replace("'", '"'), "rollout.backend=fast"]
    freed, kept = (load_config(None, base + [f"rollout.free_cache_engine={v}"]) for v in ("true", "false"))
    a, b = (phase_ledger(c, derive_layout(c, 1, 1), config) for c in (freed, kept))
    cache = sum(i["gib"] for i in a["phases"]["gen"]["items"] if i["name"] in ("KV cache", "sampler logits"))
    assert cache > 0
    for phase in ("prep", "update"):
        assert b["phases"][phase]["total_gib"] == pytest.approx(a["phases"][phase]["total_gib"] + cache), phase
    assert b["phases"]["gen"]["total_gib"] == pytest.approx(a["phases"]["gen"]["total_gib"])
    assert update_and_cache_gib(b) == pytest.approx(update_and_cache_gib(a))  # counted once


@pytest.mark.parametrize("rank,small", [(4, None), (16, "k_proj, v_proj")])
def test_the_start_up_line_counts_the_adapters_and_warns_of_a_rank_as_large_as_a_layer(rank, small):
    """The adapters' parameters are r * (in + out) for each wrapped layer; the tiny model's k/v projections are 32 ->
    16, so rank 16 is no smaller than them (warned), rank 4 is (no warning)."""
    from shardrl.engine.lora import inject_lora, lora_summary

    config = load_hf_config(None, TINY_MODELS["qwen2"])
    lm = build_causal_lm(config, None, "cpu", torch.float32, seed=0)
    base = sum(p.numel() for p in lm.parameters())
    h, kv, inter, layers = 32, 16, 64, TINY_MODELS["qwen2"]["num_hidden_layers"]
    sides = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # q k v o gate up down
    want = layers * sum(rank * (i + o) for i, o in sides)
    cfg = LoRAConfig(rank=rank)
    inject_lora(lm, cfg)
    line, warning = lora_summary(lm, cfg)
    assert f"LoRA rank {rank} on {7 * layers} linear layers" in line
    assert f"{want:,} trainable parameters, {100 * want / base:.2f}% of the base's {base:,}" in line
    if small is None:
        assert warning is None
    else:
        assert warning.startswith(f"model.lora.rank={rank} is at least the smaller side of {small}:")


def _two_steps(offload: bool, values: dict[str, torch.Tensor]) -> dict:
    """Two updates of a LoRA engine (offload_params or not) from the adapters `values`: the first update's adapter
    gradients, then the merged export, the adapters, the policy's and the reference's (adapters off) log-probs."""
    model_cfg = ModelConfig(tiny=TINY_MODELS["qwen2"], lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    engine = build_engine(model_cfg, EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2,
                                                  offload_params=offload), OptimConfig(**OPTIM))
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if LORA_MARK in n:
                copy_full_into(p, values[engine.hf_name(n)])
    batch = make_batch().chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    steps = record_grads(engine)
    for _ in range(2):
        engine.train_batch(batch, loss_fn)
    engine.offload()
    engine.onload()
    with engine.adapters_off():
        ref = engine.infer_batch(batch)["log_probs"].clone()
    return {"grads": steps[0], "export": {k: v.clone() for k, v in engine.export_weights()},
            "adapters": {n: (a.clone(), b.clone()) for n, a, b in engine.export_adapters()},
            "policy": engine.infer_batch(batch)["log_probs"].clone(), "ref": ref}


@pytest.mark.multiproc
def test_offloaded_lora_trains_as_lora_on_the_device():
    """offload_params with model.lora (verl's param_offload on a LoRA run): FSDP2 keeps the frozen base and the
    adapters on the CPU; the gradients, the steps, the export and the reference are those of the run without."""
    values = adapter_values(peft_reference())
    want = peft_reference(values)
    scale = max(float(g.abs().max()) for g in want.values())
    offloaded, plain = (run_distributed(_two_steps, 2, offload, values) for offload in (True, False))
    for key, g in want.items():
        torch.testing.assert_close(offloaded["grads"][key], g, rtol=0, atol=1e-5 * scale, msg=key)
    torch.testing.assert_close(offloaded["grads"], plain["grads"], rtol=0, atol=0, msg="grads")
    # the offloaded adapters step with torch's fused CPU AdamW, the resident ones (on this CPU) with its loop: the same
    # update to rounding
    for part in ("export", "adapters", "policy", "ref"):
        torch.testing.assert_close(offloaded[part], plain[part], rtol=1e-5, atol=1e-6, msg=part)
    assert load_config(None, ["model.lora.rank=8", "actor.engine.offload_params=true"]).actor.engine.offload_params
