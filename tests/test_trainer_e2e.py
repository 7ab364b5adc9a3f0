"""The trainer end to end on CPU: GRPO and PPO (GAE + critic) on 2 processes, a resumed run that
continues exactly like an uninterrupted one, and the clear errors `shardrl train` gives for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrl.cli import main as cli_main
from shardrl.testing import small_demo_run, run_distributed
from shardrl.trainer.demo import prepare_demo_assets

pytestmark = pytest.mark.multiproc

COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/pg_clipfrac", "rollout/logprob_abs_diff")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)


def small(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", *extra)


def run_training(overrides: list[str]) -> list[dict]:
    from shardrl.launch.rank import run

    import torch.distributed as dist

    run_dir = run(None, overrides)
    if dist.is_initialized() and dist.get_rank() != 0:  # (rank 0 may still be writing its last line: its result is read)
        return []
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _read_on_every_rank(overrides: list[str]) -> list[int]:
    """The run with rank 0 slow to write each line (as a loaded machine may be); every rank reads metrics.jsonl as
    soon as `run` returns."""
    import torch.distributed as dist

    from shardrl.launch.rank import run
    from shardrl.trainer.logger import MetricsLogger

    log = MetricsLogger.log

    def late(self, *args, **kwargs):
        if dist.get_rank() == 0:
            time.sleep(1.0)
        return log(self, *args, **kwargs)

    MetricsLogger.log = late
    run_dir = run(None, overrides)
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps == [1, 2], (dist.get_rank(), steps)  # (rank 1 too: `run` returned once the record was whole)
    return steps


def test_every_rank_finds_the_run_folder_whole_when_run_returns(assets, tmp_path):
    assert run_distributed(_read_on_every_rank, 2, small(assets, tmp_path / "whole", "trainer.total_steps=2")) == [1, 2]


def test_grpo_two_processes_trains_and_logs(assets, tmp_path):
    # the entropy bonus gives a gradient even in a step where every group's rewards are equal
    # validation at step 3: 55 prompts over 2 ranks, so one rank repeats a prompt to keep collectives matched
    records = run_distributed(run_training, 2, small(assets, tmp_path / "grpo", "trainer.total_steps=3",
                                                     "actor.entropy_coeff=0.01", "trainer.val_freq=3"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert 0.0 <= records[-1]["val/reward_mean"] <= 1.0 and "val/reward_mean" not in records[0]
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "timing/step_s"):
        assert all(isinstance(r[key], float) for r in records), key
    # the sampler's log-probs and the actor's recomputation agree: the weight sync works
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in records)
    assert all(r["actor/grad_norm"] > 0 and r["actor/entropy"] > 0 for r in records)
    assert (tmp_path / "grpo" / "reward_curve.png").stat().st_size > 1000


def test_grpo_with_the_fast_rollout(assets, tmp_path):
    # 8 rows per rank on 3 decode slots: finished rows hand their slots to waiting ones between syncs
    records = run_distributed(run_training, 2, small(assets, tmp_path / "fast", "trainer.total_steps=3",
                                                     "rollout.backend=fast", "rollout.fast.max_batch=3",
                                                     "rollout.fast.sync_every=2", "actor.entropy_coeff=0.01"))
    assert [r["step"] for r in records] == [1, 2, 3]
    # after every update the sampler runs the actor's new weights: its log-probs equal the recomputation
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in records)
    assert all(r["actor/grad_norm"] > 0 for r in records)


def test_ppo_gae_with_critic_two_processes(assets, tmp_path):
    records = run_distributed(run_training, 2, small(
        assets, tmp_path / "ppo", "trainer.total_steps=2", "algorithm.adv_estimator=gae", "rollout.n=2",
        "critic.ppo_mini_batch_size=2", "actor.use_kl_loss=true", "actor.engine.offload_optimizer=true", "critic.engine.param_dtype=float32",
        "ref.engine.param_dtype=float32"))
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["critic/grad_norm"] > 0 and "critic/vf_clipfrac" in r for r in records)
    assert all("actor/kl_loss" in r for r in records)


def test_ulysses_sp2_run_equals_single_process_run(assets, tmp_path):
    # sp=2 on 2 processes is one data-parallel rank: the same rollouts, so the same numbers as 1 process.
    # Every engine the trainer builds (actor, ref for the KL loss, critic for GAE) runs at sp=2; the
    # entropy bonus gives the actor a gradient even where all rewards are 0; token budgets of 20 per rank
    # (40 per row at sp=2, a few sequences of ~8 tokens) cut rows inside sequences
    args = ("trainer.total_steps=2", "actor.engine.param_dtype=float32", "rollout.n=2", "actor.entropy_coeff=0.01",
            "actor.use_kl_loss=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2",
            "critic.engine.param_dtype=float32", "ref.engine.param_dtype=float32",
            *(f"{role}.engine.{k}" for role in ("actor", "critic", "ref")
              for k in ("use_dynamic_bsz=true", "max_token_len_per_gpu=20")))
    sp2 = [f"{role}.engine.ulysses_sequence_parallel_size=2" for role in ("actor", "critic", "ref")]
    one = run_distributed(run_training, 1, small(assets, tmp_path / "sp1", *args))
    two = run_distributed(run_training, 2, small(assets, tmp_path / "sp2", *args, *sp2))
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in one)
    assert one[0]["rollout/logprob_abs_diff"] < 1e-5 and one[0]["kl/actor_ref"] == pytest.approx(0.0, abs=1e-6)
    assert [r["step"] for r in two] == [1, 2]
    keys = (*COMPARED, "kl/actor_ref", "actor/kl_loss", "actor/entropy", "critic/vf_loss", "critic/grad_norm")
    for got, want in zip(two, one):  # abs: fp32 noise of sums that cancel (the step-2 loss is ~0.02 of terms ~0.1)
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key, got[key], want[key])


def _train_subprocess(overrides: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "shardrl.cli", "train", *overrides, "--nproc-per-node", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once, as a node failure would: torchrun starts each worker in a
    session of its own, so killing torchrun's process group alone leaves the workers training on."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


# scores that differ within a group (a sum of character codes), so advantages and gradients are not zero
# and each rank's mini-batch order matters
VARIED_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return (sum(map(ord, solution_str)) % 7) / 6.0\n")


def run_recording(overrides: list[str]) -> dict:
    """`run` on this rank, recording what each rank holds before every step (its shuffle generator, loader
    position, KL coefficient) and its own shards of the actor's parameters at the end; rank 0 returns
    every rank's record."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardrl.trainer import rl
    from shardrl.launch.rank import run

    steps, trainers = [], []
    train_step, fit = rl.RLTrainer.train_step, rl.RLTrainer.fit

    def recording_step(self):
        state = self.state
        steps.append({"step": state.step + 1, "shuffle": state.shuffle_gen.get_state().clone(),
                      "loader": state.loader.state_dict(), "kl": state.kl_ctrl.value})
        return train_step(self)

    def recording_fit(self):
        trainers.append(self)
        return fit(self)

    rl.RLTrainer.train_step, rl.RLTrainer.fit = recording_step, recording_fit
    run_dir = run(None, overrides)
    shards = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in trainers[0].roles.actor.module.named_parameters()}
    mine = {"steps": steps, "shards": shards}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    with open(run_dir / "metrics.jsonl") as f:
        return {"ranks": every, "metrics": [json.loads(line) for line in f]}


def test_killed_run_resumes_like_an_uninterrupted_one(assets, tmp_path):
    import shutil

    import torch

    from shardrl.config.schema import load_config

    reward = tmp_path / "varied_reward.py"
    reward.write_text(VARIED_REWARD)
    args = ("trainer.total_steps=6", "trainer.save_freq=2", "trainer.keep_last=1", f"reward.function_path={reward}")
    full = run_distributed(run_recording, 2, small(assets, tmp_path / "full", *args))
    assert all(r["actor/grad_norm"] > 0 for r in full["metrics"])  # advantages are not zero
    assert len({r["reward/mean"] for r in full["metrics"]}) > 1
    # SIGKILL the whole job (torchrun and its workers) once a first checkpoint is complete
    cut = tmp_path / "cut"
    proc = _train_subprocess(small(assets, cut, *args))
    deadline = time.time() + 300
    while not any((p / "COMPLETE").exists() for p in (cut / "checkpoints").glob("step_*")):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    _kill_job(proc)
    (saved,) = [p for p in (cut / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()]
    at = int(saved.name.split("_")[1])
    other = tmp_path / "other"  # the same checkpoint, resumed at world size 1 below
    shutil.copytree(saved, other / "checkpoints" / saved.name)
    resumed = run_distributed(run_recording, 2, small(assets, cut, "trainer.resume=auto", *args))
    assert [r["step"] for r in resumed["metrics"]] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(resumed["metrics"], full["metrics"]):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)
    # each rank continues as itself: its shuffle stream, loader, KL coefficient and its parameter shards
    for rank in (0, 1):
        got, want = resumed["ranks"][rank], full["ranks"][rank]
        assert [s["step"] for s in got["steps"]] == list(range(at + 1, 7))
        for g in got["steps"]:
            w = want["steps"][g["step"] - 1]
            assert torch.equal(g["shuffle"], w["shuffle"]), (rank, g["step"], "shuffle generator")
            assert g["loader"] == w["loader"] and g["kl"] == w["kl"], (rank, g["step"])
        for name, shard in want["shards"].items():
            assert torch.allclose(got["shards"][name], shard, rtol=1e-5, atol=1e-6), (rank, name)
    assert not torch.equal(full["ranks"][0]["steps"][at]["shuffle"], full["ranks"][1]["steps"][at]["shuffle"])
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_000006"]
    # at another world size there is no saved stream for each dp rank: it is derived from data.seed, the
    # step and the dp rank (loader and KL controller are global state, valid at any size)
    one = run_distributed(run_recording, 1, small(assets, other, "trainer.resume=auto", *args[1:],
                                                  f"trainer.total_steps={at + 1}"))
    (first,) = one["ranks"][0]["steps"]
    seed = load_config(None, small(assets, other)).data.seed
    assert first["step"] == at + 1 and first["loader"] == full["ranks"][0]["steps"][at]["loader"]
    assert torch.equal(first["shuffle"], torch.Generator().manual_seed(seed + 1_000_003 * at).get_state())


def test_a_run_killed_between_its_checkpoint_and_the_steps_log_line_logs_that_step_on_resume(assets, tmp_path):
    """The checkpoint of step 2 is complete before step 2's line reaches metrics.jsonl: a kill in between (the line
    cut away here) leaves the resumed run to log step 2 from the checkpoint, so no step is missing."""
    import json

    args = ("trainer.save_freq=2", "trainer.keep_last=1")
    run_training(small(assets, tmp_path / "run", "trainer.total_steps=2", *args))
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    path.write_text(lines[0] + "\n")  # as if killed after the save, before the line
    run_training(small(assets, tmp_path / "run", "trainer.total_steps=3", "trainer.resume=auto", *args))
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3], steps
    assert json.loads(path.read_text().splitlines()[1])["reward/mean"] == json.loads(lines[1])["reward/mean"]


def _train_cli(*args: str) -> int:
    return cli_main(["train", *args])


def test_a_model_folder_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    assert _train_cli(f"data.train_files=[{tmp_path / 'nope.jsonl'}]", "model.path=" + str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.path=") and "holds no tokenizer" in err and "Traceback" not in err


def test_bad_inputs_through_the_cli(assets, tmp_path, capsys):
    base = small(assets, tmp_path / "bad", "trainer.total_steps=1")
    # a dataset file that does not exist
    assert cli_main(["train", "cfg-not-there.yaml"]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert _train_cli(*base, f"data.train_files=[{tmp_path / 'missing.jsonl'}]") == 2
    assert "missing.jsonl" in capsys.readouterr().err
    # a row without a prompt
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"prompt": "1+1=", "ground_truth": "2", "data_source": "arith"}\n{"question": "x"}\n')
    assert _train_cli(*base, f"data.train_files=[{bad_rows}]") == 2
    err = capsys.readouterr().err
    assert "row 2" in err and "prompt" in err
    # a model folder that is not a causal LM
    import transformers

    not_lm = tmp_path / "classifier"
    transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, architectures=["BertForSequenceClassification"]).save_pretrained(not_lm)
    assert _train_cli(*base, f"model.path={not_lm}", f"model.tokenizer_path={assets / 'model'}") == 2
    assert "not a causal LM" in capsys.readouterr().err
    # a causal LM folder without weights
    no_weights = tmp_path / "no_weights"
    transformers.AutoConfig.from_pretrained(assets / "model").save_pretrained(no_weights)
    assert _train_cli(*base, f"model.path={no_weights}", f"model.tokenizer_path={assets / 'model'}") == 2
    err = capsys.readouterr().err
    assert "has a config.json but no weights" in err and "Traceback" not in err
    # a reward file without the function
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def other(a, b, c, d=None):\n    return 0.0\n")
    assert _train_cli(*base, f"reward.function_path={reward_file}") == 2
    err = capsys.readouterr().err
    assert "compute_score" in err and "other" in err
    # a batch that does not divide
    assert _train_cli(*base, "data.train_batch_size=6", "actor.ppo_mini_batch_size=4") == 2
    err = capsys.readouterr().err
    assert "ppo_mini_batch_size" in err and "6" in err
    # ... nor over the processes asked for: said before torchrun starts any
    assert _train_cli("--nproc-per-node", "3", *base) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.train_batch_size=") and "dp=3" in err and "nearest valid" in err


def test_an_error_found_in_the_ranks_is_one_line_and_exit_status_2(assets, tmp_path, capfd):
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"question": "x"}\n')
    base = small(assets, tmp_path / "bad", "trainer.total_steps=1", f"data.train_files=[{bad_rows}]")
    assert _train_cli("--nproc-per-node", "2", *base) == 2
    err = capfd.readouterr().err
    assert err.count("error: ") == 1 and "rows.jsonl" in err and "no row has the columns" in err
    assert "Traceback" not in err
