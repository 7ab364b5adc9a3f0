"""Every logged metric is a property of the step's batch, not of how it was cut: the same step-1 record
for micro-batches of 1, 4 or a token budget, and for 1 or 2 processes (data or sequence parallel); metrics
over ranks are global (token means, extremes); the adaptive KL coefficient is the same on every rank; and
a step that leaves diverged weights stops the run with an error naming the learning rate.

Sampling: the rollout seed is per data-parallel rank and the HF sampler draws from one stream per batch,
so 1 and 2 processes would sample different responses. The runs compared here decode greedily (all
prompts have the same length, so no padding differs either) and use GAE with a critic, which gives
non-zero advantages without sampling: the batch is the same whatever the layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardrl.testing import run_distributed
from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

pytestmark = pytest.mark.multiproc

# keys that describe the layout or the clock, not the batch; everything else must match
LAYOUT_KEYS = ("actor/num_micro_batches", "critic/num_micro_batches",
               "memory/gen_peak_gib", "memory/prep_peak_gib", "memory/update_peak_gib")  # per GPU, on GPUs only
TIMING_PREFIX = "timing/"
# rates over the step's time; perf/step_tflop and perf/total_num_tokens are the batch's and stay compared
CLOCK_KEYS = ("perf/tokens_per_s_per_gpu", "perf/tflop_per_s_per_gpu", "perf/mfu_measured", "perf/mfu_spec")
# sampler vs trainer: here both are fp32 and agree to ~1e-7, so these measure rounding, whose summation order
# the cut decides; compared to 1e-5 (a real mismatch, e.g. a bf16 sampler, is ~1e-2)
ROUNDING_KEYS = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/kl", "rollout/k3_kl")
# verl's critic/ statistics of values and GAE returns: the values of a forward pass whose micro-batching differs
# differ in the last float32 bits, and a return near 0 has no relative tolerance to speak of
VALUE_KEYS = tuple(f"critic/{name}/{stat}" for name in ("values", "returns", "advantages")
                   for stat in ("mean", "max", "min")) + ("critic/vf_explained_var",)


def layout_free(keys) -> list[str]:
    """The keys a step's batch decides, sorted."""
    return sorted(k for k in keys if k not in LAYOUT_KEYS + CLOCK_KEYS and not k.startswith(TIMING_PREFIX))

LAYOUTS = {
    "micro1": ["actor.engine.micro_batch_size_per_gpu=1", "critic.engine.micro_batch_size_per_gpu=1",
               "ref.engine.micro_batch_size_per_gpu=1"],
    "micro4": ["actor.engine.micro_batch_size_per_gpu=4", "critic.engine.micro_batch_size_per_gpu=4",
               "ref.engine.micro_batch_size_per_gpu=4"],
    # sequences are 8 tokens: about 2 per micro-batch, cut by length and balanced
    "dynamic": [f"{role}.engine.{k}" for role in ("actor", "critic", "ref")
                for k in ("use_dynamic_bsz=true", "max_token_len_per_gpu=20")],
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # enough warm-up that greedy answers are a digit and EOS, some of them right
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=30)


# the built-in arith score, failing (scored 0 all the same) on wrong answers to odd sums, with a key of its own:
# reward/num_errors and reward/correct must not depend on the layout either
REWARD = """
from shardrl.rewards.manager import arith_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = arith_score(data_source, solution_str, ground_truth)
    if score == 0.0 and int(str(ground_truth).strip()) % 2 == 1:
        raise ValueError("a wrong answer to an odd sum")
    return {"score": score, "correct": score}
"""


def step_overrides(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    """One PPO step whose batch does not depend on the layout (greedy decoding, GAE), with non-trivial loss
    metrics: two epochs over one mini-batch (the whole batch, so no shuffle decides what a mini-batch holds)
    and a tight clip range make the clip fraction > 0; the entropy bonus and the KL loss are on."""
    reward = assets / "flaky_reward.py"
    if not reward.exists():
        reward.write_text(REWARD)
    return demo_overrides(assets) + [
        f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]", "trainer.val_freq=0", "trainer.total_steps=1",
        f"reward.function_path={reward}", "data.train_batch_size=8", "rollout.n=1", "rollout.temperature=0", "algorithm.adv_estimator=gae",
        "actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2", "actor.optim.lr=1e-3",
        "actor.clip_ratio_low=0.01", "actor.clip_ratio_high=0.01", "actor.clip_ratio_c=1.05",
        "actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.engine.use_dynamic_bsz=false",
        "critic.ppo_mini_batch_size=8", "critic.ppo_epochs=2", "critic.optim.lr=1e-2", "critic.cliprange_value=0.01",
        "critic.engine.param_dtype=float32", "ref.engine.param_dtype=float32", *extra]


def _train_runs(runs: list[list[str]]) -> list[dict]:
    """Runs each override list as a whole training run on these processes; returns each step-1 record."""
    import torch.distributed as dist

    from shardrl.launch.rank import run

    records = []
    for overrides in runs:
        run_dir = run(None, overrides)
        if dist.get_rank() == 0:  # the writer: the file is complete once its run returns
            with open(run_dir / "metrics.jsonl") as f:
                records.append(json.loads(f.readline()))
    return records


def test_step_metrics_do_not_depend_on_micro_batching_or_world_size(assets, tmp_path):
    one = run_distributed(_train_runs, 1, [step_overrides(assets, tmp_path / f"w1_{name}", *layout)
                                           for name, layout in LAYOUTS.items()])
    # sp=2: one data-parallel rank of two sequence pieces; with one sample per micro-batch every row is cut
    # inside a sequence (the actor once ran the rollout's attention on its piece only: log-probs off by ~3)
    sp2 = [f"{role}.engine.ulysses_sequence_parallel_size=2" for role in ("actor", "critic", "ref")]
    two_layouts = {"dp2_micro4": LAYOUTS["micro4"], "dp2_dynamic": LAYOUTS["dynamic"],
                   "sp2_micro1": LAYOUTS["micro1"] + sp2}
    two = run_distributed(_train_runs, 2, [step_overrides(assets, tmp_path / name, *layout)
                                           for name, layout in two_layouts.items()])
    names = [f"w1_{n}" for n in LAYOUTS] + list(two_layouts)
    records = dict(zip(names, one + two))
    want = records["w1_micro1"]
    # a run worth comparing: the loss metrics are not trivially 0, and rewards differ within the batch
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/entropy_loss",
                "actor/kl_loss", "perf/step_tflop", "perf/total_num_tokens", "prompt/length_mean",
                "critic/vf_loss", "adv/abs_mean", "actor/grad_norm", "critic/grad_norm", "reward/mean",
                "reward/num_errors", "reward/correct"):
        assert want[key] != 0.0 and math.isfinite(want[key]), key
    assert 0 < want["actor/pg_clipfrac"] < 1 and (want["reward/min"], want["reward/max"]) == (0.0, 1.0)
    for key in ("actor/pg_clipfrac_lower", "critic/vf_clipfrac"):  # logged and compared, 0 in this run
        assert key in want
    # the engine's loss is the sum of the terms it logs
    terms = want["actor/pg_loss"] - 0.01 * want["actor/entropy_loss"] + 0.001 * want["actor/kl_loss"]
    assert want["actor/loss"] == pytest.approx(terms, rel=1e-6)
    assert want["critic/loss"] == pytest.approx(want["critic/vf_loss"], rel=1e-6)
    assert records["w1_micro1"]["actor/num_micro_batches"] == 8 and records["w1_micro4"]["actor/num_micro_batches"] == 2
    compared = layout_free(want)
    assert {"response/length_max", "response/length_min", "perf/step_tflop", "actor/entropy",
            *ROUNDING_KEYS, *VALUE_KEYS, "critic/rewards/mean", "prompt/length_max"} <= set(compared)
    for name, got in records.items():
        assert layout_free(got) == compared, name
        for key in compared:
            tol = (dict(abs=1e-5) if key in ROUNDING_KEYS else dict(rel=2e-5, abs=1e-6) if key in VALUE_KEYS
                   else dict(rel=2e-5, abs=1e-7))
            assert got[key] == pytest.approx(want[key], **tol), (name, key, got[key], want[key])


# ---------------------------------------------------------------- unit checks on 2 processes, one spawn

def _rank_checks(tmp: str) -> dict:
    import torch.distributed as dist

    from shardrl.algos import policy_loss
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.base import NonFiniteParametersError
    from shardrl.testing import TINY_MODELS, random_batch
    from shardrl.metrics import Max, Min, SumCount, reduce_metrics
    from shardrl.trainer.updates import actor_loss_fn, run_updates

    rank, out = dist.get_rank(), {}
    # reduce_metrics: global extremes, global token means, plain means
    out["reduced"] = reduce_metrics({"max": Max([3.0, 7.0][rank]), "min": Min([3.0, 7.0][rank]),
                                        "token_mean": SumCount([1.0, 9.0][rank], [1.0, 3.0][rank]),
                                        "mean": [2.0, 4.0][rank]}, dist.group.WORLD)

    # placeholder micro-batches: rank 0 holds 3 samples, rank 1 one, micro-batches of 1 -> rank 1 runs 2
    # fillers; the clip fractions must be those of the 4 real samples
    engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(param_dtype="float32",
                          micro_batch_size_per_gpu=1), OptimConfig(lr=1e-3))
    batch = random_batch(4, 10, 101, seed=3)
    batch["old_log_probs"] = engine.infer_batch(batch)["log_probs"]
    g = torch.Generator().manual_seed(1)
    batch["old_log_probs"] += 0.3 * torch.randn(batch["old_log_probs"].shape, generator=g)  # ratios off 1
    mine = batch.index([0, 1, 2] if rank == 0 else [3])
    _, whole = policy_loss(engine.infer_batch(batch)["log_probs"], batch["old_log_probs"], batch["advantages"],
                           batch["loss_mask"], 0.2, 0.2, 1.5)
    out["whole"] = {k: float(s) / float(c) for k, (s, c) in whole.items()}
    actor_cfg = type("A", (), dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.5, entropy_coeff=0.0,
                                   use_kl_loss=False, loss_mode="vanilla", router_aux_loss_coef=0.0))
    out["engine"] = engine.train_batch(mine, actor_loss_fn(actor_cfg, "token-mean"))

    # a learning rate that throws the weights out of range stops at that step, on every rank
    huge = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(param_dtype="float32"),
                        OptimConfig(lr=1e30))
    try:
        run_updates(huge, mine, actor_loss_fn(actor_cfg, "token-mean"), len(mine), 1, False, torch.Generator(),
                    "actor")
        out["error"] = None
    except NonFiniteParametersError as e:
        out["error"] = str(e)
    errors = [None, None]
    dist.all_gather_object(errors, out["error"])
    out["errors"] = errors
    return out


def test_reductions_placeholders_and_diverged_weights():
    out = run_distributed(_rank_checks, 2, "")
    assert out["reduced"] == {"max": 7.0, "min": 3.0, "token_mean": 10.0 / 4.0, "mean": 3.0}

    whole, got = out["whole"], out["engine"]
    assert 0 < whole["pg_clipfrac"] < 1 and 0 < whole["pg_clipfrac_lower"] < 1
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"):
        assert got[f"actor/{key}"] == pytest.approx(whole[key], rel=1e-5), key
    assert got["actor/pg_loss"] == pytest.approx(got["loss"], rel=1e-6)
    assert got["num_micro_batches"] == 3.0  # rank 0's three; rank 1 ran two placeholders

    assert all(e is not None for e in out["errors"]), out["errors"]
    assert "learning rate is most likely too high" in out["error"] and "actor.optim.lr" in out["error"]
    assert "lr=1e+30" in out["error"]


# ---------------------------------------------------------------- trainer-level: KL controller, lr

def _kl_coefficients(overrides: list[str]) -> tuple[list[float], list[dict]]:
    """Each rank's KL coefficient after the run, and the run's records."""
    import torch.distributed as dist

    from shardrl.config.schema import load_config
    from shardrl.metrics import read_metrics
    from shardrl.trainer.rl import RLTrainer
    from shardrl.trainer.run_folder import prepare_run_dir

    cfg = load_config(None, overrides)
    cfg.trainer.nnodes, cfg.trainer.nproc_per_node = 1, dist.get_world_size()
    run_dir = prepare_run_dir(cfg)
    trainer = RLTrainer(cfg, run_dir)
    trainer.fit()
    coefs = [None] * dist.get_world_size()
    dist.all_gather_object(coefs, trainer.state.kl_ctrl.value)
    return coefs, (read_metrics(run_dir / "metrics.jsonl") if dist.get_rank() == 0 else [])


def test_adaptive_kl_coefficient_is_the_same_on_every_rank(assets, tmp_path):
    # sampled GRPO: the ranks see different responses, so their own KLs differ; the coefficient must not
    overrides = demo_overrides(assets) + [
        f"trainer.output_dir={tmp_path / 'kl'}", "trainer.logger=[jsonl]", "trainer.val_freq=0",
        "trainer.total_steps=3", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
        "actor.optim.lr=1e-3", "actor.entropy_coeff=0.01", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_coef=0.1", "algorithm.kl_target=0.001", "algorithm.kl_horizon=100", "algorithm.kl_penalty=k1"]
    coefs, records = run_distributed(_kl_coefficients, 2, overrides)
    assert coefs[0] == coefs[1], coefs
    # each step moves the coefficient by the whole batch's KL (logged) and its 16 samples (4 prompts x 4)
    coef = 0.1
    for r in records:
        assert r["kl/coef"] == pytest.approx(coef, rel=1e-12), r["step"]
        coef *= 1 + min(max(r["kl/in_reward"] / 0.001 - 1, -0.2), 0.2) * 16 / 100
    assert coefs[0] == pytest.approx(coef, rel=1e-12) and coef != pytest.approx(0.1)


def test_diverging_learning_rate_stops_the_run_with_a_clear_error(assets, tmp_path, capsys):
    from shardrl.cli import main as cli_main

    overrides = demo_overrides(assets) + [
        f"trainer.output_dir={tmp_path / 'lr'}", "trainer.logger=[jsonl]", "trainer.val_freq=0",
        "trainer.total_steps=2", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "actor.entropy_coeff=0.01", "actor.optim.lr=1e30"]  # the entropy bonus: a gradient whatever the rewards
    assert cli_main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert "actor.optim.lr" in err and "learning rate is most likely too high" in err and "Traceback" not in err
