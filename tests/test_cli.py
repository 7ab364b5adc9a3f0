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
    assert out["memory"]["num_params"] > 0 and out["memory"]["peak_phase"] in ("gen", "prep", "update")
    assert out["memory_skipped"] is None


def test_plan_warns_of_settings_the_run_would_ignore_as_the_run_does(capsys):
    assert main(["plan", TINY, "trainer.val_freq=5", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # (the JSON stays clean: the warning goes to stderr)
    assert "warning: " in captured.err and "trainer.val_freq" in captured.err and "data.val_files" in captured.err


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
    assert "peak GPU memory per phase" in out and "optimizer state" in out and "KV cache" in out


def test_plan_says_what_to_change_when_a_phase_does_not_fit(capsys):
    assert main(["plan", TINY, "--gpu-mem-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits 80 GiB" in out and "rollout.free_cache_engine=false (null: the ledger's update peak plus" in out
    big = TINY.replace("hidden_size: 64", "hidden_size: 4096").replace("intermediate_size: 128", "intermediate_size: 16384")
    args = ["plan", big, "data.max_prompt_length=2048", "actor.engine.use_dynamic_bsz=true",
            "actor.engine.max_token_len_per_gpu=65536", "--gpu-mem-gib", "24"]
    assert main(args) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit 24 GiB: update needs" in out
    assert "the largest term is activations" in out and "gradient_checkpointing=true" in out
    assert main(args + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and "activations" in out["advice"][0] and out["rollout_keeps_cache"] is False
    kept = json.loads(capsys.readouterr().out if main(["plan", TINY, "--gpu-mem-gib", "80", "--json"]) == 0
                      else "{}")
    assert kept["rollout_keeps_cache"] is True  # and the phases hold the cache as the run will
    assert {"KV cache (kept)", "sampler logits (kept)"} <= {i["name"] for i in kept["memory"]["phases"]["update"]["items"]}
    assert main(["plan", TINY, "--gpu-mem-gib", "80", "rollout.free_cache_engine=true"]) == 0
    assert "rollout.free_cache_engine" not in capsys.readouterr().out  # set: nothing to decide


def test_plan_advises_a_lora_run_to_offload_its_frozen_base(capsys):
    """Where the params are the largest term, a full fine-tuning run is told offload_params, and so is a LoRA run
    (its frozen base and adapters then on the CPU, counted there), also told to gather the base a layer at a time."""
    big = TINY.replace("hidden_size: 64", "hidden_size: 4096").replace("intermediate_size: 128", "intermediate_size: 16384")
    args = ["plan", big, "data.max_prompt_length=64", "rollout.max_new_tokens=64", "rollout.fast.max_batch=8",
            "model.gradient_checkpointing=true", "actor.engine.offload_optimizer=true", "--gpu-mem-gib", "0.5", "--json"]
    assert main(args) == 1
    full = json.loads(capsys.readouterr().out)["advice"]
    assert any("actor.engine.offload_params=true" in line for line in full), full
    assert main(args + ["model.lora.rank=8"]) == 1
    lora = json.loads(capsys.readouterr().out)["advice"]
    assert any("actor.engine.offload_params=true" in line for line in lora), lora
    assert any("actor.engine.accumulate_unsharded=false" in line for line in lora), lora
    assert main(args + ["model.lora.rank=8", "actor.engine.offload_params=true"]) in (0, 1)
    resident = json.loads(capsys.readouterr().out)["memory"]["phases"]["gen"]["items"]
    assert [i["gib"] for i in resident if i["name"] == "actor params"] == [0]  # on the CPU


def test_plan_advises_what_changes_the_phase_that_does_not_fit(capsys):
    """A LoRA run whose generation does not fit was told accumulate_unsharded=false (which changes the update only):
    a phase whose largest term is held all step is told what shrinks that term and what shrinks the phase's own
    largest (generation: the decode slots; the update: the model gathered whole), each in its own phase."""
    big = TINY.replace("hidden_size: 64", "hidden_size: 4096").replace("intermediate_size: 128", "intermediate_size: 16384")
    args = ["plan", big, "model.lora.rank=8", "rollout.lora_sync=unmerged", "rollout.free_cache_engine=true",
            "--gpu-mem-gib", "0.9", "--json"]
    assert main(args) == 1
    advice = {line.split(" ")[0]: line for line in json.loads(capsys.readouterr().out)["advice"]}
    assert set(advice) == {"gen", "prep", "update"}
    assert advice["gen"] == (
        "gen needs 1.9 GiB > 0.9 GiB; the largest term is actor params (1.0 GiB, held all step): "
        "actor.engine.offload_params=true, or more GPUs to shard over; this phase's own largest is prefill chunk (0.8 GiB): "
        "fewer decode slots (rollout.fast.max_batch) or a shorter data.max_prompt_length (a prefill takes at most the "
        "slots' prompts)")
    assert "accumulate_unsharded" not in advice["prep"]
    assert "this phase's own largest is unsharded params" in advice["update"]
    assert "actor.engine.accumulate_unsharded=false" in advice["update"]


def test_plan_prints_small_sizes_and_counts_in_units_that_show_them(capsys):
    """The demo's plan said "0.000B params" and "0.0 GiB" for every size under 0.1 GiB."""
    from shardrl.plan.layout import format_count, format_size

    assert [format_size(g) for g in (24.0, 0.1, 0.05, 3 / 1024, 5 / 2**20, 100 / 2**30, 0.0)] == [
        "24.0 GiB", "0.1 GiB", "51.2 MiB", "3.0 MiB", "5.0 KiB", "100 B", "0.0 GiB"]
    assert [format_count(n) for n in (7_615_616_512, 40_370_176, 262_144, 6784)] == [
        "7.616B", "40.37M", "0.26M", "6784"]
    assert main(["plan", TINY, "--gpu-mem-gib", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "(one GPU; 0.20M params)" in out and "0.000B" not in out and " 0.0 GiB" not in out, out
    assert "update needs 15.0 MiB > 0.001 GiB; the largest term is logits chunk (9.8 MiB)" in out, out
    assert "    logits chunk                        9.8 MiB  # 1024 tokens x 1000" in out, out


def test_plan_settles_a_null_lora_sync_as_the_run_would_on_that_gpu(capsys):
    """With LoRA and --gpu-mem-gib, rollout.lora_sync left null is chosen as on that GPU (merged where the copy
    fits, else unmerged) and the ledger's rollout holds what that choice holds."""
    lora = [TINY, "model.lora.rank=8", "rollout.backend=fast"]
    plans = {}
    for gib in ("80", "0.001"):
        main(["plan", *lora, "--gpu-mem-gib", gib, "--json"])
        plans[gib] = json.loads(capsys.readouterr().out)
    assert (plans["80"]["rollout_lora_sync"], plans["0.001"]["rollout_lora_sync"]) == ("merged", "unmerged")

    def rollout_gib(plan):
        return sum(i["gib"] for i in plan["memory"]["phases"]["gen"]["items"] if i["name"].startswith("rollout"))
    # a bf16 copy of the model, against the adapters alone (the rollout reads the actor's base)
    assert rollout_gib(plans["80"]) * 2**30 == pytest.approx(plans["80"]["memory"]["num_params"] * 2)
    assert rollout_gib(plans["0.001"]) < rollout_gib(plans["80"]) / 4
    main(["plan", *lora, "--gpu-mem-gib", "80"])
    assert "rollout.lora_sync=merged (null: the ledger's peak with a merged copy" in capsys.readouterr().out
    main(["plan", *lora, "--gpu-mem-gib", "80", "rollout.lora_sync=unmerged", "--json"])
    assert json.loads(capsys.readouterr().out)["rollout_lora_sync"] is None  # set: nothing to decide


@pytest.mark.parametrize("argv, expected", [
    (["plan", "data.train_batch_size=10", "actor.ppo_mini_batch_size=5", "--nproc-per-node", "4"],
     "nearest valid: 8 or 12"),
    (["plan", "actor.engine.fsdp_sise=2"], "unknown config key"),
    (["plan", "no/such/file.yaml"], "config file not found"),
    # what `shardrl train` refuses, plan refuses too (before any ledger)
    (["plan", "model.lora.rank=8", "actor.engine.strategy=fsdp"], "actor.engine.strategy='fsdp': must be fsdp2 "
                                                                  "with model.lora"),
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
    lines = capsys.readouterr().out.split("\n\n")[0].splitlines()  # (the table; the verdict follows it)
    status = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert status["torch"].startswith("ok") and status["gloo"] == "ok"
    assert status["fsdp2"].startswith("ok")
    assert all(s.startswith(("ok", "missing", "not usable here")) for s in status.values())


def test_train_and_plot_hand_their_arguments_on(monkeypatch):
    seen = {}
    trainer = types.ModuleType("shardrl.trainer")
    command = types.ModuleType("shardrl.launch.command")
    command.launch_main = lambda name, args: seen.setdefault(name, args) and 0
    plot = types.ModuleType("shardrl.trainer.plot")
    plot.plot_main = lambda args: seen.setdefault("plot", args) and 0
    monkeypatch.setitem(sys.modules, "shardrl.trainer", trainer)
    monkeypatch.setitem(sys.modules, "shardrl.launch.command", command)
    monkeypatch.setitem(sys.modules, "shardrl.trainer.plot", plot)

    assert main(["train", "run.yaml", "rollout.n=8", "--nproc-per-node", "2", "actor.optim.lr=1e-5"]) == 0
    args = seen["train"]
    assert args.config == "run.yaml" and args.overrides == ["rollout.n=8", "actor.optim.lr=1e-5"]
    assert args.nproc_per_node == 2 and args.nnodes is None
    assert main(["plot", "outputs/run", "--out", "x.png"]) == 0
    assert seen["plot"].run_dir == "outputs/run" and seen["plot"].out == "x.png"


def test_plan_prints_rollouts_per_step_as_a_number(capsys):
    assert main(["plan", "data.train_batch_size=12", "rollout.n=5", "actor.ppo_mini_batch_size=6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rollouts_per_step"] == 60
    assert main(["plan", "data.train_batch_size=12", "rollout.n=5", "actor.ppo_mini_batch_size=6"]) == 0
    assert "rollouts per step = 12 (train_batch_size) x 5 (n) = 60" in " ".join(capsys.readouterr().out.split())


def test_plan_checks_heads_against_sp_as_training_would(capsys):
    six_heads = TINY.replace("num_attention_heads: 4", "num_attention_heads: 6")
    argv = ["plan", six_heads, "actor.engine.ulysses_sequence_parallel_size=4", "--nproc-per-node", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: actor.engine.ulysses_sequence_parallel_size=4 does not fit the model's 6 attention "
                          "heads and 2 KV heads") and "nearest valid sp on a world of 8: 2" in err
    assert main(["plan", TINY, "actor.engine.ulysses_sequence_parallel_size=2", "--nproc-per-node", "4"]) == 0


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("flag, value", [("--nproc-per-node", "0"), ("--nproc-per-node", "-2"), ("--nnodes", "0")])
def test_process_counts_below_one_are_refused(command, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: must be >= 1, got {int(value)}" in capsys.readouterr().err


def test_train_main_refuses_zero_processes_given_in_code(tmp_path):
    import argparse

    from shardrl.launch.command import launch_main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no_model")}}))
    args = argparse.Namespace(config=str(config), overrides=[], nproc_per_node=0, nnodes=None)
    with pytest.raises(ValueError, match="--nproc-per-node 0: must be >= 1"):
        launch_main("train", args)


@pytest.mark.parametrize("logger, module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_missing_logger_package_is_a_config_error_before_anything_loads(logger, module, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no_model")},
                                      "trainer": {"logger": ["console", logger]}}))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid config value trainer.logger=['console', '{logger}']: '{logger}' needs")
    assert f"pip install 'shardrl[{logger}]'" in err and "no_model" not in err


def test_a_full_disk_is_one_error_line_not_a_traceback(monkeypatch, capsys):
    import errno

    import shardrl.cli as cli

    def full(args):
        raise OSError(errno.ENOSPC, "disk full: saving the checkpoint of step 3 to /runs/x/.tmp_step_000003 failed")

    monkeypatch.setitem(cli.COMMANDS, "train", full)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: [Errno 28] disk full: saving the checkpoint of step 3 to "
                                        "/runs/x/.tmp_step_000003 failed"]

    def other(args):
        raise OSError(errno.EIO, "an I/O error is not the user's to fix")  # still a traceback

    monkeypatch.setitem(cli.COMMANDS, "train", other)
    with pytest.raises(OSError):
        cli.main(["train"])


def test_a_command_line_run_starts_from_the_plain_defaults_not_the_demo(tmp_path, monkeypatch, capsys):
    from shardrl.config.schema import Config, load_config
    from shardrl.launch.overrides import resolve_overrides

    monkeypatch.chdir(tmp_path)  # the demo's assets would go to ./outputs/demo_assets
    defaults = Config()
    for user in (["model.path=/models/qwen", "data.train_files=[/data/train.parquet]"], ["data.train_files=[t.jsonl]"],
                 [TINY], [TINY, "model.tiny.hidden_size=32"]):
        cfg = load_config(None, resolve_overrides(None, user))
        assert cfg.actor.engine.param_dtype == "bfloat16" == defaults.actor.engine.param_dtype  # not the demo's fp32
        assert cfg.data.val_files == [] and cfg.trainer.val_freq == defaults.trainer.val_freq  # no demo validation
        assert cfg.data.train_batch_size == defaults.data.train_batch_size and cfg.rollout.n == defaults.rollout.n
    assert not (tmp_path / "outputs").exists()  # nothing of the demo was made
    # no model or data named: the demo, with the user's overrides on top
    demo = load_config(None, resolve_overrides(None, ["trainer.total_steps=5", "data.train_batch_size=8"]))
    assert demo.actor.engine.param_dtype == "float32" and demo.data.val_files and demo.trainer.total_steps == 5
    assert demo.data.train_batch_size == 8 and demo.rollout.n == 16
    # plan reads the config train would run: the demo's numbers without arguments, the plain defaults with a model
    assert main(["plan", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["samples_per_rank"], out["actor"]["mini_batch_samples_per_rank"]) == (16 * 16, 8 * 16)
    assert main(["plan", TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples_per_rank"] == defaults.data.train_batch_size * defaults.rollout.n


def test_plan_lays_out_the_offline_trainers(capsys):
    base = ["--nproc-per-node", "4", "data.max_length=512", "engine.max_token_len_per_gpu=1024", "--json"]
    assert main(["plan", "--trainer", "dpo", TINY, "data.batch_size=8", "engine.ulysses_sequence_parallel_size=2",
                 *base]) == 0
    dpo = json.loads(capsys.readouterr().out)
    assert (dpo["dp"], dpo["rows_per_rank"], dpo["sequences_per_rank"], dpo["seq_tokens_per_rank"]) == (2, 4, 8, 256)
    names = [i["name"] for i in dpo["memory"]["phases"]["update"]["items"]]
    assert "ref params" in names and "model optimizer state" in names  # sigmoid DPO holds a reference
    assert main(["plan", "--trainer", "dpo", TINY, "data.batch_size=8", "dpo.loss_type=simpo", *base]) == 0
    simpo = json.loads(capsys.readouterr().out)
    assert not simpo["ref"] and "ref params" not in [i["name"] for i in simpo["memory"]["phases"]["update"]["items"]]
    sft_params = dpo["memory"]["phases"]["update"]["items"][0]["gib"]
    assert sft_params == pytest.approx(simpo["memory"]["phases"]["update"]["items"][0]["gib"])
    # a pair's two sequences share a micro-batch: the budget must hold 2 x max_length
    assert main(["plan", "--trainer", "rm", TINY, "data.batch_size=8", "--nproc-per-node", "4", "data.max_length=512",
                 "engine.max_token_len_per_gpu=1000"]) == 2
    assert capsys.readouterr().err == (
        "error: engine.max_token_len_per_gpu=1000 cannot hold one sequence of up to 1024 tokens (data.max_length 512 "
        "x 2 (a pair shares a micro-batch)) split over sp=1; use at least 1024\n")
    assert main(["plan", "--trainer", "sft", TINY, "data.batch_size=6", "--nproc-per-node", "4"]) == 2
    assert capsys.readouterr().err == ("error: data.batch_size=6 conversations cannot be split over dp=4 data-parallel "
                                       "ranks (world 4 / sp 1); nearest valid: 4 or 8\n")
    assert main(["plan", "--trainer", "sft", TINY, "data.batch_size=8", "engine.use_dynamic_bsz=false",
                 "engine.micro_batch_size_per_gpu=3", "--nproc-per-node", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "micro-batches per step = ceil(4 / 3 (micro_batch_size_per_gpu)) = 2 of <= 3 conversations" in out
    assert "resident model params" in out and "KV cache" not in out


def test_the_trainer_subcommands_come_from_the_registry():
    """`shardrl sft|dpo|rm` and `shardrl plan --trainer` are the registry's rows; each row's entry is its trainer
    class, which reads the row's config, group size and head."""
    import importlib

    from shardrl.cli import COMMANDS, build_parser
    from shardrl.config.registry import TRAINERS

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    plan = next(a for a in commands["plan"]._actions if a.dest == "trainer")
    assert list(plan.choices) == list(TRAINERS) == ["train", "sft", "dpo", "kto", "rm"]
    for name, row in TRAINERS.items():
        assert name in commands and name in COMMANDS
        module, attr = row.entry.split(":")
        cls = getattr(importlib.import_module(module), attr)
        if row.offline:
            assert (cls.name, cls.config_cls, cls.group_size, cls.head) == (name, row.config, row.group_size, row.head)
