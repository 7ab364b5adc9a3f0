"""The table of `shardrl train --verl` (`shardrl.compat.verl.translate`): each verl key -> a `Rule`, verl's defaults that
differ from shardrl's, and the value conversions (verl's conventions -> shardrl's). One module, one table: a verl key
shardrl learns is one line here."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Rule:
    target: str | None = None
    """The shardrl key it sets (None: dropped, or handled by `apply`)."""
    convert: Callable[[Any], Any] | None = None
    """verl value -> shardrl value (raises ValueError for a value shardrl cannot run)."""
    drop: str | None = None
    """Dropped with one warning: why it changes nothing here."""
    neutral: tuple = ()
    """Values accepted and dropped without a word (verl's 'off'); any other is refused with `refuse`."""
    refuse: str | None = None
    """Why another value cannot run."""
    apply: Callable[[Any, dict, dict], str | None] | None = None
    """A rule setting several keys: apply(value, out, given) with the native overrides so far (`out`) and the
    verl keys given; it may return a note for the user (printed with the translation)."""
    hint: str | None = None
    """For an `apply` rule: the native keys it sets, for the unknown-key hint."""


def same(target: str) -> Rule:
    return Rule(target)


def conv(target: str, fn: Callable[[Any], Any]) -> Rule:
    return Rule(target, fn)


def dropped(why: str) -> Rule:
    return Rule(drop=why)


def only(neutral: tuple, refuse: str) -> Rule:
    return Rule(neutral=neutral, refuse=refuse)


# ---- value conversions ------------------------------------------------------------------------------------------
def file_list(value) -> list[str]:
    """verl takes one file as a string, or a list; `~` is expanded as verl's loader does."""
    files = [value] if isinstance(value, str) else list(value or [])
    return [os.path.expanduser(str(f)) for f in files]


def minus_one_off(value):
    """verl's -1 (or None) = off, shardrl's 0."""
    return 0 if value is None or value < 0 else value


def top_k(value):
    return 0 if value is None or value < 0 else value


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def dtype(value):
    if str(value) not in DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {sorted(DTYPES)}")
    return DTYPES[str(value)]


def strategy(value):
    if value not in ("fsdp", "fsdp2"):
        raise ValueError(f"strategy {value!r}: shardrl has fsdp (FSDP1, CUDA only) and fsdp2; megatron is not supported")
    return value


def _loss_mode(value, out, given):
    modes = {"vanilla": "vanilla", "gspo": "gspo_token", "cispo": "cispo", "sapo": "sapo", "geo_mean": "geo_mean",
             "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl"}  # verl's gspo is shardrl's gspo_token
    if value not in modes:
        raise ValueError(f"policy loss {value!r} is not supported; shardrl has verl's {sorted(modes)}")
    out["actor.loss_mode"] = modes[value]
    if value in ("gspo", "sapo", "geo_mean"):
        # verl's GSPO and SAPO reduce seq-mean-token-mean whatever actor.loss_agg_mode says, and its GMPO takes the
        # mean over sequences (its per-sequence loss on each token, seq-mean-token-mean here)
        out["actor.loss_agg_mode"] = "seq-mean-token-mean"


def loss_agg(value):
    known = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    if value not in known:
        raise ValueError(f"loss_agg_mode {value!r} is not supported (Dr. GRPO's seq-mean-token-sum-norm divides by a "
                         f"fixed length); shardrl has {list(known)}")
    return value


def kl_type(value):
    if value in ("full",):
        raise ValueError("the full-vocabulary KL is not supported; shardrl has kl/k1, abs, mse/k2, low_var_kl/k3 "
                         "(and a + suffix)")
    return value


def estimator(value):
    known = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    if value == "opd":
        raise ValueError("opd is shardrl's on-policy distillation, not a verl estimator, and its teacher "
                         "(teacher.model_path) has no verl key: run it from a shardrl config, without --verl")
    if value not in known:
        raise ValueError(f"advantage estimator {value!r} is not supported; shardrl has {sorted(known)}")
    return value


def schedule(value):
    if value not in ("constant", "cosine", None):
        raise ValueError(f"lr schedule {value!r}: shardrl has constant and cosine")
    return value or "constant"


def loggers(value):
    names = [value] if isinstance(value, str) else list(value)
    known = ("console", "wandb", "tensorboard", "mlflow", "swanlab", "trackio")
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"logger(s) {bad} are not supported; shardrl has {', '.join(known)} (and jsonl)")
    return names + ["jsonl"]  # metrics.jsonl as well: the run folder's summary and curve read it


def truncation(value):
    if value not in ("error", "left", "right"):
        raise ValueError(f"truncation {value!r}: shardrl cuts prompts on the left or right, or raises (error)")
    return value


def keep_last(value):
    return 0 if value is None or value < 0 else value


def nonneg(value):
    return max(int(value), 0)


# ---- rules that set several keys ----------------------------------------------------------------------------------
def _clip_ratio(value, out, given):
    """verl uses clip_ratio only where clip_ratio_low / _high are null (their defaults are 0.2)."""
    for side in ("low", "high"):
        key = f"actor_rollout_ref.actor.clip_ratio_{side}"
        if key in given and given[key] is None:
            out[f"actor.clip_ratio_{side}"] = value


def _do_sample(value, out, given):
    if value is False:
        out["rollout.temperature"] = 0.0


def _val_do_sample(value, out, given):
    if value is False:
        out["rollout.val_kwargs.temperature"] = 0.0


def _filter_overlong(value, out, given):
    if value:  # verl drops the prompts over max_prompt_length before training
        out["data.truncation"] = "drop"


def _resume_mode(value, out, given):
    if value == "auto":
        out["trainer.resume"] = "auto"
    elif value == "disable":
        out["trainer.resume"] = "never"
    elif value == "resume_path":
        path = given.get("trainer.resume_from_path")
        if not path:
            raise ValueError("resume_mode=resume_path needs trainer.resume_from_path")
        out["trainer.resume"] = os.path.expanduser(str(path))
    else:
        raise ValueError(f"resume_mode {value!r}: verl's modes are auto, disable, resume_path")


def _kl_ctrl_type(value, out, given):
    if value == "adaptive":
        out["algorithm.kl_target"] = given.get("algorithm.kl_ctrl.target_kl", 0.1)
    elif value != "fixed":
        raise ValueError(f"kl_ctrl.type {value!r}: verl's are fixed and adaptive")


def _reward_model_enable(value, out, given):
    if value:
        path = given.get("reward_model.model.path")
        if not path:
            raise ValueError("reward_model.enable=True needs reward_model.model.path")
        out["reward.model_path"] = os.path.expanduser(str(path))


def _reward_manager(value, out, given):
    if value not in ("naive", "dapo"):
        raise ValueError(f"reward manager {value!r}: shardrl scores like verl's naive (and dapo: set "
                         "reward_model.overlong_buffer.*)")


def _rollout_is(value, out, given):
    if value is None or given.get("algorithm.rollout_correction.rollout_rs") is not None:
        return  # with rollout_rs: `_rollout_rs` reads both
    if value not in ("token", "sequence"):
        raise ValueError(f"rollout_is {value!r}: shardrl has token and sequence")
    out["algorithm.rollout_is"] = True
    out["algorithm.rollout_is_level"] = value


RS_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
"""verl's ratio-band rejection options -> shardrl's rollout_is_level."""


def _rollout_rs(value, out, given):
    """verl's rejection (rollout_rs) as shardrl's band: alone, rollout_is_mode=reject; with rollout_is at the same
    level and the band under its cap, rollout_is_mode=mask (the kept weights are never capped). verl's k1 statistic
    is log(pi_rollout / pi_old) in [log lower, log upper], so the band on shardrl's ratio pi_old / pi_rollout is
    [1 / upper, 1 / lower]."""
    if value is None:
        return
    option = str(value).replace(" ", "")
    if option not in RS_LEVELS:
        raise ValueError(f"shardrl has one ratio-band option of {sorted(RS_LEVELS)} (the k2/k3 divergence bounds, "
                         "seq_max and chained options are not supported)")
    spec = given.get("algorithm.rollout_correction.rollout_rs_threshold")
    if spec is None:
        raise ValueError("needs algorithm.rollout_correction.rollout_rs_threshold (lower_upper, e.g. 0.5_2.0)")
    lower, _, upper = str(spec).partition("_")
    lower, upper = (float(lower), float(upper)) if upper else (1.0 / float(lower), float(lower))
    if not 0 < lower < upper:
        raise ValueError(f"rollout_rs_threshold {spec!r} must be 0 < lower < upper")
    level, is_level = RS_LEVELS[option], given.get("algorithm.rollout_correction.rollout_is")
    cap = given.get("algorithm.rollout_correction.rollout_is_threshold")
    if is_level is not None and (is_level != level or cap is None or 1.0 / lower > cap):
        raise ValueError(f"with rollout_is={is_level!r} shardrl runs only the same level's rejection (token_k1 with "
                         "token, seq_sum_k1 with sequence) whose band lies under rollout_is_threshold "
                         "(algorithm.rollout_is_mode=mask); or drop rollout_is (rollout_is_mode=reject)")
    out.update({"algorithm.rollout_is": True, "algorithm.rollout_is_level": level,
                "algorithm.rollout_is_mode": "reject" if is_level is None else "mask",
                "algorithm.rollout_is_threshold": 1.0 / lower, "algorithm.rollout_is_threshold_lower": 1.0 / upper})


def _override_config(target: str):
    """verl's model.override_config (set over the HF config, as shardrl's `target`); its attn_implementation picks
    verl's attention kernel (shardrl picks its own: model.attn_implementation), the numbers the same."""
    def apply(value, out, given):
        if not isinstance(value, dict):
            raise ValueError("is a mapping of HF config keys, e.g. +actor_rollout_ref.model.override_config."
                             "max_position_embeddings=32768")
        value = {k: v for k, v in value.items() if k != "attn_implementation"}
        if value:
            out[target] = value
    return apply


def _quantization(value, out, given):
    """verl's FP8 rollout (`rollout.quantization`: fp8, or true in its first release with `use_block_quant_rollout`):
    the linear layers' weights quantized to FP8 at each weight sync, in 128 x 128 blocks, as shardrl's
    `rollout.quantization=fp8` does (verl's vLLM also quantizes the activations in 1 x 128 groups for DeepGEMM; here
    block scales run weight-only)."""
    if value in (None, False) or str(value).lower() in ("none", "null", "false", ""):
        return None
    if value is not True and str(value).lower() not in ("fp8", "true"):
        raise ValueError("shardrl's rollout quantizes to fp8 only (rollout.quantization=fp8)")
    out["rollout.quantization"] = "fp8"
    if given.get("actor_rollout_ref.rollout.use_block_quant_rollout", True) not in (False, "false", "False"):
        out["rollout.fp8.block_size"] = 128
        return ("rollout.quantization=fp8 with rollout.fp8.block_size=128: the weights in FP8 128 x 128 blocks, the "
                "activations in bf16 (verl's vLLM quantizes them too)")
    return "rollout.quantization=fp8: the weights in FP8, a scale per output channel"


def _block_quant(value, out, given):
    """verl's use_block_quant_rollout: read by `_quantization`; alone it changes nothing."""
    if value and not given.get("actor_rollout_ref.rollout.quantization"):
        return "use_block_quant_rollout without rollout.quantization: the rollout runs unquantized"
    return None


def _global_micro_batch(target: str, per_gpu_key: str, sp_key: str | None, dynamic_key: str):
    """verl's deprecated global micro-batch (ppo_micro_batch_size, log_prob_micro_batch_size, ...), which verl
    still runs: its FSDP workers divide it by the data-parallel size (world // ulysses_sequence_parallel_size, with
    floor division) into the `*_per_gpu` key. Both given is refused, as verl's config check does, unless dynamic
    batch sizes make the micro-batch size unused (verl's worker then overwrites the `*_per_gpu` key)."""
    def apply(value, out, given):
        if value is None:
            return None
        key = per_gpu_key.removesuffix("_per_gpu")
        if given.get(per_gpu_key) is not None and not given.get(dynamic_key):
            raise ValueError(f"given with {per_gpu_key}={given[per_gpu_key]!r}, which verl refuses too: remove "
                             f"{key} (deprecated; only the _per_gpu key is supported)")
        world = int(given.get("trainer.n_gpus_per_node", 8)) * int(given.get("trainer.nnodes", 1))  # verl's defaults
        sp = int(given.get(sp_key) or 1) if sp_key else 1
        dp = max(world // sp, 1)
        per_gpu = int(value) // dp
        if per_gpu < 1:
            raise ValueError(f"verl's global micro-batch divided over the {dp} data-parallel ranks ({world} GPUs"
                             + (f" / ulysses_sequence_parallel_size {sp}" if sp > 1 else "") + ") is less than one "
                             f"sample a GPU; set {per_gpu_key} instead")
        out[target] = per_gpu
        floor = "" if int(value) % dp == 0 else " (floored, as verl's worker does)"
        return (f"{key}={value} is verl's deprecated global micro-batch: {value} // {dp} data-parallel ranks = "
                f"{per_gpu} a GPU{floor}, {target}={per_gpu}")
    return apply


def _response_length(value, out, given):
    key = "actor_rollout_ref.rollout.response_length"
    if key in given and given[key] is not None and given[key] != value:
        value = given[key]  # the rollout's own length limit is what generation obeys
    out["rollout.max_new_tokens"] = value
    out["rollout.multi_turn.max_response_tokens"] = value  # a conversation's budget, as verl's response_length


def _same_as_response(value, given):
    limit = given.get("actor_rollout_ref.rollout.response_length") or given.get("data.max_response_length")
    if value is not None and limit is not None and value != limit:
        raise ValueError(f"the DAPO penalty's max_resp_len={value} differs from the response length {limit}; shardrl "
                         "shapes against the response length limit (set them equal)")


# ---- the table --------------------------------------------------------------------------------------------------
VLLM = "a vLLM/SGLang setting; shardrl generates with its own rollout (rollout.backend)"
RAY = "a Ray/worker setting; shardrl runs under torchrun without Ray"
KERNEL = "a kernel or performance switch; shardrl picks its own kernels (the numbers do not change)"
MICRO = ("a micro-batch size of a forward-only pass; shardrl computes old log-probs with the actor engine's "
         "micro-batching (micro-batching does not change the numbers)")

RESPONSE_KEYS = "'rollout.max_new_tokens' (and 'rollout.multi_turn.max_response_tokens')"

VERL_KEYS: dict[str, Rule] = {
    # data
    "data.train_files": conv("data.train_files", file_list),
    "data.val_files": conv("data.val_files", file_list),
    "data.prompt_key": same("data.prompt_key"),
    "data.max_prompt_length": same("data.max_prompt_length"),
    "data.max_response_length": Rule(apply=_response_length, hint=RESPONSE_KEYS),
    "data.train_batch_size": same("data.train_batch_size"),
    "data.val_batch_size": same("data.val_batch_size"),
    "data.shuffle": same("data.shuffle"),
    "data.seed": Rule("data.seed", lambda v: 0 if v is None else v),
    "data.truncation": conv("data.truncation", truncation),
    "data.filter_overlong_prompts": Rule(apply=_filter_overlong, hint="'data.truncation' (drop)"),
    "data.filter_overlong_prompts_workers": dropped(RAY),
    "data.dataloader_num_workers": dropped(RAY),
    "data.return_raw_chat": dropped("shardrl always keeps the chat messages"),
    "data.return_full_prompt": dropped("shardrl always keeps the chat messages"),
    "data.use_shm": dropped(RAY),
    "data.tokenizer": only((None,), "shardrl reads the tokenizer from the model folder (model.tokenizer_path)"),
    "data.reward_fn_key": only(("data_source",), "shardrl picks the scorer by the data_source column"),
    "data.train_max_samples": only((-1, None), "not supported; cut the file instead"),
    "data.val_max_samples": only((-1, None), "not supported; cut the file instead"),
    "data.image_key": same("data.image_key"),
    "data.image_patch_size": dropped("the model folder's processor resizes with its own patch size"),
    "data.video_key": dropped("videos are not read yet (issue 61: images only)"),
    "data.return_multi_modal_inputs": only((True,), "shardrl always carries each row's images to the engine"),
    "data.trust_remote_code": same("model.trust_remote_code"),
    "data.validation_shuffle": dropped("validation scores every prompt; order does not matter"),
    # model
    "actor_rollout_ref.model.path": conv("model.path", lambda v: os.path.expanduser(str(v))),
    "actor_rollout_ref.model.tokenizer_path": Rule("model.tokenizer_path",
                                                   lambda v: v and os.path.expanduser(str(v))),
    "actor_rollout_ref.model.trust_remote_code": same("model.trust_remote_code"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": same("model.gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": same("model.use_remove_padding"),
    "actor_rollout_ref.model.lora_rank": Rule("model.lora.rank", lambda v: 0 if v is None else v),
    "actor_rollout_ref.model.lora_alpha": same("model.lora.alpha"),
    "actor_rollout_ref.model.target_modules": Rule("model.lora.target_modules",
                                                   lambda v: v if v == "all-linear" else list(v)),
    "actor_rollout_ref.model.exclude_modules": only((None,), "LoRA's exclude_modules is not supported; list "
                                                             "target_modules instead"),
    "actor_rollout_ref.model.lora_adapter_path": only((None,), "starting from a trained adapter is not supported "
                                                               "yet"),
    "actor_rollout_ref.model.external_lib": only((None,), "shardrl imports no extra model library; register the "
                                                          "model with transformers' Auto classes instead"),
    "actor_rollout_ref.model.custom_chat_template": same("model.chat_template"),
    "actor_rollout_ref.model.override_config": Rule(apply=_override_config("model.override_config"),
                                                    hint="'model.override_config'"),
    "actor_rollout_ref.model.override_config.attn_implementation": dropped(KERNEL),
    "actor_rollout_ref.model.use_liger": dropped(KERNEL),
    "actor_rollout_ref.model.use_fused_kernels": dropped(KERNEL),
    "actor_rollout_ref.model.use_shm": dropped(RAY),
    "actor_rollout_ref.model.enable_activation_offload": only((False,), "not supported; use "
                                                                        "enable_gradient_checkpointing"),
    "actor_rollout_ref.hybrid_engine": only((True,), "shardrl's colocated rollout is verl's hybrid engine; "
                                                     "see async_rl.rollout_ranks for separate rollout GPUs"),
    "actor_rollout_ref.nccl_timeout": dropped(RAY),
    # actor
    "actor_rollout_ref.actor.strategy": conv("actor.engine.strategy", strategy),
    "actor_rollout_ref.actor.ppo_mini_batch_size": same("actor.ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Rule("actor.engine.micro_batch_size_per_gpu",
                                                                 lambda v: 1 if v is None else v),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Rule(apply=_global_micro_batch(
        "actor.engine.micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.use_dynamic_bsz"),
        hint="'actor.engine.micro_batch_size_per_gpu' (per GPU)"),
    "actor_rollout_ref.actor.use_dynamic_bsz": same("actor.engine.use_dynamic_bsz"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": same("actor.engine.max_token_len_per_gpu"),
    "actor_rollout_ref.actor.clip_ratio": Rule(apply=_clip_ratio, hint="'actor.clip_ratio_low' and "
                                                                          "'actor.clip_ratio_high'"),
    "actor_rollout_ref.actor.clip_ratio_low": Rule("actor.clip_ratio_low", lambda v: 0.2 if v is None else v),
    "actor_rollout_ref.actor.clip_ratio_high": Rule("actor.clip_ratio_high", lambda v: 0.2 if v is None else v),
    "actor_rollout_ref.actor.clip_ratio_c": same("actor.clip_ratio_c"),
    "actor_rollout_ref.actor.tau_pos": same("actor.tau_pos"),
    "actor_rollout_ref.actor.tau_neg": same("actor.tau_neg"),
    "actor_rollout_ref.actor.loss_agg_mode": conv("actor.loss_agg_mode", loss_agg),
    "actor_rollout_ref.actor.entropy_coeff": same("actor.entropy_coeff"),
    "actor_rollout_ref.actor.calculate_entropy": dropped("shardrl logs the entropy it computes"),
    "actor_rollout_ref.actor.use_kl_loss": same("actor.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": same("actor.kl_loss_coef"),
    "actor_rollout_ref.actor.kl_loss_type": conv("actor.kl_loss_type", kl_type),
    "actor_rollout_ref.actor.ppo_epochs": same("actor.ppo_epochs"),
    "actor_rollout_ref.actor.freeze_vision_tower": same("model.freeze_vision_tower"),
    "actor_rollout_ref.actor.router_replay.mode": same("actor.router_replay.mode"),
    "actor_rollout_ref.actor.shuffle": same("actor.shuffle"),
    "actor_rollout_ref.actor.data_loader_seed": dropped("shardrl seeds the mini-batch shuffle from data.seed"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Rule(apply=_loss_mode, hint="'actor.loss_mode'"),
    "actor_rollout_ref.actor.grad_clip": Rule(apply=lambda v, out, given: out.__setitem__("actor.optim.clip_grad", v),
                                              hint="'actor.optim.clip_grad'"),  # verl reads it over optim.clip_grad
    "actor_rollout_ref.actor.use_torch_compile": dropped(KERNEL),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": dropped(KERNEL),
    "actor_rollout_ref.actor.entropy_checkpointing": dropped(KERNEL),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": same("actor.engine.ulysses_sequence_parallel_size"),
    "actor_rollout_ref.actor.checkpoint.save_contents": dropped("a checkpoint holds model, optimizer and the rest"),
    "actor_rollout_ref.actor.checkpoint.load_contents": dropped("a checkpoint holds model, optimizer and the rest"),
    "actor_rollout_ref.actor.checkpoint.async_save": only((False,), "checkpoints are saved synchronously"),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": conv("model.dtype", dtype),
    # reference
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Rule("ref.engine.micro_batch_size_per_gpu",
                                                                    lambda v: 1 if v is None else v),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Rule(apply=_global_micro_batch(
        "ref.engine.micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.use_dynamic_bsz"),
        hint="'ref.engine.micro_batch_size_per_gpu' (per GPU)"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": same("ref.engine.use_dynamic_bsz"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": same("ref.engine.max_token_len_per_gpu"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": same("ref.engine.ulysses_sequence_parallel_size"),
    "actor_rollout_ref.ref.strategy": conv("ref.engine.strategy", strategy),
    "actor_rollout_ref.ref.use_torch_compile": dropped(KERNEL),
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": dropped(KERNEL),
    "actor_rollout_ref.ref.entropy_checkpointing": dropped(KERNEL),
    # rollout
    "actor_rollout_ref.rollout.name": dropped(VLLM),
    "actor_rollout_ref.rollout.mode": dropped(VLLM),
    "actor_rollout_ref.rollout.n": same("rollout.n"),
    "actor_rollout_ref.rollout.temperature": same("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": same("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": conv("rollout.top_k", top_k),
    "actor_rollout_ref.rollout.do_sample": Rule(apply=_do_sample, hint="'rollout.temperature' (0: greedy)"),
    "actor_rollout_ref.rollout.response_length": Rule(apply=_response_length, hint=RESPONSE_KEYS),
    "actor_rollout_ref.rollout.prompt_length": dropped(VLLM + " (data.max_prompt_length filters the prompts)"),
    "actor_rollout_ref.rollout.free_cache_engine": same("rollout.free_cache_engine"),
    "actor_rollout_ref.rollout.enable_prefix_caching": same("rollout.fast.prefix_cache"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": dropped(MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": dropped(MICRO),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": dropped(MICRO),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": dropped(MICRO),
    "actor_rollout_ref.rollout.val_kwargs.n": same("rollout.val_kwargs.n"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": same("rollout.val_kwargs.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": same("rollout.val_kwargs.top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": conv("rollout.val_kwargs.top_k", top_k),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Rule(apply=_val_do_sample),
    "actor_rollout_ref.rollout.multi_turn.enable": same("rollout.multi_turn.enable"),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": Rule("rollout.multi_turn.max_turns",
                                                                     lambda v: 0 if v is None else v),  # null: none
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": same("rollout.multi_turn.max_tool_output_chars"),
    "actor_rollout_ref.rollout.multi_turn.format": only(("hermes",), "shardrl parses Hermes tool calls"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": Rule("rollout.multi_turn.tool_config_path",
                                                                  lambda v: v and os.path.expanduser(str(v))),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": same("rollout.multi_turn.max_calls_per_turn"),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": only((None,), "user (interaction) turns are not "
                                                                         "supported yet"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": same(
        "rollout.multi_turn.tool_output_truncate_side"),
    "data.tool_config_path": dropped("read from actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    "global_profiler.tool": dropped("a profiler setting; shardrl has no built-in profiler"),
    "global_profiler.save_path": dropped("a profiler setting; shardrl has no built-in profiler"),
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries": dropped("a profiler setting"),
    "global_profiler.global_tool_config.torch_memory.stack_depth": dropped("a profiler setting"),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": only((None,), "verl's interaction config is not "
                                                                                  "read; use "
                                                                                  "rollout.multi_turn.interaction_path"),
    "actor_rollout_ref.rollout.calculate_log_probs": dropped("the sampler's log-probs are always kept"),
    "actor_rollout_ref.rollout.quantization": Rule(apply=_quantization,
                                                   hint="'rollout.quantization' and 'rollout.fp8.block_size'"),
    "actor_rollout_ref.rollout.use_block_quant_rollout": Rule(apply=_block_quant, hint="'rollout.fp8.block_size'"),
    "actor_rollout_ref.rollout.ignore_eos": only((False,), "not supported"),
    "actor_rollout_ref.rollout.over_sample_rate": dropped("a rollout-server throughput setting (it aborts the "
                                                          "slowest requests); shardrl generates every response"),
    "actor_rollout_ref.rollout.skip_rollout": only((False,), "not supported"),
    **{f"actor_rollout_ref.rollout.{k}": dropped(VLLM) for k in (
        "gpu_memory_utilization", "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size",
        "pipeline_model_parallel_size", "enforce_eager", "cudagraph_capture_sizes", "max_num_batched_tokens",
        "max_model_len", "max_num_seqs", "enable_chunked_prefill", "load_format", "dtype",
        "disable_log_stats", "logprobs_mode", "scheduling_policy", "multi_stage_wake_up", "skip_tokenizer_init",
        "layered_summon", "agent.num_workers", "trace.backend", "trace.token2text", "enable_rollout_routing_replay",
        "prometheus.enable", "engine_kwargs.vllm.swap_space", "engine_kwargs.sglang.attention_backend",
        "mode", "multi_turn.tokenization_sanity_check_mode", "multi_turn.use_inference_chat_template")},
    # critic
    "critic.strategy": conv("critic.engine.strategy", strategy),
    "critic.enable": dropped("shardrl builds the critic when the estimator needs one (gae)"),
    "critic.model.path": conv("critic.model_path", lambda v: os.path.expanduser(str(v))),
    "critic.model.tokenizer_path": dropped("the critic reads the policy's tokenizer"),
    "critic.model.override_config": Rule(apply=_override_config("critic.model_override_config"),
                                         hint="'critic.model_override_config'"),
    "critic.model.override_config.attn_implementation": dropped(KERNEL),
    "critic.model.enable_gradient_checkpointing": dropped("shardrl's model.gradient_checkpointing covers every role"),
    "critic.model.use_remove_padding": dropped("shardrl's model.use_remove_padding covers every role"),
    "critic.model.trust_remote_code": dropped("shardrl's model.trust_remote_code covers every role"),
    "critic.model.external_lib": only((None,), "shardrl imports no extra model library"),
    "critic.model.lora_rank": only((0, None), "LoRA on the critic is not supported (the policy's is: "
                                              "actor_rollout_ref.model.lora_rank)"),
    "critic.ppo_mini_batch_size": same("critic.ppo_mini_batch_size"),
    "critic.ppo_micro_batch_size_per_gpu": Rule("critic.engine.micro_batch_size_per_gpu",
                                                lambda v: 1 if v is None else v),
    "critic.ppo_micro_batch_size": Rule(apply=_global_micro_batch(
        "critic.engine.micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
        "critic.ulysses_sequence_parallel_size", "critic.use_dynamic_bsz"),
        hint="'critic.engine.micro_batch_size_per_gpu' (per GPU)"),
    "critic.forward_micro_batch_size_per_gpu": dropped(MICRO),
    "critic.forward_micro_batch_size": dropped(MICRO),
    "critic.forward_max_token_len_per_gpu": dropped(MICRO),
    "critic.use_dynamic_bsz": same("critic.engine.use_dynamic_bsz"),
    "critic.ppo_max_token_len_per_gpu": same("critic.engine.max_token_len_per_gpu"),
    "critic.ppo_epochs": same("critic.ppo_epochs"),
    "critic.shuffle": same("critic.shuffle"),
    "critic.cliprange_value": same("critic.cliprange_value"),
    "critic.loss_agg_mode": conv("critic.loss_agg_mode", loss_agg),
    "critic.grad_clip": Rule(apply=lambda v, out, given: out.__setitem__("critic.optim.clip_grad", v),
                             hint="'critic.optim.clip_grad'"),
    "critic.ulysses_sequence_parallel_size": same("critic.engine.ulysses_sequence_parallel_size"),
    "critic.data_loader_seed": dropped("shardrl seeds the mini-batch shuffle from data.seed"),
    "critic.checkpoint.save_contents": dropped("a checkpoint holds model, optimizer and the rest"),
    "critic.checkpoint.load_contents": dropped("a checkpoint holds model, optimizer and the rest"),
    # reward
    "reward_model.enable": Rule(apply=_reward_model_enable, hint="'reward.model_path'"),
    "reward_model.model.path": dropped("read with reward_model.enable=True"),
    "reward_model.strategy": conv("reward.engine.strategy", strategy),
    "reward_model.micro_batch_size_per_gpu": Rule("reward.engine.micro_batch_size_per_gpu",
                                                  lambda v: 1 if v is None else v),
    "reward_model.micro_batch_size": Rule(apply=_global_micro_batch(
        "reward.engine.micro_batch_size_per_gpu", "reward_model.micro_batch_size_per_gpu", None,
        "reward_model.use_dynamic_bsz"), hint="'reward.engine.micro_batch_size_per_gpu' (per GPU)"),
    "reward_model.use_dynamic_bsz": same("reward.engine.use_dynamic_bsz"),
    "reward_model.forward_max_token_len_per_gpu": same("reward.engine.max_token_len_per_gpu"),
    "reward_model.max_length": only((None,), "not supported"),
    "reward_model.model.input_tokenizer": dropped(
        "implied: the policy's tokenizer decodes the responses, and a reward model whose folder holds a tokenizer "
        "encoding differently (a Llama-3 reward model of a Qwen policy) reads them re-tokenized with its own "
        "tokenizer and chat template, as verl's does; one encoding the same reads the policy's ids"),
    "reward_model.model.trust_remote_code": dropped("shardrl's model.trust_remote_code covers every role"),
    "reward_model.model.use_remove_padding": dropped("shardrl's model.use_remove_padding covers every role"),
    "reward_model.model.external_lib": only((None,), "shardrl imports no extra model library"),
    "reward_model.reward_manager": Rule(apply=_reward_manager),
    "reward_model.launch_reward_fn_async": dropped(RAY),
    "reward_model.sandbox_fusion.url": only((None,), "sandbox fusion is not supported; score code in your reward "
                                                     "function"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": same("reward.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": same("reward.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": same("reward.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": dropped("the penalty's mean is always logged"),
    "reward_model.reward_kwargs.max_resp_len": Rule(apply=lambda v, out, given: _same_as_response(v, given),
                                                    hint="'rollout.max_new_tokens'"),
    "data.gen_batch_size": same("data.gen_batch_size"),
    "reward_model.overlong_buffer.enable": same("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": same("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": same("reward.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": dropped("the penalty's mean is always logged"),
    "reward_model.ulysses_sequence_parallel_size": same("reward.engine.ulysses_sequence_parallel_size"),
    "reward_model.use_reward_loop": dropped(RAY),
    "reward_model.num_workers": dropped(RAY),
    "reward_model.enable_resource_pool": dropped(RAY),
    "reward_model.n_gpus_per_node": dropped(RAY),
    "reward_model.nnodes": dropped(RAY),
    "custom_reward_function.path": Rule("reward.function_path", lambda v: v and os.path.expanduser(str(v))),
    "custom_reward_function.name": same("reward.function_name"),
    "custom_reward_function.reward_kwargs": Rule("reward.reward_kwargs", lambda v: dict(v or {})),
    # algorithm
    "algorithm.adv_estimator": conv("algorithm.adv_estimator", estimator),
    "algorithm.gamma": same("algorithm.gamma"),
    "algorithm.lam": same("algorithm.lam"),
    "algorithm.norm_adv_by_std_in_grpo": same("algorithm.norm_adv_by_std_in_grpo"),
    "algorithm.use_kl_in_reward": same("algorithm.use_kl_in_reward"),
    "algorithm.kl_penalty": conv("algorithm.kl_penalty", kl_type),
    "algorithm.kl_ctrl.type": Rule(apply=_kl_ctrl_type, hint="'algorithm.kl_target' (null: fixed)"),
    "algorithm.kl_ctrl.kl_coef": same("algorithm.kl_coef"),
    "algorithm.kl_ctrl.horizon": same("algorithm.kl_horizon"),
    "algorithm.kl_ctrl.target_kl": dropped("read with kl_ctrl.type=adaptive"),
    "algorithm.filter_groups.enable": same("algorithm.filter_groups.enable"),
    "algorithm.filter_groups.max_num_gen_batches": conv("algorithm.filter_groups.max_num_gen_batches",
                                                        lambda v: max(v, 0)),  # verl's <= 0: no limit, our 0
    "algorithm.filter_groups.metric": same("algorithm.filter_groups.metric"),
    "algorithm.use_pf_ppo": only((False,), "PF-PPO is not supported"),
    "algorithm.rollout_correction.rollout_is": Rule(apply=_rollout_is),
    "algorithm.rollout_correction.rollout_is_threshold": same("algorithm.rollout_is_threshold"),
    "algorithm.rollout_correction.rollout_rs": Rule(apply=_rollout_rs, hint="'algorithm.rollout_is_mode' (reject, "
                                                                              "mask) and its thresholds"),
    "algorithm.rollout_correction.rollout_rs_threshold": Rule(apply=lambda value, out, given: None),  # by rollout_rs
    "algorithm.rollout_correction.bypass_mode": only((False,), "not supported"),
    # trainer
    "trainer.total_epochs": same("trainer.total_epochs"),
    "trainer.total_training_steps": same("trainer.total_steps"),
    "trainer.project_name": same("trainer.project_name"),
    "trainer.experiment_name": same("trainer.experiment_name"),
    "trainer.logger": conv("trainer.logger", loggers),
    "trainer.log_val_generations": same("trainer.log_val_generations"),
    "trainer.nnodes": same("trainer.nnodes"),
    "trainer.n_gpus_per_node": same("trainer.nproc_per_node"),
    "trainer.save_freq": conv("trainer.save_freq", minus_one_off),
    "trainer.test_freq": conv("trainer.val_freq", minus_one_off),
    "trainer.val_before_train": same("trainer.val_before_train"),
    "trainer.val_only": only((False,), "not supported; run with trainer.total_training_steps=... and test_freq"),
    "trainer.resume_mode": Rule(apply=_resume_mode, hint="'trainer.resume'"),
    "trainer.resume_from_path": dropped("read with resume_mode=resume_path"),
    "trainer.default_local_dir": Rule("trainer.output_dir", lambda v: None if v is None else os.path.expanduser(str(v))),
    "trainer.max_actor_ckpt_to_keep": conv("trainer.keep_last", keep_last),
    "trainer.max_critic_ckpt_to_keep": dropped("one checkpoint holds actor and critic (trainer.keep_last)"),
    "trainer.critic_warmup": only((0,), "critic warm-up is not supported"),
    "trainer.balance_batch": dropped("shardrl balances dynamic micro-batches by tokens itself"),
    "trainer.device": same("trainer.device"),
    "trainer.default_hdfs_dir": only((None,), "HDFS is not supported; set trainer.default_local_dir"),
    "trainer.del_local_ckpt_after_load": dropped("local checkpoints are kept (trainer.keep_last)"),
    "trainer.rollout_data_dir": only((None,), "not supported; the run folder keeps generations.jsonl of validation"),
    "trainer.validation_data_dir": only((None,), "not supported; the run folder keeps generations.jsonl"),
    "trainer.ray_wait_register_center_timeout": dropped(RAY),
    "trainer.esi_redundant_time": dropped(RAY),
    "trainer.use_legacy_worker_impl": dropped(RAY),
    "ray_kwargs.ray_init.num_cpus": dropped(RAY),
    "ray_kwargs.timeline_json_file": dropped(RAY),
    "transfer_queue.enable": only((False,), RAY),
}

# the FSDP sections of each role: verl's fsdp_config keys -> shardrl's engine keys
ROLE_FSDP = {"actor_rollout_ref.actor.fsdp_config": "actor.engine", "actor_rollout_ref.ref.fsdp_config": "ref.engine",
             "critic.model.fsdp_config": "critic.engine", "reward_model.model.fsdp_config": "reward.engine"}
for _verl, _native in ROLE_FSDP.items():
    VERL_KEYS.update({
        f"{_verl}.param_offload": same(f"{_native}.offload_params"),
        f"{_verl}.offload_policy": Rule(apply=lambda v, out, given, k=f"{_native}.offload_params": out.__setitem__(
            k, bool(v) or bool(out.get(k))), hint=f"'{_native}.offload_params'"),  # either one offloads
        f"{_verl}.optimizer_offload": same(f"{_native}.offload_optimizer"),
        f"{_verl}.reshard_after_forward": same(f"{_native}.reshard_after_forward"),
        f"{_verl}.fsdp_size": same(f"{_native}.fsdp_size"),
        f"{_verl}.forward_prefetch": same(f"{_native}.forward_prefetch"),
        f"{_verl}.dtype": conv(f"{_native}.param_dtype", dtype),
        f"{_verl}.strategy": conv(f"{_native}.strategy", strategy),
        f"{_verl}.ulysses_sequence_parallel_size": same(f"{_native}.ulysses_sequence_parallel_size"),
        **{f"{_verl}.{k}": dropped(KERNEL) for k in (
            "wrap_policy.min_num_params", "use_orig_params", "seed", "full_determinism",
            "entropy_from_logits_with_chunking", "use_torch_compile", "entropy_checkpointing", "forward_only")},
    })
    if not _verl.startswith("actor_rollout_ref.actor"):
        VERL_KEYS.setdefault(f"{_verl}.model_dtype", dropped("shardrl's model.dtype covers every role"))
# the optimizers
for _verl, _native in (("actor_rollout_ref.actor.optim", "actor.optim"), ("critic.optim", "critic.optim")):
    VERL_KEYS.update({
        f"{_verl}.lr": same(f"{_native}.lr"),
        f"{_verl}.betas": same(f"{_native}.betas"),
        f"{_verl}.weight_decay": same(f"{_native}.weight_decay"),
        f"{_verl}.clip_grad": same(f"{_native}.clip_grad"),
        f"{_verl}.min_lr_ratio": Rule(f"{_native}.min_lr_ratio", lambda v: 0.0 if v is None else v),
        f"{_verl}.lr_warmup_steps": conv(f"{_native}.warmup_steps", lambda v: 0 if v is None or v < 0 else v),
        f"{_verl}.lr_warmup_steps_ratio": same(f"{_native}.warmup_ratio"),
        f"{_verl}.total_training_steps": Rule(f"{_native}.total_steps", lambda v: None if v is None or v < 0 else v),
        f"{_verl}.lr_scheduler_type": conv(f"{_native}.lr_schedule", schedule),
        f"{_verl}.warmup_style": conv(f"{_native}.lr_schedule", schedule),
        f"{_verl}.num_cycles": only((0.5,), "shardrl's cosine is one half cycle (num_cycles=0.5)"),
        f"{_verl}.optimizer": only(("AdamW",), "shardrl trains with AdamW"),
        f"{_verl}.optimizer_impl": only(("torch.optim",), "shardrl uses torch.optim.AdamW"),
        f"{_verl}.override_optimizer_config": only((None,), "not supported"),
        f"{_verl}.eps": same(f"{_native}.eps"),
    })

_GKD = ("is a key of verl's on-policy distillation recipe (recipe/gkd: a teacher server queried over ZeroMQ for "
        "top-k log-probs, a sparse forward KL on Megatron); shardrl's teacher is a role of the run instead "
        "(algorithm.adv_estimator=opd, teacher.model_path: the per-token reverse KL), set from a shardrl config, "
        "without --verl")
VERL_KEYS.update({key: only((None,), _GKD) for key in (
    "actor_rollout_ref.teacher.server_ip", "actor_rollout_ref.teacher.server_port",
    "actor_rollout_ref.teacher.n_server_workers", "trainer.scheduler")})
"""verl's newest snapshot (2026-01-29) has no on-policy distillation keys in its trainer: only the GKD recipe's
(docs/advance/async-on-policy-distill.md), refused by name here rather than as unknown keys."""

DICT_KEYS = ("custom_reward_function.reward_kwargs", "actor_rollout_ref.model.override_config",
             "critic.model.override_config")
"""verl keys holding a mapping that Hydra fills key by key (`+custom_reward_function.reward_kwargs.bonus=1`, and
deeper: `+actor_rollout_ref.model.override_config.rope_scaling.factor=4.0`)."""

VERL_DEFAULTS: dict[str, Any] = {
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.truncation": "error",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.rollout.n": 1,
    "algorithm.adv_estimator": "gae",
    "trainer.total_epochs": 30,
    "trainer.val_before_train": True,
    "trainer.log_val_generations": 0,
    "trainer.resume_mode": "auto",
    "trainer.max_actor_ckpt_to_keep": None,  # keep every checkpoint
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": None,  # no turn limit
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": 256,
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "middle",
}
"""verl's defaults where they differ from shardrl's: a key the command line does not give takes verl's value, as
it would under verl. (The role defaults that verl takes from the actor, shardrl's `Config.inherit` takes too.)"""
