"""What offloading an engine's state to the host costs (`shardrl plan`): the host's CPU Adam step, the host memory the
offloaded state holds against this host's, and the bytes an offloaded engine moves over the host link a step, as
FSDP2 gathers and reduces the shards (`tests/test_plan_offload.py` counts them on 2 ranks)."""

from __future__ import annotations

import os

from shardrl.plan.layout import DTYPE_BYTES, format_count, format_size
from shardrl.plan.memory import critic_numbers, model_numbers
from shardrl.plan.step_plan import old_log_probs_from_update


def host_adam_rate(params: int = 8_000_000, repeats: int = 3) -> float:
    """Parameters a second this host's CPU steps with torch's fused AdamW (the kernel an engine with offloaded
    parameters steps with), measured now on `params` fp32 parameters with all of torch's threads."""
    import time

    import torch

    p = torch.nn.Parameter(torch.zeros(params))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # (the state allocated outside the timing)
    start = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    return params * repeats / (time.perf_counter() - start)


def plan_host_adam(cfg, layout, hf_config, nproc_per_node: int, offline: bool) -> dict | None:
    """What the offloaded engines of the run `cfg` laid out as `layout` cost the host (`host_adam_estimate` of each:
    `engine` offline, else the actor's, the critic's and a separate reference's), their host memory added up against
    the host's (one host holds every role's share), and what an offloaded actor or critic moves over the host link
    a step (`offload_traffic`). The actor's (else the first offloaded role's) fields at the top, `roles` each one's;
    None without offload."""
    numbers = model_numbers(hf_config, cfg.model.trust_remote_code, cfg.model.lora, cfg.model.freeze_vision_tower)
    master = DTYPE_BYTES[cfg.model.dtype]
    plain = {**numbers, "trained": None}  # a separate reference runs without the adapters
    lora = bool(numbers.get("trained"))
    if offline:
        roles = [("engine", cfg.engine, layout.engine, numbers, True)]
    else:
        roles = [("actor", cfg.actor.engine, layout.actor, numbers, True)]
        if layout.critic is not None:
            roles.append(("critic", cfg.critic.engine, layout.critic, critic_numbers(numbers, hf_config), True))
        if layout.ref is not None and not lora:  # (with LoRA the reference is the actor, adapters off)
            roles.append(("ref", cfg.ref.engine, layout.ref, plain, False))
    host_gib, rate = host_memory_gib(), None
    found = {}
    for name, engine_cfg, role, nums, trains in roles:
        key = name if offline else f"{name}.engine"
        est = host_adam_estimate(nums, engine_cfg, role.shard_size, nproc_per_node, key, rate=rate, master=master,
                                 host_gib=host_gib, trains=trains)
        if est is None:
            continue
        rate = est.get("rate_params_per_s", rate)  # (measured once)
        if not offline and trains:  # (an offline trainer's passes: one forward and backward a micro-batch)
            passes = 1 if name == "critic" else (not old_log_probs_from_update(cfg)[0]) + (lora and layout.ref
                                                                                             is not None)
            traffic = offload_traffic(nums, engine_cfg, role, layout, master, passes)
            if traffic is not None:
                est.update(traffic, line=f"{est['line']}\n{traffic['traffic_line']}")
        found[name] = est
    if not found:
        return None
    out = dict(next(iter(found.values())), roles=found)
    if len(found) > 1:  # the host holds them all
        total = sum(e["host_state_gib"] for e in found.values())
        line = f"together the offloaded {', '.join(found)} hold {format_size(total)} of the host's memory"
        out.update(host_state_gib=total, line="\n".join([*(e["line"] for e in found.values()),
                                                         line + _host_verdict(total, host_gib, 1)]))
    return out


HOST_LINK_GB_S = 25.0
"""Bytes a second between host and GPU assumed for `offload_traffic`'s seconds: a PCIe 4.0 x16 link's in practice
(pinned memory), each GPU's own; PCIe 5.0 doubles it."""


def micro_batch_count(role, samples: int, layout, fixed: int | None) -> int:
    """Micro-batches of `samples` sequences a rank at their longest: `fixed` (the layout's count) or as the engine
    cuts them by `role.max_token_len_per_gpu` (`RoleLayout`) tokens (`num_dynamic_micro_batches`, the sequences
    whole and the budget times sp, as `Engine.split` does)."""
    if fixed:
        return fixed
    from shardrl.engine.microbatch import num_dynamic_micro_batches

    budget = role.max_token_len_per_gpu * layout.sp
    try:
        return num_dynamic_micro_batches([layout.max_seq_len] * samples, budget)
    except ValueError:  # (a sequence longer than the budget: the layout says so; counted as one a micro-batch)
        return max(1, samples)


def offload_traffic(numbers: dict, engine_cfg, role, layout, master: int, passes: int) -> dict | None:
    """What an RL step moves between the host and each GPU for an engine with offloaded parameters (`role`: its
    `RoleLayout`; `passes`: its forward-only passes before the update, the old log-probs and a LoRA reference's):
    the shard crosses to the GPU at each gather (its stored bytes: `master` a parameter; LoRA's frozen base
    `param_dtype` and adapters 4) and the trained gradients back at each reduction (in the parameters' dtype: FSDP2
    casts them so before the copy). When, as FSDP2 does it (counted on 2 ranks by
    `test_offload_traffic_is_the_engines_own`):
      - ZeRO-3 (`reshard_after_forward`): a training micro-batch gathers the model for its forward and all but the
        last block (kept gathered for the backward) again for its backward, then reshards all of it; a forward-only
        micro-batch gathers all but the last block, the first of a pass after a training one the last block too;
      - ZeRO-2 (`reshard_after_forward=false`): no unit reshards after a forward: the forward-only passes gather once
        between them, a training micro-batch once (the first after those passes not at all), resharded after its
        backward;
      - `accumulate_unsharded`: as ZeRO-2, but kept over an optimizer step's micro-batches and reduced once.
    Seconds at HOST_LINK_GB_S. None without offload_params."""
    if not engine_cfg.offload_params:
        return None
    shard = max(role.shard_size, 1)
    lora = numbers.get("trained")
    trained = lora or numbers["total"] - numbers.get("frozen", 0)
    base = DTYPE_BYTES[engine_cfg.param_dtype] if lora else master
    gather = (numbers["total"] * base + (lora or 0) * 4) / shard
    regather = gather * (1 - numbers["largest_block"] / numbers["total"])  # (all but the last block)
    reduce = trained * (4 if lora else master) / shard
    kept = engine_cfg.accumulates_unsharded(shard)
    update_mb = micro_batch_count(role, role.mini_batch_samples_per_rank, layout, role.num_micro_batches)
    infer_mb = micro_batch_count(role, layout.samples_per_rank, layout, role.num_infer_micro_batches)
    steps = role.num_updates
    if kept or not engine_cfg.reshard_after_forward:
        gathers_infer = gather if passes else 0.0
        per_step = 1 if kept else update_mb  # (gathers, and reductions)
        gathers_update = steps * per_step * gather - (gather if passes else 0.0)
        reductions = steps * per_step * reduce
        each = ("1 gather + 1 reduction, the micro-batches kept gathered" if kept else
                f"{update_mb} micro-batches x (1 gather + 1 reduction)")
        infer_how = f"the {passes} forward-only pass(es) 1 gather, kept for the update's first micro-batch" \
            if passes else "no forward-only pass"
    else:
        gathers_infer = (gather + (passes * infer_mb - 1) * regather) if passes else 0.0
        gathers_update = steps * update_mb * (gather + regather) - (gather - regather if passes else 0.0)
        reductions = steps * update_mb * reduce
        each = f"{update_mb} micro-batches x (a gather + a gather of all but the last block + 1 reduction)"
        infer_how = (f"{passes} forward-only pass(es) x {infer_mb} micro-batches x a gather of all but the last block"
                     if passes else "no forward-only pass")
    total = gathers_infer + gathers_update + reductions
    seconds = total / (HOST_LINK_GB_S * 1e9)
    how = (f"{steps} optimizer step(s) x ({each}); {infer_how}; a gather {_gb(gather)}, a reduction "
           f"{_gb(reduce)}")
    line = (f"  and the offloaded parameters cross the host link about {_gb(total)} a step ({how}): about "
            f"{seconds:,.3g} s at {HOST_LINK_GB_S:g} GB/s a GPU")
    if not kept and update_mb > 1:
        key = "max_token_len_per_gpu" if role.max_token_len_per_gpu else "micro_batch_size_per_gpu"
        line += (f"; fewer, larger micro-batches ({role.role}.engine.{key}, as the GPU's memory allows) gather fewer "
                 f"times, and {role.role}.engine.accumulate_unsharded=true once an optimizer step (the whole model and "
                 "its gradients then held on the GPU)")
    return {"host_link_gb_per_step": total / 1e9, "host_link_seconds": seconds, "traffic_line": line}


def _gb(n: float) -> str:
    """Bytes in GB, legibly: 1,950 GB, 30.5 GB, 0.0161 GB."""
    return f"{n / 1e9:,.0f} GB" if n >= 100e9 else f"{n / 1e9:.3g} GB"


def host_memory_gib() -> float | None:
    """This host's physical memory, GiB (None where it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def host_adam_estimate(numbers: dict, engine_cfg, shard_size: int, nproc_per_node: int, key: str,
                       rate: float | None = None, master: int = 4, host_gib: float | None = None,
                       trains: bool = True) -> dict | None:
    """What an offloaded engine pays on the host (None without offload). With `offload_params`: its optimizer step,
    the node's ranks stepping their shards of the trained parameters at once on its CPU, whose memory bandwidth
    bounds fused AdamW, so the node's whole share (the rank's shard x `nproc_per_node`) at this host's measured
    `rate` (`host_adam_rate`; the training host may differ); and the host memory the offloaded state holds, the
    node's shards of the parameters (`master` bytes each; LoRA: the frozen base in `param_dtype` and the fp32
    adapters), the trained ones' gradients and AdamW's two moments (both in the trained parameters' dtype, as torch
    keeps them), against this host's (`host_gib`; None: read here). A forward-only engine (`trains` false, a
    separate reference) holds its parameters alone. With `offload_optimizer` alone: AdamW's moments wait in the
    host's memory between updates (the step runs on the GPU)."""
    if not (engine_cfg.offload_params or (trains and engine_cfg.offload_optimizer)):
        return None
    lora = numbers.get("trained") if numbers.get("trained") and numbers["trained"] < numbers["total"] else None
    trained = numbers["trained"] or numbers["total"] - numbers["frozen"]
    share = nproc_per_node / max(shard_size, 1)  # (HSDP: each replica on the node holds its shards)
    size = 4 if lora else master  # (the trained parameters', their gradients' and moments')
    moments = 2 * trained * size
    params = numbers["total"] * DTYPE_BYTES[engine_cfg.param_dtype] + lora * 4 if lora else numbers["total"] * master
    host_gib = host_gib if host_gib is not None else host_memory_gib()
    out = {"key": key, "host_gib": host_gib}
    if engine_cfg.offload_params and trains:
        per_node = trained / max(shard_size, 1) * nproc_per_node
        rate = rate or host_adam_rate()
        seconds = per_node / rate
        state_gib = (params + trained * size + moments) * share / 2**30
        line = (f"{key}.offload_params=true: the optimizer steps on the host's CPU, about {seconds:.2f} s a step for "
                f"this node's {format_count(per_node)} trained parameters (fused AdamW measured on this host at "
                f"{rate / 1e6:.0f}M parameters/s; the training host's CPU may differ); the offloaded state holds "
                f"{format_size(state_gib)} of the host's memory (parameters, gradients, AdamW's moments)")
        out.update(trained_params_per_node=int(per_node), rate_params_per_s=rate, seconds=seconds)
    elif engine_cfg.offload_params:
        state_gib = params * share / 2**30
        line = f"{key}.offload_params=true: its parameters hold {format_size(state_gib)} of the host's memory"
    else:
        state_gib, crossing = moments * share / 2**30, 2 * moments / max(shard_size, 1)
        line = (f"{key}.offload_optimizer=true: AdamW's moments wait in the host's memory between updates, "
                f"{format_size(state_gib)}, and cross the host link twice a step ({_gb(crossing)} a GPU)")
    out.update(host_state_gib=state_gib, line=line + _host_verdict(state_gib, host_gib, share))
    return out


def _host_verdict(state_gib: float, host_gib: float | None, share: float) -> str:
    """The end of a host-memory line: against this host's memory, and what to change where it is too much (`share`:
    copies of the model a node holds, nproc_per_node / shard size; more GPUs on a node do not lower its part)."""
    if host_gib is None:
        return ""
    out = f" of this host's {host_gib:.0f} GiB"
    if state_gib > 0.85 * host_gib:
        fewer = "a larger fsdp_size (fewer copies of the model on a node), " if share > 1 else ""
        out += (f": too much, the run would swap or be killed; use a host with more memory, {fewer}more nodes with "
                "the model sharded across them (each node holds its part), LoRA, or model.dtype=bfloat16 (half the "
                "bytes of each)")
    return out
