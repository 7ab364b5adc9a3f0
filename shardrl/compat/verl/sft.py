"""verl's SFT command lines in shardrl: `shardrl sft --verl key=value ...` takes the `key=value` lines of a
`torchrun -m verl.trainer.fsdp_sft_trainer` script and runs them as `shardrl sft` overrides, as
`shardrl.compat.verl.translate` does for `shardrl train --verl`.

`VERL_SFT_KEYS` is the table: every key of verl's sft_trainer.yaml (`VERL_SFT_DEFAULTS`) -> a `Rule` (the same
`Rule`s as the PPO table: the shardrl key it sets, or why it is dropped or refused). Keys the command line does not
give take verl's SFT default where it differs from shardrl's (`SFT_DEFAULTS_APPLIED`). What verl's SFT trainer
(verl/trainer/fsdp_sft_trainer.py) does not read (the `optim` keys of its shared optimizer config other than
lr, betas, weight_decay, clip_grad, lr_warmup_steps_ratio, lr_scheduler; trainer.seed; the deprecated
data.micro_batch_size) is dropped with a line saying so.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from shardrl.compat.verl.defaults import VERL_SFT_DEFAULTS
from shardrl.compat.verl.keys import (Rule, _resume_mode, conv, dropped, dtype, file_list, keep_last, loggers,
                                      minus_one_off, only, same, strategy)
from shardrl.compat.verl.translate import Translation, VerlKeyError, parse_verl_args

NOT_READ = "verl's SFT trainer does not read it"
KERNEL = "a kernel or loading switch; it changes no number of the run"


def _nested_key(key: str):
    """verl's `data.prompt_key` + `data.prompt_dict_keys` (a column holding a dict, and the keys to descend) ->
    shardrl's dotted `data.prompt_key` (extra_info + [question] -> extra_info.question)."""
    def apply(value, out, given):
        column = given.get(key)
        if isinstance(column, (list, tuple)):
            if len(column) != 1:
                raise ValueError(f"{key}={column!r}: shardrl reads one column")
            column = column[0]
        path = [str(column), *(str(k) for k in (value or []))]
        out[f"data.{key.split('.')[-1]}"] = ".".join(path)
    return Rule(apply=apply, hint=f"'data.{key.split('.')[-1]}' (a dotted path: column.key)")


def _multiturn(value, out, given):
    if value:
        out["data.messages_key"] = given.get("data.multiturn.messages_key", "messages")


def _truncation(value):
    if value not in ("error", "right"):
        raise ValueError(f"truncation {value!r}: shardrl cuts an SFT row on the right (right), or raises (error)")
    return value


def _scheduler(value):
    if value not in ("cosine", None):
        raise ValueError(f"lr_scheduler {value!r}: shardrl has cosine (verl's SFT default) and constant, not wsd")
    return "cosine"


def _micro_batch(value, out, given):
    out["engine.micro_batch_size_per_gpu"] = value
    out["engine.use_dynamic_bsz"] = False  # verl's SFT micro-batches are fixed row counts


def _convert_none(rule: Rule):
    try:
        return rule.convert(None) if rule.convert else None
    except (TypeError, ValueError, AttributeError):
        return None


VERL_SFT_KEYS: dict[str, Rule] = {
    # data
    "data.train_files": conv("data.train_files", file_list),
    "data.val_files": conv("data.val_files", file_list),
    "data.train_batch_size": same("data.batch_size"),
    "data.micro_batch_size_per_gpu": Rule(apply=_micro_batch, hint="'engine.micro_batch_size_per_gpu'"),
    "data.micro_batch_size": dropped(f"verl's deprecated global micro-batch; {NOT_READ} (micro_batch_size_per_gpu "
                                     "is what it cuts by)"),
    "data.train_max_samples": only((-1, None), "not supported; cut the file instead"),
    "data.val_max_samples": only((-1, None), "not supported; cut the file instead"),
    "data.prompt_key": same("data.prompt_key"),
    "data.response_key": same("data.response_key"),
    "data.prompt_dict_keys": _nested_key("data.prompt_key"),
    "data.response_dict_keys": _nested_key("data.response_key"),
    "data.multiturn.enable": Rule(apply=_multiturn, hint="'data.messages_key' (a row with it is a chat)"),
    "data.multiturn.messages_key": Rule(apply=lambda value, out, given: None,  # read by data.multiturn.enable
                                        hint="'data.messages_key' (with data.multiturn.enable=true)"),
    "data.multiturn.tools_key": only(("tools",), "not supported: shardrl sft renders no tools column"),
    "data.multiturn.enable_thinking_key": only(("enable_thinking",), "not supported"),
    "data.max_length": same("data.max_length"),
    "data.truncation": conv("data.truncation", _truncation),
    "data.balance_dp_token": dropped("shardrl's loss is the token mean of the whole global batch however it is "
                                     "cut into micro-batches and ranks"),
    "data.chat_template": same("model.chat_template"),
    "data.custom_cls.path": only((None,), "a custom dataset class is not supported"),
    "data.custom_cls.name": only((None,), "a custom dataset class is not supported"),
    "data.use_shm": dropped(KERNEL),
    "data.apply_chat_template_kwargs": only(({},), "not supported"),
    # model
    "model.partial_pretrain": Rule("model.path", lambda v: v and os.path.expanduser(str(v))),
    "model.use_shm": dropped(KERNEL),
    "model.fsdp_config.model_dtype": conv("model.dtype", dtype),
    "model.fsdp_config.wrap_policy.min_num_params": dropped("shardrl shards each decoder layer"),
    "model.fsdp_config.cpu_offload": only((False,), "FSDP's CPU offload of the SFT step is not supported"),
    "model.fsdp_config.offload_params": only((False,), "FSDP's CPU offload of the SFT step is not supported"),
    "model.external_lib": only((None,), "shardrl imports no extra model library"),
    "model.enable_gradient_checkpointing": same("model.gradient_checkpointing"),
    "model.trust_remote_code": same("model.trust_remote_code"),
    "model.lora_rank": same("model.lora.rank"),
    "model.lora_alpha": same("model.lora.alpha"),
    "model.target_modules": same("model.lora.target_modules"),
    "model.use_liger": dropped(KERNEL),
    "model.strategy": conv("engine.strategy", strategy),
    # optim
    "optim.lr": same("optim.lr"),
    "optim.betas": same("optim.betas"),
    "optim.weight_decay": same("optim.weight_decay"),
    "optim.clip_grad": same("optim.clip_grad"),
    "optim.lr_warmup_steps_ratio": same("optim.warmup_ratio"),
    "optim.lr_scheduler": conv("optim.lr_schedule", _scheduler),
    "optim.optimizer": only(("AdamW",), "shardrl trains with AdamW"),
    "optim.optimizer_impl": only(("torch.optim",), "shardrl uses torch.optim.AdamW"),
    "optim.override_optimizer_config": only((None,), "not supported"),
    **{f"optim.{k}": dropped(NOT_READ) for k in ("total_training_steps", "lr_warmup_steps", "min_lr_ratio",
                                                 "num_cycles", "lr_scheduler_type", "warmup_style")},
    "ulysses_sequence_parallel_size": same("engine.ulysses_sequence_parallel_size"),
    "use_remove_padding": same("model.use_remove_padding"),
    # trainer
    "trainer.default_local_dir": Rule("trainer.output_dir", lambda v: None if v is None else os.path.expanduser(str(v))),
    "trainer.default_hdfs_dir": only((None,), "HDFS is not supported; set trainer.default_local_dir"),
    "trainer.project_name": same("trainer.project_name"),
    "trainer.experiment_name": same("trainer.experiment_name"),
    "trainer.total_epochs": same("trainer.total_epochs"),
    "trainer.total_training_steps": same("trainer.total_steps"),
    "trainer.logger": conv("trainer.logger", loggers),
    "trainer.seed": dropped(NOT_READ),
    "trainer.save_freq": conv("trainer.save_freq", minus_one_off),
    "trainer.test_freq": conv("trainer.val_freq", minus_one_off),
    "trainer.nnodes": dropped("verl's SFT trainer runs on torchrun's processes: give shardrl --nnodes"),
    "trainer.n_gpus_per_node": dropped("verl's SFT trainer runs on torchrun's processes: give shardrl "
                                       "--nproc-per-node"),
    "trainer.max_ckpt_to_keep": conv("trainer.keep_last", keep_last),
    "trainer.resume_mode": Rule(apply=_resume_mode, hint="'trainer.resume'"),
    "trainer.resume_from_path": dropped("read with resume_mode=resume_path"),
    "trainer.checkpoint.save_contents": dropped("a shardrl checkpoint holds the model, optimizer and train state; "
                                                "trainer.export_hf writes the model as a Hugging Face folder"),
    "trainer.checkpoint.load_contents": dropped("a shardrl checkpoint is loaded whole"),
    "trainer.device": dropped("shardrl runs on CUDA when present (trainer.device=auto)"),
}

SFT_DEFAULTS_APPLIED = ("data.train_batch_size", "data.micro_batch_size_per_gpu", "data.prompt_key",
                        "data.response_key", "model.enable_gradient_checkpointing", "optim.betas",
                        "optim.lr_warmup_steps_ratio", "optim.lr_scheduler", "use_remove_padding",
                        "trainer.total_epochs", "trainer.resume_mode", "trainer.max_ckpt_to_keep")
"""verl's SFT defaults that differ from `shardrl sft`'s and change the run: taken when the command line does not
give the key (its other defaults are shardrl's, or change nothing here)."""


def translate_sft(args: list[str]) -> Translation:
    """verl's SFT `key=value` arguments as `shardrl sft` overrides; a `VerlKeyError` naming every verl key shardrl
    does not know or cannot run."""
    given = parse_verl_args(args)
    refused = []
    for key in [k for k in given if k not in VERL_SFT_KEYS]:
        close = difflib.get_close_matches(key, sorted(VERL_SFT_KEYS), n=1, cutoff=0.8)
        refused.append(f"{key} (verl's SFT trainer has no such key" + (f"; did you mean {close[0]}?)" if close else ")"))
    values = {**{k: VERL_SFT_DEFAULTS[k] for k in SFT_DEFAULTS_APPLIED if k not in given},
              **{k: v for k, v in given.items() if k in VERL_SFT_KEYS}}
    out: dict[str, Any] = {}
    dropped_keys: dict[str, str] = {}
    applies = []
    for key, value in values.items():
        rule = VERL_SFT_KEYS[key]
        try:
            if rule.apply is not None:
                applies.append((key, rule, value))
            elif rule.drop is not None:
                dropped_keys[key] = rule.drop
            elif rule.refuse is not None:
                if value not in rule.neutral:
                    raise ValueError(rule.refuse)
            elif value is None:  # null: verl's "unset": shardrl's default, unless the conversion gives it a
                converted = _convert_none(rule)  # meaning (max_ckpt_to_keep: keep all)
                if converted is not None:
                    out[rule.target] = converted
            else:
                out[rule.target] = rule.convert(value) if rule.convert else value
        except (ValueError, TypeError) as e:
            refused.append(f"{key}={value!r}: {e}")
    for key, rule, value in applies:  # after the plain keys: a dotted prompt_key replaces the plain one
        try:
            rule.apply(value, out, values)
        except (ValueError, TypeError) as e:
            refused.append(f"{key}={value!r}: {e}")
    if refused:
        raise VerlKeyError(f"verl SFT key(s) shardrl cannot run: {'; '.join(refused)}. The verl SFT keys shardrl "
                           "takes are listed in shardrl/compat/verl/sft.py (README, 'For verl users')")
    out["trainer.export_hf"] = True  # verl's SFT trainer saves the model at its last step, whatever save_freq says
    if "model.path" not in out:
        raise VerlKeyError("the verl SFT command line gives no model.partial_pretrain (a model folder or hub id)")
    return Translation([f"{k}={json.dumps(v, default=str)}" for k, v in out.items()], dropped_keys, "sft")
