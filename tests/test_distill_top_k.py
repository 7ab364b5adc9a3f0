"""On-policy distillation toward the teacher's distribution (algorithm.opd.top_k): the teacher's top-k tokens and
log-probs at each response token against a plain forward, and the student's update gradient of the top-k forward KL
against a plain model's, on one rank and two, in one micro-batch and several, packed and padded; the logged loss
the same on every layout; a short run; the settings checked."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardrl.testing import random_batch, run_distributed, save_char_model, small_demo_run

K, TEMPERATURE, COEF = 4, 0.7, 0.5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_top_k")
    tok = save_char_model(root / "student", seed=1)
    save_char_model(root / "teacher", seed=2, hidden_size=96, intermediate_size=192)
    return str(root / "student"), str(root / "teacher"), len(tok)


def plain_logits(model, batch) -> torch.Tensor:
    """(B, T, V) logits / T at each token, of the distribution that scores it (a plain HF forward; row 0 unused)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits.float()
    return F.pad(logits[:, :-1], (0, 0, 1, 0)) / TEMPERATURE  # shifted onto the scored token


def load(folder: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _teacher_then_update(student: str, teacher: str, batch, micro: int, remove_padding: bool, sp: int = 1):
    """This rank's rows of `batch` (rank r of w holds the r-th w-th): the teacher engine's top-k, then one update
    of the student engine on the policy loss (the batch's advantages, old log-probs the engine's own: ratio 1) plus
    the top-k term; the recorded whole gradient and the logged term."""
    import torch.distributed as dist

    from shardrl.config.schema import Config, EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.base import DISTILL_IDS_KEY
    from shardrl.testing import record_grads
    from shardrl.trainer.updates import actor_loss_fn

    engine_cfg = EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=micro, ulysses_sequence_parallel_size=sp)
    actor = build_engine(ModelConfig(path=student, use_remove_padding=remove_padding), engine_cfg,
                         OptimConfig(lr=1e-3, clip_grad=0.0))
    teacher_engine = build_engine(ModelConfig(path=teacher, use_remove_padding=remove_padding), engine_cfg)
    world, rank = dist.get_world_size() // sp, dist.get_rank() // sp  # (the data-parallel ranks)
    n = len(batch)
    mine = batch.index(list(range(n))[rank * n // world: (rank + 1) * n // world])
    scored = teacher_engine.infer_batch(mine, temperature=TEMPERATURE, top_k=K)
    mine[DISTILL_IDS_KEY] = scored["top_k_ids"]
    mine["teacher_top_k_log_probs"] = scored["top_k_log_probs"]
    mine["old_log_probs"] = actor.infer_batch(mine, temperature=TEMPERATURE)["log_probs"]
    grads = record_grads(actor)
    loss_fn = actor_loss_fn(Config().actor, "token-mean", distill_coef=COEF)
    metrics = actor.train_batch(mine, loss_fn, temperature=TEMPERATURE)
    return scored["top_k_ids"], scored["top_k_log_probs"], grads[0], metrics["distill/top_k_kl"]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,micro,remove_padding,responses,sp", [
    (1, 6, True, False, 1), (1, 2, True, True, 1), (2, 1, True, False, 1), (2, 3, False, True, 1),
    (2, 2, True, True, 1), (2, 3, True, True, 2)])
def test_top_k_targets_and_the_students_gradient_match_plain_models(models, world, micro, remove_padding, responses,
                                                                     sp):
    student, teacher, vocab = models
    batch = random_batch(6, 11, vocab, seed=4)
    if responses:  # an RL batch's [prompt | response] columns: the head runs on the responses' positions only
        batch["loss_mask"][:, :5] = 0
        batch["response_mask"] = batch["loss_mask"][:, 5:].clone()
    mask = batch["loss_mask"].bool()
    ids, logp, grads, logged = run_distributed(_teacher_then_update, world, student, teacher, batch, micro,
                                               remove_padding, sp)
    # the reference: plain forwards of both models, the top-k forward KL token-mean over the whole batch
    with torch.no_grad():
        t_logp_all = plain_logits(load(teacher).eval(), batch).log_softmax(-1)  # (B, T, V)
    t_logp, t_ids = t_logp_all.topk(K, -1)
    # rank 0's rows come back (the gradients are whole), over the responses' columns (all of them without)
    rows, cols = slice(0, len(ids)), slice(batch["input_ids"].shape[1] - ids.shape[1], None)
    assert ids.shape[1] == (batch["response_mask"].shape[1] if responses else batch["input_ids"].shape[1])
    assert ids.dtype == torch.int32
    assert torch.equal(ids[mask[rows, cols]].long(), t_ids[rows, cols][mask[rows, cols]])
    torch.testing.assert_close(logp[mask[rows, cols]], t_logp[rows, cols][mask[rows, cols]], atol=2e-5, rtol=1e-4)
    model = load(student).train()
    s_logp = plain_logits(model, batch).log_softmax(-1).gather(-1, t_ids)  # (B, T, K)
    per_token = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # (B, T)
    loss = per_token[mask].mean()
    # the policy loss at ratio 1 (token-mean): -A log p of the sampled tokens, from the same forward
    sampled = plain_logits(model, batch).log_softmax(-1).gather(-1, batch["input_ids"][..., None]).squeeze(-1)
    pg = -(batch["advantages"] * sampled)[mask].mean()
    (pg + COEF * loss).backward()
    assert float(loss.detach()) > 0.01  # two different models: a real target
    assert logged == pytest.approx(float(loss.detach()), rel=1e-4)  # the logged term is the batch's, on every layout
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected)
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=2e-4, msg=name)


def test_a_run_trains_on_the_teachers_top_k_alone(tmp_path):
    from shardrl.launch.rank import run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    save_char_model(tmp_path / "teacher", seed=5)
    run_dir = run(None, small_demo_run(
        assets, tmp_path / "run", "algorithm.adv_estimator=opd", f"teacher.model_path={tmp_path / 'teacher'}",
        "teacher.engine.param_dtype=float32", "algorithm.opd.kl_coef=0", "algorithm.opd.top_k=3",
        "trainer.total_steps=2", "trainer.logger=[jsonl]"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["distill/top_k_kl"] > 0.01  # a random teacher: far from the student
        assert 0 < r["distill/top_k_mass"] <= 1.0 + 1e-6
        assert r["actor/grad_norm"] > 0  # the top-k term alone trains (the advantages are 0)


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.opd.top_k=-1"], r"algorithm.opd.top_k.*must be in \[0, 1024\]"),
    (["algorithm.opd.top_k_coef=0", "algorithm.opd.top_k=2"], r"algorithm.opd.top_k_coef.*must be > 0"),
    (["algorithm.opd.kl_coef=0"], r"nothing would be trained"),
])
def test_top_k_settings_are_checked(overrides, match):
    from shardrl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.tiny={model_type: qwen2}", "algorithm.adv_estimator=opd",
                           "teacher.model_path=/nonexistent", *overrides])


def test_the_step_plan_asks_the_teacher_for_its_top_k_only_with_opd():
    from shardrl.config.schema import Config
    from shardrl.plan.step_plan import StepPlan

    cfg = Config()
    cfg.algorithm.opd.top_k = 5
    assert StepPlan.from_config(cfg).distill_top_k == 0  # grpo: no teacher
    cfg.algorithm.adv_estimator, cfg.teacher.model_path = "opd", "t"
    assert StepPlan.from_config(cfg).distill_top_k == 5


def wide_teacher(folder, extra: int = 8):
    """A teacher of the character tokenizer whose head has `extra` more rows than the tokenizer's ids (padded, as
    Qwen2.5's larger models' heads are), those rows scaled up so that they are often its likeliest tokens."""
    import transformers

    from shardrl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = transformers.AutoConfig.for_model("qwen2", vocab_size=len(tok) + extra, hidden_size=32,
                                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight[len(tok):] *= 30
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return len(tok)


def _wide_top_k(teacher: str, batch, vocab: int):
    from shardrl.config.schema import EngineConfig, ModelConfig
    from shardrl.engine import build_engine

    engine = build_engine(ModelConfig(path=teacher), EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2))
    out = engine.infer_batch(batch, temperature=TEMPERATURE, top_k=K, top_k_vocab=vocab)
    return out["top_k_ids"], out["top_k_log_probs"]


def test_a_teachers_top_k_is_taken_among_the_students_ids(tmp_path):
    vocab = wide_teacher(tmp_path / "teacher")
    batch = random_batch(4, 9, vocab, seed=2)
    mask = batch["loss_mask"].bool()
    ids, logp = run_distributed(_wide_top_k, 1, str(tmp_path / "teacher"), batch, vocab)
    ids = ids.long()
    with torch.no_grad():
        full = plain_logits(load(str(tmp_path / "teacher")).eval(), batch).log_softmax(-1)  # (B, T, V + 8)
    assert (full.topk(K, -1).indices[mask] >= vocab).any()  # unrestricted, the padded rows would be chosen
    want_logp, want_ids = full[..., :vocab].topk(K, -1)  # among the student's ids, normalized over the whole row
    assert torch.equal(ids[mask], want_ids[mask])
    torch.testing.assert_close(logp[mask], want_logp[mask], atol=2e-5, rtol=1e-4)


def test_a_wider_teacher_trains_and_a_top_k_past_the_vocabulary_is_refused(tmp_path):
    from shardrl.config.schema import ConfigError
    from shardrl.launch.rank import run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    vocab = wide_teacher(tmp_path / "teacher")
    args = ["algorithm.adv_estimator=opd", f"teacher.model_path={tmp_path / 'teacher'}", "trainer.total_steps=1",
            "trainer.logger=[jsonl]"]
    run_dir = run(None, small_demo_run(assets, tmp_path / "run", *args, "algorithm.opd.top_k=4"))
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # (over a part of the teacher's mass the sum can be below 0: the padded rows hold much of this teacher's)
    assert abs(record["distill/top_k_kl"]) < 1e3 and 0 < record["distill/top_k_mass"] < 0.999
    assert record["actor/grad_norm"] > 0
    with pytest.raises(ConfigError, match=rf"algorithm.opd.top_k={vocab + 1} is more than the {vocab} tokens "
                                          rf"teacher.model_path=.* \({vocab + 8} output tokens\) and the policy "
                                          rf"\({vocab}\) share: set algorithm.opd.top_k to at most {vocab}"):
        run(None, small_demo_run(assets, tmp_path / "run2", *args, f"algorithm.opd.top_k={vocab + 1}"))


def test_top_k_without_opd_is_named_as_ignored():
    from shardrl.config.schema import load_config

    cfg = load_config(None, ["model.tiny={model_type: qwen2}", "algorithm.opd.top_k=8"])
    assert any(line.startswith("algorithm.opd.top_k=8 is set but algorithm.adv_estimator=grpo: no distillation runs")
               for line in cfg.ignored_settings())


def test_plan_counts_the_teachers_top_k(models, capsys):
    from shardrl.cli import main

    student, teacher, _ = models
    args = ["plan", f"model.path={student}", "algorithm.adv_estimator=opd", f"teacher.model_path={teacher}",
            "data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=64", "--json"]
    assert main(args) == 0
    assert "teacher top-k" not in {i["name"] for i in json.loads(capsys.readouterr().out)["memory"]["phases"]["prep"]
                                   ["items"]}
    assert main(args[:-1] + ["algorithm.opd.top_k=16", "--json"]) == 0
    items = {i["name"]: i for i in json.loads(capsys.readouterr().out)["memory"]["phases"]["prep"]["items"]}
    assert items["teacher top-k"]["gib"] * 2**30 == 32 * 64 * 16 * 8  # 32 samples x 64 tokens x 16 x (id, log-prob)
