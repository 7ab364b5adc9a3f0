"""Every rule between two or more config fields, in one place; each section's `validate` keeps the checks of a
single value and calls its rules here. A rule that needs more than the config (the world size, the model, the
machine) stays where that is known (`shardrl.plan.layout`, the trainer's start); a rule some part also applies to
settings built in code (the engine's LoRA, the layout's mini-batch) is a function here it calls.

Every failure is a `ConfigError` naming the dotted key, as `require` writes it.
"""

from __future__ import annotations

from shardrl.config.load import ConfigError, divisors, nearest, require
from shardrl.config.names import ADVANTAGE_ESTIMATORS


def check_model(model, prefix: str) -> None:
    require(model, prefix, "tiny", model.path is None or model.tiny is None,
            "set only one of model.path (a model folder) and model.tiny (a random-init config)")
    require(model, prefix, "load_weights", model.load_weights != "random_shards" or model.tiny is not None,
            "random_shards draws a random model.tiny; with model.path use sharded or rank0")


def check_optim(optim, prefix: str) -> None:
    require(optim, prefix, "warmup_ratio", optim.warmup_steps == 0 or optim.warmup_ratio == 0,
            "set only one of warmup_steps and warmup_ratio")


def check_engine(engine, prefix: str) -> None:
    require(engine, prefix, "max_token_len_per_gpu", not engine.use_dynamic_bsz or engine.max_token_len_per_gpu >= 1,
            "must be >= 1 when use_dynamic_bsz is on")
    require(engine, prefix, "compile", not (engine.compile and engine.strategy == "fsdp"),
            "is implemented for strategy=fsdp2 only; set compile=false with FSDP1 (strategy=fsdp)")
    # FSDP1's CPU offload gave wrong gradient norms against the plain loop on one GPU, and its gradients cannot
    # be gathered on two; FSDP2's offload matches the loop (bench/RESULTS.md, "Current figures: GPU tests")
    require(engine, prefix, "offload_params", not (engine.offload_params and engine.strategy == "fsdp"),
            "is supported with strategy=fsdp2 only (FSDP1's CPU offload gave wrong gradients on GPU); "
            "use strategy=fsdp2, or offload_optimizer=true with FSDP1")
    require(engine, prefix, "accumulate_unsharded", not (engine.accumulate_unsharded and engine.strategy == "fsdp"),
            "is implemented for strategy=fsdp2 only; leave it null (or false) with FSDP1")


def check_multi_turn(mt, prefix: str) -> None:
    require(mt, prefix, "enable", not mt.enable or bool(mt.interaction_path or mt.tools
                                                          or mt.tool_config_path),
            "multi-turn rollouts need tools: set rollout.multi_turn.tools (e.g. [calculator]), "
            "rollout.multi_turn.interaction_path (a Python file defining an Interaction) or "
            "rollout.multi_turn.tool_config_path (verl's tool config)")
    require(mt, prefix, "tool_config_path", not (mt.tool_config_path and mt.interaction_path),
            "and interaction_path both define the tools; set one of them")
    require(mt, prefix, "max_calls_per_turn", mt.max_calls_per_turn == 1 or not mt.overlap_tools,
            "must be 1 with overlap_tools=true (a turn there ends at its first call); set one of them back")


def check_rollout(rollout, prefix: str) -> None:
    for key in rollout.fast_only_keys() if rollout.backend == "hf" else ():  # null: checked once resolved
        require(rollout, prefix, key, False, "applies to backend=fast only; set rollout.backend=fast or drop it")
    require(rollout, prefix, "agent", not (rollout.runs_agent() and rollout.multi_turn.enable),
            "and multi_turn both run the episodes; set rollout.agent.entrypoint (or rollout.env) or "
            "rollout.multi_turn.enable")
    require(rollout, prefix, "env", not (rollout.env and rollout.agent.entrypoint),
            "and rollout.agent.entrypoint both run the episodes; set one of them")
    require(rollout, prefix, "env", not rollout.env or rollout.env.startswith("verifiers:") or (
        ":" in rollout.env and rollout.env.rsplit(":", 1)[0].endswith(".py")),
        "must be 'verifiers:ENV_ID' or 'path/to/env.py:function'")


def check_async(async_rl, prefix: str) -> None:
    require(async_rl, prefix, "max_staleness", async_rl.max_staleness == 0 or async_rl.rollout_ranks >= 1,
            "needs rollout ranks of its own to generate ahead of training: set async_rl.rollout_ranks >= 1 "
            "(e.g. 1 of 2 GPUs), or max_staleness=0")
    require(async_rl, prefix, "partial_rollout", not async_rl.partial_rollout or async_rl.rollout_ranks >= 1,
            "needs rollout ranks of their own (weights change under a running rollout only there): set "
            "async_rl.rollout_ranks >= 1, or partial_rollout=false")


def check_reward(reward, prefix: str) -> None:
    require(reward, prefix, "model_path", not (reward.model_path and reward.function_path),
            "cannot be set together with reward.function_path; choose a reward model or a function")
    require(reward, prefix, "num_workers", not (reward.model_path and (reward.num_workers or reward.timeout_s)),
            "and reward.timeout_s apply to reward functions; a reward model (reward.model_path) scores on the "
            "GPU: drop them")
    require(reward, prefix, "reward_kwargs", not reward.reward_kwargs or bool(reward.function_path),
            "is passed to your reward function only; set reward.function_path too, or drop reward_kwargs")


def check_trainer(trainer, prefix: str) -> None:
    require(trainer, prefix, "total_steps", trainer.total_steps is not None or trainer.total_epochs is not None,
            "must be set (>= 1), or trainer.total_epochs")


def check_command(cfg, prefix: str, engines: dict) -> None:
    """What every training command's config must hold. `engines`: the sections that build a model from model.*,
    by key, the trained one (which holds LoRA's adapters) first."""
    require(cfg, prefix, "trainer.export_lora_adapter", not cfg.trainer.export_lora_adapter
            or cfg.model.lora.rank > 0, "needs model.lora.rank > 0 (there are no adapters to write)")
    trained = next(iter(engines))
    check_lora_engine(cfg.model.lora, engines[trained], trained, prefix)
    for key, engine in engines.items():
        require(cfg, prefix, "model.load_weights", cfg.model.load_weights != "random_shards"
                or engine.strategy == "fsdp2",
                f"random_shards needs FSDP2 (each rank draws its own shards); {key}.strategy is fsdp")


def check_lora_engine(lora, engine, key: str, prefix: str = "") -> None:
    """LoRA's needs of the engine that trains the adapters (`key`: that engine's section). The engine applies it
    too, to an engine built in code."""
    if lora.rank == 0:
        return
    key = f"{prefix}.{key}" if prefix else key
    require(engine, key, "strategy", engine.strategy == "fsdp2",
            "must be fsdp2 with model.lora (FSDP1's flat parameters cannot hold a frozen base beside trained "
            "adapters)")


def check_mini_batch(cfg, role: str, prefix: str = "") -> None:
    """`role`'s mini-batch (actor or critic) cuts the step's batch evenly; the layout applies it too, to a config
    built in code."""
    batch, mini = cfg.data.train_batch_size, getattr(cfg, role).ppo_mini_batch_size
    key = f"{role}.ppo_mini_batch_size"
    require(cfg, prefix, key, 1 <= mini <= batch and batch % mini == 0,
            f"must divide data.train_batch_size={batch} (both count prompts); nearest valid: "
            f"{nearest(mini, divisors(batch))}")


def check_reward_model_trainer(cfg, prefix: str = "") -> None:
    """`shardrl rm`'s rules: the whole model and its new score head train, so no LoRA."""
    if cfg.model.lora.rank > 0:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank}: the reward-model trainer (shardrl rm) does not "
                          "support LoRA (it trains the whole model and its new score head); remove model.lora "
                          "(set model.lora.rank=0 or drop it)")
    check_command(cfg, prefix, {"engine": cfg.engine})


def check_router_replay_settings(cfg) -> None:
    """Router replay's and the load-balancing loss's rules that need only the config; the trainer applies them at
    start, with those that need the model (a mixture of experts, its router, the fast rollout's support)."""
    sp = cfg.actor.engine.ulysses_sequence_parallel_size
    if sp > 1 and (cfg.actor.router_aux_loss_coef > 0 or cfg.actor.router_replay.mode != "disabled"):
        raise ConfigError(f"actor.engine.ulysses_sequence_parallel_size={sp}: router replay and the load-balancing "
                          "loss need every token of a sequence on one rank; set it to 1 (or actor.router_replay.mode="
                          "disabled and actor.router_aux_loss_coef=0)")
    if cfg.actor.router_replay.mode != "R3":
        return
    if cfg.rollout.backend == "hf":
        raise ConfigError("actor.router_replay.mode=R3 replays the routing the fast rollout records; set "
                          "rollout.backend=fast (or null), or use mode R2")
    if cfg.rollout.multi_turn.enable or cfg.rollout.runs_agent():
        raise ConfigError("actor.router_replay.mode=R3 records single-turn rollouts only (multi-turn and agent "
                          "turns are prefilled again); use mode R2")


def group_of_one_warning(cfg) -> str | None:
    """The warning for a group baseline over groups of one response (rollout.n=1), which verl runs and so does
    shardrl: the group's mean is taken as 0 and its std as 1 (`compute_grpo`), so no baseline is subtracted."""
    name = cfg.algorithm.adv_estimator
    if cfg.rollout.n >= 2 or not ADVANTAGE_ESTIMATORS[name].group_baseline:
        return None
    what = ("the whitening over the batch is the only baseline" if name == "reinforce_plus_plus_baseline" else
            "REINFORCE without a baseline: with rewards >= 0 every sampled response is reinforced")
    return (f"rollout.n=1 with algorithm.adv_estimator={name!r}: a prompt's group is one response, so there is no "
            "group baseline; as in verl, its mean is taken as 0 (and its std as 1), and each response's advantage "
            f"is its own score ({what}). Set rollout.n >= 2 to compare responses within a group")


def check_rl(cfg, prefix: str = "") -> None:
    """`shardrl train`'s rules between sections."""
    check_command(cfg, prefix, {f"{role}.engine": getattr(cfg, role).engine
                                for role in ("actor", "ref", "teacher", "critic")})
    for key, given in (("data.train_files", cfg.data.train_files), ("data.reasoning_gym.tasks",
                                                                     cfg.data.reasoning_gym.tasks)):
        require(cfg, prefix, key, not (cfg.rollout.env and given),
                "and rollout.env both give the training prompts (the environment's dataset is them); keep one")
    require(cfg, prefix, "data.val_files", not (cfg.rollout.env and cfg.data.val_files),
            "and rollout.env: an environment's episodes run its own rows only (its evaluation dataset validates, "
            "where it has one); drop data.val_files")
    require(cfg, prefix, "teacher.model_path", cfg.algorithm.adv_estimator != "opd" or bool(cfg.teacher.paths()),
            "is needed by algorithm.adv_estimator=opd (on-policy distillation scores each sampled token with the "
            "teacher): set it to the teacher's model folder (or teacher.by_data_source, a teacher per data source)")
    require(cfg, prefix, "teacher.by_data_source", all(isinstance(v, str) and v for v in
                                                       cfg.teacher.by_data_source.values()),
            "maps each data source to a teacher's model folder (a non-empty string), e.g. {math: /models/math}")
    require(cfg, prefix, "rollout.lora_sync", cfg.rollout.lora_sync in (None, "full")
            or cfg.async_rl.rollout_ranks == 0, "unmerged and merged sync a colocated rollout; rollout ranks of "
            "their own (async_rl.rollout_ranks > 0) receive the merged model whole: set full or drop it")
    require(cfg, prefix, "rollout.quantization", cfg.rollout.quantization == "none" or cfg.model.lora.rank == 0,
            "fp8 is not supported with model.lora yet (the adapter-only sync merges into, or shares, bf16 "
            "weights); set rollout.quantization=none or drop model.lora")
    estimator = ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator]
    for role in ("actor", "critic") if estimator.needs_critic else ("actor",):
        check_mini_batch(cfg, role, prefix)
    group_baseline = [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.group_baseline]
    require(cfg, prefix, "rollout.n", not (cfg.algorithm.filter_groups.enable and cfg.rollout.n < 2),
            "with algorithm.filter_groups.enable: a group of one response has no spread of rewards, so dynamic "
            "sampling would keep none; set rollout.n >= 2")
    require(cfg, prefix, "algorithm.filter_groups.enable",
            not cfg.algorithm.filter_groups.enable or estimator.group_baseline,
            f"drops groups whose rewards are all equal, which only a group baseline ({', '.join(group_baseline)}) "
            f"leaves without advantage; set algorithm.adv_estimator to one, or filter_groups.enable=false")
    gen = cfg.data.gen_batch_size
    require(cfg, prefix, "data.gen_batch_size", gen in (None, cfg.data.train_batch_size)
            or cfg.algorithm.filter_groups.enable,
            f"differs from data.train_batch_size={cfg.data.train_batch_size}; generation batches of their "
            "own size are drawn by dynamic sampling only: set algorithm.filter_groups.enable=true, or drop it")
    final = cfg.algorithm.filter_groups.metric == "seq_final_reward"
    require(cfg, prefix, "algorithm.filter_groups.metric", not (final and cfg.algorithm.use_kl_in_reward),
            "with algorithm.use_kl_in_reward=true would filter by the reward less its KL penalty, "
            "which shardrl computes after the filter; filter by seq_reward, or set use_kl_in_reward=false")
    if cfg.async_rl.rollout_ranks:
        require(cfg, prefix, "async_rl.partial_rollout", not (cfg.async_rl.partial_rollout
                                                           and cfg.rollout.multi_turn.enable),
                "is not supported with rollout.multi_turn.enable (weights change between generate calls "
                "only there, i.e. between turns); set one of them to false")
        require(cfg, prefix, "algorithm.filter_groups.enable", not cfg.algorithm.filter_groups.enable,
                "dynamic sampling is not supported with async_rl.rollout_ranks > 0 (the rollout ranks generate "
                "one batch per step); set filter_groups.enable=false or async_rl.rollout_ranks=0")
        require(cfg, prefix, "trainer.val_freq", cfg.trainer.val_freq == 0 or not cfg.data.has_val(),
                "validation is not supported with async_rl.rollout_ranks > 0 (the training ranks hold no "
                "rollout); set trainer.val_freq=0 or async_rl.rollout_ranks=0")
    require(cfg, prefix, "trainer.total_epochs", cfg.trainer.total_epochs is None or not cfg.async_rl.rollout_ranks,
            "is not supported with async_rl.rollout_ranks > 0 (the rollout ranks do not read the training set); "
            "set trainer.total_steps")
    require(cfg, prefix, "algorithm.rollout_is", cfg.async_rl.max_staleness == 0 or cfg.rollout_correction(),
            f"async_rl.max_staleness={cfg.async_rl.max_staleness} trains on samples of an older policy: set "
            "algorithm.rollout_is=true so the loss weighs them by the sampler's log-probs (the behaviour "
            "policy), or async_rl.max_staleness=0")
    ob = cfg.reward.overlong_buffer
    limit_key, limit = cfg.rollout.response_budget()  # the limit a response is shaped against
    require(cfg, prefix, "reward.overlong_buffer.len", not ob.enable or ob.len <= limit,
            f"must be <= {limit_key}={limit} (the penalty spans the last len tokens before it); lower it or "
            f"raise {limit_key}")
