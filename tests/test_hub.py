"""Hub ids where a config takes a model folder (`model.path=org/name`): resolved from a hub-layout cache made here
(HF_HUB_CACHE, HF_HUB_OFFLINE=1: nothing reaches the network), else downloaded; not in the cache offline, one line
saying how to get it."""

import json
import shutil

import pytest
import yaml

from shardrl.cli import main
from shardrl.config.hub import hub_folder, is_hub_id, resolve_hub_paths
from shardrl.config.schema import Config, DPOConfig

SHA = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache, repo_id, make):
    """A hub cache's entry for `repo_id` as huggingface_hub lays it out: models--org--name/refs/main names the
    snapshot folder that `make` fills."""
    entry = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = entry / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(SHA)
    make(snapshot)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A cache holding the tiny char model as org/tiny, offline."""
    from shardrl.testing import save_char_model

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, _cached(cache, "org/tiny", lambda folder: save_char_model(folder, hidden_size=16,
                                                                            intermediate_size=32))


def test_every_model_key_takes_a_hub_id_from_the_cache(hub, tmp_path):
    cache, snapshot = hub
    cfg = Config()
    cfg.model.path = cfg.critic.model_path = cfg.reward.model_path = "org/tiny"
    cfg.model.tokenizer_path = str(tmp_path)  # a local folder stays as it is
    assert resolve_hub_paths(cfg) == [f"model.path={snapshot}", f"critic.model_path={snapshot}",
                                      f"reward.model_path={snapshot}"]
    assert (cfg.model.path, cfg.critic.model_path, cfg.model.tokenizer_path) == (str(snapshot), str(snapshot),
                                                                                  str(tmp_path))
    dpo = DPOConfig()
    dpo.model.tokenizer_path, dpo.dpo.ref_model_path = "org/tiny", "org/tiny"
    assert resolve_hub_paths(dpo) == [f"model.tokenizer_path={snapshot}", f"dpo.ref_model_path={snapshot}"]
    assert resolve_hub_paths(dpo) == []  # resolved once: the folders are local now
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("model") and not is_hub_id("../org/tiny")


def test_plan_and_an_sft_run_take_a_hub_id_and_the_run_records_the_local_folder(hub, tmp_path, capsys):
    cache, snapshot = hub
    assert main(["plan", "model.path=org/tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_skipped"] is None and out["memory"]["num_params"] > 0
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(8)))
    run_dir = tmp_path / "run"
    assert main(["sft", "model.path=org/tiny", f"data.train_files=[{rows}]", "data.batch_size=4",
                 "trainer.total_steps=1", "trainer.logger=[jsonl]", f"trainer.output_dir={run_dir}",
                 "trainer.device=cpu"]) == 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"] == str(snapshot)


def test_a_hub_id_not_in_the_cache_offline_is_one_error_line(hub, tmp_path, capsys):
    cache, _ = hub
    assert main(["sft", "model.path=org/missing", "data.train_files=[x.jsonl]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.path='org/missing' is no local folder, and the hub id is not in the Hugging Face "
                   f"cache ({cache}) while HF_HUB_OFFLINE is set: download it with `hf download org/missing` (or "
                   f"`huggingface-cli download org/missing`) where the hub is reachable, into this cache "
                   f"(HF_HUB_CACHE={cache}), or give a local model folder, or unset HF_HUB_OFFLINE to let shardrl "
                   f"download it"]
    assert main(["plan", "model.path=org/missing", "--json"]) == 0  # the layout still stands; the ledger says why not
    assert "'org/missing' is no local folder, and the hub id is not in" in json.loads(
        capsys.readouterr().out)["memory_skipped"]
    _cached(cache, "org/config-only", lambda folder: shutil.copy(hub[1] / "config.json", folder))
    with pytest.raises(ValueError, match=r"model.path='org/config-only' is no local folder, and the hub id is in the "
                                         r"Hugging Face cache \(.*\) without weights \(\*.safetensors\) while "
                                         r"HF_HUB_OFFLINE is set"):
        hub_folder("model.path", "org/config-only")
    assert hub_folder("model.path", "org/config-only", "config").endswith(SHA)  # all `shardrl plan` reads


def test_online_the_cache_comes_first_then_a_download(hub, monkeypatch):
    import shardrl.config.hub as hub_module
    from huggingface_hub import constants

    cache, snapshot = hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    downloads = []

    def download(repo_id, files, cache_dir):  # the hub, here: fills the cache as snapshot_download would
        downloads.append((repo_id, files, cache_dir))
        return str(_cached(cache, repo_id, lambda folder: shutil.copytree(snapshot, folder, dirs_exist_ok=True)))

    monkeypatch.setattr(hub_module, "_download", download)
    assert hub_folder("model.path", "org/tiny") == str(snapshot) and downloads == []  # cached: no hub call
    folder = hub_folder("reward.model_path", "org/other")  # not cached: downloaded, into HF_HUB_CACHE
    assert downloads == [("org/other", "model", str(cache))]
    assert folder == str(cache / "models--org--other" / "snapshots" / SHA)


def test_serve_resolves_a_hub_id_and_names_the_model_by_it(hub):
    from shardrl.cli import _serve_hub_paths

    cache, snapshot = hub
    cfg = Config()
    cfg.model.path = "org/tiny"
    assert _serve_hub_paths(cfg) == "org/tiny" and cfg.model.path == str(snapshot)  # not the snapshot's hash
    assert _serve_hub_paths(cfg) is None  # a local folder: named by the folder, as before


def test_the_hub_out_of_reach_is_one_line_naming_the_download(hub, monkeypatch):
    import shardrl.config.hub as hub_module
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache, _ = hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(repo_id, files, cache_dir):  # what snapshot_download raises without a network
        raise LocalEntryNotFoundError("An error happened while trying to locate the files") from ConnectionError()

    monkeypatch.setattr(hub_module, "_download", unreachable)
    with pytest.raises(ValueError) as e:
        hub_folder("model.path", "org/missing")
    assert str(e.value) == (f"model.path='org/missing' is no local folder, and the hub id is not in the Hugging Face "
                            f"cache ({cache}); the hub could not be reached (ConnectionError): download it with `hf "
                            f"download org/missing` (or `huggingface-cli download org/missing`) where the hub is "
                            f"reachable, into this cache (HF_HUB_CACHE={cache}), or give a local model folder")
