"""verl's SFT command lines run as `shardrl sft --verl` (`shardrl.compat.verl.sft`): the key table against verl's
sft_trainer.yaml, verl's example scripts (tests/data/verl/examples/sft, verbatim) translated, one of them training
two steps on a tiny model, and what cannot run refused by its verl name."""

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardrl.compat.verl.defaults import VERL_SFT_DEFAULTS
from shardrl.compat.verl.sft import VERL_SFT_KEYS, translate_sft
from shardrl.compat.verl.translate import VerlKeyError
from shardrl.config.schema import SFTConfig, config_keys, load_config

SCRIPTS = Path(__file__).parent / "data" / "verl" / "examples" / "sft"


def sft_script_args(script: str, home: Path, *extra: str) -> list[str]:
    """The arguments `torchrun ... -m verl.trainer.fsdp_sft_trainer` gets from verl's script run as
    `script.sh 2 SAVE_PATH EXTRA...` (its usage), as bash expands them with HOME."""
    shim = 'torchrun() { printf "%s\\0" "$@"; }; source "$0" 2 "$@"'  # the command prints its argv instead
    out = subprocess.run(["bash", "-c", shim, str(SCRIPTS / script), str(home / "save"), *extra],
                         env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, capture_output=True, check=True,
                         cwd=home).stdout.decode()
    args = out.split("\0")[:-1]
    start = args.index("verl.trainer.fsdp_sft_trainer")
    assert args[start - 1] == "-m"
    return args[start + 1:]


def native(translation) -> dict:
    return {o.split("=", 1)[0]: json.loads(o.split("=", 1)[1]) for o in translation.overrides}


def test_every_verl_sft_key_has_a_rule_and_every_target_is_a_shardrl_sft_key():
    assert sorted(VERL_SFT_KEYS) == sorted(VERL_SFT_DEFAULTS)
    keys = set(config_keys(SFTConfig))
    assert not sorted(r.target for r in VERL_SFT_KEYS.values() if r.target and r.target not in keys)


def test_verls_gemma_sft_script_translates(tmp_path):
    got = native(translate_sft(sft_script_args("gsm8k/run_gemma_2b.sh", tmp_path)))
    home = str(tmp_path)
    assert got == {
        "data.train_files": [f"{home}/data/gsm8k/train.parquet"], "data.val_files": [f"{home}/data/gsm8k/test.parquet"],
        # data.prompt_key=extra_info + data.prompt_dict_keys=['question']: a field of the extra_info column
        "data.prompt_key": "extra_info.question", "data.response_key": "extra_info.answer",
        "engine.micro_batch_size_per_gpu": 4, "engine.use_dynamic_bsz": False,
        "model.path": "google/gemma-2b-it", "trainer.output_dir": f"{home}/save",
        "trainer.project_name": "gsm8k-sft", "trainer.experiment_name": "gsm8k-sft-gemma-2b-it",
        "trainer.total_epochs": 2, "trainer.logger": ["console", "wandb", "jsonl"],
        # verl's SFT defaults the script relies on (sft_trainer.yaml)
        "data.batch_size": 256, "model.gradient_checkpointing": True, "optim.betas": [0.9, 0.95],
        "optim.warmup_ratio": 0.1, "optim.lr_schedule": "cosine", "model.use_remove_padding": False,
        "trainer.keep_last": 0, "trainer.resume": "auto",
        "trainer.export_hf": True}  # verl saves the model at its last step


def test_verls_multiturn_sft_script_translates(tmp_path):
    t = translate_sft(sft_script_args("multiturn/run_qwen_05_sp2.sh", tmp_path))
    got = native(t)
    assert got["data.messages_key"] == "messages" and got["engine.ulysses_sequence_parallel_size"] == 2
    assert got["model.use_remove_padding"] is True and got["trainer.total_steps"] == 1
    assert (got["data.prompt_key"], got["data.response_key"]) == ("question", "answer")  # verl's defaults
    # data.micro_batch_size=4 is verl's deprecated key, which its SFT trainer never reads: its default 4 per GPU cuts
    assert got["engine.micro_batch_size_per_gpu"] == 4 and "does not read it" in t.dropped["data.micro_batch_size"]
    assert "shardrl sft KEY=VALUE" in t.describe()


def test_what_shardrl_sft_cannot_run_is_refused_by_its_verl_name_all_at_once():
    with pytest.raises(VerlKeyError) as e:
        translate_sft(["model.partial_pretrain=/m", "optim.lr_scheduler=wsd", "data.truncation=left",
                       "model.fsdp_config.cpu_offload=True", "data.prompt_keys=question"])
    message = str(e.value)
    for part in ("optim.lr_scheduler='wsd'", "data.truncation='left'", "model.fsdp_config.cpu_offload=True",
                 "data.prompt_keys (verl's SFT trainer has no such key; did you mean data.prompt_key?)"):
        assert part in message
    with pytest.raises(VerlKeyError, match="gives no model.partial_pretrain"):
        translate_sft(["data.train_files=/d.parquet"])


def write_gsm8k_sft_assets(home: Path) -> None:
    """A tiny model folder, and parquet files in the layout verl's examples/data_preprocess/gsm8k.py writes (the
    question and answer under extra_info), where verl's SFT scripts read them."""
    from shardrl.testing import save_char_model

    save_char_model(home / "model")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "question": f"what is {i} plus {i}?",
                            "answer": f"{i}+{i}={2 * i} #### {2 * i}"}} for i in range(10)]
    (home / "data" / "gsm8k").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:8]), home / "data" / "gsm8k" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[8:]), home / "data" / "gsm8k" / "test.parquet")


def test_verls_lora_sft_script_trains_two_steps(tmp_path):
    """verl's run_qwen_05_peft.sh with only the model's path and the sizes changed (its $@): LoRA rank 32, the
    prompt and response read from the extra_info column, verl's SFT optimizer defaults."""
    from shardrl.cli import main

    home = tmp_path / "home"
    home.mkdir()
    write_gsm8k_sft_assets(home)
    args = sft_script_args("gsm8k/run_qwen_05_peft.sh", home, f"model.partial_pretrain={home / 'model'}",
                           "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "data.max_length=128",
                           "trainer.total_training_steps=2")
    assert main(["sft", "--verl", *args]) == 0
    run_dir = home / "save"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["sft/loss"] < 10 for r in records)
    assert (run_dir / "hf_model" / "config.json").is_file()  # the trained model, as verl saves it at the end
    saved = load_config(str(run_dir / "config.yaml"), cls=SFTConfig)
    assert (saved.model.lora.rank, saved.optim.lr, saved.optim.betas) == (32, 1e-4, [0.9, 0.95])
    assert (saved.data.prompt_key, saved.data.batch_size, saved.engine.micro_batch_size_per_gpu) == (
        "extra_info.question", 4, 2)


def test_a_dotted_sft_key_reads_a_field_of_a_dict_column(tmp_path):
    from shardrl.data.chat import load_chat_dataset
    from shardrl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    pq.write_table(pa.Table.from_pylist([{"extra_info": {"question": "1+1?", "answer": "2"}}]), tmp_path / "n.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "response": "2"}]), tmp_path / "f.parquet")
    got = load_chat_dataset([str(tmp_path / "n.parquet")], tok, 64, prompt_key="extra_info.question",
                            response_key="extra_info.answer")
    want = load_chat_dataset([str(tmp_path / "f.parquet")], tok, 64)
    assert got[0]["input_ids"] == want[0]["input_ids"] and got[0]["loss_mask"] == want[0]["loss_mask"]
    assert sum(got[0]["loss_mask"]) > 0
