"""The first hour at the command line: `--version`, `shardrl config`, the help texts, `shardrl doctor`'s verdict,
`shardrl plot` over a folder of runs."""

import json
import subprocess
import sys

import pytest

import shardrl
from shardrl.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"shardrl {shardrl.__version__}"


def test_config_lists_a_sections_keys_with_defaults_and_docstrings(capsys):
    assert main(["config", "actor.optim"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "actor.optim.lr = 1e-06" and lines[1] == "    Peak learning rate of AdamW."
    assert "actor.optim.betas = [0.9, 0.999]" in lines and "actor.optim.total_steps = null" in lines
    assert not any(line.startswith("critic.") for line in lines)
    assert main(["config"]) == 0
    everything = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert len(everything) > 200 and "trainer.logger = [console, jsonl]" in everything


def test_config_shows_each_trainers_own_defaults(capsys):
    assert main(["config", "--trainer", "dpo", "dpo.beta"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["dpo.beta = 0.1", "    The inverse temperature of the "
                                                        "implicit reward (TRL's `beta`)."]
    assert main(["config", "--trainer", "sft", "engine.use_dynamic_bsz"]) == 0  # the offline engine's default
    assert capsys.readouterr().out.startswith("engine.use_dynamic_bsz = true\n")
    assert main(["config", "engine.use_dynamic_bsz"]) == 2  # the RL config has actor.engine, not engine
    assert "no config key or section 'engine.use_dynamic_bsz'" in capsys.readouterr().err


def test_config_imports_no_torch():
    code = ("import sys; from shardrl.cli import main; main(['config', 'rollout.n']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("rollout.n = ")


def test_train_help_says_no_arguments_run_the_demo_and_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "With no arguments, `shardrl train` runs the built-in demo" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1)" in out and "(default: 8000;" in out


def test_doctor_ends_with_what_this_machine_can_run(capsys):
    from shardrl.cli import doctor_lines, doctor_verdict

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    table, verdict = out.rstrip("\n").split("\n\n")
    assert verdict == doctor_verdict(dict(doctor_lines()), 0)  # (the tests run on the CPU)
    assert verdict.startswith("CPU only: the demo, the tests and gloo runs")
    assert verdict.endswith("GPU runs need CUDA")


@pytest.mark.parametrize("status, num_gpus, expected", [
    ({"torch": "missing"}, 0, "nothing runs here yet: install torch"),
    ({"torch": "ok", "transformers": "ok", "gloo": "missing"}, 0, "CPU only, one process: the demo and single-"),
    ({"torch": "ok", "transformers": "ok", "gloo": "ok", "nccl": "ok", "fsdp2": "ok", "fsdp1": "ok"}, 8,
     "8 GPUs: GPU runs with FSDP2 and FSDP1 over NCCL, up to --nproc-per-node 8 a node, work here, as do the demo"),
    ({"torch": "ok (2.11.0+cu130, CUDA build 13.0)", "cuda": "ok (1 device(s): NVIDIA H100 80GB HBM3 79 GiB)",
      "nccl": "ok", "gloo": "ok", "transformers": "ok (5.17.0)", "fsdp2": "ok (fully_shard; gloo on CPU, NCCL on GPU)",
      "fsdp1": "ok"}, 1,  # (an H100's, as `shardrl doctor` lists it)
     "1 GPU: GPU runs with FSDP2 and FSDP1 over NCCL, up to --nproc-per-node 1 a node, work here, as do the demo, "
     "the tests and gloo runs"),
    ({"torch": "ok", "transformers": "ok", "gloo": "ok", "nccl": "missing", "fsdp2": "ok", "fsdp1": "ok"}, 1,
     "1 GPU but no NCCL: one-GPU runs (FSDP2 and FSDP1) and CPU runs work here"),
])
def test_doctors_verdict_follows_the_parts(status, num_gpus, expected):
    from shardrl.cli import doctor_verdict

    assert doctor_verdict(status, num_gpus).startswith(expected)


def _write_run(folder, records):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_overlays_the_runs_of_a_folder_with_a_legend(tmp_path, monkeypatch, capsys):
    import matplotlib.axes

    drawn, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *a, **k: drawn.append((ax, list(a[0]), list(a[1]), k["label"], k.get("color")))
                        or plot(ax, *a, **k))
    runs = tmp_path / "outputs"
    _write_run(runs / "demo" / "20261201-100000", [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.3},
                                                    {"step": 2, "val/reward_mean": 0.25}])
    _write_run(runs / "demo" / "20261202-100000", [{"step": 1, "reward/mean": 0.2}])
    _write_run(runs / "sft" / "20261203-100000", [{"step": 1, "sft/loss": 2.0}, {"step": 2, "sft/loss": 1.5}])
    (runs / "demo" / "20261204-100000").mkdir()  # a run that has not logged yet: not a run folder of the listing
    _write_run(runs / "demo" / "20261205-100000", [{"step": 1, "timing/step_s": 1.0}])  # nothing to plot: skipped

    assert main(["plot", str(runs)]) == 0  # outputs/<experiment>/<timestamp>: two levels down
    out = capsys.readouterr()
    assert out.out.strip() == str(runs / "reward_loss_curves.png") and (runs / "reward_loss_curves.png").is_file()
    assert "skipped " + str(runs / "demo" / "20261205-100000") in out.err
    assert [d[1:] for d in drawn] == [
        ([1, 2], [0.1, 0.3], "demo/20261201-100000", "C0"),
        ([2], [0.25], "demo/20261201-100000 (validation)", "C0"),
        ([1], [0.2], "demo/20261202-100000", "C1"),
        ([1, 2], [2.0, 1.5], "sft/20261203-100000", "C0"),
    ]
    reward, loss = drawn[0][0], drawn[3][0]  # a chart per kind, each with its legend
    assert drawn[2][0] is reward and (reward.get_ylabel(), loss.get_ylabel()) == ("reward", "loss")
    assert reward.get_legend() is not None and loss.get_legend() is not None
    drawn.clear()
    assert main(["plot", str(runs / "demo"), "--out", str(tmp_path / "demo.png")]) == 0  # one level down
    assert [d[3] for d in drawn] == ["20261201-100000", "20261201-100000 (validation)", "20261202-100000"]
    assert (tmp_path / "demo.png").is_file()
    drawn.clear()
    assert main(["plot", str(runs / "demo" / "20261202-100000")]) == 0  # one run: as before
    assert [d[3] for d in drawn] == ["train reward (mean)"]
    assert (runs / "demo" / "20261202-100000" / "reward_curve.png").is_file()
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no run folder under it holds one" in capsys.readouterr().err
