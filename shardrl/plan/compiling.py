"""Whether an engine compiles its decoder blocks when `engine.compile` is left null: a start-up default
(`shardrl.plan.defaults`) that the memory ledger (`shardrl.plan.memory`) also needs, since a compiled update keeps
fewer activations."""

from __future__ import annotations

COMPILE_MIN_PARAMS = 500_000_000
"""`engine.compile` left null is on, on CUDA, for a policy of this many matmul parameters and more: compiling
costs tens of seconds once and pays back on models whose steps take seconds (see `compile_choice`)."""


def compile_choice(engine, hf_config, cuda: bool) -> tuple[bool, str]:
    """`engine.compile` left null, and why: on CUDA with FSDP2 for a policy (`hf_config`) of `COMPILE_MIN_PARAMS`
    matmul parameters or more (bench/RESULTS.md, "Current figures: Whole step settings"); off for smaller ones
    (compiled, the built-in demo with its dynamic micro-batch shapes did not finish a first step in minutes), for
    expert parallelism, and on CPU."""
    if not cuda:
        return False, "off on CPU"
    if engine.strategy != "fsdp2":
        return False, "FSDP1 does not compile"
    if engine.expert_parallel_size > 1:
        return False, "expert parallelism does not compile yet"
    from shardrl.plan.perf import model_shape

    try:
        size = model_shape(hf_config).num_params if hf_config is not None else None
    except ValueError:  # a config without the usual names: no size, no compile
        size = None
    if size is None:
        return False, "on CUDA, but the model's size is unknown"
    on = size >= COMPILE_MIN_PARAMS
    return on, (f"on CUDA, the model's {size / 1e9:.2f}B matmul parameters {'>=' if on else '<'} "
                f"{COMPILE_MIN_PARAMS / 1e9:g}B")
