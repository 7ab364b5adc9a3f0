"""On-policy distillation (algorithm.adv_estimator=opd): the teacher role, its per-token reverse-KL advantage against
a plain forward of both models, a short run, the refusal of a teacher with another tokenizer, and the teacher's
memory in `shardrl plan`."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardrl.testing import random_batch, run_distributed, save_char_model, small_demo_run


def plain_log_probs(folder: str, batch) -> torch.Tensor:
    """Each token's log-prob under the model in `folder`, from a plain HF forward (B, T); 0 where unscored."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * batch["loss_mask"]


def _prepared(student: str, teacher: str, kl_coef: float, reward_coef: float, vocab: int, baseline: str = "none"):
    """`prepare` of an opd step on one rank: the actor is `student`, the teacher `teacher` (built by the
    reference's path)."""
    from shardrl.config.schema import Config, EngineConfig, ModelConfig
    from shardrl.engine import build_engine
    from shardrl.plan.step_plan import StepPlan
    from shardrl.trainer.prepare import prepare
    from shardrl.trainer.roles import build_reference

    cfg = Config()
    cfg.model.path, cfg.teacher.model_path = student, teacher
    cfg.algorithm.adv_estimator = "opd"
    cfg.algorithm.opd.kl_coef, cfg.algorithm.opd.reward_coef = kl_coef, reward_coef
    cfg.algorithm.opd.baseline = baseline
    plan = StepPlan.from_config(cfg)
    assert plan.uses_teacher and not plan.old_from_update and "teacher" in plan.roles()
    engine_cfg = EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2)  # 3 forwards of 2
    actor = build_engine(ModelConfig(path=student), engine_cfg)
    roles = types.SimpleNamespace(actor=actor, mesh=actor.mesh,
                                  teacher=build_reference(cfg.model, engine_cfg, actor.mesh, teacher))
    batch = random_batch(6, 10, vocab, seed=3)
    batch["prompt_index"] = torch.tensor([0, 0, 0, 1, 1, 1])
    batch["sampled_log_probs"] = torch.zeros(6, 10)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    metrics = prepare(batch, scores, plan, roles, cfg.algorithm, 0.0, 1.0)
    return batch, scores, metrics


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tok = save_char_model(root / "student", seed=1)
    save_char_model(root / "teacher", seed=2, hidden_size=96, intermediate_size=192)  # another, wider model
    return root, len(tok)


def loo_baseline(values: torch.Tensor, mask: torch.Tensor, groups: list[int]) -> torch.Tensor:
    """The group baseline written out: at each real token, the mean of `values` over the other rows of its group
    that have a real token at that column (0 if none)."""
    out = torch.zeros_like(values)
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            others = [values[j, t] for j in range(values.shape[0])
                      if j != i and groups[j] == groups[i] and mask[j, t] > 0]
            if mask[i, t] > 0 and others:
                out[i, t] = sum(others) / len(others)
    return out


def test_opd_group_baseline_is_the_other_samples_mean_at_the_position():
    from shardrl.algos.advantages import compute_opd

    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(7, 6)
    for i, (start, end) in enumerate([(0, 6), (0, 3), (1, 5), (0, 6), (0, 2), (2, 6), (0, 4)]):
        mask[i, start:end] = 1  # ragged: some columns are reached by one sample of a group only
    groups = [4, 4, 4, 9, 9, 9, 2]  # row 6: a group of one (no baseline)
    student, teacher = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g) - 2
    scores = torch.tensor([1.0, 0, 1, 0, 0, 1, 1])
    reward = -0.5 * (student - teacher) * mask
    adv, ret = compute_opd(scores, mask, torch.tensor(groups), student, teacher, kl_coef=0.5, baseline="group")
    expected = (reward - loo_baseline(reward, mask, groups)) * mask
    torch.testing.assert_close(adv, expected)
    assert adv[6].equal(reward[6]) and (adv - reward).abs().max() > 0.1
    plain, _ = compute_opd(scores, mask, torch.tensor(groups), student, teacher, kl_coef=0.5)
    torch.testing.assert_close(plain, reward)  # the default: no baseline


@pytest.mark.multiproc
@pytest.mark.parametrize("reward_coef,baseline", [(0.0, "none"), (0.7, "none"), (0.7, "group")])
def test_opd_advantage_is_the_reverse_kl_of_a_plain_forward(models, reward_coef, baseline):
    root, vocab = models
    student, teacher = str(root / "student"), str(root / "teacher")
    batch, scores, metrics = run_distributed(_prepared, 1, student, teacher, 0.5, reward_coef, vocab, baseline)
    mask = batch["loss_mask"].float()
    s, t = plain_log_probs(student, batch), plain_log_probs(teacher, batch)
    assert (s - t).abs()[mask > 0].min() > 1e-4  # two different models: a KL to push along
    expected = -0.5 * (s - t) * mask  # (B, T)
    if baseline == "group":
        expected = expected - loo_baseline(expected, mask, batch["prompt_index"].tolist())
    groups = scores.view(2, 3)  # the verifier's GRPO advantage, written out: (score - group mean) / (std + eps)
    grpo = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(6, 1)
    expected = (expected + reward_coef * grpo) * mask
    torch.testing.assert_close(batch["advantages"], expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(batch["teacher_log_probs"] * mask, t, atol=2e-5, rtol=1e-4)
    kl_sum, count = metrics["distill/reverse_kl"]
    assert count == float(mask.sum())
    assert kl_sum == pytest.approx(float(((s - t) * mask).sum()), abs=1e-3)
    t_sum, _ = metrics["distill/teacher_log_prob"]
    assert t_sum == pytest.approx(float(t.sum()), abs=1e-3)


def spliced_batch(teacher: str, vocab: int):
    """A random batch whose response tokens at even columns are the teacher's greedy choice given what comes
    before (so some sampled tokens agree with the teacher's argmax, some do not), with two GRPO groups of 3."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    batch = random_batch(6, 10, vocab, seed=3)
    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    for col in range(0, ids.shape[1], 2):
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
        greedy = logits[:, col - 1].argmax(-1)
        ids[:, col] = torch.where(lm[:, col].bool(), greedy, ids[:, col])
    batch["prompt_index"] = torch.tensor([0, 0, 0, 1, 1, 1])
    batch["sampled_log_probs"] = torch.zeros(6, 10)
    return batch


def plain_top1(folder: str, batch) -> torch.Tensor:
    """1.0 where a scored token's logit is the largest of its position under a plain HF forward (B, T)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, am = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    top1 = torch.zeros(ids.shape)
    top1[:, 1:] = (logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) >= logits[:, :-1].max(-1).values).float()
    return top1 * batch["loss_mask"]


def _agreement(student: str, teacher: str, batch, micro: int):
    """`prepare` of an opd step on this rank's rows (rank r of 2 holds group r); the teacher-agreement metric
    summed over the ranks, and this rank's rows of the teacher's `top1`."""
    import torch.distributed as dist

    from shardrl.config.schema import Config, EngineConfig, ModelConfig
    from shardrl.engine import build_engine
    from shardrl.plan.step_plan import StepPlan
    from shardrl.trainer.prepare import prepare
    from shardrl.trainer.roles import build_reference

    cfg = Config()
    cfg.model.path, cfg.teacher.model_path, cfg.algorithm.adv_estimator = student, teacher, "opd"
    engine_cfg = EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=micro)
    actor = build_engine(ModelConfig(path=student), engine_cfg)
    teacher_engine = build_reference(cfg.model, engine_cfg, actor.mesh, teacher)
    roles = types.SimpleNamespace(actor=actor, mesh=actor.mesh, teacher=teacher_engine)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = batch.index(list(range(6))[rank * 6 // world: (rank + 1) * 6 // world])
    metrics = prepare(mine, torch.ones(len(mine)), StepPlan.from_config(cfg), roles, cfg.algorithm, 0.0, 1.0)
    total = torch.tensor(metrics["distill/teacher_argmax_agree"], dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist(), teacher_engine.infer_batch(mine, with_top1=True)["top1"]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,micro", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_teacher_argmax_agreement_matches_a_plain_forward(models, world, micro):
    root, vocab = models
    student, teacher = str(root / "student"), str(root / "teacher")
    batch = spliced_batch(teacher, vocab)
    expected = plain_top1(teacher, batch)
    mask = batch["loss_mask"].float()
    hits = float(expected.sum())
    assert 0 < hits < float(mask.sum())  # some sampled tokens are the teacher's argmax, some are not
    (agree, count), top1 = run_distributed(_agreement, world, student, teacher, batch, micro)
    assert count == float(mask.sum()) and agree == hits  # the same tokens, counted once, on any layout
    torch.testing.assert_close(top1 * mask[: len(top1)], expected[: len(top1)], atol=0, rtol=0)


def test_opd_runs_two_steps_with_a_tiny_teacher(tmp_path):
    from shardrl.launch.rank import run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    save_char_model(tmp_path / "teacher", seed=5)
    run_dir = run(None, small_demo_run(
        assets, tmp_path / "run", "algorithm.adv_estimator=opd", f"teacher.model_path={tmp_path / 'teacher'}",
        "teacher.engine.param_dtype=float32", "algorithm.opd.reward_coef=0.5", "trainer.total_steps=2",
        "trainer.logger=[jsonl]"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        # a random teacher is far from the warmed-up student: a positive KL estimate, log-probs well below 0
        assert r["distill/reverse_kl"] > 0.1 and r["distill/teacher_log_prob"] < -1.0
        assert "timing/teacher_s" in r and r["reward/mean"] >= 0
        assert 0 <= r["distill/teacher_argmax_agree"] < 0.5  # a random teacher's argmax is seldom what was sampled


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from shardrl.config.schema import ConfigError
    from shardrl.launch.rank import run
    from shardrl.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    save_char_model(tmp_path / "teacher")
    swapped = build_char_tokenizer(DEFAULT_ALPHABET[1] + DEFAULT_ALPHABET[0] + DEFAULT_ALPHABET[2:])
    swapped.save_pretrained(tmp_path / "teacher")  # the same size, other ids
    with pytest.raises(ConfigError, match=r"teacher.model_path=.* has a tokenizer that encodes unlike the "
                                          r"policy's: on-policy distillation needs the same tokenizer"):
        run(None, small_demo_run(assets, tmp_path / "run", "algorithm.adv_estimator=opd",
                                 f"teacher.model_path={tmp_path / 'teacher'}", "trainer.total_steps=1"))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


def test_opd_without_a_teacher_is_refused():
    from shardrl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="teacher.model_path.*is needed by algorithm.adv_estimator=opd"):
        load_config(None, ["model.tiny={model_type: qwen2}", "algorithm.adv_estimator=opd"])


def test_plan_shows_the_teachers_memory(models, capsys):
    from shardrl.cli import main

    root, _ = models
    args = ["plan", f"model.path={root / 'student'}", "algorithm.adv_estimator=opd",
            f"teacher.model_path={root / 'teacher'}", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["teacher"]["role"] == "teacher" and out["teacher"]["ppo_mini_batch_size"] is None  # forward only
    items = {i["name"]: i for i in out["memory"]["phases"]["gen"]["items"]}
    # the teacher's own size (fp32 master weights of the 96-wide teacher), not the student's
    import transformers

    teacher = transformers.AutoModelForCausalLM.from_pretrained(root / "teacher")
    count = sum(p.numel() for p in teacher.parameters())
    assert items["teacher params"]["gib"] * 2**30 == pytest.approx(count * 4)
    assert main(args[:-1] + ["teacher.engine.offload_params=true", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {i["name"]: i for i in out["memory"]["phases"]["gen"]["items"]}["teacher params"]["gib"] == 0
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert "teacher sharding" in text and "resident teacher params" in text


def _mopd_prepared(student: str, by_source: dict, default: str | None, batch):
    """`prepare` of an opd step with a teacher per data source, on this rank's rows (rank r of 2 holds group r)."""
    import torch.distributed as dist

    from shardrl.config.schema import Config, EngineConfig, ModelConfig
    from shardrl.engine import build_engine
    from shardrl.plan.step_plan import StepPlan
    from shardrl.trainer.prepare import prepare
    from shardrl.trainer.roles import build_reference
    from shardrl.trainer.teachers import Teachers

    cfg = Config()
    cfg.model.path, cfg.algorithm.adv_estimator = student, "opd"
    cfg.teacher.model_path, cfg.teacher.by_data_source = default, by_source
    engine_cfg = EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=2)
    actor = build_engine(ModelConfig(path=student), engine_cfg)
    teachers = Teachers(cfg, lambda path: build_reference(cfg.model, engine_cfg, actor.mesh, path))
    roles = types.SimpleNamespace(actor=actor, mesh=actor.mesh, teacher=teachers)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = batch.index(list(range(6))[rank * 6 // world: (rank + 1) * 6 // world])
    prepare(mine, torch.ones(len(mine)), StepPlan.from_config(cfg), roles, cfg.algorithm, 0.0, 1.0)
    return mine["teacher_log_probs"], len(teachers.engines)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_mopd_scores_each_row_with_its_data_sources_teacher(models, tmp_path, world):
    root, vocab = models
    save_char_model(tmp_path / "teacher_b", seed=4, hidden_size=32, intermediate_size=64)
    save_char_model(tmp_path / "teacher_c", seed=6)
    student = str(root / "student")
    paths = {"a": str(root / "teacher"), "b": str(tmp_path / "teacher_b"), "c": str(tmp_path / "teacher_c")}
    batch = random_batch(6, 10, vocab, seed=3)
    batch["prompt_index"] = torch.tensor([0, 0, 0, 1, 1, 1])
    batch["sampled_log_probs"] = torch.zeros(6, 10)
    # rank 1 of 2 has no row of "a": it still runs a's teacher (its forwards are collective), with no rows
    batch["data_source"] = ["a", "b", "c", "b", "c", "c"]
    # "c" has no entry: the default teacher (teacher.model_path) scores it; "a" and "d" share a folder (one engine)
    by_source = {"a": paths["a"], "b": paths["b"], "d": paths["a"]}
    got, engines = run_distributed(_mopd_prepared, world, student, by_source, paths["c"], batch)
    assert engines == 3
    mask = batch["loss_mask"].float()
    own = {name: plain_log_probs(path, batch) for name, path in paths.items()}
    assert (own["a"] - own["b"]).abs()[mask > 0].min() > 1e-4  # different teachers: a wrong route shows
    rows = range(3) if world == 2 else range(6)  # rank 0's rows
    expected = torch.stack([own[batch["data_source"][i]][i] for i in rows])
    torch.testing.assert_close(got * mask[: len(got)], expected, atol=2e-5, rtol=1e-4)


def test_mopd_refuses_a_data_source_without_a_teacher_at_start(tmp_path):
    from shardrl.config.schema import ConfigError
    from shardrl.launch.rank import run
    from shardrl.trainer.demo import prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)  # its rows' data_source: "arith"
    save_char_model(tmp_path / "teacher")
    with pytest.raises(ConfigError, match=r"teacher.by_data_source names no teacher for the training data's "
                                          r"data_source 'arith' \(it names math\) and teacher.model_path is unset"):
        run(None, small_demo_run(assets, tmp_path / "run", "algorithm.adv_estimator=opd",
                                 f"teacher.by_data_source={{math: {tmp_path / 'teacher'}}}", "trainer.total_steps=1"))


def test_plan_counts_every_mopd_teacher(models, tmp_path, capsys):
    import transformers

    from shardrl.cli import main

    root, _ = models
    save_char_model(tmp_path / "teacher_b", seed=4, hidden_size=32, intermediate_size=64)
    args = ["plan", f"model.path={root / 'student'}", "algorithm.adv_estimator=opd",
            f"teacher.by_data_source={{math: {root / 'teacher'}, code: {tmp_path / 'teacher_b'}, "
            f"chat: {root / 'teacher'}}}", "--json"]
    assert main(args) == 0
    items = {i["name"]: i for i in json.loads(capsys.readouterr().out)["memory"]["phases"]["gen"]["items"]}
    count = sum(sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(f).parameters())
                for f in (root / "teacher", tmp_path / "teacher_b"))  # two folders: chat shares math's
    assert items["teacher params"]["gib"] * 2**30 == pytest.approx(count * 4)
    assert items["teacher params"]["how"].startswith("2 teachers: ")


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (None, 0.7), (5.0, 1.3)])
def test_top1_is_the_argmax_of_the_logits_across_chunks(softcap, temperature):
    from shardrl.engine.logprob import chunked_log_probs, chunked_log_probs_top1

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(11, 8, generator=g), torch.randn(13, 8, generator=g)
    logits = hidden @ weight.T
    targets = torch.randint(0, 13, (11,), generator=g)
    targets[::2] = logits[::2].argmax(-1)  # half of them the argmax
    lp, ent, top1 = chunked_log_probs_top1(hidden, weight, None, targets, temperature, 4, True, softcap)
    ref_lp, ref_ent = chunked_log_probs(hidden, weight, None, targets, temperature, 4, True, softcap)
    torch.testing.assert_close((lp, ent), (ref_lp, ref_ent), atol=1e-4, rtol=1e-4)  # (two ways to the entropy)
    assert top1.tolist() == (targets == logits.argmax(-1)).tolist() and top1[::2].all() and not top1.all()


def test_opd_baseline_is_group_unless_set_and_checked():
    from shardrl.config.schema import ConfigError, load_config

    base = ["model.tiny={model_type: qwen2}", "algorithm.adv_estimator=opd", "teacher.model_path=/t"]
    assert load_config(None, base).algorithm.opd.baseline == "group"
    with pytest.raises(ConfigError, match=r"algorithm.opd.baseline='mean': must be none or group"):
        load_config(None, [*base, "algorithm.opd.baseline=mean"])


def test_one_mopd_teacher_still_refuses_a_row_it_does_not_cover():
    from shardrl.config.schema import Config, ConfigError
    from shardrl.trainer.teachers import Teachers

    cfg = Config()
    cfg.teacher.by_data_source = {"math": "/m"}
    calls = []
    teachers = Teachers(cfg, lambda path: types.SimpleNamespace(infer_batch=lambda b, **kw: calls.append(b)))
    batch = random_batch(2, 5, 10)
    batch["data_source"] = ["math", "chat"]  # e.g. an agent's row: not in the training data the start checked
    with pytest.raises(ConfigError, match="no teacher for data_source 'chat': add it to teacher.by_data_source"):
        teachers.infer_batch(batch)
    assert calls == []


def test_demo_tasks_reverse_and_keep_the_sums_and_products(tmp_path):
    """bench/distill.py's reversal task: every string of 3 or 4 letters of "abc", its answer reversed (3 or 4
    tokens); the demo's sums and the products keep their prompts and answers; an unknown task is refused."""
    import json

    from shardrl.trainer.demo import REVERSE, demo_problems, prepare_demo_assets

    rev = demo_problems(REVERSE)
    assert len(rev) == 3 ** 3 + 3 ** 4
    assert rev["abca="] == "acba" and rev["aab="] == "baa" and rev["cbaa="] == "aabc"
    sums, products = demo_problems("+"), demo_problems("*")
    assert len(sums) == 55 and sums["3+4="] == "7" and "5+5=" not in sums
    assert len(products) == 100 and products["7*8="] == "56"
    with pytest.raises(ValueError, match="demo op must be"):
        demo_problems("-")
    assets = prepare_demo_assets(tmp_path / "rev", warmup_steps=1, op=REVERSE)
    rows = [json.loads(line) for line in open(assets / "train.jsonl")]
    assert rows[1] == {"prompt": "aab=", "data_source": "arith", "ground_truth": "baa"}
