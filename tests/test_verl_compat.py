"""verl's command lines run as shardrl runs (`shardrl train --verl`): the key table, verl's value conventions, and
verl's own example scripts (tests/data/verl, verbatim) training two steps on CPU."""

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardrl.config.schema import config_keys, Config, load_config
from shardrl.compat.verl.translate import VERL_KEYS, VerlKeyError, config_file_args, translate

DATA = Path(__file__).parent / "data" / "verl"


def script_args(script: str, home: Path, cwd: Path | None = None) -> list[str]:
    """The arguments `python3 -m verl.trainer.main_ppo` gets from verl's script, as bash expands them with HOME (in
    `cwd`, the verl checkout a script runs from)."""
    # the command prints its argv instead; `set -x`'s trace goes elsewhere (a script may pipe 2>&1 into tee)
    shim = 'python3() { printf "%s\\0" "$@"; }; ulimit() { :; }; exec 9>/dev/null; BASH_XTRACEFD=9; source "$0"'
    out = subprocess.run(["bash", "-c", shim, str(DATA / script)], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                         capture_output=True, check=True, cwd=cwd).stdout.decode()
    args = out.split("\0")[:-1]
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    return args[2:]


def native(translation) -> dict:
    return {o.split("=", 1)[0]: json.loads(o.split("=", 1)[1]) for o in translation.overrides}


def test_every_target_of_the_table_is_a_shardrl_key():
    keys = set(config_keys(Config))
    assert not sorted(r.target for r in VERL_KEYS.values() if r.target and r.target not in keys)


def test_verls_qwen3_8b_grpo_script_translates(tmp_path):
    t = translate(script_args("run_qwen3-8b.sh", tmp_path))
    got = native(t)
    home = str(tmp_path)
    assert got == {
        "algorithm.adv_estimator": "grpo",
        "data.train_files": [f"{home}/data/gsm8k/train.parquet"], "data.val_files": [f"{home}/data/gsm8k/test.parquet"],
        "data.train_batch_size": 1024, "data.max_prompt_length": 512,
        "data.truncation": "drop",  # filter_overlong_prompts=True: verl drops the long prompts first
        "model.path": "Qwen/Qwen3-8B", "actor.optim.lr": 1e-6, "model.use_remove_padding": True,
        "actor.ppo_mini_batch_size": 256, "actor.engine.micro_batch_size_per_gpu": 32, "actor.use_kl_loss": True,
        "actor.kl_loss_coef": 0.001, "actor.kl_loss_type": "low_var_kl", "actor.entropy_coeff": 0,
        "model.gradient_checkpointing": True, "actor.engine.offload_params": False,
        "actor.engine.offload_optimizer": False, "rollout.n": 5, "ref.engine.micro_batch_size_per_gpu": 32,
        "ref.engine.offload_params": True, "algorithm.use_kl_in_reward": False,
        "trainer.logger": ["console", "wandb", "jsonl"], "trainer.project_name": "verl_grpo_example_gsm8k",
        "trainer.experiment_name": "qwen3_8b_function_rm", "trainer.nproc_per_node": 8, "trainer.nnodes": 1,
        "trainer.save_freq": 20, "trainer.val_freq": 5, "trainer.total_epochs": 15,
        # verl's defaults the script relies on
        "actor.shuffle": False, "trainer.val_before_train": True,
        "trainer.log_val_generations": 0, "trainer.resume": "auto", "trainer.keep_last": 0,
        "rollout.multi_turn.max_turns": 0, "rollout.multi_turn.max_tool_output_chars": 256,
        "rollout.multi_turn.tool_output_truncate_side": "middle",
        "rollout.max_new_tokens": 1024, "rollout.multi_turn.max_response_tokens": 1024,
        "trainer.verl_metric_names": True, "rollout.multi_turn.reward_text": "conversation",
    }
    assert set(t.dropped) == {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size",
                              "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.gpu_memory_utilization"}
    assert "vLLM" in t.dropped["actor_rollout_ref.rollout.name"] and "model.path=" in t.describe()
    load_config(None, t.overrides)  # the native config is valid as it stands (8 GPUs, 1024 prompts)


def test_verls_value_conventions():
    got = native(translate([
        "data.train_files=~/data/train.parquet", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.do_sample=False",
        "trainer.resume_mode=disable", "trainer.total_epochs=3", "trainer.total_training_steps=7",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
        "actor_rollout_ref.actor.optim.total_training_steps=-1", "+actor_rollout_ref.actor.clip_ratio=0.3",
        "trainer.max_actor_ckpt_to_keep=null", "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
        "actor_rollout_ref.model.path=m", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05"]))
    assert got["data.train_files"][0].endswith("/data/train.parquet") and "~" not in got["data.train_files"][0]
    assert (got["trainer.save_freq"], got["trainer.val_freq"], got["rollout.top_k"]) == (0, 0, 0)
    assert got["rollout.temperature"] == 0.0 and got["rollout.val_kwargs.temperature"] == 0.0
    assert got["trainer.resume"] == "never" and got["actor.loss_mode"] == "gspo_token"  # verl's gspo is gspo_token
    assert (got["trainer.total_steps"], got["trainer.total_epochs"]) == (7, 3)  # verl: whichever comes first
    assert (got["actor.optim.warmup_steps"], got["actor.optim.total_steps"], got["trainer.keep_last"]) == (0, None, 0)
    assert "actor.clip_ratio_low" not in got  # verl reads clip_ratio only where clip_ratio_low/high are null
    assert got["algorithm.kl_target"] == 0.05
    got = native(translate(["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=null",
                            "actor_rollout_ref.model.path=m"]))
    assert got["actor.clip_ratio_low"] == 0.3 and "actor.clip_ratio_high" not in got


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.actor.no_such_key=1"], r"verl key\(s\) shardrl cannot run: actor_rollout_ref.actor.no_such_key"),
    (["actor_rollout_ref.actor.ppo_mini_batchsize=4"], r"did you mean actor_rollout_ref.actor.ppo_mini_batch_size\?"),
    (["critic.model.lora_rank=8"], r"critic.model.lora_rank=8: LoRA on the critic is not supported"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"], r"loss_mode='clip_cov': policy loss 'clip_cov' is not"),
    (["data.truncation=middle"], r"data.truncation='middle'"),
    (["trainer.critic_warmup=2"], r"trainer.critic_warmup=2: critic warm-up is not supported"),
    (["trainer.resume_mode=resume_path"], r"resume_mode=resume_path needs trainer.resume_from_path"),
    (["~trainer.logger"], r"Hydra's ~key deletion is not supported"),
])
def test_what_shardrl_cannot_run_is_refused_by_its_verl_name(args, message):
    with pytest.raises(VerlKeyError, match=message):
        translate(args)


def save_char_model_with_chatml(folder: Path) -> None:
    """The tiny char model, its tokenizer given a ChatML template that renders tools, as Qwen's does."""
    from shardrl.testing import save_char_model

    tok = save_char_model(folder)
    tok.chat_template = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                         "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(folder)


def write_verl_assets(home: Path) -> None:
    """A tiny model folder and parquet files in the layouts verl's preprocessing scripts write
    (examples/data_preprocess/gsm8k.py and math_dataset.py), under `home` as verl's scripts expect them."""
    from shardrl.testing import save_char_model

    save_char_model(home / "model")
    gsm8k = "Let's think step by step and output the final answer after \"####\"."
    rows = {"gsm8k": [{"data_source": "openai/gsm8k", "ability": "math",
                       "prompt": [{"role": "user", "content": f"{i}+{i}? {gsm8k}"}],
                       "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                       "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}", "question": f"{i}+{i}?"}}
                      for i in range(12)],
            "math": [{"data_source": "DigitalLearningGmbH/MATH-lighteval", "ability": "Algebra",
                      "prompt": [{"role": "user", "content": f"{i}*3? Let's think step by step and output the final "
                                                             "answer within \\boxed{}."}],
                      "reward_model": {"style": "rule", "ground_truth": str(3 * i)},
                      "extra_info": {"split": "train", "index": i}} for i in range(12)]}
    for name, table in rows.items():
        (home / "data" / name).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(table[:8]), home / "data" / name / "train.parquet")
        pq.write_table(pa.Table.from_pylist(table[8:]), home / "data" / name / "test.parquet")


# what a user appends to the script (it ends with $@): the local model, and sizes for a CPU
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=8",
         "data.max_prompt_length=256", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
         "trainer.logger=console", "trainer.test_freq=1", "actor_rollout_ref.rollout.n=2"]


@pytest.mark.parametrize("script, sources", [("run_qwen3-8b.sh", ["openai/gsm8k"]),
                                             ("run_qwen2-7b_math.sh",
                                              ["DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k"])])
def test_verls_example_scripts_train_two_steps(script, sources, tmp_path):
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    run_dir = tmp_path / "run"
    args = script_args(script, home) + [f"actor_rollout_ref.model.path={home / 'model'}",
                                        f"trainer.default_local_dir={run_dir}", *SMALL,
                                        "actor_rollout_ref.rollout.val_kwargs.n=2",
                                        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                                        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
    assert main(["train", "--verl", *args]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # verl validates before training by default
    for r in (records[0], records[2]):
        for source in sources:  # per data source, sampled twice per prompt, under verl's names too
            assert 0 <= r[f"val/{source}/reward_mean@2"] <= 1
            assert r[f"val-core/{source}/reward/mean@2"] == r[f"val/{source}/reward_mean@2"]
    step = records[1]
    assert step["critic/score/mean"] == step["reward/mean"] and step["response_length/mean"] == step[
        "response/length_mean"]
    for phase in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "testing"):
        assert step[f"timing_s/{phase}"] >= 0
    assert records[2]["timing_s/save_checkpoint"] >= 0 and step["training/global_step"] == 1
    assert step["timing_per_token_ms/gen"] == pytest.approx(step["timing_s/gen"] * 1000 / step["response/num_tokens"])
    # the script's own settings reached the run: the KL loss (low_var_kl), the reference offloaded
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.actor.use_kl_loss and saved.ref.engine.offload_params and saved.rollout.n == 2
    script_micro = next(a for a in args if a.startswith("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="))
    assert saved.ref.engine.micro_batch_size_per_gpu == int(script_micro.split("=")[1]) != 2
    assert saved.actor.engine.micro_batch_size_per_gpu == 2


def test_a_verl_reward_file_with_reward_kwargs(tmp_path):
    """custom_reward_function.{path,name,reward_kwargs} as verl passes them: by name, with the kwargs."""
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def my_score(solution_str, ground_truth, bonus=0.0):\n    return bonus\n")
    run_dir = tmp_path / "run"
    args = [f"actor_rollout_ref.model.path={home / 'model'}", f"data.train_files={home}/data/gsm8k/train.parquet",
            "data.val_files=[]", f"custom_reward_function.path={reward}", "custom_reward_function.name=my_score",
            "+custom_reward_function.reward_kwargs.bonus=0.75", "algorithm.adv_estimator=grpo",
            f"trainer.default_local_dir={run_dir}", *SMALL, "trainer.total_training_steps=1"]
    assert main(["train", "--verl", *args]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["reward/mean"] == 0.75


def test_the_reference_takes_the_actors_dtype_so_the_first_kl_is_zero(tmp_path):
    """With an fp32 actor and no ref settings, the reference computes in fp32 too (verl's inheritance): the
    on-policy KL loss of the first update is exactly 0. A bf16 reference is not."""
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    common = [f"model.path={home / 'model'}", f"data.train_files=[{home}/data/gsm8k/train.parquet]",
              "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=8",
              "actor.use_kl_loss=true", "actor.engine.param_dtype=float32", "trainer.total_steps=1",
              "trainer.logger=[jsonl]"]
    kl = {}
    for name, extra in (("inherited", []), ("bf16_ref", ["ref.engine.param_dtype=bfloat16"])):
        assert main(["train", *common, *extra, f"trainer.output_dir={tmp_path / name}"]) == 0
        kl[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["actor/kl_loss"]
    assert kl["inherited"] == 0.0 and kl["bf16_ref"] > 1e-8


def test_verls_gsm8k_tool_example_runs_from_its_config(tmp_path):
    """examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh as verl ships it: its Hydra config
    (--config-path/--config-name), verl's tool config (verl's own gsm8k tool), data in the layout of verl's
    gsm8k_multiturn_w_tool.py; one step and validation on CPU."""
    from shardrl.cli import main

    home = tmp_path / "home"
    save_char_model_with_chatml(home / "model")
    system = "You are a math expert. Use the `calc_gsm8k_reward` tool. Put your final answer as `#### <answer>`."
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": system}, {"role": "user", "content": f"{i}+{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "need_tools_kwargs": True,
                            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(2 * i)}}}}}
            for i in range(10)]
    (home / "data" / "gsm8k").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:8]), home / "data" / "gsm8k" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[8:]), home / "data" / "gsm8k" / "test.parquet")
    argv = script_args("examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh", home, cwd=DATA)
    assert argv[0].startswith("--config-path=") and argv[1] == "--config-name=gsm8k_multiturn_grpo"
    run_dir = tmp_path / "run"
    args = argv + [f"actor_rollout_ref.model.path={home / 'model'}", f"trainer.default_local_dir={run_dir}",
                   *SMALL, "trainer.total_training_steps=1", "data.max_response_length=24", "data.max_prompt_length=1024",
                   "trainer.log_val_generations=1"]
    assert main(["train", "--verl", *args]) == 0
    saved = load_config(str(run_dir / "config.yaml"))
    mt = saved.rollout.multi_turn
    assert mt.enable and mt.max_turns == 5 and mt.tool_config_path.endswith("gsm8k_tool_config.yaml")
    assert mt.reward_text == "conversation" and saved.rollout.n == 2  # the command line's n wins over 16
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and "multi_turn/num_turns_mean" in records[1]
    assert "val/openai/gsm8k/reward_mean@1" in records[0]
    shown = json.loads((run_dir / "generations.jsonl").read_text().splitlines()[0])["prompt"]
    assert '"name": "calc_gsm8k_reward"' in shown and system in shown  # the tool schema reached the chat template


def test_plan_lays_out_a_verl_command_line(tmp_path, capsys):
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    args = script_args("run_qwen3-8b.sh", home) + [f"actor_rollout_ref.model.path={home / 'model'}"]
    assert main(["plan", "--verl", *args]) == 0
    out = capsys.readouterr().out
    assert "1 nodes x 8 procs = 8" in out and "1024 (train_batch_size) x 5 (n) = 5120" in out


def test_verl_values_read_as_hydra_reads_them_and_pairs_by_verls_precedence():
    got = native(translate([
        "actor_rollout_ref.model.path=m", "trainer.experiment_name=2025-01-31", "trainer.project_name=12:30",
        "actor_rollout_ref.actor.optim.lr=5e-7", "trainer.total_training_steps=null", "trainer.total_epochs=2",
        "actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor_rollout_ref.actor.fsdp_config.offload_policy=False",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "data.max_response_length=64", "actor_rollout_ref.rollout.response_length=32",
        "critic.checkpoint.async_save=False", "global_profiler.steps=[1,2]",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16", "+reward_model.reward_kwargs.max_resp_len=32",
        "data.train_batch_size=8", "data.gen_batch_size=8", "algorithm.filter_groups.metric=acc"]))
    assert got["trainer.experiment_name"] == "2025-01-31" and got["trainer.project_name"] == "12:30"
    assert got["actor.optim.lr"] == 5e-7 and "trainer.total_steps" not in got and got["trainer.total_epochs"] == 2
    assert got["actor.optim.clip_grad"] == 0.5  # verl reads actor.grad_clip, whatever the order
    assert got["actor.engine.offload_params"] is True  # either verl key offloads
    assert (got["actor.loss_mode"], got["actor.loss_agg_mode"]) == ("gspo_token", "seq-mean-token-mean")
    assert got["rollout.max_new_tokens"] == 32  # the rollout's own limit is what verl generates to
    assert got["reward.overlong_buffer.enable"] is True and got["reward.overlong_buffer.len"] == 16
    assert "critic.checkpoint.async_save" in translate(["actor_rollout_ref.model.path=m",
                                                        "critic.checkpoint.async_save=False"]).dropped


@pytest.mark.parametrize("args, message", [
    (["critic.checkpoint.async_save=True"], r"critic.checkpoint.async_save=True \(verl's default False; shardrl has "
                                            r"no such setting"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], r"Megatron is not supported"),
    (["critic.model.path=${actor_rollout_ref.model.path}"], r"is a Hydra interpolation"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"], r"Dr. GRPO's seq-mean-token-sum-norm"),
    (["actor_rollout_ref.actor.kl_loss_type=full"], r"the full-vocabulary KL is not supported"),
    (["data.max_response_length=64", "+reward_model.reward_kwargs.max_resp_len=32"], r"max_resp_len=32 differs"),
    # on-policy distillation: verl's trainer has no key of it (its GKD recipe's are refused by name), nor opd
    (["actor_rollout_ref.teacher.server_ip=127.0.0.1"], r"teacher.server_ip='127.0.0.1': is a key of verl's on-policy "
                                                        r"distillation recipe \(recipe/gkd.*teacher.model_path"),
    (["trainer.scheduler=one_step_off"], r"trainer.scheduler='one_step_off': is a key of verl's on-policy "
                                         r"distillation recipe"),
    (["algorithm.adv_estimator=opd"], r"opd is shardrl's on-policy distillation, not a verl estimator"),
])
def test_more_of_what_shardrl_cannot_run_is_refused(args, message):
    with pytest.raises(VerlKeyError, match=message):
        translate(args)


def test_every_refusal_of_a_command_line_is_shown_at_once():
    with pytest.raises(VerlKeyError) as e:
        translate(["actor_rollout_ref.model.path=m", "actor_rollout_ref.actor.no_such_key=1",
                   "critic.checkpoint.async_save=True", "trainer.critic_warmup=2",
                   "actor_rollout_ref.actor.kl_loss_type=full", "data.max_response_length=64",
                   "+reward_model.reward_kwargs.max_resp_len=32"])
    message = str(e.value)
    assert message.startswith("verl key(s) shardrl cannot run (5):\n  - ")
    for part in ("actor_rollout_ref.actor.no_such_key (verl has no such key",  # unknown
                 "critic.checkpoint.async_save=True (verl's default False",  # not verl's default
                 "trainer.critic_warmup=2: critic warm-up is not supported",  # a refused value
                 "actor_rollout_ref.actor.kl_loss_type='full': ",  # a conversion's
                 "reward_model.reward_kwargs.max_resp_len=32: the DAPO penalty's max_resp_len=32 differs"):  # a rule setting several keys
        assert f"\n  - {part}" in message, (part, message)


def test_verls_tool_answer_cuts_and_the_epoch_limit():
    from shardrl.rollout.episodes.multiturn import cut_tool_answer
    from shardrl.trainer.state import resolve_total_epochs

    assert cut_tool_answer("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert cut_tool_answer("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert cut_tool_answer("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert cut_tool_answer("abc", 4, "middle") == "abc"
    both = load_config(None, ["trainer.total_epochs=1", "trainer.total_steps=10"]).trainer
    assert "stopped first" not in resolve_total_epochs(both, 16, 4) and both.total_steps == 4  # verl: the smaller
    epochs_only = load_config(None, ["trainer.total_epochs=3"]).trainer
    resolve_total_epochs(epochs_only, 16, 4)
    assert epochs_only.total_steps == 12  # total_steps' default does not cap the epochs
    steps_first = load_config(None, ["trainer.total_epochs=3", "trainer.total_steps=5"]).trainer
    assert "stopped first by trainer.total_steps=5" in resolve_total_epochs(steps_first, 16, 4)
    assert load_config(None, ["actor.shuffle=false"]).critic.shuffle is False  # the critic takes the actor's


def test_a_prompt_key_the_data_lacks_names_the_key_not_skip_bad_rows(tmp_path, capsys):
    """data.prompt_key=question on verl's gsm8k parquet (its prompts under `prompt`): the error advised
    data.skip_bad_rows, which --verl refuses (it is no verl key) and which would drop every row."""
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    train = home / "data" / "gsm8k" / "train.parquet"
    args = [f"actor_rollout_ref.model.path={home / 'model'}", f"data.train_files={train}", "data.val_files=[]",
            "data.prompt_key=question", "algorithm.adv_estimator=grpo", f"trainer.default_local_dir={tmp_path / 'run'}",
            *SMALL]
    assert main(["train", "--verl", *args]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"error: {train}: no row has the columns for shardrl train: the prompt under 'question' "
                     "(data.prompt_key: set it to the key that holds the prompts); the rows' keys: ['ability', "
                     "'data_source', 'extra_info', 'prompt', 'reward_model']")


def test_verls_custom_chat_template_is_model_chat_template():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    overrides = translate(["actor_rollout_ref.model.path=/m",
                           f"actor_rollout_ref.model.custom_chat_template='{template}'"]).overrides
    assert f"model.chat_template={json.dumps(template)}" in overrides


def test_reward_model_input_tokenizer_is_implied():
    """verl's reward-model scripts name the policy's tokenizer (`reward_model.model.input_tokenizer`): accepted, its
    note saying shardrl re-tokenizes for a reward model with its own tokenizer."""
    t = translate(["reward_model.enable=True", "reward_model.model.path=/models/FsfairX-LLaMA3-RM-v0.1",
                   "reward_model.model.input_tokenizer=/models/Qwen2-7B-Instruct",
                   "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct"])
    assert native(t)["reward.model_path"] == "/models/FsfairX-LLaMA3-RM-v0.1"
    assert "re-tokenized with its own tokenizer and chat template" in t.dropped["reward_model.model.input_tokenizer"]


def _configs_the_roles_build(overrides: list[str]) -> dict:
    """(max_position_embeddings, rope_theta) of the models an RL run builds from `overrides`: actor, reference,
    critic and the fast rollout."""
    import torch

    from shardrl.plan.step_plan import StepPlan
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.generation import Generation
    from shardrl.trainer.roles import Roles

    cfg = load_config(None, overrides)
    roles = Roles.build(cfg, StepPlan.from_config(cfg), {"actor": 1, "critic": 1})
    rollout = Generation(cfg, roles.actor.hf_config, build_char_tokenizer(), torch.device("cpu")).rollout
    models = {"actor": roles.actor.module.lm, "ref": roles.ref.module.lm, "critic": roles.critic.module.lm,
              "rollout": rollout.model}
    return {name: (m.config.max_position_embeddings, m.config.rope_parameters["rope_theta"])
            for name, m in models.items()}


def test_verls_override_config_sets_the_models_config_for_actor_ref_rollout_and_critic():
    from shardrl.models.tiny import TINY_MODELS
    from shardrl.testing import run_distributed

    t = translate(["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=gae",
                   "+actor_rollout_ref.model.override_config.max_position_embeddings=1024",
                   "+actor_rollout_ref.model.override_config.rope_theta=500000.0",
                   "+actor_rollout_ref.model.override_config.attn_implementation=eager",
                   "+critic.model.override_config.max_position_embeddings=512",
                   "+critic.model.override_config.rope_scaling.type=yarn",
                   "+critic.model.override_config.rope_scaling.factor=4.0",
                   "+critic.model.override_config.rope_scaling.original_max_position_embeddings=256"])
    got = native(t)
    assert got["model.override_config"] == {"max_position_embeddings": 1024, "rope_theta": 500000.0}
    assert got["critic.model_override_config"] == {
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
    assert "kernel" in t.dropped["actor_rollout_ref.model.override_config.attn_implementation"]  # verl's attention
    small = ["model.path=null", f"model.tiny={json.dumps(TINY_MODELS['qwen2'])}", "rollout.backend=fast",
             "actor.use_kl_loss=true", "trainer.total_steps=1", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
             "critic.ppo_mini_batch_size=2", "rollout.n=1", "trainer.nproc_per_node=1",
             "actor.engine.param_dtype=float32", "critic.engine.param_dtype=float32", "ref.engine.param_dtype=float32"]
    seen = run_distributed(_configs_the_roles_build, 1, [*t.overrides, *small])
    assert seen == {"actor": (1024, 500000.0), "ref": (1024, 500000.0), "rollout": (1024, 500000.0),
                    "critic": (512, 10000.0)}
    from shardrl.engine.model import load_hf_config

    with pytest.raises(ValueError, match=r"model.override_config: \['max_position_embedding'\] are not keys of the "
                                         r"'qwen2' config .*did you mean 'max_position_embedding' -> "
                                         r"'max_position_embeddings'"):  # a typo HF would keep and nothing read
        load_hf_config(None, TINY_MODELS["qwen2"], override={"max_position_embedding": 9})


def test_verls_deprecated_global_micro_batches_are_divided_over_the_data_parallel_ranks(tmp_path):
    """verl's FSDP workers divide ppo_micro_batch_size and log_prob_micro_batch_size by world // ulysses (floored)
    into the *_per_gpu keys; verl's LoRA tuning scripts still set them."""
    t = translate(script_args("qwen2-14b_grpo-lora_2_h100_fsdp_vllm.sh", tmp_path, cwd=tmp_path))
    got = native(t)  # 58 x 2 GPUs = 116 a mini-batch; ulysses 2 on 2 GPUs: one data-parallel rank
    assert (got["actor.engine.micro_batch_size_per_gpu"], got["ref.engine.micro_batch_size_per_gpu"]) == (116, 116)
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size" in t.dropped  # the old-log-prob pass: the actor's
    assert ("actor_rollout_ref.actor.ppo_micro_batch_size=116 is verl's deprecated global micro-batch: 116 // 1 "
            "data-parallel ranks = 116 a GPU, actor.engine.micro_batch_size_per_gpu=116") in t.notes
    assert "notes:" in t.describe()
    got = native(translate([
        "actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=4", "trainer.nnodes=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=20", "critic.ppo_micro_batch_size=24",
        "reward_model.micro_batch_size=16"]))
    assert (got["actor.engine.micro_batch_size_per_gpu"], got["ref.engine.micro_batch_size_per_gpu"],
            got["critic.engine.micro_batch_size_per_gpu"], got["reward.engine.micro_batch_size_per_gpu"]) == (4, 5, 3, 2)
    floored = translate(["actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=8",
                         "critic.ppo_micro_batch_size=20"])
    assert native(floored)["critic.engine.micro_batch_size_per_gpu"] == 2 and "(floored, as verl's worker does)" in \
        floored.notes[0]
    dynamic = native(translate(["actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=2",
                                "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]))
    assert dynamic["actor.engine.micro_batch_size_per_gpu"] == 4  # verl's worker: the global key overwrites


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
     r"ppo_micro_batch_size=8: given with actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2, which verl refuses "
     r"too: remove actor_rollout_ref.actor.ppo_micro_batch_size \(deprecated"),
    (["trainer.n_gpus_per_node=8", "critic.ppo_micro_batch_size=4"],
     r"critic.ppo_micro_batch_size=4: verl's global micro-batch divided over the 8 data-parallel ranks \(8 GPUs\) is "
     r"less than one sample a GPU; set critic.ppo_micro_batch_size_per_gpu instead"),
])
def test_a_global_micro_batch_verl_cannot_run_either_is_refused(args, message):
    with pytest.raises(VerlKeyError, match=message):
        translate(args)


def test_verls_grpo_with_one_response_a_prompt_runs_with_a_warning(tmp_path, caplog):
    """actor_rollout_ref.rollout.n not given (verl's default 1) with GRPO: verl runs it, a group of one taking mean 0
    and std 1, so each advantage is the response's score (here a constant 0.75), not 0."""
    from shardrl.cli import main

    home = tmp_path / "home"
    write_verl_assets(home)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def my_score(solution_str, ground_truth):\n    return 0.75\n")
    run_dir = tmp_path / "run"
    small = [a for a in SMALL if not a.startswith("actor_rollout_ref.rollout.n=")]
    args = [f"actor_rollout_ref.model.path={home / 'model'}", f"data.train_files={home}/data/gsm8k/train.parquet",
            "data.val_files=[]", f"custom_reward_function.path={reward}", "custom_reward_function.name=my_score",
            "algorithm.adv_estimator=grpo", f"trainer.default_local_dir={run_dir}", *small,
            "trainer.total_training_steps=1"]
    with caplog.at_level("WARNING", logger="shardrl"):
        assert main(["train", "--verl", *args]) == 0
    assert any(r.getMessage().startswith("rollout.n=1 with algorithm.adv_estimator='grpo': a prompt's group is one "
                                         "response") for r in caplog.records)
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert step["critic/advantages/mean"] == pytest.approx(0.75 / (1 + 1e-6), rel=1e-6)
    assert step["critic/advantages/min"] == step["critic/advantages/max"]


def test_a_megatron_script_is_refused_by_its_config_name_before_its_config_is_read(tmp_path, monkeypatch, capsys):
    """verl's run_qwen2-7b_math_megatron.sh (--config-path=config --config-name='ppo_megatron_trainer.yaml'): one
    line naming Megatron, even where a file of that name (with verl's `${...}` references) lies under ./config."""
    from shardrl.cli import main

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ppo_megatron_trainer.yaml").write_text(
        "critic:\n  ppo_micro_batch_size_per_gpu: ${oc.select:.ppo_micro_batch_size,null}\n")
    monkeypatch.chdir(tmp_path)
    args = script_args("run_qwen2-7b_math_megatron.sh", tmp_path)
    assert args[:2] == ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"]
    assert main(["plan", "--verl", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --config-name=ppo_megatron_trainer.yaml is verl's Megatron trainer: shardrl trains with FSDP only; "
        "run verl's FSDP script of the job (no --config-name, or --config-name=ppo_trainer) with "
        "actor_rollout_ref.actor.strategy=fsdp2 and without the *.megatron.* keys")


def test_verls_own_config_names_resolve_against_verls_config_tree(tmp_path, monkeypatch):
    """--config-name of verl's tree, with no --config-path or --config-path=config (Hydra: relative to verl's
    main_ppo.py): ppo_trainer is verl's defaults, which the translation applies; the others are no PPO run."""
    from shardrl.launch.overrides import verl_overrides

    monkeypatch.chdir(tmp_path)  # no ./config here: verl's tree is not a folder of the user's
    plain = verl_overrides(None, ["actor_rollout_ref.model.path=/m"])
    for path, name in ((None, "ppo_trainer"), ("config", "ppo_trainer.yaml"), ("./config", "ppo_trainer")):
        assert verl_overrides(None, ["actor_rollout_ref.model.path=/m"], path, name) == plain
    assert verl_overrides(None, ["actor_rollout_ref.model.path=/m"], None, None) == plain
    assert config_file_args("config", "sft_trainer", own="sft_trainer") == []  # `shardrl sft --verl`'s own
    with pytest.raises(VerlKeyError, match=r"--config-name=sft_trainer is verl's config of "
                                           r"verl.trainer.fsdp_sft_trainer, not of verl.trainer.main_ppo: run it "
                                           r"with `shardrl sft --verl`"):
        verl_overrides(None, ["actor_rollout_ref.model.path=/m"], "config", "sft_trainer")
    with pytest.raises(VerlKeyError, match=r"--config-name=generation is verl's config of "
                                           r"verl.trainer.main_generation, .*offline generation is not a training run"):
        verl_overrides(None, ["actor_rollout_ref.model.path=/m"], None, "generation")
    with pytest.raises(VerlKeyError, match=r"--config-name=my_job: verl's config tree has no 'my_job' \(verl's: "
                                           r"ppo_trainer, ppo_megatron_trainer, "):
        verl_overrides(None, ["actor_rollout_ref.model.path=/m"], None, "my_job")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "job.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    with pytest.raises(VerlKeyError, match=r"job.yaml: its defaults name 'ppo_megatron_trainer', verl's Megatron "
                                           r"trainer: shardrl trains with FSDP only"):
        verl_overrides(None, ["actor_rollout_ref.model.path=/m"], "mine", "job")


def test_verls_lora_script_with_param_offload_is_a_valid_config(tmp_path):
    """verl's LoRA tuning script offloads the params (actor_rollout_ref.actor.fsdp_config.param_offload=True): the
    frozen base and the adapters on the CPU, as verl runs it (tests/test_lora.py: the same gradients)."""
    cfg = load_config(None, translate(script_args("qwen2-14b_grpo-lora_2_h100_fsdp_vllm.sh", tmp_path,
                                                  cwd=tmp_path)).overrides)
    assert (cfg.model.lora.rank, cfg.actor.engine.offload_params, cfg.actor.engine.offload_optimizer) == (32, True, True)
    assert cfg.ref.engine.offload_params  # (the reference of a LoRA run is the actor with its adapters off)


@pytest.mark.parametrize("verl_mode, mode, agg", [
    ("cispo", "cispo", "token-mean"), ("dppo_tv", "dppo_tv", "seq-mean-token-sum"),
    ("dppo_kl", "dppo_kl", "token-mean"),
    # verl's SAPO reduces seq-mean-token-mean and its GMPO means over sequences, whatever loss_agg_mode says
    ("sapo", "sapo", "seq-mean-token-mean"), ("geo_mean", "geo_mean", "seq-mean-token-mean"),
])
def test_verls_2026_policy_losses_and_their_settings(verl_mode, mode, agg):
    given = "seq-mean-token-sum" if verl_mode == "dppo_tv" else "token-mean"
    got = native(translate([
        "actor_rollout_ref.model.path=m", f"actor_rollout_ref.actor.policy_loss.loss_mode={verl_mode}",
        f"actor_rollout_ref.actor.loss_agg_mode={given}", "actor_rollout_ref.actor.tau_pos=2.0",
        "actor_rollout_ref.actor.tau_neg=3.5", "actor_rollout_ref.actor.clip_ratio_low=0.1",
        "actor_rollout_ref.actor.clip_ratio_high=0.25", "actor_rollout_ref.actor.clip_ratio_c=10.0"]))
    assert (got["actor.loss_mode"], got["actor.loss_agg_mode"]) == (mode, agg)
    assert (got["actor.tau_pos"], got["actor.tau_neg"]) == (2.0, 3.5)
    assert (got["actor.clip_ratio_low"], got["actor.clip_ratio_high"], got["actor.clip_ratio_c"]) == (0.1, 0.25, 10.0)
    cfg = load_config(None, translate(["actor_rollout_ref.model.path=m",
                                       f"actor_rollout_ref.actor.policy_loss.loss_mode={verl_mode}",
                                       "actor_rollout_ref.actor.tau_neg=3.5"]).overrides)
    assert cfg.actor.loss_mode == mode and cfg.actor.tau_neg == 3.5 and cfg.actor.tau_pos == 1.0


def test_verls_rejection_sampling_is_shardrls_band():
    rc = "algorithm.rollout_correction."

    def run(*args):
        got = native(translate(["actor_rollout_ref.model.path=m", *[rc + a for a in args]]))
        return {k.removeprefix("algorithm."): v for k, v in got.items() if k.startswith("algorithm.rollout_is")}

    # alone: rejection, weight 1; verl's k1 bounds pi_rollout / pi_old, so 0.7_1.25 is [0.8, 1/0.7] on shardrl's ratio
    got = run("rollout_rs=token_k1", "rollout_rs_threshold=0.7_1.25")
    assert got["rollout_is_mode"] == "reject" and got["rollout_is_level"] == "token"
    assert (got["rollout_is_threshold"], got["rollout_is_threshold_lower"]) == pytest.approx((1 / 0.7, 0.8))
    got = run("rollout_rs=seq_mean_k1", "rollout_rs_threshold=2.0")  # one float: the band [1/2, 2]
    assert (got["rollout_is_level"], got["rollout_is_threshold"], got["rollout_is_threshold_lower"]) == (
        "geometric", 2.0, 0.5)
    # with IS weights at the same level, the band under the cap: MIS (IcePop at token level)
    got = run("rollout_is=sequence", "rollout_is_threshold=3.0", "rollout_rs=seq_sum_k1", "rollout_rs_threshold=0.5_2.0")
    assert (got["rollout_is_mode"], got["rollout_is_level"], got["rollout_is_threshold"]) == ("mask", "sequence", 2.0)
    for args, message in [(("rollout_rs=token_k2", "rollout_rs_threshold=0.1"), "token_k1"),
                          (("rollout_rs=token_k1",), "rollout_rs_threshold"),
                          (("rollout_is=token", "rollout_rs=seq_mean_k1", "rollout_rs_threshold=2.0"), "same level"),
                          (("rollout_is=token", "rollout_is_threshold=1.5", "rollout_rs=token_k1",
                            "rollout_rs_threshold=2.0"), "under rollout_is_threshold")]:
        with pytest.raises(VerlKeyError, match=message):
            run(*args)
    cfg = load_config(None, translate(["actor_rollout_ref.model.path=m", rc + "rollout_rs=token_k1",
                                       rc + "rollout_rs_threshold=0.5_2.0"]).overrides)
    assert cfg.algorithm.rollout_is and cfg.algorithm.rollout_is_mode == "reject"


def test_verls_val_before_train_default_needs_val_files_to_apply():
    """verl's default trainer.val_before_train=true is applied only where there is something to validate on: a run
    without data.val_files would otherwise warn about a key its user never set."""
    base = ["data.train_files=~/data/train.parquet", "actor_rollout_ref.model.path=Qwen/Qwen3-8B"]
    without = translate(base)
    assert "trainer.val_before_train" not in native(without)
    assert not [line for line in load_config(None, without.overrides).ignored_settings() if "val_before_train" in line]
    with_val = native(translate(base + ["data.val_files=~/data/test.parquet"]))
    assert with_val["trainer.val_before_train"] is True
    given = native(translate(base + ["trainer.val_before_train=True"]))  # set by the user: kept (and warned about)
    assert given["trainer.val_before_train"] is True


def test_verls_fp8_rollout_is_shardrls():
    """verl's `rollout.quantization=fp8` (true in its first release) is its FP8 rollout: the weights quantized at
    each sync in 128 x 128 blocks, as `rollout.quantization=fp8` with `rollout.fp8.block_size=128` (it was dropped
    as a vLLM setting: the run went bf16); `use_block_quant_rollout=false` keeps a scale per channel; other methods
    are refused, and null is verl's off."""
    def fp8_keys(args):
        return [o for o in translate(args).overrides if o.startswith("rollout.quantization") or "fp8" in o]

    assert fp8_keys(["actor_rollout_ref.rollout.quantization=fp8"]) == ['rollout.quantization="fp8"',
                                                                       "rollout.fp8.block_size=128"]
    assert fp8_keys(["actor_rollout_ref.rollout.quantization=True",
                     "+actor_rollout_ref.rollout.use_block_quant_rollout=False"]) == ['rollout.quantization="fp8"']
    assert fp8_keys([]) == [] and fp8_keys(["actor_rollout_ref.rollout.quantization=null"]) == []
    with pytest.raises(VerlKeyError, match="quantization='awq': shardrl's rollout quantizes to fp8 only"):
        translate(["actor_rollout_ref.rollout.quantization=awq"])
    cfg = load_config(None, translate(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.name=vllm",
                                       "actor_rollout_ref.rollout.quantization=fp8"]).overrides)
    assert (cfg.rollout.quantization, cfg.rollout.fp8.block_size) == ("fp8", 128)
