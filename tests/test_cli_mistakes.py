"""A hostile first user's mistakes at the command line (session 38), each one a problem the CLI handled badly: a
traceback for a user's mistake, a message that said the wrong thing, or a run that silently did something else
than asked. Each test failed on the code before its fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardrl.cli import main
from shardrl.testing import interrupt_after_first_step, small_demo_run
from shardrl.trainer.demo import prepare_demo_assets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=2)


def small(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return small_demo_run(assets, run_dir, "trainer.logger=[jsonl]", "trainer.total_steps=1", *extra)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """`shardrl *argv` in this process: (exit status, stderr); an exception escaping main() is a traceback the user
    would see, so it fails the test naming it (a KeyboardInterrupt would stop pytest itself: not caught here)."""
    try:
        rc = main(argv)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"shardrl {argv[0]} ended in a traceback for a user's mistake: {type(e).__name__}: {e}")
    return rc, capsys.readouterr().err


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---- model folders ---------------------------------------------------------------------------------------------

def test_a_config_json_that_does_not_match_the_weights_is_one_error_line(assets, tmp_path, capsys):
    """A model folder whose config.json says another size than its weights (an edited or copied-over config.json)
    is a user's mistake: today the sharded-load check sees it ("model.embed_tokens.weight has shape (53, 128) in
    model.safetensors, the model (53, 64)") but only logs it at INFO and falls back to rank 0's
    `from_pretrained`, which raises transformers' RuntimeError ("You set `ignore_mismatched_sizes` to `False`"):
    a traceback and exit status 1 after transformers' whole load report."""
    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] // 2
    (model / "config.json").write_text(json.dumps(config))
    rc, err = cli(["train", *small(assets, tmp_path / "run", f"model.path={model}")], capsys)
    assert rc == 2 and "error: " in err and "config.json" in err and "shape" in err, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_tilde_in_model_path_is_the_home_folder(assets, tmp_path, monkeypatch, capsys):
    """`model.path: ~/models/x` in a YAML file (or a quoted override: the shell does not expand it there) is taken
    literally: "model.path='~/model' is not a folder" for a folder that is there. model.tokenizer_path expands `~`
    (tokenizer.py), and so do the verl translations of the same keys (compat/verl/keys.py), the native keys not."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(assets / "model", home / "model")
    monkeypatch.setenv("HOME", str(home))
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("model:\n  path: ~/model\n")
    rc = main(["plan", str(run_yaml), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out)["memory_skipped"] is None, json.loads(out)["memory_skipped"]


def test_a_tilde_in_output_dir_is_not_a_folder_named_tilde(assets, tmp_path, monkeypatch, capsys):
    """`trainer.output_dir: ~/runs/x` writes the run into a folder literally named `~` under the current folder
    (config.yaml records /cwd/~/runs/x), not under the home folder; a user who then cleans up with `rm -rf ~...`
    is one typo from deleting their home."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, err = cli(["train", *small(assets, tmp_path / "unused"), "trainer.output_dir=~/runs/x"], capsys)
    assert rc == 0, err[-2000:]
    assert not (cwd / "~").exists(), "the run went into a folder named '~' under the current folder"
    assert (home / "runs" / "x" / "summary.json").is_file()


# ---- stopping a run --------------------------------------------------------------------------------------------

def test_ctrl_c_says_whether_the_steps_done_can_be_resumed(assets, tmp_path):
    """Ctrl-C after some steps of a run with the default trainer.save_freq=0 leaves no checkpoint: the steps are
    lost (trainer.resume=auto then moves the records aside and starts at step 0). The one line says only
    "interrupted (Ctrl-C) after N of M steps; summary ..., reward curve ..." (launch/signals.py interrupted_line):
    nothing says that nothing can be resumed, nor, with checkpoints, which step trainer.resume=auto goes back to.
    (Seen by hand: 285 steps gone with that line alone.)"""
    run_dir = tmp_path / "run"
    code = interrupt_after_first_step(
        ["train", *small_demo_run(assets, run_dir, "trainer.total_steps=1000", "trainer.logger=[jsonl]")],
        run_dir, tmp_path / "stderr.txt")
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 130, err[-3000:]
    line = [line for line in err.splitlines() if "interrupted" in line.lower()][-1]
    saved = any((run_dir / "checkpoints").glob("*/COMPLETE")) if (run_dir / "checkpoints").is_dir() else False
    assert saved or "checkpoint" in line, f"no checkpoint left and the stop line does not say so: {line!r}"


def test_ctrl_c_during_start_up_is_one_line_and_status_130(assets, tmp_path):
    """Ctrl-C before the trainer's stop handlers are installed (launch/command.py: the trainer's imports,
    load_config, a hub download in resolve_hub_paths, which can take minutes) is a KeyboardInterrupt traceback
    with exit status 1, not the README's one line and 130. Here the signal arrives while the hub paths resolve."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import shardrl.config.hub as hub
        real = hub.resolve_hub_paths
        def slow_download(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C while a model downloads
            return real(*args, **kwargs)
        hub.resolve_hub_paths = slow_download
        from shardrl.cli import main
        sys.exit(main({["train", *small(assets, tmp_path / "run")]!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-1500:])


# ---- resuming --------------------------------------------------------------------------------------------------

def test_resuming_a_checkpoint_of_another_model_is_not_silent(assets, tmp_path, capsys, caplog):
    """trainer.resume=auto refuses a run folder that trained another model.path (run_folder.check_same_model), but
    trainer.resume=<checkpoint> with another model of the same shape loads that checkpoint's weights without a word,
    while the reference (and config.yaml's model.path) is the other model: the KL is then to a model the policy never
    started from. The check only looks at resume=auto."""
    import transformers

    first = tmp_path / "first"
    rc, err = cli(["train", *small(assets, first, "trainer.save_freq=1")], capsys)
    assert rc == 0, err[-2000:]
    checkpoint = next((first / "checkpoints").glob("step_*"))
    other = tmp_path / "other_model"
    shutil.copytree(assets / "model", other)
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(other)
    caplog.clear()  # (the first run's lines name its model too)
    rc, err = cli(["train", *small(assets, tmp_path / "second", f"model.path={other}", f"trainer.resume={checkpoint}",
                                   "trainer.total_steps=2")], capsys)
    assert rc != 0 or str(assets / "model") in err + caplog.text, \
        "a checkpoint of another model.path was resumed without a word naming the model it trained"


# ---- plot ------------------------------------------------------------------------------------------------------

def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 4}) + "\n"
                                                     for s in range(1, 4)))
    return run


def test_plot_to_a_path_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """`shardrl plot RUN --out PATH` where PATH cannot be written (under a file: NotADirectoryError; an
    unwritable folder: PermissionError) ends in matplotlib's traceback and exit status 1: cli.main turns only
    ValueError, FileNotFoundError and disk-full/read-only OSErrors into an error line."""
    run = _run_folder(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    rc, err = cli(["plot", str(run), "--out", str(tmp_path / "notes.txt" / "curve.png")], capsys)
    assert rc != 0 and err.startswith("error: ") and "notes.txt" in err


@pytest.mark.parametrize("out", ["curve", "folder"])
def test_plot_prints_the_path_of_the_image_it_wrote(tmp_path, capsys, out):
    """`--out curve` (no extension) or `--out SOME_FOLDER` writes `curve.png` / `SOME_FOLDER.png` (matplotlib adds
    the extension) but prints the path given, which is no image (or a folder): trainer/plot.py prints `out` as
    given, not what savefig wrote."""
    run = _run_folder(tmp_path)
    (tmp_path / "folder").mkdir()
    target = tmp_path / out
    rc = main(["plot", str(run), "--out", str(target)])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0
    assert Path(printed).is_file(), f"printed {printed!r}, which is not the image written"


# ---- serve -----------------------------------------------------------------------------------------------------

def test_serve_on_an_address_not_of_this_machine_does_not_blame_the_port(assets, capsys):
    """`--host` an address this machine does not have (or a name that does not resolve) is said as "cannot serve on
    192.0.2.1:PORT: Cannot assign requested address (another server there? pick a free port with --port)": the hint
    blames the port for every bind error (rollout/serving/frontend.py listening_sockets), so the user changes the
    port, which cannot help; the wrong thing is --host."""
    rc, err = cli(["serve", f"model.path={assets / 'model'}", "--host", "192.0.2.1", "--port", "0"], capsys)
    assert rc != 0 and "192.0.2.1" in err
    assert "another server there" not in err and "--host" in err, err


# ---- overrides -------------------------------------------------------------------------------------------------

def test_an_unknown_key_is_not_called_verls_name_for_its_last_two_parts(capsys):
    """`foo.optim.lr=1e-5` (a section that does not exist) is said to be "verl's name
    (actor_rollout_ref.actor.optim.lr); shardrl's is 'actor.optim.lr'": compat/verl/translate.py native_hint matches
    any key by its last two parts, so a typo'd section (`Actor.optim.lr`, `reward.optim.lr`) is blamed on verl."""
    rc, err = cli(["plan", "foo.optim.lr=1e-5"], capsys)
    assert rc == 2 and "unknown config key 'foo.optim.lr'" in err
    assert "verl's name" not in err, err
