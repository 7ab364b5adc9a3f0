"""The model and the engine that trains or runs it: `ModelConfig` (with `LoRAConfig`), `OptimConfig`,
`EngineConfig` (sharding, precision, micro-batching), as every trainer's config holds them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.checks import check_engine, check_model, check_optim
from shardrl.config.load import require

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class LoRAConfig:
    """LoRA adapters (PyPI peft) on the policy: only they train (fp32); the base stays frozen, stored in the
    engine's param_dtype (no fp32 copy, gradient or optimizer state for it), and the reference policy is the base
    with the adapters off. FSDP2 only."""

    rank: int = 0
    """The adapters' rank r; 0: no LoRA (every weight trains)."""
    alpha: float = 16.0
    """The adapters' scale: B @ A is added times alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the update's forward equal to the old log-probs')."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The linear layers that get adapters, by their leaf name (q_proj, v_proj, ...), or every linear layer but
    the output head. A vision-language model's: its language model's only (the vision tower gets none)."""
    use_rslora: bool = False
    """Rank-stabilized scale alpha / sqrt(rank)."""
    seed: int = 0
    """Seed of the adapters' A init (B starts at 0: training starts at the base model)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "rank", self.rank >= 0, "must be >= 0 (0: no LoRA)")
        require(self, prefix, "alpha", self.alpha > 0, "must be > 0")
        require(self, prefix, "dropout", 0 <= self.dropout < 1, "must be in [0, 1)")
        require(self, prefix, "target_modules", self.target_modules == "all-linear" or bool(self.target_modules),
                'must name at least one linear layer (q_proj, ...) or be "all-linear"')
        require(self, prefix, "target_modules", self.target_modules == "all-linear"
                or not {"lm_head", "score"} & set(self.target_modules),
                "cannot hold the output head (lm_head, score): log-probs are computed from its weight directly")


@dataclass
class ModelConfig:
    path: str | None = None
    """Hugging Face model folder (config, weights, usually the tokenizer), or a hub id (org/name) resolved to its
    folder in the hub's cache, downloaded when not there (`shardrl.config.hub`)."""
    tiny: dict | None = None
    """HF config kwargs for a random-init model when `path` is unset, e.g. {"model_type": "qwen2", "hidden_size": 64}."""
    override_config: dict = field(default_factory=dict)
    """Attributes set over the model's HF config (config.json or `tiny`) for the policy, its reference and the
    rollout, e.g. {"max_position_embeddings": 65536, "rope_theta": 1e6}; a mapping sets a sub-config's
    (text_config). verl's actor_rollout_ref.model.override_config. The critic's: critic.model_override_config."""
    tokenizer_path: str | None = None
    """Tokenizer folder or hub id; None uses `path`."""
    chat_template: str | None = None
    """A Jinja chat template set on the tokenizer in place of its own (e.g. for a base model's folder, which has
    none): the template's text, or the path of a file holding it. None: the tokenizer's own."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code shipped inside the model folder to run."""
    attn_implementation: str = "auto"
    """HF attention implementation; "auto" = packed varlen FlashAttention on CUDA, SDPA elsewhere."""
    experts_implementation: Literal["auto", "grouped_mm", "eager", "batched_mm"] = "auto"
    """Mixture-of-experts models: how a layer's experts compute (HF's `experts_implementation`). "auto":
    grouped_mm (one grouped matrix product per projection over the tokens sorted by expert) where the hidden and
    expert sizes are multiples of 8, else eager (a loop over the experts hit). Dense models ignore it."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    use_remove_padding: bool = True
    """Pack a micro-batch's sequences into one padding-free row (position_ids) for the forward."""
    dtype: Dtype = "float32"
    """Dtype of the master weights (and optimizer state)."""
    disable_dropout: bool = True
    """Set every dropout probability of the model's config to 0 (GPT-2 ships 0.1): with dropout the update's
    forward differs from the one that computed the old log-probs, so the PPO ratio is not 1 on-policy."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (off: lora.rank=0)."""
    freeze_vision_tower: bool = False
    """A vision-language model: train the language model only, the vision tower (patch embedding, blocks, merger)
    kept as loaded (verl's actor.freeze_vision_tower). false: the vision tower is sharded and trained with the rest."""
    load_weights: Literal["sharded", "rank0", "random_shards"] = "sharded"
    """How an FSDP2 engine fills its shards from `path`: "sharded" builds the model on the meta device and
    each rank reads only its own slices of the safetensors files; "rank0" (FSDP1 always, and `tiny` or
    `.bin` folders whatever this says) has rank 0 build the whole model on its CPU and broadcast it.
    "random_shards" (a `tiny` config, FSDP2): each rank draws its own shards on its device (normal(0,
    initializer_range), norms 1, biases 0), for benchmarks of shapes too big to build on a CPU or write to
    disk; the numbers depend on the layout (unlike `tiny`'s HF init on rank 0)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "tiny", self.tiny is None or "model_type" in self.tiny,
                'needs a "model_type" entry, e.g. {"model_type": "qwen2", ...}')
        require(self, prefix, "attn_implementation", self.attn_implementation != "shardrl_varlen"
                or self.use_remove_padding, "shardrl_varlen attends over packed rows and needs "
                f"{prefix}.use_remove_padding=true; with padding kept, set it to auto or sdpa")
        check_model(self, prefix)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps; 0 uses `warmup_ratio`."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of `total_steps`, used when `warmup_steps` is 0."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of `lr`."""
    total_steps: int | None = None
    """Optimizer steps the schedule spans; None takes it from the trainer."""
    clip_grad: float = 1.0
    """Max global grad norm; <= 0 disables clipping (the norm is still reported)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "lr", self.lr > 0 and math.isfinite(self.lr), "must be a finite number > 0")
        require(self, prefix, "betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        require(self, prefix, "eps", self.eps > 0, "must be > 0")
        require(self, prefix, "weight_decay", self.weight_decay >= 0, "must be >= 0")
        require(self, prefix, "warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        require(self, prefix, "warmup_ratio", 0 <= self.warmup_ratio < 1, "must be in [0, 1)")
        require(self, prefix, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        require(self, prefix, "total_steps", self.total_steps is None or self.total_steps >= 1, "must be >= 1 or null")
        check_optim(self, prefix)


@dataclass
class EngineConfig:
    strategy: Literal["fsdp2", "fsdp"] = "fsdp2"
    """Sharding backend: FSDP2 (`fully_shard`, CPU or GPU) or legacy FSDP1 (CUDA only)."""
    fsdp_size: int = -1
    """Ranks one copy of the model is sharded over; -1 (or >= world) shards over all, smaller gives HSDP."""
    reshard_after_forward: bool = True
    """Free gathered params after forward (ZeRO-3); False keeps them until backward (ZeRO-2): no re-gather in
    backward, for one layer-set of gathered params more memory. Faster on two GPUs with compile (measured:
    bench/RESULTS.md, "Current figures: Engine update")."""
    accumulate_unsharded: bool | None = None
    """FSDP2: over a mini-batch's micro-batches, keep the params gathered and accumulate the gradients unsharded
    (in `reduce_dtype`), reducing them once, after the last micro-batch. Saves per micro-batch a gather (two with
    `reshard_after_forward`) and a gradient reduction, at the memory of the whole model in `param_dtype` (and,
    with shards of several ranks, a whole gradient) on every GPU. null = on where a shard is the whole model
    (one GPU, or HSDP with fsdp_size=1) and params are not offloaded: there sharding saves no memory, and the
    gathers and reductions are copies (or, with HSDP, all-reduces) per micro-batch. With `offload_params` it is
    off unless set: true keeps the gathered params and the unsharded gradients (in `reduce_dtype`) on the GPU over
    the micro-batches, so the offloaded shards cross the host link once a mini-batch, not at each micro-batch's
    forward and backward (`shardrl plan` counts both)."""
    param_dtype: Dtype = "bfloat16"
    """Dtype of the gathered params the forward/backward compute in."""
    reduce_dtype: Dtype = "float32"
    """Dtype gradients are reduce-scattered in."""
    offload_params: bool = False
    """Keep params (and grads) on CPU between phases (FSDP2's CPUOffloadPolicy). With model.lora: the frozen base
    and the adapters (verl's param_offload with LoRA), the optimizer stepping the adapters on the CPU."""
    offload_optimizer: bool = False
    """Keep optimizer state on CPU between updates."""
    forward_prefetch: bool = False
    """Issue the next layer's all-gather before the current layer's forward runs."""
    micro_batch_size_per_gpu: int = 1
    """Samples per micro-batch when `use_dynamic_bsz` is off."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by token budget (`max_token_len_per_gpu`) instead of sample count."""
    max_token_len_per_gpu: int = 16384
    """Token budget of one dynamic micro-batch."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks one sequence is split over (Ulysses); data-parallel size is world // this."""
    expert_parallel_size: int = 1
    """FSDP2, mixtures of experts: ranks each MoE layer's experts are spread over (`ep`: a rank holds E / ep whole
    experts; tokens go to their experts' ranks and back by all-to-all), the experts then sharded over the world // ep
    ranks that hold the same ones; everything else is sharded as without it. 1 = off. Must divide the world size and
    each layer's expert count; not with HSDP, Ulysses, LoRA, offload_params or compile (yet)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs from hidden states, so logits never fill tokens x vocab."""
    seed: int = 0
    """Seed of the random init of a `model.tiny` model and of a new value head (weights read from a folder do
    not use it). It does not seed dropout: training runs the model in train mode, so a model with dropout > 0
    draws its masks from torch's global generator."""
    compile: bool | None = None
    """`torch.compile` each decoder block before sharding (FSDP2 only): faster steps for seconds of compilation
    at start-up (measured: bench/RESULTS.md, "Current figures: Engine update"). null = on CUDA with FSDP2 for a
    policy of 0.5B matmul parameters or more, where the whole step gains ("Current figures: Whole step
    settings"), off for smaller models (compiled, the built-in demo with its dynamic micro-batch shapes did not
    finish a first step in minutes on an H200) and on CPU. An engine built directly (tests, bench/) treats null as off."""

    def accumulates_unsharded(self, shard_size: int) -> bool:
        """`accumulate_unsharded` resolved for shards of `shard_size` ranks (null: on where a shard holds the
        whole model and the params stay on the GPU; FSDP2 only)."""
        if self.accumulate_unsharded is not None:
            return self.accumulate_unsharded
        return self.strategy == "fsdp2" and shard_size == 1 and not self.offload_params

    @staticmethod
    def moved_key(name: str, prefix: str) -> str | None:
        """Where a key that used to sit in this section lives now (read by the loader), or None."""
        if name != "loss_agg_mode":
            return None
        role = prefix.rsplit(".", 1)[0]
        if role in ("actor", "critic"):
            return f"set {role}.loss_agg_mode instead (the loss is the {role}'s, not its engine's)"
        owner = f"{role} computes no loss" if role else "an engine computes no loss"
        return f"{owner}; set actor.loss_agg_mode (and critic.loss_agg_mode) instead"

    def validate(self, prefix: str) -> None:
        require(self, prefix, "fsdp_size", self.fsdp_size == -1 or self.fsdp_size >= 1,
                "must be -1 (shard over all ranks) or >= 1")
        require(self, prefix, "micro_batch_size_per_gpu", self.micro_batch_size_per_gpu >= 1, "must be >= 1")
        require(self, prefix, "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size >= 1,
                "must be >= 1")
        require(self, prefix, "expert_parallel_size", self.expert_parallel_size >= 1, "must be >= 1 (1: off)")
        require(self, prefix, "logprob_chunk_size", self.logprob_chunk_size >= 1, "must be >= 1")
        check_engine(self, prefix)
