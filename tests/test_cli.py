import json
import sys
import types

import pytest
import yaml

from shardrl.cli import main

TINY = ("model.tiny={model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 1000}")


def test_plan_json_holds_the_derived_numbers(capsys):
    rc = main(["plan", TINY, "data.train_batch_size=16", "--nnodes", "2", "--nproc-per-node", "4",
               "actor.ppo_mini_batch_size=8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["world_size"], out["dp"], out["prompts_per_rank"], out["samples_per_rank"]) == (8, 8, 2, 8)
    assert out["actor"]["mini_batch_samples_per_rank"] == 4 and out["actor"]["num_mini_batches"] == 2
    assert out["memory"]["shard_size"] == 8 and out["memory"]["num_params"] > 0
    assert out["memory_skipped"] is None


def test_plan_reads_a_yaml_file_and_the_trainer_world(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"nproc_per_node": 2}, "data": {"train_batch_size": 4},
                                    "actor": {"ppo_mini_batch_size": 2}}))
    assert main(["plan", str(path), "rollout.n=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["samples_per_rank"], out["actor"]["mini_batch_samples_per_rank"]) == (2, 6, 3)
    assert out["memory"] is None and "model.path" in out["memory_skipped"]


def test_plan_text_shows_the_derivation_and_ledger(capsys):
    assert main(["plan", TINY, "--nproc-per-node", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "samples per rank = 8 prompts x 4 (n) / 2 (dp) = 16" in out
    assert "memory per GPU (actor" in out and "optimizer state" in out


@pytest.mark.parametrize("argv, expected", [
    (["plan", "data.train_batch_size=10", "actor.ppo_mini_batch_size=5", "--nproc-per-node", "4"],
     "nearest valid: 8 or 12"),
    (["plan", "actor.engine.fsdp_sise=2"], "unknown config key"),
    (["plan", "no/such/file.yaml"], "config file not found"),
])
def test_plan_bad_config_exits_2_with_error_line(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err


def test_unknown_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--bogus"])
    assert e.value.code == 2


def test_doctor_reports_torch_and_gloo(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert status["torch"].startswith("ok") and status["gloo"] == "ok"
    assert status["fsdp2"].startswith("ok")
    assert all(s.startswith(("ok", "missing", "not usable here")) for s in status.values())


def test_train_and_plot_hand_their_arguments_on(monkeypatch):
    seen = {}
    trainer = types.ModuleType("shardrl.trainer")
    trainer_main = types.ModuleType("shardrl.trainer.main")
    trainer_main.train_main = lambda args: seen.setdefault("train", args) and 0
    plot = types.ModuleType("shardrl.plot")
    plot.plot_main = lambda args: seen.setdefault("plot", args) and 0
    monkeypatch.setitem(sys.modules, "shardrl.trainer", trainer)
    monkeypatch.setitem(sys.modules, "shardrl.trainer.main", trainer_main)
    monkeypatch.setitem(sys.modules, "shardrl.plot", plot)

    assert main(["train", "run.yaml", "rollout.n=8", "--nproc-per-node", "2", "actor.optim.lr=1e-5"]) == 0
    args = seen["train"]
    assert args.config == "run.yaml" and args.overrides == ["rollout.n=8", "actor.optim.lr=1e-5"]
    assert args.nproc_per_node == 2 and args.nnodes is None
    assert main(["plot", "outputs/run", "--out", "x.png"]) == 0
    assert seen["plot"].run_dir == "outputs/run" and seen["plot"].out == "x.png"
