import dataclasses
import re

import pytest
import yaml

from shardrl.config import schema as config_module
from shardrl.config.docs import field_docs
from shardrl.config.schema import (
    Config,
    ConfigError,
    EngineConfig,
    OptimConfig,
    config_keys,
    config_to_dict,
    from_dict,
    load_config,
    save_config,
    validate_config,
)


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_then_overrides_fill_nested_fields_with_field_types(tmp_path):
    path = write_yaml(tmp_path / "run.yaml", {
        "model": {"tiny": {"model_type": "qwen2", "hidden_size": 64}},
        "actor": {"engine": {"fsdp_size": 4, "use_dynamic_bsz": True}, "optim": {"lr": "1e-5"}},
        "rollout": {"n": 8, "stop": ["</answer>"]},
    })
    cfg = load_config(path, [
        "actor.engine.fsdp_size=2",        # overrides beat the file
        "actor.clip_ratio_c=4",            # int -> float
        "critic.optim.lr=3e-6",            # PyYAML reads this as a string -> float
        "actor.engine.max_token_len_per_gpu=2e4",  # an integral float -> int
        "model.tiny.num_hidden_layers=2",  # reaches inside a plain dict field
        "data.train_files=[a.parquet, b.parquet]",
        "reward.model_path=null",
        "trainer.experiment_name=42",      # a str field keeps the text as typed
        "trainer.logger=[console]",
        "algorithm.kl_target=0.1",
    ])
    assert cfg.actor.engine.fsdp_size == 2 and cfg.actor.engine.use_dynamic_bsz is True
    assert cfg.actor.optim.lr == 1e-5 and type(cfg.actor.optim.lr) is float
    assert cfg.actor.clip_ratio_c == 4.0 and type(cfg.actor.clip_ratio_c) is float
    assert cfg.critic.optim.lr == 3e-6
    assert cfg.actor.engine.max_token_len_per_gpu == 20000 and type(cfg.actor.engine.max_token_len_per_gpu) is int
    assert cfg.model.tiny == {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    assert cfg.rollout.n == 8 and cfg.rollout.stop == ["</answer>"]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.reward.model_path is None
    assert cfg.trainer.experiment_name == "42"
    assert cfg.trainer.logger == ["console"]
    assert cfg.algorithm.kl_target == 0.1
    # untouched fields keep their defaults
    assert cfg.ref.engine == cfg.actor.engine  # the reference takes the actor's engine settings it does not set
    assert cfg.data.train_batch_size == 8


def test_partial_section_keeps_parent_defaults(tmp_path):
    # the critic's own optimizer default (lr 1e-5) survives a file that sets only weight decay
    path = write_yaml(tmp_path / "run.yaml", {"critic": {"optim": {"weight_decay": 0}}, "ref": None})
    cfg = load_config(path, ["actor.optim={weight_decay: 0.1}"])
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.weight_decay == 0.0
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.optim.weight_decay == 0.1


def test_no_file_gives_defaults_and_other_top_level_classes_load():
    assert load_config() == Config()
    engine = load_config(None, ["fsdp_size=2", "reshard_after_forward=false"], cls=EngineConfig)
    assert isinstance(engine, EngineConfig)
    assert engine.fsdp_size == 2 and engine.reshard_after_forward is False
    assert from_dict(OptimConfig, {"lr": 2e-5, "betas": [0.9, 0.95]}) == OptimConfig(lr=2e-5, betas=[0.9, 0.95])


@pytest.mark.parametrize("override, expected", [
    ("actor.engine.fsdp_sise=2",
     "unknown config key 'actor.engine.fsdp_sise'; did you mean 'actor.engine.fsdp_size'?"),
    ("actor.engin.fsdp_size=2",
     "unknown config key 'actor.engin.fsdp_size'; did you mean 'actor.engine.fsdp_size'?"),
    ("lr=1e-5", "did you mean 'actor.optim.lr' or 'critic.optim.lr'?"),
    ("actor.engine.fsdp_size=abc", "config key 'actor.engine.fsdp_size' expects int, got 'abc' (str)"),
    ("actor.engine.fsdp_size=1.5", "config key 'actor.engine.fsdp_size' expects int, got 1.5 (float)"),
    ("actor.shuffle=1", "config key 'actor.shuffle' expects bool, got 1 (int)"),
    ("rollout.stop=3", "config key 'rollout.stop' expects list[str], got 3 (int)"),
    ("actor.engine.strategy=fsdp3",
     "config key 'actor.engine.strategy' must be one of 'fsdp2', 'fsdp'; got 'fsdp3'"),
    ("trainer.logger=[console, clearml]",
     "config key 'trainer.logger[1]' must be one of 'console', 'jsonl', 'tensorboard', 'wandb', 'mlflow', 'swanlab', "
     "'trackio'; got 'clearml'"),
    ("algorithm.gamma=null", "config key 'algorithm.gamma' expects float, got None"),
    ("actor.engine.fsdp_size", "bad override 'actor.engine.fsdp_size': expected key=value"),
    ("=2", "bad override '=2': expected key=value"),
    ("actor.ppo_epochs.x=1", "'actor.ppo_epochs' holds a value of type int, not a section"),
    ("actor=3", "config key 'actor' is a section (ActorConfig)"),
    # validation: impossible values name the dotted key
    ("actor.optim.lr=0", "invalid config value actor.optim.lr=0.0: must be a finite number > 0"),
    ("critic.engine.fsdp_size=0", "invalid config value critic.engine.fsdp_size=0: must be -1"),
    ("actor.clip_ratio_low=1.5", "invalid config value actor.clip_ratio_low=1.5: must be in [0, 1)"),
    ("actor.clip_ratio_c=1", "invalid config value actor.clip_ratio_c=1.0: must be > 1"),
    ("rollout.top_p=0", "invalid config value rollout.top_p=0.0"),
    # the sampler's bounds, at load (not when the first rollout or validation samples with them)
    ("rollout.temperature=1e-9", "invalid config value rollout.temperature=1e-09: must be 0 (greedy) or in [1e-5"),
    ("rollout.val_kwargs.temperature=1e5", "rollout.val_kwargs.temperature=100000.0: must be 0 (greedy) or in"),
    ("rollout.top_k=3000000000", "invalid config value rollout.top_k=3000000000: must be in [0, 2**31)"),
    ("rollout.fast.attention=flash", "config key 'rollout.fast.attention' must be one of 'auto', 'triton', 'sdpa'"),
    # fast-only keys with backend=hf: tests/test_defaults.py
    ("rollout.fast.max_batch=0", "invalid config value rollout.fast.max_batch=0: must be >= 1 or null"),
    ("data.train_batch_size=6",
     "invalid config value actor.ppo_mini_batch_size=4: must divide data.train_batch_size=6"),
    # another framework's name for a key: ours, not the nearest spelling (learning_rate is nearer clip_grad)
    ("actor.optim.learning_rate=1e-5", "unknown config key 'actor.optim.learning_rate'; did you mean 'actor.optim.lr'?"),
    ("critic.optim.max_grad_norm=1", "did you mean 'critic.optim.clip_grad'?"),
    ("model.lora.lora_alpha=16", "did you mean 'model.lora.alpha'?"),
    ("learning_rate=1e-5", "did you mean 'actor.optim.lr' or 'critic.optim.lr'?"),
])
def test_bad_override_message(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validation_depends_on_other_fields():
    load_config(None, ["max_token_len_per_gpu=0"], cls=EngineConfig)  # unused without dynamic batching
    with pytest.raises(ConfigError, match=r"max_token_len_per_gpu=0: must be >= 1 when use_dynamic_bsz is on"):
        load_config(None, ["max_token_len_per_gpu=0", "use_dynamic_bsz=true"], cls=EngineConfig)
    with pytest.raises(ConfigError, match=r"actor\.engine\.max_token_len_per_gpu=0"):
        load_config(None, ["actor.engine.max_token_len_per_gpu=0", "actor.engine.use_dynamic_bsz=true"])
    load_config(None, ["model.attn_implementation=shardrl_varlen"])  # packed rows: the default
    with pytest.raises(ConfigError, match=r"shardrl_varlen.*needs model\.use_remove_padding=true"):
        load_config(None, ["model.attn_implementation=shardrl_varlen", "model.use_remove_padding=false"])
    load_config(None, ["compile=true"], cls=EngineConfig)  # FSDP2 compiles its blocks
    with pytest.raises(ConfigError, match=r"actor\.engine\.compile=True: is implemented for strategy=fsdp2 only"):
        load_config(None, ["actor.engine.compile=true", "actor.engine.strategy=fsdp"])
    # the critic's mini-batch only has to divide the batch when the critic is used
    load_config(None, ["data.train_batch_size=6", "actor.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=4: must divide"):
        load_config(None, ["data.train_batch_size=6", "actor.ppo_mini_batch_size=3",
                           "critic.ppo_mini_batch_size=4", "algorithm.adv_estimator=gae"])


def test_bad_yaml_files(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=f"config file not found: '{missing}'"):
        load_config(missing)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys at the top level, got list") as info:
        load_config(str(listing))
    assert str(listing) in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(broken))
    typo = write_yaml(tmp_path / "typo.yaml", {"actor": {"optim": {"lrr": 1e-5}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.optim\.lrr'; did you mean 'actor\.optim\.lr'\?"):
        load_config(typo)
    wrong = write_yaml(tmp_path / "wrong.yaml", {"rollout": {"n": "four"}})
    with pytest.raises(ConfigError, match=r"config key 'rollout\.n' expects int, got 'four' \(str\)"):
        load_config(wrong)


def test_save_then_load_gives_an_equal_config(tmp_path):
    cfg = load_config(None, [
        "model.tiny={model_type: qwen2, hidden_size: 64, rope_scaling: {type: linear, factor: 2.0}}",
        "actor.optim.lr=1e-5", "actor.optim.betas=[0.9, 0.95]", "actor.engine.use_dynamic_bsz=true",
        'rollout.stop=["\\n\\n", "</answer>"]', "algorithm.kl_target=0.05", "trainer.resume=/ckpt/step_10",
        "trainer.logger=[console, tensorboard]", "data.val_batch_size=16",
    ])
    path = str(tmp_path / "run" / "config.yaml")
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.rollout.stop == ["\n\n", "</answer>"]
    assert load_config(path, ["trainer.resume=auto"]).trainer.resume == "auto"


def test_validate_config_checks_programmatic_configs():
    cfg = Config()
    cfg.actor.optim.lr = 1  # an int where a float belongs is normalised
    cfg.actor.optim.betas = (0.9, 0.95)
    validate_config(cfg)
    assert type(cfg.actor.optim.lr) is float and cfg.actor.optim.betas == [0.9, 0.95]
    cfg.rollout.n = "8"
    cfg.actor.engine.param_dtype = "fp16"
    with pytest.raises(ConfigError, match=r"'actor\.engine\.param_dtype' must be one of 'float32', 'bfloat16', 'float16'"):
        validate_config(cfg)


def test_every_schema_field_has_a_docstring():
    sections = [c for c in vars(config_module).values()
                if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__.startswith("shardrl.config.")]
    assert len(sections) == 31  # with model.lora, actor.router_replay, rollout.val_kwargs, rollout.agent, algorithm.filter_groups, reward.overlong_buffer, async_rl, rollout.multi_turn,
    # and the offline trainers' configs with their data sections and settings (`shardrl sft|dpo|kto|rm`)
    for cls in sections:  # (a field may be documented where an offline data section's base declares it)
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
        assert not missing, f"{cls.__name__}: fields without a docstring: {sorted(missing)}"
    assert "actor.engine.fsdp_size" in config_keys(Config)


def test_loss_agg_mode_is_the_actors_and_the_critics_and_the_old_key_says_where_it_went(tmp_path):
    cfg = load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum", "critic.loss_agg_mode=seq-mean-token-mean"])
    assert (cfg.actor.loss_agg_mode, cfg.critic.loss_agg_mode) == ("seq-mean-token-sum", "seq-mean-token-mean")
    assert Config().actor.loss_agg_mode == "token-mean" and "loss_agg_mode" not in config_keys(EngineConfig)
    for role in ("actor", "critic"):
        with pytest.raises(ConfigError, match=rf"'{role}\.engine\.loss_agg_mode' is no longer here: "
                                              rf"set {role}\.loss_agg_mode instead"):
            load_config(None, [f"{role}.engine.loss_agg_mode=token-mean"])
    old_yaml = write_yaml(tmp_path / "old.yaml", {"actor": {"engine": {"loss_agg_mode": "seq-mean-token-sum"}}})
    with pytest.raises(ConfigError, match=r"set actor\.loss_agg_mode instead"):
        load_config(old_yaml)
    with pytest.raises(ConfigError, match=r"ref computes no loss; set actor\.loss_agg_mode"):
        load_config(None, ["ref.engine.loss_agg_mode=token-mean"])


def test_mini_batch_that_does_not_divide_names_the_nearest_valid_values():
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=5: must divide data\.train_batch_size=12 "
                                          r"\(both count prompts\); nearest valid: 4 or 6"):
        load_config(None, ["data.train_batch_size=12", "actor.ppo_mini_batch_size=5"])
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=9: .*nearest valid: 8$"):
        load_config(None, ["data.train_batch_size=8", "critic.ppo_mini_batch_size=9", "algorithm.adv_estimator=gae"])


def test_a_key_given_twice_in_a_yaml_file_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  optim: {lr: 1.0e-5}\ndata:\n  train_batch_size: 4\nactor:\n  ppo_epochs: 2\n")
    with pytest.raises(ConfigError, match=r"the key 'actor' is given twice in one mapping \(first on line 1, again "
                                          r"on line 5\)"):
        load_config(str(path))
    path.write_text("actor:\n  optim: {lr: 1.0e-5, lr: 2.0e-5}\n")  # inside a flow mapping too
    with pytest.raises(ConfigError, match=r"the key 'lr' is given twice"):
        load_config(str(path))
    path.write_text("actor:\n  optim: {lr: 1.0e-5}\n  ppo_epochs: 2\n")
    assert load_config(str(path)).actor.optim.lr == 1e-5


def test_a_key_of_model_tiny_its_config_class_does_not_know_is_an_error():
    from shardrl.engine.model import load_hf_config

    base = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=r"model.tiny: \['hiden_size'\] are not keys of the 'qwen2' config "
                                          r"\(Qwen2Config\); did you mean 'hiden_size' -> 'hidden_size'"):
        load_hf_config(None, {**base, "hiden_size": 32})
    # legacy names the class still takes (rope_scaling) and the base class's keys are keys
    config = load_hf_config(None, {**base, "rope_scaling": {"type": "linear", "factor": 2.0},
                                   "tie_word_embeddings": True})
    assert config.hidden_size == 64 and config.tie_word_embeddings
    # optional attributes a model reads that no signature lists pass (only near misses of known keys are errors)
    assert load_hf_config(None, {**base, "head_dim": 32, "rope_theta": 5000.0}).head_dim == 32


def test_plan_refuses_a_misspelt_model_tiny_key(capsys):
    from shardrl.cli import main

    assert main(["plan", "model.tiny={model_type: qwen2, hiden_size: 64}"]) == 2
    assert "['hiden_size'] are not keys of the 'qwen2' config" in capsys.readouterr().err


def test_a_file_of_another_command_says_which_command_reads_it(tmp_path):
    """`shardrl train sft.yaml` or `shardrl plan dpo.yaml` (no --trainer dpo) named 'ref.engine' for the file's
    'engine'; the file's top-level keys are another command's, and the error says which and how to run it."""
    from shardrl.config.schema import DPOConfig, RMConfig, SFTConfig

    dpo = write_yaml(tmp_path / "dpo.yaml", {"model": {"path": "m"}, "engine": {"use_dynamic_bsz": True},
                                             "optim": {"lr": 1e-6}, "dpo": {"beta": 0.1}})
    with pytest.raises(ConfigError) as info:
        load_config(dpo)
    assert str(info.value) == (f"config file {dpo!r} looks like a `shardrl dpo` config, not a `shardrl train` one "
                               f"(dpo, engine, optim are no `shardrl train` keys): run it with `shardrl dpo {dpo}`, "
                               f"or plan it with `shardrl plan {dpo} --trainer dpo`")
    with pytest.raises(ConfigError, match=r"looks like a `shardrl dpo` config, not a `shardrl rm` one \(dpo is no "):
        load_config(dpo, cls=RMConfig)
    sft = write_yaml(tmp_path / "sft.yaml", {"engine": {"max_token_len_per_gpu": 4096}, "optim": {"lr": 1e-5},
                                             "data": {"messages_key": "chat"}})
    with pytest.raises(ConfigError, match=r"looks like a `shardrl sft` config, .* `shardrl sft .*sft.yaml`"):
        load_config(sft)
    # pairs fit both dpo and rm: the one the file is named after comes first
    rm = write_yaml(tmp_path / "my_rm.yaml", {"engine": {}, "optim": {}, "data": {"chosen_key": "good"}})
    with pytest.raises(ConfigError, match=r"looks like a `shardrl rm` \(or `shardrl dpo`\) config, .*--trainer rm`$"):
        load_config(rm)
    rl = write_yaml(tmp_path / "rl.yaml", {"actor": {"ppo_epochs": 1}, "rollout": {"n": 4}, "trainer": {}})
    with pytest.raises(ConfigError, match=r"looks like a `shardrl train` config, not a `shardrl sft` one \(actor, "
                                          r"rollout are no `shardrl sft` keys\): .* `shardrl plan [^ ]*rl.yaml`$"):
        load_config(rl, cls=SFTConfig)
    # a file of this command with a misspelt key keeps the plain message
    with pytest.raises(ConfigError, match=r"^unknown config key 'dpo\.bta'; did you mean 'dpo\.beta'\?$"):
        load_config(write_yaml(tmp_path / "typo.yaml", {"dpo": {"bta": 0.1}}), cls=DPOConfig)
    with pytest.raises(ConfigError, match=r"^unknown config key 'data\.batch_sise'; did you mean 'data\.batch_size'"
                                          r"\?$"):
        load_config(write_yaml(tmp_path / "typo.yaml", {"data": {"batch_sise": 2}}), cls=DPOConfig)


def test_a_file_whose_nested_keys_are_another_command_s_says_which_command_reads_it(tmp_path):
    """`shardrl train dpo.yaml` of model, data and trainer only (every top-level key is train's too) said only
    "unknown config key 'data.batch_size'; did you mean 'data.val_batch_size'?": the error now adds which commands
    read the file whole, the one it is named after first; and the other way round (`shardrl dpo` on a train file)."""
    from shardrl.config.schema import DPOConfig

    dpo = write_yaml(tmp_path / "dpo.yaml", {"model": {"path": "m"}, "data": {"train_files": ["p.jsonl"],
                                                                              "batch_size": 8},
                                             "trainer": {"total_steps": 3}})
    with pytest.raises(ConfigError) as info:
        load_config(dpo)
    assert str(info.value) == (
        "unknown config key 'data.batch_size'; did you mean 'data.val_batch_size'? (the file's keys are those of a "
        f"`shardrl dpo` (or `shardrl sft`, `shardrl kto`, `shardrl rm`) config: run it with `shardrl dpo {dpo}`, or "
        f"plan it with "
        f"`shardrl plan {dpo} --trainer dpo`)")
    rl = write_yaml(tmp_path / "rl.yaml", {"data": {"train_batch_size": 8}, "trainer": {"total_steps": 3}})
    with pytest.raises(ConfigError, match=r"^unknown config key 'data.train_batch_size'.*\(the file's keys are those "
                                          rf"of a `shardrl train` config: run it with `shardrl train {rl}`, or plan "
                                          rf"it with `shardrl plan {rl}`\)$"):
        load_config(rl, cls=DPOConfig)


def test_a_dotted_key_in_yaml_says_that_yaml_keys_nest(tmp_path):
    """`model.lora.rank: 4` in a file was 'unknown config key 'model.lora.rank'; did you mean 'model.lora.rank'?'."""
    path = write_yaml(tmp_path / "run.yaml", {"model.lora.rank": 4})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == ("config key 'model.lora.rank' is dotted, but in a YAML file keys nest: write model: "
                               "{lora: {rank: 4}} (or model:, lora:, rank: each on a line of its own, indented under "
                               "the one before); dotted keys are for key=value overrides (model.lora.rank=4)")
    path = write_yaml(tmp_path / "run.yaml", {"actor": {"optim.lr": 1e-5}})
    with pytest.raises(ConfigError, match=r"config key 'optim\.lr' under 'actor' is dotted, .*write optim: \{lr: "
                                          r"1\.0e-05\} .*\(actor\.optim\.lr=1\.0e-05\)$"):
        load_config(path)
    path = write_yaml(tmp_path / "run.yaml", {"model.lora.rnk": 4})  # misspelt too: the nearest key, and the nesting
    with pytest.raises(ConfigError, match=r"^unknown config key 'model\.lora\.rnk'; did you mean 'model\.lora\.rank'"
                                          r"\? \(and in a YAML file keys nest"):
        load_config(path)
    assert load_config(write_yaml(tmp_path / "run.yaml", {"model": {"lora": {"rank": 4}}})).model.lora.rank == 4


def test_settings_nothing_reads_are_named():
    assert load_config(None, []).ignored_settings() == []
    lines = load_config(None, ["data.val_files=[v.jsonl]", "trainer.val_freq=0",
                               "rollout.multi_turn.tools=[calculator]"]).ignored_settings()
    assert len(lines) == 2
    assert lines[0].startswith("data.val_files=['v.jsonl'] is never read: trainer.val_freq=0")
    assert lines[1].startswith("rollout.multi_turn.tools is set but rollout.multi_turn.enable=false")
    assert load_config(None, ["rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.enable=true",
                              "data.val_files=[v.jsonl]", "trainer.val_freq=5"]).ignored_settings() == []
    lines = load_config(None, ["model.lora.alpha=32", "model.lora.target_modules=[q_proj]"]).ignored_settings()
    assert lines == ["model.lora.alpha, model.lora.target_modules are set but model.lora.rank=0: LoRA is off and "
                     "every weight trains (set model.lora.rank to train adapters)"]
    assert load_config(None, ["model.lora.alpha=32", "model.lora.rank=8"]).ignored_settings() == []


def test_validation_without_files_and_a_token_budget_without_dynamic_batches_are_named():
    from shardrl.config.schema import DPOConfig, SFTConfig

    no_files = ("trainer.val_freq=1 is never used: data.val_files is empty, so there is nothing to validate on (give "
                "data.val_files=[...] to validate)")
    assert load_config(None, ["trainer.val_freq=1"]).ignored_settings() == [no_files]
    assert load_config(None, ["trainer.val_freq=1"], cls=SFTConfig).ignored_settings() == [no_files]
    assert load_config(None, ["trainer.val_before_train=true"]).ignored_settings() == [
        no_files.replace("trainer.val_freq=1", "trainer.val_before_train=true")]
    assert load_config(None, ["trainer.val_freq=1", "data.val_files=[v.jsonl]"], cls=SFTConfig).ignored_settings() == []
    assert load_config(None, ["data.val_files=[v.jsonl]"], cls=SFTConfig).ignored_settings()[0].startswith(
        "data.val_files=['v.jsonl'] is never read: trainer.val_freq=0")
    # the actor's budget without dynamic batches: one line (ref, critic and reward take the actor's engine settings)
    assert load_config(None, ["actor.engine.max_token_len_per_gpu=5"]).ignored_settings() == [
        "actor.engine.max_token_len_per_gpu=5 is never read: it is the token budget of dynamic micro-batches, and "
        "actor.engine.use_dynamic_bsz=false cuts micro-batches by actor.engine.micro_batch_size_per_gpu=1 samples "
        "instead (set actor.engine.use_dynamic_bsz=true to cut them by tokens)"]
    assert load_config(None, ["actor.engine.max_token_len_per_gpu=5",
                              "actor.engine.use_dynamic_bsz=true"]).ignored_settings() == []
    lines = load_config(None, ["ref.engine.max_token_len_per_gpu=6"]).ignored_settings()
    assert [line.split(" ")[0] for line in lines] == ["ref.engine.max_token_len_per_gpu=6"]
    lines = load_config(None, ["actor.engine.use_dynamic_bsz=true", "critic.engine.use_dynamic_bsz=false",
                               "critic.engine.max_token_len_per_gpu=7"]).ignored_settings()
    assert [line.split(" ")[0] for line in lines] == ["critic.engine.max_token_len_per_gpu=7"]
    lines = load_config(None, ["engine.use_dynamic_bsz=false", "engine.max_token_len_per_gpu=5"],
                        cls=DPOConfig).ignored_settings()
    assert lines == ["engine.max_token_len_per_gpu=5 is never read: it is the token budget of dynamic micro-batches, "
                     "and engine.use_dynamic_bsz=false cuts micro-batches by engine.micro_batch_size_per_gpu=1 samples "
                     "instead (set engine.use_dynamic_bsz=true to cut them by tokens)"]
    assert load_config(None, ["engine.max_token_len_per_gpu=5"], cls=DPOConfig).ignored_settings() == []


def test_a_reference_model_with_a_reference_free_loss_is_named():
    from shardrl.config.schema import DPOConfig

    lines = load_config(None, ["dpo.loss_type=simpo", "dpo.ref_model_path=/models/ref"], cls=DPOConfig
                        ).ignored_settings()
    assert lines == ["dpo.ref_model_path='/models/ref' is never read: dpo.loss_type=simpo is reference-free (no "
                     "reference model is loaded); drop it, or set dpo.loss_type=sigmoid (or another loss with a "
                     "reference) to train against it"]
    assert load_config(None, ["dpo.loss_type=ipo", "dpo.ref_model_path=/models/ref"], cls=DPOConfig
                       ).ignored_settings() == []
    assert load_config(None, ["dpo.loss_type=simpo"], cls=DPOConfig).ignored_settings() == []


def test_messages_that_used_to_mislead(tmp_path, capsys, caplog):
    """Issue 31's list: each bad input gets a line that says what is wrong."""
    from shardrl.cli import main
    from shardrl.data.prompts import load_prompt_dataset
    from shardrl.engine.model import load_hf_config
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.placement import check_rollout_ranks
    from shardrl.launch.torchrun import warn_oversubscribed

    # heads that do not cut the width: said by plan (and the trainer), not as a tensor-size error at the first forward
    bad_heads = "model.tiny={model_type: qwen2, hidden_size: 30, num_attention_heads: 4, num_key_value_heads: 2}"
    assert main(["plan", bad_heads]) == 2
    assert "hidden_size=30 is not a multiple of num_attention_heads=4" in capsys.readouterr().err
    from shardrl.trainer.roles import check_vocab_sizes

    with pytest.raises(ConfigError, match=r"hidden_size=30 is not a multiple of num_attention_heads=4"):
        check_vocab_sizes(load_config(None, [bad_heads]), 10)
    # --gpu-mem-gib must be a size; a verdict that cannot be given is an error, not a silent exit 0
    for bad in ("0", "-5", "nan"):
        with pytest.raises(SystemExit):
            main(["plan", "--gpu-mem-gib", bad])
        assert "must be a finite number of GiB > 0" in capsys.readouterr().err
    assert main(["plan", "model.path=/no/such/model", "--gpu-mem-gib", "80"]) == 2
    assert "error: no verdict on --gpu-mem-gib 80" in capsys.readouterr().err
    # a folder given as a data file, and a .json holding one object
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"is a folder, not a data file"):
        load_prompt_dataset([str(tmp_path)], tok)
    one = tmp_path / "one.json"
    one.write_text('{\n  "prompt": "1+1=",\n  "ground_truth": "2"\n}\n')  # pretty-printed
    with pytest.raises(ValueError, match=r"one.json: holds one JSON object, not rows"):
        load_prompt_dataset([str(one)], tok)
    # resume=Auto is not a path, and a missing checkpoint path is "not found"
    with pytest.raises(ConfigError, match=r'trainer.resume=\'Auto\': is read as a checkpoint path; did you mean "auto"'):
        load_config(None, ["trainer.resume=Auto"])
    from shardrl.trainer.checkpoint import CheckpointManager

    with pytest.raises(ValueError, match=r"checkpoint '.*nowhere' not found"):
        CheckpointManager(tmp_path / "ckpts").load(tmp_path / "nowhere", {})
    # rollout ranks on one process
    with pytest.raises(ValueError, match=r"needs at least 2 processes .* this run has 1"):
        check_rollout_ranks(1, 1)
    with pytest.raises(ValueError, match=r"choose 1\.\.3"):
        check_rollout_ranks(4, 4)
    # more processes than cores on a CPU machine: a warning (the run still starts)
    with caplog.at_level("WARNING", logger="shardrl"):
        warn_oversubscribed(10_000, "cpu")
        warn_oversubscribed(1, "cpu")
    assert caplog.text.count("on a CPU machine with") == 1


def test_roles_take_the_actors_settings_they_do_not_set(tmp_path):
    """As verl's config does (`oc.select`): the reference, critic and reward model take every engine setting of the
    actor that they do not set themselves, and the critic its mini-batch, epochs and loss reduction."""
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  engine: {param_dtype: float32, use_dynamic_bsz: true}\n  ppo_mini_batch_size: 8\n"
                    "ref:\n  engine: {max_token_len_per_gpu: 999}\n")
    cfg = load_config(str(path), ["data.train_batch_size=16", "critic.engine.param_dtype=bfloat16",
                                  "critic.ppo_epochs=3", "actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-sum"])
    assert (cfg.ref.engine.param_dtype, cfg.ref.engine.use_dynamic_bsz, cfg.ref.engine.max_token_len_per_gpu) == (
        "float32", True, 999)
    assert (cfg.critic.engine.param_dtype, cfg.critic.engine.use_dynamic_bsz) == ("bfloat16", True)
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs, cfg.critic.loss_agg_mode) == (
        8, 3, "seq-mean-token-sum")
    assert cfg.reward.engine.param_dtype == "float32" and cfg.critic.optim.lr == 1e-5  # optimizers are not taken
    # a config read back from a run folder is the same config
    save_config(cfg, str(tmp_path / "saved.yaml"))
    assert load_config(str(tmp_path / "saved.yaml")) == cfg


def test_total_epochs_alone_leaves_total_steps_to_the_data():
    cfg = load_config(None, ["trainer.total_epochs=2"]).trainer
    assert (cfg.total_epochs, cfg.total_steps) == (2, None)  # resolved from the training set's size at start-up
    assert load_config(None, ["trainer.total_epochs=2", "trainer.total_steps=5"]).trainer.total_steps == 5
    with pytest.raises(ConfigError, match=r"trainer.total_steps=None: must be set"):
        load_config(None, ["trainer.total_steps=null"])
    from shardrl.config.schema import SFTConfig

    assert load_config(None, ["trainer.total_epochs=2"], cls=SFTConfig).trainer.total_steps is None  # offline too


def test_a_verl_key_name_gets_the_native_key():
    cases = {"trainer.test_freq=5": "shardrl's is 'trainer.val_freq'",
             "data.max_response_length=64": "shardrl's is 'rollout.max_new_tokens'",
             "actor.clip_ratio=0.2": "shardrl's is 'actor.clip_ratio_low' and 'actor.clip_ratio_high'",
             "model.lora_rank=8": "shardrl's is 'model.lora.rank'",
             "actor.optim.lr_warmup_steps_ratio=0.1": "shardrl's is 'actor.optim.warmup_ratio'",
             "critic.optim.lr_warmup_steps_ratio=0.1": "shardrl's is 'critic.optim.warmup_ratio'",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4":
                 "shardrl's is 'actor.engine.micro_batch_size_per_gpu'",
             "trainer.n_gpus_per_node=8": "shardrl's is 'trainer.nproc_per_node'"}
    for override, hint in cases.items():
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(None, [override])


def test_loading_and_checking_a_config_imports_no_torch(tmp_path):
    """`shardrl.config` is the bottom layer: importing it, loading a demo-like file (and another command's), and
    the errors of a bad key and a bad value bring in no torch (a subprocess, so that this one's torch is not seen)."""
    import subprocess
    import sys

    demo = write_yaml(tmp_path / "run.yaml", {
        "model": {"tiny": {"model_type": "qwen2", "hidden_size": 64}}, "data": {"train_batch_size": 4},
        "rollout": {"n": 4, "max_new_tokens": 16, "fast": {"max_batch": 8}},
        "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": True, "engine": {"use_dynamic_bsz": True}},
        "algorithm": {"adv_estimator": "rloo"}, "trainer": {"total_steps": 3, "device": "cpu"}})
    dpo = write_yaml(tmp_path / "dpo.yaml", {"dpo": {"loss_type": "ipo"}, "data": {"batch_size": 4}})
    code = f"""if True:
        import sys
        import shardrl.config
        assert 'torch' not in sys.modules, 'import shardrl.config'
        from shardrl.config import ConfigError, DPOConfig, load_config
        cfg = load_config({demo!r}, ["rollout.n=2"])
        assert cfg.rollout.n == 2 and cfg.algorithm.adv_estimator == "rloo"
        load_config({dpo!r}, cls=DPOConfig)
        for bad in (["trainer.test_freq=2"], ["data.train_batch_size=3"], ["algorithm.adv_estimator=nope"]):
            try:
                load_config({demo!r}, bad)
            except ConfigError:
                pass
            else:
                raise AssertionError(bad)
        try:
            load_config({dpo!r})
        except ConfigError:
            pass
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not torch, torch
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_config_s_algorithm_names_are_the_registries():
    """The config reads the algorithms' names (and what each estimator needs) from a torch-free table; the
    registries in `shardrl.algos` hold the functions under the same names and declare the same needs."""
    from shardrl.algos import ADVANTAGE_ESTIMATORS, LOSS_MODES
    from shardrl.algos.preference import PREFERENCE_LOSSES
    from shardrl.config import names

    assert list(names.ADVANTAGE_ESTIMATORS) == list(ADVANTAGE_ESTIMATORS)
    for name, needs in names.ADVANTAGE_ESTIMATORS.items():
        estimator = ADVANTAGE_ESTIMATORS[name]
        assert (needs.needs_critic, needs.group_baseline) == (estimator.needs_critic, estimator.group_baseline), name
    assert list(names.LOSS_MODES) == list(LOSS_MODES)
    assert list(names.PREFERENCE_LOSSES) == list(PREFERENCE_LOSSES)
    assert [n for n, loss in PREFERENCE_LOSSES.items() if not loss.uses_ref] == list(names.REFERENCE_FREE_LOSSES)


def test_the_fast_backends_keys_moved_under_rollout_fast_and_the_old_ones_still_work(tmp_path, caplog):
    """rollout.max_batch (and the other fast-only keys) is rollout.fast.max_batch now: the new key works; the old
    one, in an override or a file, lands in the new field with a one-line note; a saved config has the new keys."""
    moved = {"max_batch": 8, "kv_cache_tokens": 4096, "sync_every": 4, "compile": False, "attention": "sdpa",
             "sampler": "torch", "prefix_cache": False, "cascade": False}
    new = load_config(None, [f"rollout.fast.{k}={str(v).lower()}" for k, v in moved.items()])
    assert {k: getattr(new.rollout.fast, k) for k in moved} == moved
    assert not caplog.records
    old = load_config(None, [f"rollout.{k}={str(v).lower()}" for k, v in moved.items()])
    assert old == new
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == len(moved) and all("\n" not in n for n in notes)
    assert "config key 'rollout.max_batch' is deprecated: it is 'rollout.fast.max_batch' now" in notes[0]
    old_yaml = write_yaml(tmp_path / "old.yaml", {"rollout": {"max_batch": 3, "n": 2}})
    assert load_config(old_yaml).rollout.fast.max_batch == 3
    with pytest.raises(ConfigError, match=r"'rollout\.fast\.max_batch' expects int, got 'many'"):
        load_config(None, ["rollout.max_batch=many"])
    save_config(old, str(tmp_path / "config.yaml"))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["rollout"]["fast"] == moved and not set(moved) & set(saved["rollout"])
    assert load_config(str(tmp_path / "config.yaml")) == old


def test_a_file_with_a_deprecated_key_and_its_new_name_is_refused(tmp_path):
    """`max_batch: 8` beside `fast: {max_batch: 16}` would keep one of the two by the order of the lines."""
    for rollout in ({"max_batch": 8, "fast": {"max_batch": 16}}, {"fast": {"max_batch": 16}, "max_batch": 8}):
        path = write_yaml(tmp_path / "both.yaml", {"rollout": rollout})
        with pytest.raises(ConfigError, match=r"'rollout\.max_batch' and 'rollout\.fast\.max_batch' are both set"):
            load_config(path)
    path = write_yaml(tmp_path / "other.yaml", {"rollout": {"max_batch": 8, "fast": {"sync_every": 2}}})
    cfg = load_config(path)
    assert (cfg.rollout.fast.max_batch, cfg.rollout.fast.sync_every) == (8, 2)


def test_an_old_rl_file_given_to_another_trainer_names_the_wrong_command(tmp_path):
    """A deprecated key in a file loaded as another trainer's config reaches the wrong-command hint, not a
    KeyError."""
    from shardrl.config.offline import SFTConfig

    path = write_yaml(tmp_path / "rl.yaml", {"rollout": {"max_batch": 8}, "actor": {"optim": {"lr": 1e-5}}})
    with pytest.raises(ConfigError):
        load_config(path, cls=SFTConfig)


def test_a_group_baseline_over_groups_of_one_runs_with_a_warning():
    """rollout.n=1 with GRPO (verl's default n): verl runs it, the group's mean 0 and std 1; so does shardrl."""
    from shardrl.config.checks import group_of_one_warning

    cfg = load_config(None, ["rollout.n=1", "algorithm.adv_estimator=grpo"])
    assert group_of_one_warning(cfg).startswith(
        "rollout.n=1 with algorithm.adv_estimator='grpo': a prompt's group is one response, so there is no group "
        "baseline; as in verl, its mean is taken as 0 (and its std as 1), and each response's advantage is its own "
        "score (REINFORCE without a baseline")
    assert "whitening" in group_of_one_warning(load_config(None, [
        "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus_baseline"]))
    assert group_of_one_warning(load_config(None, ["rollout.n=2"])) is None
    assert group_of_one_warning(load_config(None, ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])) \
        is None
    with pytest.raises(ConfigError, match=r"rollout.n=1: with algorithm.filter_groups.enable: a group of one "
                                          r"response has no spread of rewards"):
        load_config(None, ["rollout.n=1", "algorithm.filter_groups.enable=true"])


def test_an_optim_total_steps_below_the_runs_steps_with_cosine_to_zero_is_warned():
    """Was: `shardrl sft optim.lr_schedule=cosine optim.total_steps=2 trainer.total_steps=4` trained steps 3 and 4
    at LR 0 without a word."""
    from shardrl.config.registry import TRAINERS, load_config

    def ignored(name, *overrides):
        return load_config(None, list(overrides), TRAINERS[name].config).ignored_settings()

    assert ignored("sft", "optim.lr_schedule=cosine", "optim.total_steps=2", "trainer.total_steps=4") == [
        "optim.total_steps=2 ends the cosine schedule before the run's trainer.total_steps=4 (each step makes one "
        "optimizer step or more): the steps after it train at LR 0 (optim.min_lr_ratio=0); leave optim.total_steps "
        "unset to span the run, or set optim.min_lr_ratio for a floor"]
    (line,) = ignored("train", "actor.optim.lr_schedule=cosine", "actor.optim.total_steps=2", "trainer.total_steps=4")
    assert line.startswith("actor.optim.total_steps=2 ends the cosine schedule before the run's trainer.total_steps=4")
    for fine in (["optim.lr_schedule=cosine", "optim.total_steps=4", "trainer.total_steps=4"],  # spans the run
                 ["optim.lr_schedule=cosine", "optim.total_steps=2", "optim.min_lr_ratio=0.1", "trainer.total_steps=4"],
                 ["optim.total_steps=2", "trainer.total_steps=4"],  # constant: no decay
                 ["optim.lr_schedule=cosine", "trainer.total_steps=4"]):  # unset: the run's length
        assert ignored("sft", *fine) == [], fine
    assert ignored("train", "critic.optim.lr_schedule=cosine", "critic.optim.total_steps=2",
                   "trainer.total_steps=4") == []  # (grpo: no critic is stepped)
