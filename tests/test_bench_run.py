"""bench/run.py, the benchmarks' one runner: its sets name scripts that exist, a step's JSON lines are collected and
tagged, a pytest step becomes its counts, and a step past its time limit is ended with what it spawned."""

import json
import os
import sys
import time

import pytest

from bench import run


def test_every_step_of_every_set_names_a_script_that_exists():
    for name, (about, steps) in run.SETS.items():
        assert about and steps, name
        for step in steps:
            script = step.argv[1] if not step.pytest else None
            if script is not None:
                assert os.path.isfile(script), (name, step.name, script)
            else:
                paths = [a for a in step.argv if a.startswith("tests/")]
                assert paths and all(os.path.exists(p) for p in paths), (name, step.name)
    assert {"check", "cuda-tests", "whole-step", "rollout", "server", "lora", "moe"} <= set(run.SETS)


def test_a_steps_json_lines_are_collected_with_its_set_and_step(tmp_path):
    printing = run.Step("prints", (sys.executable, "-c", "print('noise'); print('{\"x\": 1}'); print('{bad')"),
                        limit_s=60, out_flag=False)
    summary = run.run_step(printing, "demo", str(tmp_path))
    assert summary["rc"] == 0 and summary["results"] == 1 and not summary["timed_out"]
    lines = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert lines == [{"set": "demo", "step": "prints", "x": 1}]


def test_a_pytest_step_becomes_its_counts(tmp_path):
    log = tmp_path / "logs" / "t.log"
    log.parent.mkdir()
    log.write_text("FAILED tests/test_a.py::test_b - boom\n1 failed, 3 passed, 2 skipped in 4.20s\n")
    counts = run._pytest_counts(str(log))
    assert counts == {"failed": 1, "passed": 3, "skipped": 2, "failures": ["tests/test_a.py::test_b"]}


@pytest.mark.skipif(sys.platform != "linux", reason="process groups as on the GPU machines")
def test_a_step_past_its_limit_is_ended_with_the_processes_it_spawned(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    summary = run.run_step(run.Step("sleeps", (sys.executable, "-c", code), limit_s=2, out_flag=False),
                           "demo", str(tmp_path))
    assert summary["timed_out"] and summary["seconds"] < 30
    child = int(pid_file.read_text())
    assert _ended(child, within_s=5.0)  # the grandchild went with the group


def _ended(pid: int, within_s: float) -> bool:
    """Whether `pid` is gone (or a zombie no one reaped yet) within `within_s` seconds."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_wheels_of_several_folders_are_installed_once_each_and_two_versions_refused(tmp_path):
    for folder, files in (("a", ["x-1.0-py3-none-any.whl", "y-2.0-py3-none-any.whl"]),
                          ("b", ["x-1.0-py3-none-any.whl", "z-0.1-py3-none-any.whl"]),
                          ("c", ["X-1.1-py3-none-any.whl"])):
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_text("")
    got = run.collect_wheels(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert sorted(os.path.basename(p) for p in got) == [
        "x-1.0-py3-none-any.whl", "y-2.0-py3-none-any.whl", "z-0.1-py3-none-any.whl"]
    with pytest.raises(SystemExit, match="X 1.0 and 1.1 are both in"):
        run.collect_wheels(f"{tmp_path / 'a'},{tmp_path / 'c'}")
    with pytest.raises(SystemExit, match="no wheels under"):
        run.collect_wheels(str(tmp_path / "nothing"))


def test_a_step_with_a_tree_runs_that_trees_code_and_its_lines_land_in_the_output(tmp_path):
    """`Step.cwd` (a baseline tree unpacked by bench/base_tree.sh): the step runs there, that tree first on its
    PYTHONPATH, and the JSON lines it writes to `--out` reach the runner's output folder, wherever that is."""
    tree = tmp_path / "base"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("WHO = 'base'\n")
    script = ("import argparse, json, os, pkg; p = argparse.ArgumentParser(); p.add_argument('--out'); "
              "a = p.parse_args(); open(a.out, 'a').write(json.dumps({'who': pkg.WHO, 'cwd': os.getcwd()}) + '\\n')")
    step = run.Step("in_tree", (sys.executable, "-c", script), limit_s=60, cwd=str(tree))
    out = tmp_path / "out"
    summary = run.run_step(step, "demo", str(out))
    assert summary["rc"] == 0 and summary["results"] == 1, (out / "logs" / "in_tree.log").read_text()
    line = json.loads((out / "results.jsonl").read_text())
    assert line == {"set": "demo", "step": "in_tree", "who": "base", "cwd": str(tree)}


def test_the_baseline_tree_script_unpacks_an_archive_and_refuses_a_missing_one(tmp_path):
    import subprocess

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "marker.txt").write_text("old commit\n")
    archive = tmp_path / "base.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tmp_path / "src"), "marker.txt"], check=True)
    dest = tmp_path / "tree"
    ok = subprocess.run(["bash", "bench/base_tree.sh", str(dest)], env=dict(os.environ, BASE_TAR=str(archive)),
                        capture_output=True, text=True)
    assert ok.returncode == 0 and (dest / "marker.txt").read_text() == "old commit\n"
    missing = subprocess.run(["bash", "bench/base_tree.sh", str(dest)],
                             env=dict(os.environ, BASE_TAR=str(tmp_path / "none.tar")), capture_output=True, text=True)
    assert missing.returncode == 2 and "git archive" in missing.stderr
