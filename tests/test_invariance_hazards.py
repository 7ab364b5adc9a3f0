"""The cut-invariance contract where the other tests do not reach: ranks holding different numbers of samples
and tokens (5 and 3 rows, one row without loss tokens), so that a rank runs placeholder micro-batches and
micro-batches with no loss token, under every loss aggregation mode, fixed and token-budget micro-batches; the
actor's whole loss (clip with dual-clip, entropy bonus, KL loss) and its metrics; the critic's clipped value loss
and its metrics; a non-finite gradient on one rank only; PPO epochs over shuffled mini-batches; the same under
Ulysses and HSDP on 4 processes; and step metrics that only some ranks name (a reward function's own key).

The reference is written here: one process, the plain HF model on the whole (mini-)batch, one backward (and torch's
AdamW where steps follow steps). Gradients are compared, not parameters after AdamW (its first step is about
lr * sign(g), which hides a wrong scale). fp32 on CPU, gloo; one spawn for all the 2-process engine runs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardrl.testing import TINY_MODELS, random_batch, run_distributed

pytestmark = pytest.mark.multiproc

KIND = TINY_MODELS["qwen2"]
NUM_SEQS, MAX_LEN = 8, 14
SPLIT = 5  # rank 0 holds rows [0, 5), rank 1 rows [5, 8)
EMPTY_ROW = 6  # a row of rank 1 with no loss tokens
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LAYOUTS = {
    "mb1": dict(micro_batch_size_per_gpu=1),  # rank 1: 3 real micro-batches (one with no loss token), 2 fillers
    "mb2": dict(micro_batch_size_per_gpu=2),
    "mb1_unsharded": dict(micro_batch_size_per_gpu=1, accumulate_unsharded=True),  # one reduction, after the last
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24),
    # two replicas of the whole model (HSDP, shards of 1): the gradients accumulate unreduced by default
    "replicated_dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24, fsdp_size=1),
}
# on 4 processes: Ulysses (sp=2: two data-parallel ranks of 5 and 3 rows) and HSDP (4 data-parallel ranks, the
# rows cut 3/2/2/1: the rank of 1 row runs placeholders, a rank holds the row without loss tokens)
LAYOUTS_4 = {
    "sp2_mb1": dict(micro_batch_size_per_gpu=1, ulysses_sequence_parallel_size=2),
    "sp2_dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=12, ulysses_sequence_parallel_size=2),
    "hsdp_mb1": dict(micro_batch_size_per_gpu=1, fsdp_size=2),
}
CUTS = {2: [0, SPLIT, NUM_SEQS], 4: [0, 3, 5, 7, NUM_SEQS]}  # data-parallel size -> the rows of each dp rank
ACTOR = dict(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5, entropy_coeff=0.01, use_kl_loss=True,
             kl_loss_coef=0.1, kl_loss_type="low_var_kl")
CLIPRANGE_VALUE = 0.05
FROZEN = dict(lr=1e-30, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.0, clip_grad=0.0)  # steps leave the init
MOVING = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.01, clip_grad=0.0)
GRAD_RTOL = 1e-5  # of the largest gradient entry
PPO_MINI, PPO_EPOCHS, SHUFFLE_SEED = 2, 2, 7  # per rank: 4 rows -> 2 mini-batches an epoch


# ---------------------------------------------------------------- the plain reference (this process)

def plain_model():
    from shardrl.engine.model import build_causal_lm, load_hf_config

    return build_causal_lm(load_hf_config(None, KIND), None, "cpu", torch.float32, seed=0)


def value_head(hidden_size: int, seed: int = 0) -> nn.Linear:
    """The critic's new head as the engine makes it (`Engine._value_head_init`): normal(0, 1/sqrt(H)), seed + 1."""
    head = nn.Linear(hidden_size, 1)
    with torch.no_grad():
        torch.manual_seed(seed + 1)
        nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden_size))
        head.bias.zero_()
    return head


def plain_forward(model, batch, head: nn.Linear | None = None) -> dict:
    """log_probs and entropy (or a critic's values) `(B, T)` on the token they score, from the padded batch."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    if head is not None:
        hidden = model.model(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
        v = head(hidden).squeeze(-1)  # (B, T)
        return {"values": F.pad(v[:, :-1], (1, 0))}
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()  # (B, T, V)
    logp_all = F.log_softmax(logits[:, :-1], -1)
    logp = F.pad(logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    entropy = F.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    return {"log_probs": logp, "entropy": entropy}


def actor_cfg():
    from shardrl.config.schema import ActorConfig

    return ActorConfig(**ACTOR)


def reference(loss_fn, batch, head=None, model=None) -> dict:
    """One backward of `loss_fn` on the whole batch: the gradients by HF name and each metric's value."""
    from shardrl.metrics import metric_value

    model = model or plain_model()
    outputs = plain_forward(model, batch, head)
    loss, metrics = loss_fn(outputs, batch, batch["loss_mask"].sum().double(), torch.tensor(float(len(batch))))
    loss.backward()
    named = list(model.named_parameters()) + ([] if head is None else
                                              [(f"value_head.{n}", p) for n, p in head.named_parameters()])
    grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
    return {"grads": grads, "metrics": {"loss": float(loss), **{k: metric_value(v) for k, v in metrics.items()}}}


def make_batch():
    """Random rows, one without loss tokens, with old / reference / sampler log-probs and old values off the
    plain model's, so that clips, dual clips, the KL and the value clip are all active somewhere."""
    batch = random_batch(NUM_SEQS, MAX_LEN, KIND["vocab_size"], seed=11, min_len=4)
    batch["loss_mask"][EMPTY_ROW] = 0
    batch["advantages"][EMPTY_ROW] = 0
    mask = batch["loss_mask"].float()
    g = torch.Generator().manual_seed(12)
    noise = lambda scale: scale * torch.randn(mask.shape, generator=g) * mask  # noqa: E731
    with torch.no_grad():
        logp = plain_forward(plain_model(), batch)["log_probs"] * mask
        model = plain_model()
        values = plain_forward(model, batch, value_head(model.config.hidden_size))["values"] * mask
    batch["old_log_probs"] = logp + noise(0.3)
    batch["ref_log_probs"] = logp + noise(0.2)
    batch["sampled_log_probs"] = logp + noise(0.1)
    batch["old_values"] = values + noise(0.1)
    batch["returns"] = noise(1.0)
    return batch


def ppo_reference(batch) -> list[dict]:
    """`run_updates` over PPO_EPOCHS epochs, shuffled, as the plain loop sees it: the mini-batch of a step holds
    each rank's piece of it (each rank shuffles its own rows with the same generator); AdamW steps."""
    from shardrl.trainer.updates import actor_loss_fn

    model = plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=MOVING["lr"], betas=MOVING["betas"], eps=MOVING["eps"],
                            weight_decay=MOVING["weight_decay"])
    gen = torch.Generator().manual_seed(SHUFFLE_SEED)
    half = NUM_SEQS // 2
    steps = []
    for _ in range(PPO_EPOCHS):
        order = torch.randperm(half, generator=gen)
        for j in range(half // PPO_MINI):
            rows = [r * half + int(i) for r in range(2) for i in order[j * PPO_MINI:(j + 1) * PPO_MINI]]
            opt.zero_grad(set_to_none=True)
            steps.append(reference(actor_loss_fn(actor_cfg(), "token-mean"), batch.index(rows), model=model))
            opt.step()
    return steps


# ---------------------------------------------------------------- the engine runs (2 processes)

def _engine(engine_kwargs: dict, optim: dict, head: str = "lm"):
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import record_grads

    engine = build_engine(ModelConfig(tiny=KIND), EngineConfig(param_dtype="float32", logprob_chunk_size=7,
                                                               **engine_kwargs), OptimConfig(**optim), head=head)
    return engine, record_grads(engine)


def _dp_share(batch, engine):
    cuts = CUTS[engine.mesh.dp_size]
    return batch.index(list(range(cuts[engine.mesh.dp_rank], cuts[engine.mesh.dp_rank + 1])))


def _layout_runs(batch, layouts: dict, modes=MODES, critic_modes=("token-mean", "seq-mean-token-sum")) -> dict:
    """Each layout's actor and critic steps on this rank's unequal share (`CUTS`)."""
    from shardrl.config.schema import CriticConfig
    from shardrl.trainer.updates import actor_loss_fn, critic_loss_fn

    out = {}
    for lname, kwargs in layouts.items():
        actor, grads = _engine(kwargs, FROZEN)
        mine = _dp_share(batch, actor)
        for mode in modes:
            metrics = actor.train_batch(mine, actor_loss_fn(actor_cfg(), mode, with_ref=True), with_entropy=True)
            out["actor", lname, mode] = {"grads": grads[-1], "metrics": metrics}
        metrics = actor.train_batch(mine, actor_loss_fn(actor_cfg(), "token-mean", old_from_forward=True,
                                                        with_ref=True), with_entropy=True)
        out["actor_fwd", lname, "token-mean"] = {"grads": grads[-1], "metrics": metrics}
        critic, grads = _engine(kwargs, FROZEN, head="value")
        for mode in critic_modes:
            cfg = CriticConfig(cliprange_value=CLIPRANGE_VALUE)
            metrics = critic.train_batch(mine, critic_loss_fn(cfg, mode))
            out["critic", lname, mode] = {"grads": grads[-1], "metrics": metrics}
    return out


def _runs(batch) -> dict:
    import torch.distributed as dist

    from shardrl.trainer.updates import actor_loss_fn, run_updates

    rank = dist.get_rank()
    mine = batch.index(list(range(SPLIT)) if rank == 0 else list(range(SPLIT, NUM_SEQS)))
    out = _layout_runs(batch, LAYOUTS)

    # a non-finite gradient on rank 1 only: both ranks skip the step, and the next step is a clean one
    for lname in ("mb2", "mb1_unsharded"):
        engine, grads = _engine(LAYOUTS[lname], MOVING)
        before = {k: v.clone() for k, v in engine.export_weights()}
        poisoned = mine.index(list(range(len(mine))))
        if rank == 1:
            poisoned["advantages"][0, -1] = float("nan")  # a real token of the rank's first row
        loss_fn = actor_loss_fn(actor_cfg(), "token-mean", with_ref=True)
        skipped = engine.train_batch(poisoned, loss_fn, with_entropy=True)
        after = {k: v.clone() for k, v in engine.export_weights()}
        state = (engine.global_step, engine.lr_scheduler.last_epoch, len(grads))
        clean = engine.train_batch(mine, loss_fn, with_entropy=True)
        flags = [None, None]
        dist.all_gather_object(flags, (skipped["skipped_step"], state))
        moved = max(float((after[k] - v).abs().max()) for k, v in before.items())
        out["skip", lname] = {"flags": flags, "moved": moved, "skipped": skipped, "clean": clean, "grads": grads}

    # PPO epochs over shuffled mini-batches (equal shares: every rank runs the same number of steps)
    engine, grads = _engine(dict(micro_batch_size_per_gpu=1), MOVING)
    half = batch.index(list(range(rank * NUM_SEQS // 2, (rank + 1) * NUM_SEQS // 2)))
    metrics = run_updates(engine, half, actor_loss_fn(actor_cfg(), "token-mean"), PPO_MINI, PPO_EPOCHS, True,
                          torch.Generator().manual_seed(SHUFFLE_SEED), "actor", with_entropy=True)
    out["ppo"] = {"grads": grads, "metrics": metrics}
    return out


@pytest.fixture(scope="module")
def batch():
    return make_batch()


@pytest.fixture(scope="module")
def runs(batch):
    return run_distributed(_runs, 2, batch)


@pytest.fixture(scope="module")
def runs_4(batch):
    return run_distributed(_layout_runs, 4, batch, LAYOUTS_4, ("token-mean", "seq-mean-token-mean"), ("token-mean",))


def assert_same_grads(got: dict, want: dict, what: str = "", rtol: float = GRAD_RTOL):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    scale = max(w.abs().max().item() for w in want.values())
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        assert diff <= rtol * scale, f"{what} {name}: max |grad diff| {diff:.3g} > {rtol} x max |grad| {scale:.3g}"


def assert_same_metrics(got: dict, want: dict, what: str = ""):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (what, key, got[key], value)


# ---------------------------------------------------------------- the tests

def test_the_batch_is_a_hard_case(batch):
    mask = batch["loss_mask"]
    assert int(mask[EMPTY_ROW].sum()) == 0 and int(mask[:SPLIT].sum()) != int(mask[SPLIT:].sum())
    # rank 1 does hold a micro-batch of 1 row with no loss tokens, and fewer rows than rank 0
    assert SPLIT <= EMPTY_ROW < NUM_SEQS and NUM_SEQS - SPLIT < SPLIT


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_actor_update_and_metrics_with_unequal_ranks(runs, batch, layout, mode):
    from shardrl.trainer.updates import actor_loss_fn

    want = reference(actor_loss_fn(actor_cfg(), mode, with_ref=True), batch)
    # a comparison worth making: every term is non-trivial
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/kl_loss", "actor/entropy_loss"):
        assert want["metrics"][key] > 0, key
    got = runs["actor", layout, mode]
    assert_same_grads(got["grads"], want["grads"], f"{layout} {mode}")
    assert_same_metrics(got["metrics"], want["metrics"], f"{layout} {mode}")
    terms = want["metrics"]
    total = terms["actor/pg_loss"] - 0.01 * terms["actor/entropy_loss"] + 0.1 * terms["actor/kl_loss"]
    assert got["metrics"]["loss"] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
@pytest.mark.parametrize("mode", ("token-mean", "seq-mean-token-mean"))
def test_actor_and_critic_under_ulysses_and_hsdp_with_unequal_ranks(runs_4, batch, layout, mode):
    from shardrl.config.schema import CriticConfig
    from shardrl.trainer.updates import actor_loss_fn, critic_loss_fn

    got, want = runs_4["actor", layout, mode], reference(actor_loss_fn(actor_cfg(), mode, with_ref=True), batch)
    assert_same_grads(got["grads"], want["grads"], f"{layout} {mode}")
    assert_same_metrics(got["metrics"], want["metrics"], f"{layout} {mode}")
    want = reference(actor_loss_fn(actor_cfg(), "token-mean", old_from_forward=True, with_ref=True), batch)
    assert_same_metrics(runs_4["actor_fwd", layout, "token-mean"]["metrics"], want["metrics"], layout)
    if mode == "token-mean":
        model = plain_model()
        want = reference(critic_loss_fn(CriticConfig(cliprange_value=CLIPRANGE_VALUE), mode), batch,
                         head=value_head(model.config.hidden_size), model=model)
        got = runs_4["critic", layout, mode]
        assert_same_grads(got["grads"], want["grads"], f"critic {layout}")
        assert_same_metrics(got["metrics"], want["metrics"], f"critic {layout}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_actor_metrics_of_the_update_forward(runs, batch, layout):
    from shardrl.trainer.updates import actor_loss_fn

    want = reference(actor_loss_fn(actor_cfg(), "token-mean", old_from_forward=True, with_ref=True), batch)
    assert {"actor/entropy", "kl/actor_ref", "rollout/kl", "rollout/k3_kl"} <= set(want["metrics"])
    got = runs["actor_fwd", layout, "token-mean"]
    assert_same_grads(got["grads"], want["grads"], layout)
    assert_same_metrics(got["metrics"], want["metrics"], layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ("token-mean", "seq-mean-token-sum"))
def test_critic_update_and_metrics_with_unequal_ranks(runs, batch, layout, mode):
    from shardrl.config.schema import CriticConfig
    from shardrl.trainer.updates import critic_loss_fn

    model = plain_model()
    want = reference(critic_loss_fn(CriticConfig(cliprange_value=CLIPRANGE_VALUE), mode), batch,
                     head=value_head(model.config.hidden_size), model=model)
    assert 0 < want["metrics"]["critic/vf_clipfrac"] < 1
    got = runs["critic", layout, mode]
    assert_same_grads(got["grads"], want["grads"], f"{layout} {mode}")
    assert_same_metrics(got["metrics"], want["metrics"], f"{layout} {mode}")


@pytest.mark.parametrize("layout", ("mb2", "mb1_unsharded"))
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(runs, batch, layout):
    from shardrl.trainer.updates import actor_loss_fn

    got = runs["skip", layout]
    # both ranks skipped, stepped neither the optimizer nor the schedule, and the weights did not move
    assert got["flags"] == [(1.0, (0, 0, 0))] * 2, got["flags"]
    assert got["moved"] == 0.0 and not math.isfinite(got["skipped"]["grad_norm"])
    # the next step starts from clean gradients: the plain loop's on the same weights
    assert got["clean"]["skipped_step"] == 0.0 and len(got["grads"]) == 1
    want = reference(actor_loss_fn(actor_cfg(), "token-mean", with_ref=True), batch)
    assert_same_grads(got["grads"][0], want["grads"], layout)
    assert got["clean"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5)


def test_ppo_epochs_over_shuffled_mini_batches(runs, batch):
    want = ppo_reference(batch)
    got = runs["ppo"]
    assert len(got["grads"]) == len(want) == PPO_EPOCHS * (NUM_SEQS // 2 // PPO_MINI)
    for i, (g, w) in enumerate(zip(got["grads"], want)):
        assert_same_grads(g, w["grads"], f"step {i}", rtol=1e-4)  # after AdamW steps: rounding grows
    # the logged numbers are the steps' mean
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        mean = sum(w["metrics"][key] for w in want) / len(want)
        assert got["metrics"][key] == pytest.approx(mean, rel=1e-4), key


# ---------------------------------------------------------------- metrics whose keys differ between ranks

def _reduce_with_rank_keys() -> list[dict]:
    """Each rank's `reduce_metrics` of what a step of a two-dataset run gives: every rank names the common keys, a
    rank names a reward function's own key only where one of its samples came from that function's dataset, and a
    rank whose samples have no loss token (`value_metrics`) names no per-token statistic."""
    import torch.distributed as dist

    from shardrl.metrics import Max, Min, Sum, SumCount, reduce_metrics

    rank = dist.get_rank()
    common = {"reward/mean": SumCount([3.0, 1.0][rank], 4.0), "reward/num_errors": Sum([1.0, 2.0][rank]),
              "kl/coef": 0.1}
    own = ({"reward/acc": SumCount(3.0, 4.0), "critic/returns/max": Max(2.0), "critic/returns/min": Min(-1.0),
            "multi_turn/num_turns_mean": 2.0} if rank == 0 else {"reward/pass_rate": SumCount(1.0, 4.0)})
    got = reduce_metrics({**common, **own}, dist.group.WORLD)
    every = [None, None]
    dist.all_gather_object(every, got)
    try:  # one key reduced two ways is a clear error on every rank
        reduce_metrics({"x": Sum(1.0) if rank == 0 else SumCount(1.0, 2.0)}, dist.group.WORLD)
        error = None
    except ValueError as e:
        error = str(e)
    errors = [None, None]
    dist.all_gather_object(errors, error)
    return every, errors


def test_metrics_named_by_some_ranks_only_are_reduced_by_name():
    every, errors = run_distributed(_reduce_with_rank_keys, 2)
    want = {"reward/mean": 0.5, "reward/num_errors": 3.0, "kl/coef": 0.1, "reward/acc": 0.75,
            "reward/pass_rate": 0.25, "critic/returns/max": 2.0, "critic/returns/min": -1.0,
            "multi_turn/num_turns_mean": 2.0}  # a plain number: the mean over the ranks that name it
    for got in every:  # every rank logs the same numbers, each under its own name
        assert got == pytest.approx(want), got
    assert all(e is not None and "'x'" in e for e in errors), errors


def _reward_step_metrics(items: list[dict], rows: list[int] | None) -> dict:
    """The step's reward metrics as the trainer logs them (`batch_metrics`, then `reduce_metrics`) for this rank's
    `rows` of `items` (None: all, one process)."""
    import torch.distributed as dist

    from shardrl.batch import Batch
    from shardrl.metrics import reduce_metrics
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.rl import batch_metrics

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "code":  # a dataset whose function has no "acc"
            return {"score": 0.5, "tests_passed": 3.0}
        return {"score": float(solution_str == ground_truth), "acc": float(solution_str == ground_truth)}

    if rows is None:
        rows = list(range(len(items)))
    elif dist.get_rank() == 1:
        rows = [i for i in range(len(items)) if i not in rows]
    mine = [items[i] for i in rows]
    scores, reward_metrics, _ = RewardManager(fn).score_with_values(mine)
    n = len(mine)
    batch = Batch({"response_mask": torch.ones(n, 3, dtype=torch.long), "attention_mask": torch.ones(n, 5),
                   "prompt_index": torch.arange(n)})
    group = dist.group.WORLD if dist.is_initialized() else None
    return reduce_metrics(batch_metrics(batch, scores, reward_metrics, 3), group)


def test_a_reward_functions_own_metric_is_its_mean_over_the_samples_that_have_it_whatever_the_ranks():
    def item(source, answer):
        return {"data_source": source, "response_text": answer, "extra": {"ground_truth": "7"}}

    # rank 0: one math sample (right) and three code samples; rank 1: four math samples, all wrong
    items = [item("math", "7"), item("code", ""), item("code", ""), item("code", ""),
             item("math", "1"), item("math", "2"), item("math", "3"), item("math", "4")]
    one = _reward_step_metrics(items, None)
    assert one["reward/acc"] == pytest.approx(1 / 5) and one["reward/tests_passed"] == pytest.approx(3.0)
    two = run_distributed(_reward_step_metrics, 2, items, [0, 1, 2, 3])
    for key in ("reward/acc", "reward/tests_passed", "reward/mean"):
        assert two[key] == pytest.approx(one[key]), (key, two[key], one[key])
