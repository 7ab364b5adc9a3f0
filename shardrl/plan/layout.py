"""The batch-size arithmetic of one step, done once, up front, before anything is built.

Global sizes in the config count prompts (docs/design.md); `derive_layout`
turns them into per-rank sample counts for a world of `nnodes x nproc_per_node` ranks and checks every
divisibility rule, raising a `ValueError` that shows the numbers and the nearest valid values.
`memory_ledger` estimates the actor's per-GPU memory for that layout (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardrl.algos.preference import PREFERENCE_LOSSES
from shardrl.config.checks import check_mini_batch
from shardrl.config.registry import TRAINERS
from shardrl.config.schema import Config, DPOConfig, EngineConfig, KTOConfig
from shardrl.config.load import divisors as _divisors, nearest as _nearest
from shardrl.models.config import text_config
from shardrl.plan.step_plan import StepPlan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3


def format_size(gib: float, digits: int = 1) -> str:
    """A size given in GiB, in a unit that shows it: GiB (`digits` decimals) from 0.1 GiB, else MiB, KiB or bytes
    (a tiny model's 3 MiB is not "0.0 GiB")."""
    if gib >= 0.1 or gib <= 0:
        return f"{gib:.{digits}f} GiB"
    for unit, scale in (("MiB", 2**10), ("KiB", 2**20)):
        if gib * scale >= 1:
            return f"{gib * scale:.1f} {unit}"
    return f"{gib * GIB:.0f} B"


def format_count(n: float) -> str:
    """A parameter count: 7.616B, 40.37M, 0.26M; exact under 10 thousand (a tiny model's are not "0.000B")."""
    if n >= 1e9:
        return f"{n / 1e9:.3f}B"
    if n >= 1e4:
        return f"{n / 1e6:.2f}M"
    return f"{n:.0f}"


@dataclass
class RoleLayout:
    """How one model (actor, critic or ref) is sharded and how its per-rank batch is cut."""
    role: str
    fsdp_size: int
    sharding: str
    """"FSDP over N" or "HSDP R x S" (R replicas, each sharded over S ranks)."""
    shard_size: int
    num_replicas: int
    micro_batch_size_per_gpu: int | None
    """Samples per micro-batch; None with dynamic batching."""
    max_token_len_per_gpu: int | None
    """Token budget of a dynamic micro-batch; None with fixed micro-batches."""
    micro_batches: str
    """Micro-batches per mini-batch (per forward pass for ref), in words."""
    num_infer_micro_batches: int | None
    """Micro-batches of a forward pass over the rank's whole step batch; None when dynamic."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step (global); None for the forward-only ref."""
    mini_batch_samples_per_rank: int | None = None
    num_mini_batches: int | None = None
    ppo_epochs: int | None = None
    num_updates: int | None = None
    """Optimizer steps per training step: num_mini_batches x ppo_epochs."""
    num_micro_batches: int | None = None
    """Micro-batches per mini-batch; None when dynamic."""


@dataclass
class Layout:
    nnodes: int
    nproc_per_node: int
    world_size: int
    sp: int
    dp: int
    train_batch_size: int
    """Prompts per step (global)."""
    n: int
    rollouts_per_step: int
    """Responses generated (and trained on) per step over all ranks: train_batch_size x n."""
    prompts_per_rank: int
    samples_per_rank: int
    max_prompt_length: int
    max_new_tokens: int
    """Response tokens at most: the response budget (`RolloutConfig.response_budget`): rollout.max_new_tokens, or
    multi_turn.max_response_tokens for multi-turn rollouts, agent.max_response_tokens for an agent's."""
    max_seq_len: int
    seq_tokens_per_rank: int
    """Tokens of one max-length sequence on one rank: ceil(max_seq_len / sp)."""
    actor: RoleLayout
    critic: RoleLayout | None
    """Only when the advantage estimator needs values (`StepPlan.needs_critic`)."""
    ref: RoleLayout | None
    """Only when a KL term needs the reference policy."""
    teacher: RoleLayout | None = None
    """Only for on-policy distillation (`StepPlan.uses_teacher`); forward only, as the reference."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _nearest_multiples(value: int, step: int) -> str:
    below = value // step * step
    return _nearest(value, [v for v in (below, below + step) if v > 0])


def _role_engines(cfg: Config, steps: StepPlan) -> dict[str, EngineConfig]:
    roles = steps.roles()  # the roles that train or score log-probs (not the reward model)
    return {role: getattr(cfg, role).engine for role in ("actor", "critic", "ref", "teacher")
            if role in roles}


def _sharding(role: str, engine: EngineConfig, world: int) -> tuple[int, str, int, int]:
    size = engine.fsdp_size
    if size == -1 or size >= world:
        return size, f"FSDP over {world}", world, 1
    if size < 1 or world % size != 0:
        raise ValueError(
            f"{role}.engine.fsdp_size={size} does not divide the world size {world} (HSDP needs world = "
            f"replicas x fsdp_size); valid: -1 (shard over all {world}) or one of {_divisors(world)}"
        )
    return size, f"HSDP {world // size} x {size}", size, world // size


def _check_fits(section: str, engine: EngineConfig, max_seq_len: int, sp: int, why: str) -> None:
    if engine.max_token_len_per_gpu * sp < max_seq_len:
        need = math.ceil(max_seq_len / sp)
        raise ValueError(
            f"{section}.max_token_len_per_gpu={engine.max_token_len_per_gpu} cannot hold one sequence of up "
            f"to {max_seq_len} tokens ({why}) split over sp={sp}; use at least {need}"
        )


def _train_role(cfg: Config, role: str, engine: EngineConfig, dp: int, n: int, samples_per_rank: int,
                sharding: tuple[int, str, int, int]) -> RoleLayout:
    section = getattr(cfg, role)
    batch, mini = cfg.data.train_batch_size, section.ppo_mini_batch_size
    check_mini_batch(cfg, role)  # the config's rule, for a config built in code
    if (mini * n) % dp != 0:
        valid = [m for m in _divisors(batch) if (m * n) % dp == 0]
        raise ValueError(
            f"{role}.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini * n} samples cannot be split over "
            f"dp={dp} data-parallel ranks; nearest valid {role}.ppo_mini_batch_size: {_nearest(mini, valid)}"
        )
    mini_samples = mini * n // dp
    num_mini = batch // mini
    layout = RoleLayout(role, *sharding, None, None, "", None, mini, mini_samples, num_mini,
                        section.ppo_epochs, num_mini * section.ppo_epochs)
    if engine.use_dynamic_bsz:
        layout.max_token_len_per_gpu = engine.max_token_len_per_gpu
        layout.micro_batches = f"dynamic, <= {engine.max_token_len_per_gpu} tokens each"
        return layout
    micro = engine.micro_batch_size_per_gpu
    formula = f"(ppo_mini_batch_size {mini} x n {n} / dp {dp})"
    if micro > mini_samples:
        raise ValueError(
            f"{role}.engine.micro_batch_size_per_gpu={micro} exceeds the per-rank mini-batch of {mini_samples} "
            f"samples {formula}; use at most {mini_samples} (valid: {_divisors(mini_samples)})"
        )
    if mini_samples % micro != 0:
        raise ValueError(
            f"{role}.engine.micro_batch_size_per_gpu={micro} does not divide the per-rank mini-batch of "
            f"{mini_samples} samples {formula}; nearest valid: {_nearest(micro, _divisors(mini_samples))}"
        )
    layout.micro_batch_size_per_gpu = micro
    layout.num_micro_batches = mini_samples // micro
    layout.num_infer_micro_batches = math.ceil(samples_per_rank / micro)
    layout.micro_batches = f"{mini_samples // micro} of {micro} samples"
    return layout


def derive_layout(cfg: Config, nnodes: int, nproc_per_node: int, steps: StepPlan | None = None,
                  response: tuple[str, int] | None = None) -> Layout:
    """Per-rank sizes of one step on `nnodes x nproc_per_node` ranks; `ValueError` for a layout that cannot work.
    `steps` and `response` (the response budget, `RolloutConfig.response_budget`): the run's `Plan`'s; a caller
    without a plan has them derived from `cfg`."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes={nnodes} and nproc_per_node={nproc_per_node} must both be >= 1")
    world = nnodes * nproc_per_node
    roles = _role_engines(cfg, steps or StepPlan.from_config(cfg))
    sp = cfg.actor.engine.ulysses_sequence_parallel_size
    if sp < 1 or world % sp != 0:
        raise ValueError(
            f"actor.engine.ulysses_sequence_parallel_size={sp} does not divide the world size {world} "
            f"({nnodes} nodes x {nproc_per_node} procs); valid sp: {_divisors(world)}"
        )
    for role, engine in roles.items():
        if engine.ulysses_sequence_parallel_size != sp:
            # every role works on the same dp shard of the step's batch, so they must cut the world alike
            raise ValueError(
                f"{role}.engine.ulysses_sequence_parallel_size={engine.ulysses_sequence_parallel_size} differs "
                f"from actor.engine.ulysses_sequence_parallel_size={sp}; set both to {sp}"
            )
    dp = world // sp
    batch, n = cfg.data.train_batch_size, cfg.rollout.n
    if batch % dp != 0:
        raise ValueError(
            f"data.train_batch_size={batch} prompts cannot be split over dp={dp} data-parallel ranks "
            f"(world {world} / sp {sp}); nearest valid: {_nearest_multiples(batch, dp)}"
        )
    gen = cfg.data.gen_batch_size
    if gen is not None and gen % dp != 0:  # (dynamic sampling's generation batches are dp-sharded the same way)
        raise ValueError(
            f"data.gen_batch_size={gen} prompts cannot be split over dp={dp} data-parallel ranks "
            f"(world {world} / sp {sp}); nearest valid: {_nearest_multiples(gen, dp)}"
        )
    prompts_per_rank = batch // dp
    samples_per_rank = prompts_per_rank * n
    # a multi-turn or agent response (model and tool turns) is bounded by its own budget, not by one turn's limit
    response_key, response_len = response or cfg.rollout.response_budget()
    max_seq_len = cfg.data.max_prompt_length + response_len
    why = f"data.max_prompt_length {cfg.data.max_prompt_length} + {response_key} {response_len}"

    layouts: dict[str, RoleLayout] = {}
    for role, engine in roles.items():
        sharding = _sharding(role, engine, world)
        if engine.use_dynamic_bsz:
            _check_fits(f"{role}.engine", engine, max_seq_len, sp, why)
        if role in ("ref", "teacher"):  # forward only
            dynamic = engine.use_dynamic_bsz
            micro = engine.micro_batch_size_per_gpu
            layouts[role] = RoleLayout(
                role, *sharding,
                micro_batch_size_per_gpu=None if dynamic else micro,
                max_token_len_per_gpu=engine.max_token_len_per_gpu if dynamic else None,
                micro_batches=(f"dynamic, <= {engine.max_token_len_per_gpu} tokens each" if dynamic
                               else f"{math.ceil(samples_per_rank / micro)} of <= {micro} samples"),
                num_infer_micro_batches=None if dynamic else math.ceil(samples_per_rank / micro),
            )
        else:
            layouts[role] = _train_role(cfg, role, engine, dp, n, samples_per_rank, sharding)

    return Layout(
        nnodes=nnodes, nproc_per_node=nproc_per_node, world_size=world, sp=sp, dp=dp,
        train_batch_size=batch, n=n, rollouts_per_step=batch * n, prompts_per_rank=prompts_per_rank,
        samples_per_rank=samples_per_rank,
        max_prompt_length=cfg.data.max_prompt_length, max_new_tokens=response_len,
        max_seq_len=max_seq_len, seq_tokens_per_rank=math.ceil(max_seq_len / sp),
        actor=layouts["actor"], critic=layouts.get("critic"), ref=layouts.get("ref"),
        teacher=layouts.get("teacher"),
    )


def check_model_heads(layout, hf_config, section: str = "actor.engine") -> None:
    """The model's attention and KV heads against sp, by the rule the engine applies when it builds
    (`shardrl.engine.ulysses.check_heads`), so `shardrl plan` finds what training would; `ValueError`
    naming the key and the nearest sp values that work on this world."""
    from shardrl.engine.ulysses import check_heads

    text = text_config(hf_config)
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:  # an architecture that names its heads otherwise: the engine's own check decides
        return
    kv_heads = getattr(text, "num_key_value_heads", None) or heads

    def fits(sp: int) -> bool:
        try:
            check_heads(heads, kv_heads, sp)
        except ValueError:
            return False
        return True

    if fits(layout.sp):
        return
    valid = [d for d in _divisors(layout.world_size) if fits(d)]
    raise ValueError(
        f"{section}.ulysses_sequence_parallel_size={layout.sp} does not fit the model's {heads} attention heads "
        f"and {kv_heads} KV heads (sp must divide the attention heads, and sp and the KV heads must divide one "
        f"another); nearest valid sp on a world of {layout.world_size}: {_nearest(layout.sp, valid)}"
    )


def _role_lines(r: RoleLayout, layout: Layout) -> list[tuple[str, str, object]]:
    lines: list[tuple[str, str, object]] = [(
        f"{r.role} sharding", f"fsdp_size {r.fsdp_size} on world {layout.world_size}",
        f"{r.sharding} ({r.num_replicas} replica(s), each sharded over {r.shard_size})")]
    if r.ppo_mini_batch_size is not None:
        lines += [
            (f"{r.role} mini-batch per rank", f"{r.ppo_mini_batch_size} prompts x {layout.n} (n) / {layout.dp} (dp)",
             f"{r.mini_batch_samples_per_rank} samples"),
            (f"{r.role} mini-batches per step", f"{layout.train_batch_size} (train_batch_size) / "
             f"{r.ppo_mini_batch_size} (ppo_mini_batch_size)", r.num_mini_batches),
            (f"{r.role} updates per step", f"{r.num_mini_batches} mini-batches x {r.ppo_epochs} (ppo_epochs)",
             r.num_updates),
        ]
        if r.num_micro_batches is not None:
            lines.append((f"{r.role} micro-batches per mini-batch", f"{r.mini_batch_samples_per_rank} samples / "
                          f"{r.micro_batch_size_per_gpu} (micro_batch_size_per_gpu)", r.num_micro_batches))
    if r.num_infer_micro_batches is not None:
        lines.append((f"{r.role} forward micro-batches per step", f"ceil({layout.samples_per_rank} samples / "
                      f"{r.micro_batch_size_per_gpu} (micro_batch_size_per_gpu))", r.num_infer_micro_batches))
    else:
        per = "mini-batch" if r.ppo_mini_batch_size is not None else "forward"
        lines.append((f"{r.role} micro-batches per {per}", "dynamic (use_dynamic_bsz), balanced by tokens",
                      f"<= {r.max_token_len_per_gpu} tokens each (max_token_len_per_gpu)"))
    return lines


def format_layout(layout: Layout) -> str:
    """The derivation, one "name = formula = value" line per number."""
    L = layout
    lines: list[tuple[str, str, object]] = [
        ("world size", f"{L.nnodes} nodes x {L.nproc_per_node} procs", L.world_size),
        ("sp", "actor.engine.ulysses_sequence_parallel_size", L.sp),
        ("dp", f"{L.world_size} (world) / {L.sp} (sp)", L.dp),
        ("rollouts per step", f"{L.train_batch_size} (train_batch_size) x {L.n} (n)", L.rollouts_per_step),
        ("prompts per rank", f"{L.train_batch_size} (train_batch_size) / {L.dp} (dp)", L.prompts_per_rank),
        ("samples per rank", f"{L.train_batch_size} prompts x {L.n} (n) / {L.dp} (dp)", L.samples_per_rank),
        ("max sequence length", f"{L.max_prompt_length} (max_prompt_length) + {L.max_new_tokens} (max response tokens)",
         L.max_seq_len),
    ]
    if L.sp > 1:
        lines.append(("tokens of one sequence per rank", f"ceil({L.max_seq_len} / {L.sp} (sp))", L.seq_tokens_per_rank))
    for role in (L.actor, L.critic, L.ref, L.teacher):
        if role is not None:
            lines += _role_lines(role, L)
    width = max(len(name) for name, _, _ in lines)
    return "\n".join(f"{name:<{width}} = {formula} = {value}" for name, formula, value in lines)



@dataclass
class OfflineLayout:
    """How an offline trainer's step (`shardrl sft|dpo|rm`) is laid out: rows from files, one update a step."""
    trainer: str
    nnodes: int
    nproc_per_node: int
    world_size: int
    sp: int
    dp: int
    engine: RoleLayout
    rows_per_step: int
    """data.batch_size: conversations (sft) or preference pairs (dpo, rm)."""
    rows_per_rank: int
    sequences_per_rank: int
    """Rows x sequences per row (2 for a pair)."""
    group_size: int
    max_seq_len: int
    """data.max_length: a sequence is the prompt and one completion."""
    seq_tokens_per_rank: int
    ref: bool
    """A forward-only reference model beside the trained one (dpo with a loss that needs it)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def derive_offline_layout(cfg, trainer: str, nnodes: int, nproc_per_node: int) -> OfflineLayout:
    """`derive_layout` for `shardrl sft|dpo|rm`: data.batch_size over dp, the micro-batches of a rank's share
    (a pair's two sequences always share one), and the token budget against data.max_length."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes={nnodes} and nproc_per_node={nproc_per_node} must both be >= 1")
    world, engine = nnodes * nproc_per_node, cfg.engine
    sp = engine.ulysses_sequence_parallel_size
    if sp < 1 or world % sp != 0:
        raise ValueError(f"engine.ulysses_sequence_parallel_size={sp} does not divide the world size {world} "
                         f"({nnodes} nodes x {nproc_per_node} procs); valid sp: {_divisors(world)}")
    dp = world // sp
    batch, group, what = cfg.data.batch_size, TRAINERS[trainer].group_size, TRAINERS[trainer].rows
    if batch % dp:
        raise ValueError(f"data.batch_size={batch} {what} cannot be split over dp={dp} data-parallel ranks "
                         f"(world {world} / sp {sp}); nearest valid: {_nearest_multiples(batch, dp)}")
    rows = batch // dp
    longest = cfg.data.max_length * group
    sharding = _sharding("engine", engine, world)
    if engine.use_dynamic_bsz:
        why = f"data.max_length {cfg.data.max_length}" + (" x 2 (a pair shares a micro-batch)" if group > 1 else "")
        _check_fits("engine", engine, longest, sp, why)
        role = RoleLayout("engine", *sharding, None, engine.max_token_len_per_gpu,
                          f"dynamic, <= {engine.max_token_len_per_gpu} tokens each", None)
    else:
        micro = engine.micro_batch_size_per_gpu
        if micro > rows:
            raise ValueError(f"engine.micro_batch_size_per_gpu={micro} {what} exceeds the {rows} {what} a rank "
                             f"holds (data.batch_size {batch} / dp {dp}); use at most {rows}")
        count = math.ceil(rows / micro)
        role = RoleLayout("engine", *sharding, micro, None, f"{count} of <= {micro} {what}", None,
                          num_micro_batches=count)
    uses_ref = isinstance(cfg, KTOConfig) or (isinstance(cfg, DPOConfig)
                                             and PREFERENCE_LOSSES[cfg.dpo.loss_type].uses_ref)
    return OfflineLayout(trainer, nnodes, nproc_per_node, world, sp, dp, role, batch, rows, rows * group, group,
                         cfg.data.max_length, math.ceil(cfg.data.max_length / sp), uses_ref)


def format_offline_layout(layout: OfflineLayout) -> str:
    L, e = layout, layout.engine
    what = TRAINERS[L.trainer].rows
    lines: list[tuple[str, str, object]] = [
        ("world size", f"{L.nnodes} nodes x {L.nproc_per_node} procs", L.world_size),
        ("sp", "engine.ulysses_sequence_parallel_size", L.sp),
        ("dp", f"{L.world_size} (world) / {L.sp} (sp)", L.dp),
        ("sharding", f"fsdp_size {e.fsdp_size} on world {L.world_size}",
         f"{e.sharding} ({e.num_replicas} replica(s), each sharded over {e.shard_size})"),
        (f"{what} per rank", f"{L.rows_per_step} (data.batch_size) / {L.dp} (dp)", L.rows_per_rank),
        ("sequences per rank", f"{L.rows_per_rank} {what} x {L.group_size}", L.sequences_per_rank),
        ("max sequence length", "data.max_length", L.max_seq_len),
        ("micro-batches per step", "dynamic (use_dynamic_bsz), balanced by tokens" if e.num_micro_batches is None
         else f"ceil({L.rows_per_rank} / {e.micro_batch_size_per_gpu} (micro_batch_size_per_gpu))", e.micro_batches),
    ]
    if L.sp > 1:
        lines.append(("tokens of one sequence per rank", f"ceil({L.max_seq_len} / {L.sp} (sp))", L.seq_tokens_per_rank))
    if L.ref:
        lines.append(("reference model", "the loss needs it", "forward-only, same sharding"))
    width = max(len(name) for name, _, _ in lines)
    return "\n".join(f"{name:<{width}} = {formula} = {value}" for name, formula, value in lines)
