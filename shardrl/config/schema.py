"""The config schema: typed dataclasses, one per part of a run; the loader lives in `shardrl.config.load`.

    cfg = load_config("run.yaml", ["actor.optim.lr=1e-5", "rollout.n=8"])

Batch sizes follow DESIGN.md: `data.train_batch_size` and `*.ppo_mini_batch_size` count prompts and
are global; per-rank sizes are derived from them and the world size elsewhere. Each section's
`validate(prefix)` rejects values that cannot work whatever the world size; checks that need the
world size run when the run is laid out.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, TypeVar

from shardrl.algos import ADVANTAGE_ESTIMATORS, LOSS_MODES
from shardrl.algos.preference import PREFERENCE_LOSSES
from shardrl.config.load import (
    ConfigError,
    apply_override,
    config_keys,
    config_to_dict,
    divisors,
    from_dict,
    load,
    nearest,
    require,
    save_config,
    unknown_keys,
    validate_config,
)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "AsyncConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "EngineConfig", "FilterGroupsConfig", "LoRAConfig", "OverlongBufferConfig",
    "ModelConfig", "MultiTurnConfig", "OptimConfig", "RefConfig", "RewardConfig", "RolloutConfig",
    "TrainerConfig", "apply_override", "config_keys", "config_to_dict", "from_dict", "load_config",
    "save_config", "validate_config",
]

T = TypeVar("T")
Dtype = Literal["float32", "bfloat16", "float16"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
"""verl's KL estimator names (shardrl.algos.kl): k3 = low_var_kl (clamped); a "+" takes k2's gradient."""
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]
EstimatorName = Literal[tuple(ADVANTAGE_ESTIMATORS)]  # the registries are the lists of names
LossModeName = Literal[tuple(LOSS_MODES)]
PreferenceLossName = Literal[tuple(PREFERENCE_LOSSES)]


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
    the output head."""
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
    """Local Hugging Face model folder (config, weights, usually the tokenizer)."""
    tiny: dict | None = None
    """HF config kwargs for a random-init model when `path` is unset, e.g. {"model_type": "qwen2", "hidden_size": 64}."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None uses `path`."""
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
    load_weights: Literal["sharded", "rank0", "random_shards"] = "sharded"
    """How an FSDP2 engine fills its shards from `path`: "sharded" builds the model on the meta device and
    each rank reads only its own slices of the safetensors files; "rank0" (FSDP1 always, and `tiny` or
    `.bin` folders whatever this says) has rank 0 build the whole model on its CPU and broadcast it.
    "random_shards" (a `tiny` config, FSDP2): each rank draws its own shards on its device (normal(0,
    initializer_range), norms 1, biases 0), for benchmarks of shapes too big to build on a CPU or write to
    disk; the numbers depend on the layout (unlike `tiny`'s HF init on rank 0)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "tiny", self.path is None or self.tiny is None,
                "set only one of model.path (a model folder) and model.tiny (a random-init config)")
        require(self, prefix, "tiny", self.tiny is None or "model_type" in self.tiny,
                'needs a "model_type" entry, e.g. {"model_type": "qwen2", ...}')
        require(self, prefix, "load_weights", self.load_weights != "random_shards" or self.tiny is not None,
                "random_shards draws a random model.tiny; with model.path use sharded or rank0")


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
        require(self, prefix, "warmup_ratio", self.warmup_steps == 0 or self.warmup_ratio == 0,
                "set only one of warmup_steps and warmup_ratio")
        require(self, prefix, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        require(self, prefix, "total_steps", self.total_steps is None or self.total_steps >= 1, "must be >= 1 or null")


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
    gathers and reductions are copies (or, with HSDP, all-reduces) per micro-batch."""
    param_dtype: Dtype = "bfloat16"
    """Dtype of the gathered params the forward/backward compute in."""
    reduce_dtype: Dtype = "float32"
    """Dtype gradients are reduce-scattered in."""
    offload_params: bool = False
    """Keep params (and grads) on CPU between phases."""
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
        require(self, prefix, "max_token_len_per_gpu", not self.use_dynamic_bsz or self.max_token_len_per_gpu >= 1,
                "must be >= 1 when use_dynamic_bsz is on")
        require(self, prefix, "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size >= 1, "must be >= 1")
        require(self, prefix, "expert_parallel_size", self.expert_parallel_size >= 1, "must be >= 1 (1: off)")
        require(self, prefix, "logprob_chunk_size", self.logprob_chunk_size >= 1, "must be >= 1")
        require(self, prefix, "compile", not (self.compile and self.strategy == "fsdp"),
                "is implemented for strategy=fsdp2 only; set compile=false with FSDP1 (strategy=fsdp)")
        # FSDP1's CPU offload gave wrong gradient norms against the plain loop on one GPU, and its gradients cannot
        # be gathered on two; FSDP2's offload matches the loop (bench/RESULTS.md, "Current figures: GPU tests")
        require(self, prefix, "offload_params", not (self.offload_params and self.strategy == "fsdp"),
                "is supported with strategy=fsdp2 only (FSDP1's CPU offload gave wrong gradients on GPU); "
                "use strategy=fsdp2, or offload_optimizer=true with FSDP1")
        require(self, prefix, "accumulate_unsharded", not (self.accumulate_unsharded and self.strategy == "fsdp"),
                "is implemented for strategy=fsdp2 only; leave it null (or false) with FSDP1")
        require(self, prefix, "accumulate_unsharded", not (self.accumulate_unsharded and self.offload_params),
                "keeps the whole model gathered on the GPU, which offload_params=true exists to avoid; set one of "
                "them false (or leave accumulate_unsharded null)")


def _validate_ppo_loop(section: Any, prefix: str) -> None:
    require(section, prefix, "ppo_mini_batch_size", section.ppo_mini_batch_size >= 1, "must be >= 1 (prompts)")
    require(section, prefix, "ppo_epochs", section.ppo_epochs >= 1, "must be >= 1")


@dataclass
class RouterReplayConfig:
    mode: Literal["disabled", "R2", "R3"] = "disabled"
    """A mixture of experts' routing in the update (verl's actor.router_replay.mode). "R2": the old-log-prob
    pass records each token's experts per MoE layer and every update forward is routed as it was (the expert
    choice stays the old policy's; the weights are this forward's, so the router still learns); logs
    actor/router_replay_mismatch, the share of (token, layer) routings the update would have chosen
    otherwise. It replays nothing when the old log-probs come from the update's own forward (one optimizer
    step per training step). "R3": the fast rollout records each token's experts as it generates, and the
    old-log-prob pass and every update forward are routed as the rollout was (single-turn, rollout.backend
    fast); the mismatch then counts the routings the trainer would have chosen otherwise than the rollout."""


@dataclass
class ActorConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the policy."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the policy."""
    ppo_mini_batch_size: int = 4
    """Prompts per optimizer step (global); a step's batch gives train_batch_size / this updates per epoch."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    shuffle: bool = True
    """Shuffle samples before cutting mini-batches."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (larger = "clip-higher")."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound on the loss for negative advantages; must be > 1."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add KL(policy || ref) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token policy, entropy and KL losses are reduced to one number (verl's actor.loss_agg_mode)."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped), a "+" suffix for k2's gradient."""
    router_aux_loss_coef: float = 0.0
    """A mixture of experts: weight of HF's load-balancing loss (HF's name; `load_balancing_loss_func` over each
    micro-batch's tokens, weighted by its share of the mini-batch's loss tokens) added to the actor's loss; logs
    actor/router_aux_loss. 0: off (RL post-training usually leaves the router's balance alone). Being a function
    of a whole micro-batch, not a sum over tokens, its value depends on how the batch is cut."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Mixtures of experts: replay a recorded routing in the update (`RouterReplayConfig`)."""
    recompute_old_log_probs: Literal["auto", "always"] = "auto"
    """"always": a forward pass over the step's batch computes the old log-probs before the update. "auto":
    skip that pass when it provably equals the update's own forward (one optimizer step per training step:
    ppo_mini_batch_size == data.train_batch_size and ppo_epochs == 1; no KL in the reward, which needs the
    old log-probs before the advantages; dropout off); the PPO ratio is then exactly 1, so the update uses
    the detached log-probs of its own forward as the old ones. The choice is logged at start-up."""
    loss_mode: LossModeName = "vanilla"
    """Policy loss (verl's actor.policy_loss.loss_mode): "vanilla" PPO clip (per-token ratio, dual-clip);
    "gspo": GSPO, one length-normalized ratio per sequence, clipped per sequence; "gspo_token": GSPO-token,
    that ratio's value with a gradient per token and each token's own advantage (verl's "gspo"). GSPO's paper
    uses loss_agg_mode=seq-mean-token-mean and tight clips (clip_ratio_low=3e-4, clip_ratio_high=4e-4);
    clip_ratio_c is not used by the GSPO modes. A sequence's ratio needs the whole sequence in one loss call,
    which holds for every layout: micro-batches (fixed or dynamic, packed or padded) are cut between sequences,
    and under Ulysses sp the loss sees the gathered whole rows. `shardrl.algos.gspo`."""

    def validate(self, prefix: str) -> None:
        _validate_ppo_loop(self, prefix)
        require(self, prefix, "clip_ratio_low", 0 <= self.clip_ratio_low < 1, "must be in [0, 1)")
        require(self, prefix, "clip_ratio_high", self.clip_ratio_high >= 0, "must be >= 0")
        require(self, prefix, "clip_ratio_c", self.clip_ratio_c > 1, "must be > 1 (dual-clip bound)")
        require(self, prefix, "kl_loss_coef", self.kl_loss_coef >= 0, "must be >= 0")
        require(self, prefix, "router_aux_loss_coef", self.router_aux_loss_coef >= 0, "must be >= 0")


@dataclass
class RefConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the frozen reference policy (used for KL)."""


@dataclass
class CriticConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the value model (used by GAE)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the value model."""
    ppo_mini_batch_size: int = 4
    """Prompts per critic optimizer step (global)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    shuffle: bool = True
    """Shuffle samples before cutting the critic's mini-batches (taken from actor.shuffle unless set)."""
    cliprange_value: float = 0.5
    """Value clip: new values stay within this of the old ones."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token value losses are reduced to one number (verl's critic.loss_agg_mode)."""
    model_path: str | None = None
    """Model folder of the critic; None starts from the actor's model."""

    def validate(self, prefix: str) -> None:
        _validate_ppo_loop(self, prefix)
        require(self, prefix, "cliprange_value", self.cliprange_value > 0, "must be > 0")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (`shardrl.rollout.episodes.multiturn`): the model calls a tool in the Hermes/Qwen
    format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>), the tool's answer is appended as a turn
    of exact token ids, and only the model's tokens are trained. KV is recomputed per turn."""

    enable: bool = False
    """Run the agent loop around the rollout backend (hf or fast) instead of single-turn generation."""
    interaction_path: str | None = None
    """Python file defining the interaction (a subclass of shardrl.rollout.episodes.multiturn.Interaction: tools, per-sample
    state, `start`, `step`, a final `reward`); null uses the built-in `tools` with no state, and the reward function."""
    interaction_name: str = "Interaction"
    """Name of the interaction class (or a function making one) in `interaction_path`."""
    tool_config_path: str | None = None
    """verl's tool config YAML (`tools:` entries of class_name, config, tool_schema; `shardrl.tools.verl_tools`):
    the tools of an interaction that creates them per conversation with the row's extra_info.tools_kwargs. verl's
    own gsm8k tool runs as in verl."""
    tools_in_chat_template: bool | None = None
    """Pass the tools' schemas to the prompts' chat template (`apply_chat_template(tools=...)`: Qwen's and Hermes'
    templates then describe the tools in a system block). null: on with tool_config_path (verl does so), off
    otherwise."""
    max_calls_per_turn: int = 1
    """Tool calls one model turn may make (verl's max_parallel_calls). 1: the turn stops at its first call's end
    marker; more: the turn runs to its end of turn, its first this-many calls run together and their answers form
    one tool turn (joined by tool_answer_separator)."""
    tool_answer_separator: str = "\n</tool_response>\n<tool_response>\n"
    """Between the answers of one turn's calls inside the tool turn's {output} (the default closes one Qwen/Hermes
    <tool_response> block and opens the next)."""
    reward_text: Literal["last_turn", "conversation"] = "last_turn"
    """What the reward function (and an interaction's reward) reads as the response: the final model turn's text, or
    the whole conversation after the prompt (model and tool turns, special tokens skipped), as verl scores it."""
    tools: list[str] = field(default_factory=list)
    """Built-in tools when no interaction file is given: "calculator" (ast arithmetic), "python" (a subprocess
    sandbox: time/memory limits, a temporary folder as cwd; the network and the file system are NOT isolated)."""
    max_turns: int = 4
    """Model turns per conversation at most (a tool call in the last one is not run); 0: no limit but the token
    budget (verl's max_assistant_turns=null)."""
    max_response_tokens: int = 512
    """Token budget of a whole response: the model's turns and the tool turns together. Each model turn is also
    capped at rollout.max_new_tokens."""
    tool_timeout_s: float = 10.0
    """Time limit of one tool call (from its submission); a late call answers with an error message."""
    max_tool_output_chars: int = 2000
    """A tool's answer is cut to this many characters before it is tokenized."""
    tool_output_truncate_side: Literal["left", "right", "middle"] = "left"
    """Which part of a longer answer is kept, as verl says it: left, its start (then "...(truncated)"); right, its
    end; middle, half of each."""
    num_tool_workers: int = 16
    """Threads running tool calls concurrently."""
    overlap_tools: bool = False
    """Run each conversation's tool the moment its turn ends, while the other conversations decode, and
    put its next turn into the running batch when the answer is in (rollout.backend=fast only). Off: turns go
    in rounds, a round's tools run together between two generate calls. On, the sampled tokens depend on when
    the tools answer, so a run is not bit-reproducible from its seed."""
    tool_turn_template: str = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    """The text inserted after a call, `{output}` the tool's answer; tokenized once, loss mask 0. The default is
    Qwen2.5/Hermes ChatML: it closes the assistant's turn (which stopped at `call_end`), adds the tool's answer as
    a turn, and opens the next assistant turn."""
    call_start: str = "<tool_call>"
    """The marker that opens a tool call in the model's text."""
    call_end: str = "</tool_call>"
    """The marker that closes a tool call; a stop string of every model turn."""

    def validate(self, prefix: str) -> None:
        builtin = ("calculator", "python")  # shardrl.tools.BUILTIN_TOOLS
        bad = [t for t in self.tools if t not in builtin]
        require(self, prefix, "tools", not bad, f"unknown built-in tool(s) {bad}; choose from {list(builtin)}")
        require(self, prefix, "enable", not self.enable or bool(self.interaction_path or self.tools
                                                              or self.tool_config_path),
                "multi-turn rollouts need tools: set rollout.multi_turn.tools (e.g. [calculator]), "
                "rollout.multi_turn.interaction_path (a Python file defining an Interaction) or "
                "rollout.multi_turn.tool_config_path (verl's tool config)")
        require(self, prefix, "tool_config_path", not (self.tool_config_path and self.interaction_path),
                "and interaction_path both define the tools; set one of them")
        require(self, prefix, "max_calls_per_turn", self.max_calls_per_turn >= 1, "must be >= 1")
        require(self, prefix, "max_calls_per_turn", self.max_calls_per_turn == 1 or not self.overlap_tools,
                "must be 1 with overlap_tools=true (a turn there ends at its first call); set one of them back")
        require(self, prefix, "max_turns", self.max_turns >= 0, "must be >= 0 (0: no limit but max_response_tokens)")
        require(self, prefix, "max_response_tokens", self.max_response_tokens >= 1, "must be >= 1")
        require(self, prefix, "tool_timeout_s", self.tool_timeout_s > 0, "must be > 0 (seconds)")
        require(self, prefix, "max_tool_output_chars", self.max_tool_output_chars >= 1, "must be >= 1")
        require(self, prefix, "num_tool_workers", self.num_tool_workers >= 1, "must be >= 1")
        require(self, prefix, "tool_turn_template", "{output}" in self.tool_turn_template,
                "must hold the placeholder {output} (where the tool's answer goes)")
        require(self, prefix, "call_end", bool(self.call_end), "must be a non-empty string (it ends a model turn)")


@dataclass
class AgentConfig:
    """Agent episodes (`shardrl.rollout.episodes.agent`): the user's async function runs each episode against an
    OpenAI-compatible endpoint served from the run's rollout; the trajectory is assembled token-exact from what
    the endpoint sampled (the model's tokens trained, everything else masked)."""

    entrypoint: str | None = None
    """`path/to/agent.py:run`: `async def run(sample, client) -> float | None`, where `sample` is the prompt row
    (`prompt`: the data's prompt, a string or chat messages; `data_source`; `extra`) and `client` an
    `openai.AsyncOpenAI` pointed at the run's endpoint (model name `policy`). It returns the episode's reward, or
    None to leave it to the reward function (which scores the last reply). Null: no agent."""
    timeout_s: float = 300.0
    """An episode running longer fails (scored `failure_reward`)."""
    failure_reward: float = 0.0
    """The reward of an episode that raised, timed out, returned something other than a number or None, or never
    called the model."""
    max_concurrency: int = 256
    """Episodes running at once (per rank)."""
    max_response_tokens: int = 1024
    """An episode's trajectory after its first prompt, in tokens (the model's and the rest); longer is cut."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "entrypoint", self.entrypoint is None or (":" in self.entrypoint and
                                                                       self.entrypoint.split(":", 1)[0].endswith(".py")),
                "must be 'path/to/file.py:function'")
        require(self, prefix, "timeout_s", self.timeout_s > 0, "must be > 0 (seconds)")
        require(self, prefix, "max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        require(self, prefix, "max_response_tokens", self.max_response_tokens >= 1, "must be >= 1")


@dataclass
class ValSamplingConfig:
    """How validation samples (verl's rollout.val_kwargs): greedy and one response per prompt by default."""

    n: int = 1
    """Responses per validation prompt; with n > 1 validation logs mean@n and pass@n per data source."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy (then n > 1 repeats one response)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 is off."""
    top_k: int = 0
    """Top-k sampling; 0 is off."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "n", self.n >= 1, "must be >= 1")
        require(self, prefix, "temperature", self.temperature == 0 or 1e-5 <= self.temperature <= 1e4,
                "must be 0 (greedy) or in [1e-5, 1e4]")
        require(self, prefix, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        require(self, prefix, "top_k", 0 <= self.top_k < 2**31, "must be in [0, 2**31) (0 = off)")


@dataclass
class RolloutConfig:
    backend: Literal["hf", "fast"] | None = None
    """Generation engine: HF `generate`, or the static-KV-cache fast engine (Llama/Qwen2-style models).
    null = by device, resolved once when a run starts (`shardrl.plan.defaults`): fast on CUDA when it
    supports the model (bench/RESULTS.md, "Current figures: Fast rollout"), hf otherwise and on CPU."""
    n: int = 4
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 is off."""
    top_k: int = 0
    """Top-k sampling; 0 is off."""
    max_new_tokens: int = 32
    """Response length limit in tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (besides EOS)."""
    seed: int = 0
    """Seed of sampling."""
    micro_batch_size: int = 64
    """Prompts per generate call (hf); with `fast`, prompts x n sets the decode slots unless max_batch does."""
    max_batch: int | None = None
    """fast backend: decode slots (rows decoded together; a finished row's slot goes to a waiting one)."""
    kv_cache_tokens: int | None = None
    """fast backend: the KV cache's positions in all (null: every slot's longest row, max_batch x the longest
    prompt + response). Rows are admitted while the free blocks hold them at their longest; set it to give many
    slots (a served agent's, each allowed a long context) a cache sized for what the rows really hold."""
    sync_every: int = 16
    """fast backend: decode steps between host syncs (which retire finished rows and admit waiting ones)."""
    compile: bool | None = None
    """fast backend: run the layer's parts around attention (decode and prefill) and the torch sampler through
    `torch.compile`; null = on CUDA (faster there: bench/RESULTS.md, "Current figures: Decode step"), off elsewhere."""
    attention: Literal["auto", "triton", "sdpa"] = "auto"
    """fast backend: decode attention. triton (CUDA) reads each row's cache up to its length; sdpa reads a
    padded common length with a mask; auto = triton where it applies."""
    sampler: Literal["auto", "triton", "torch"] = "auto"
    """fast backend: triton (CUDA) samples in one pass over the logits with noise drawn in the kernel
    (top-k/top-p still sort in torch); auto = triton where the triton attention runs."""
    prefix_cache: bool = True
    """fast backend: a finished row's full KV blocks stay indexed by their tokens, so a later prompt that starts
    with them (a conversation's next turn, an agent's next call, the samples of a prompt admitted later) prefills
    only what follows (`shardrl.rollout.fast.paged`; new weights forget them). In bf16 a prefix read from the cache
    differs by rounding from one prefilled again, so the tokens can depend on what earlier calls cached; false
    prefills every prompt whole (a prompt's n samples still share its blocks). The hf backend keeps no cache across
    calls (verl's rollout.enable_prefix_caching)."""
    cascade: bool = True
    """fast backend, Triton attention: the n samples of a prompt read the K/V blocks of their shared prompt once a
    decode step, together, instead of once per sample (`shardrl.rollout.fast.decode_kernel`; the same tokens up to
    rounding: in bf16 a sum in another order can part sampled paths)."""
    free_cache_engine: bool | None = None
    """CUDA, rollout and training on the same GPUs: free the rollout's KV cache and CUDA graphs while the
    actor trains, and rebuild them before the next generation (a cost per step: bench/RESULTS.md, "Current
    figures: Whole step settings"; the allocator's cached blocks go back to the driver with them). null: free
    them only when the memory ledger (`shardrl plan`) says that the update's peak plus the cache would not fit in 85% of the GPU."""
    lora_sync: Literal["unmerged", "merged", "full"] | None = None
    """With model.lora, a colocated fast rollout: after an update only the adapters move (tensor by tensor, no
    gather of the base). unmerged: the rollout adds scale * B (A x) at run time and reads the trainer's frozen
    base itself where it sits whole on the GPU (one GPU, or fsdp_size=1; else a copy sent once), so the base
    is held once; merged: base + scale * B @ A is written into the rollout's own weights (a second copy of the
    model, the plain decode step); full: the merged model is exported whole after every update, as without
    LoRA (also what the hf backend and a disaggregated rollout get). null: merged where the memory ledger says
    the copy fits (7B on one H200 decoded 1.6x faster so), else unmerged (32B on one H200 fits only so);
    unmerged on CPU. Measured: bench/RESULTS.md, "LoRA"."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools (off by default)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent episodes through an OpenAI-compatible endpoint (off by default)."""
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampling of validation (greedy, n=1 by default)."""

    def fast_only_keys(self) -> list[str]:
        """The fast-backend-only keys set away from their defaults."""
        unset = {"max_batch": (None,), "kv_cache_tokens": (None,), "compile": (None,), "attention": ("auto",),
                 "sampler": ("auto",), "lora_sync": (None, "full")}  # full: what the hf backend does anyway
        keys = [k for k, defaults in unset.items() if getattr(self, k) not in defaults]
        return keys + (["multi_turn.overlap_tools"] if self.multi_turn.overlap_tools else [])

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_batch", self.max_batch is None or self.max_batch >= 1, "must be >= 1 or null")
        require(self, prefix, "sync_every", self.sync_every >= 1, "must be >= 1")
        require(self, prefix, "kv_cache_tokens", self.kv_cache_tokens is None or self.kv_cache_tokens >= 1,
                "must be >= 1 or null")
        for key in self.fast_only_keys() if self.backend == "hf" else ():  # null: checked once resolved
            require(self, prefix, key, False, "applies to backend=fast only; set rollout.backend=fast or drop it")
        require(self, prefix, "n", self.n >= 1, "must be >= 1")
        require(self, prefix, "temperature", self.temperature == 0 or 1e-5 <= self.temperature <= 1e4,
                "must be 0 (greedy) or in [1e-5, 1e4]")
        require(self, prefix, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        require(self, prefix, "top_k", 0 <= self.top_k < 2**31, "must be in [0, 2**31) (0 = off)")
        require(self, prefix, "max_new_tokens", self.max_new_tokens >= 1, "must be >= 1")
        require(self, prefix, "micro_batch_size", self.micro_batch_size >= 1, "must be >= 1")
        require(self, prefix, "agent", not (self.agent.entrypoint and self.multi_turn.enable),
                "and multi_turn both run the episodes; set rollout.agent.entrypoint or rollout.multi_turn.enable")


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt files (parquet / jsonl) to train on."""
    val_files: list[str] = field(default_factory=list)
    """Prompt files to validate on."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string or a chat message list)."""
    max_prompt_length: int = 256
    """Prompt length limit in tokens."""
    truncation: Literal["error", "drop", "left", "right"] = "drop"
    """Over-long prompts: raise, drop the row, or cut tokens from the left / right."""
    skip_bad_rows: bool = False
    """Skip (and count) rows without a usable prompt instead of raising."""
    train_batch_size: int = 8
    """Prompts per training step (global)."""
    val_batch_size: int | None = None
    """Prompts per validation round over all ranks (ceil(this / dp) per rank: weight sync, greedy generation and
    scoring); None takes the whole validation set in one round. The rollout still cuts a round into generate
    calls of `rollout.micro_batch_size` prompts."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 0
    """Seed of the shuffle."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_prompt_length", self.max_prompt_length >= 1, "must be >= 1")
        require(self, prefix, "train_batch_size", self.train_batch_size >= 1, "must be >= 1 (prompts)")
        require(self, prefix, "val_batch_size", self.val_batch_size is None or self.val_batch_size >= 1,
                "must be >= 1 or null")


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong reward shaping: add a soft length penalty to each response's reward."""
    len: int = 16
    """Tokens before the length limit over which the penalty grows from 0 to -penalty_factor (reached by a
    response cut at the limit). The limit is rollout.max_new_tokens; for multi-turn rollouts, the conversation's
    budget rollout.multi_turn.max_response_tokens (model and tool tokens together, not the per-turn limit)."""
    penalty_factor: float = 1.0
    """The penalty at the limit."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "len", self.len >= 1, "must be >= 1 (tokens)")
        require(self, prefix, "penalty_factor", self.penalty_factor >= 0, "must be >= 0")


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling: drop the groups (a prompt's rollout.n responses) whose rewards are all equal
    (no advantage, no gradient) and generate more batches until the step has data.train_batch_size informative
    groups. Logs dynamic_sampling/num_gen_batches (batches drawn) and dynamic_sampling/informative_frac."""
    max_num_gen_batches: int = 10
    """At most this many batches drawn per step; if they hold too few informative groups, the step tops up
    with uninformative ones (zero advantage under GRPO/RLOO) and counts them in dynamic_sampling/num_filler_groups."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_num_gen_batches", self.max_num_gen_batches >= 1, "must be >= 1 (batches per step)")


@dataclass
class RewardConfig:
    function_path: str | None = None
    """Python file defining the reward function; None uses the built-in rule-based scorers."""
    function_name: str = "compute_score"
    """Name of the reward function in `function_path`."""
    reward_kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the reward function on every call (verl's custom_reward_function.reward_kwargs),
    e.g. {method: flexible}; the function must take them."""
    model_path: str | None = None
    """Reward model folder (a *ForSequenceClassification with one label, same tokenizer as the policy),
    scored through a forward-only engine, instead of a function."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine of the reward model (forward only)."""
    num_workers: int = 0
    """Processes (per rank) that score samples in parallel, for slow reward functions; 0 scores in the training
    process. Each worker imports the reward file itself."""
    timeout_s: float | None = None
    """Time limit of one sample's reward, in seconds: past it the sample scores like a failing one (on_error_score,
    counted in reward/num_errors and reward/num_timeouts) and its worker is replaced. Scores in worker processes
    (at least one, whatever num_workers says); None: no limit."""
    on_error_score: float = 0.0
    """Score given when the reward function raises on a sample (or returns no finite float32 number); a step
    where it fails on every sample of every rank stops the run with the first failure."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong penalty (verl's reward_model.overlong_buffer), `shardrl.algos.dapo`."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of every response cut at the length limit (it never ended: no end of sequence,
    no stop string), TRL's name. A reward model trained on finished replies has never seen the last token of a
    cut one, and RL learns to write to the limit when that token scores well; None: no penalty."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "model_path", not (self.model_path and self.function_path),
                "cannot be set together with reward.function_path; choose a reward model or a function")
        require(self, prefix, "num_workers", self.num_workers >= 0, "must be >= 0 (0: score in the training process)")
        require(self, prefix, "timeout_s", self.timeout_s is None or self.timeout_s > 0, "must be > 0 (seconds) or null")
        require(self, prefix, "num_workers", not (self.model_path and (self.num_workers or self.timeout_s)),
                "and reward.timeout_s apply to reward functions; a reward model (reward.model_path) scores on the "
                "GPU: drop them")
        require(self, prefix, "reward_kwargs", not self.reward_kwargs or bool(self.function_path),
                "is passed to your reward function only; set reward.function_path too, or drop reward_kwargs")
        require(self, prefix, "missing_eos_penalty", self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
                "must be >= 0 (it is subtracted) or null")


@dataclass
class AlgorithmConfig:
    adv_estimator: EstimatorName = "grpo"
    """How advantages are estimated (`shardrl.algos.ADVANTAGE_ESTIMATORS`); "gae" needs the critic."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False is Dr. GRPO)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract a KL(policy || ref) penalty from the token rewards."""
    kl_penalty: KLEstimator = "k1"
    """KL estimator of the in-reward penalty (names as `actor.kl_loss_type`)."""
    kl_coef: float = 0.001
    """Weight of the in-reward KL penalty (initial value when adaptive)."""
    kl_target: float | None = None
    """Target KL of the adaptive controller; None keeps `kl_coef` fixed."""
    kl_horizon: int = 10000
    """Horizon of the adaptive KL controller, in samples."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (verl's algorithm.filter_groups); needs a group baseline (grpo, rloo, ...)."""
    rollout_is: bool = False
    """Correct for the rollout-training mismatch (the sampler's log-probs differ from the trainer's, e.g. bf16
    fast rollout): weight each token's policy loss by pi_trainer(old) / pi_sampler, detached
    (`shardrl.algos.rollout_correction`). In truncate mode with actor.recompute_old_log_probs=auto's shortcut
    (one mini-batch, one epoch) the weights come from the update's own forward; mask mode needs the old
    log-probs before the update, so it turns the shortcut off. Mismatch metrics (rollout/logprob_abs_diff, _max, rollout/kl
    per sequence, rollout/k3_kl) are logged either way; with this on also rollout_is/weight_mean,
    rollout_is/truncated_frac and rollout_is/masked_frac."""
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token"
    """"token": a ratio per token (TIS); "sequence": the product of a sequence's token ratios; "geometric":
    their geometric mean (length-independent); the sequence levels put one weight on all of a sequence's tokens."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """"truncate": cap the weights at rollout_is_threshold; "mask": drop from the loss (MIS, rejection) the
    tokens (level token) or whole sequences whose weight leaves [rollout_is_threshold_lower, rollout_is_threshold]."""
    rollout_is_threshold: float = 2.0
    """The cap (truncate) or upper bound of the band (mask)."""
    rollout_is_threshold_lower: float | None = None
    """The lower bound of the band (mask); null is 1 / rollout_is_threshold."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "gamma", 0 <= self.gamma <= 1, "must be in [0, 1]")
        require(self, prefix, "lam", 0 <= self.lam <= 1, "must be in [0, 1]")
        require(self, prefix, "kl_coef", self.kl_coef >= 0, "must be >= 0")
        require(self, prefix, "kl_target", self.kl_target is None or self.kl_target > 0, "must be > 0 or null")
        require(self, prefix, "kl_horizon", self.kl_horizon >= 1, "must be >= 1")
        require(self, prefix, "rollout_is_threshold", self.rollout_is_threshold > 1, "must be > 1 (e.g. 2.0)")
        lower = self.rollout_is_threshold_lower
        require(self, prefix, "rollout_is_threshold_lower", lower is None or 0 <= lower < 1,
                "must be in [0, 1) or null (1 / rollout_is_threshold)")


@dataclass
class AsyncConfig:
    """Disaggregated, asynchronous RL (shardrl.trainer.async_rl): some ranks only generate, the others only
    train, and generation runs ahead of training within a staleness bound."""

    rollout_ranks: int = 0
    """Ranks (processes, GPUs) that only generate: the last `rollout_ranks` of the world; the others train
    (FSDP/HSDP/sp as configured, over their own ranks). 0 = colocated: every rank generates and trains in
    turn, synchronously."""
    max_staleness: int = 0
    """How many updates behind the policy being trained the policy that generated a batch is: the batch of
    step k is generated with the weights of update max(k - max_staleness, first). 0 = the rollout waits for
    the newest weights (the synchronous run's numbers, on separate ranks); 1 = one-step off-policy
    (generating step k+1 while step k trains); 2+ = a deeper queue. Needs algorithm.rollout_is (the sampler's
    log-probs as the behaviour policy) when > 0."""
    weight_bucket_mb: int = 256
    """Weights stream to the rollout ranks in buckets of about this many MiB (one broadcast each)."""
    partial_rollout: bool = False
    """Weights that the training ranks push while a rollout rank generates are loaded at once, between two
    decode steps (the fast engine's host syncs; every step with rollout.backend=hf), instead of after the
    generate call: responses in flight continue under the new weights (their KV cache so far is kept), and
    each token records the version that sampled it (`token_version`; the batch's `policy_version` is each
    response's first). The training ranks then wait less for the rollout to take the weights. Needs
    max_staleness >= 1 to change anything (at 0 the rollout never generates while weights are pushed)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "rollout_ranks", self.rollout_ranks >= 0,
                "must be >= 0 (0 = colocated; k = the last k ranks only generate)")
        require(self, prefix, "max_staleness", self.max_staleness >= 0, "must be >= 0 (0 = on-policy)")
        require(self, prefix, "max_staleness", self.max_staleness == 0 or self.rollout_ranks >= 1,
                "needs rollout ranks of its own to generate ahead of training: set async_rl.rollout_ranks >= 1 "
                "(e.g. 1 of 2 GPUs), or max_staleness=0")
        require(self, prefix, "weight_bucket_mb", self.weight_bucket_mb >= 1, "must be >= 1 (MiB)")
        require(self, prefix, "partial_rollout", not self.partial_rollout or self.rollout_ranks >= 1,
                "needs rollout ranks of their own (weights change under a running rollout only there): set "
                "async_rl.rollout_ranks >= 1, or partial_rollout=false")


@dataclass
class TrainerConfig:
    total_steps: int | None = 20
    """Training steps (one rollout batch and its updates each); null with total_epochs."""
    total_epochs: int | None = None
    """Passes over the training prompts: the run stops after total_epochs x the steps of one epoch (prompts //
    data.train_batch_size; an epoch's last, short batch is dropped), or at total_steps if that is set too and
    comes first (verl's rule)."""
    output_dir: str | None = None
    """Run folder (config, metrics, checkpoints); None is ./outputs/<experiment_name>/<timestamp>, or with
    resume=auto the newest such folder that has checkpoints."""
    save_freq: int = 0
    """Checkpoint every this many steps; 0 never."""
    export_hf: bool = False
    """At the end of training, write the actor as a Hugging Face model folder, `<run_dir>/hf_model` (weights in
    `model.dtype`, config, tokenizer): what `from_pretrained`, another run's `model.path` or an evaluation loads."""
    export_lora_adapter: bool = False
    """With model.lora: at the end of training, also write the adapters as a peft adapter folder,
    `<run_dir>/lora_adapter` (`PeftModel.from_pretrained(base, folder)` loads it; export_hf writes the merged
    model)."""
    keep_last: int = 2
    """Checkpoints kept on disk; 0 keeps all."""
    resume: Literal["auto", "never"] | str = "never"
    """Where to start: "auto" (latest checkpoint in output_dir, if any), "never" (fresh), or a checkpoint path."""
    val_freq: int = 0
    """Validate every this many steps; 0 never."""
    val_before_train: bool = False
    """Validate once before the first step (logged as step 0) when data.val_files is given; a resumed run does not."""
    log_val_generations: int = 3
    """Sample generations (prompt, response, reward, ground truth) shown per validation, on the console
    and in `<run_dir>/generations.jsonl` (one line each, with the step); rank 0's first ones. 0 = off."""
    logger: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks."""
    verl_metric_names: bool = False
    """Log each step's metrics under verl's names too (`critic/score/mean`, `response_length/mean`,
    `timing_s/gen`, `timing_per_token_ms/*`, `val-core/<data_source>/reward/mean@n`, ...; `shardrl.compat.verl.metric_names`),
    so that a verl dashboard reads the run; `shardrl train --verl` turns it on."""
    project_name: str = "shardrl"
    """Project name for loggers that group runs."""
    experiment_name: str = "run"
    """Name of this run in the loggers."""
    nnodes: int = 1
    """Nodes the run spans (torchrun --nnodes)."""
    nproc_per_node: int = 1
    """Processes (GPUs) per node (torchrun --nproc-per-node)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run; "auto" picks CUDA when present."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "total_steps", self.total_steps is not None or self.total_epochs is not None,
                "must be set (>= 1), or trainer.total_epochs")
        require(self, prefix, "total_steps", self.total_steps is None or self.total_steps >= 1, "must be >= 1")
        require(self, prefix, "total_epochs", self.total_epochs is None or self.total_epochs >= 1, "must be >= 1 or null")
        require(self, prefix, "save_freq", self.save_freq >= 0, "must be >= 0 (0 = never)")
        require(self, prefix, "keep_last", self.keep_last >= 0, "must be >= 0 (0 = keep all)")
        require(self, prefix, "resume", bool(self.resume), 'must be "auto", "never" or a checkpoint path')
        require(self, prefix, "resume", self.resume in ("auto", "never") or self.resume.lower() not in ("auto", "never"),
                f'is read as a checkpoint path; did you mean "{self.resume.lower()}"? (the values are lower case)')
        require(self, prefix, "val_freq", self.val_freq >= 0, "must be >= 0 (0 = never)")
        require(self, prefix, "log_val_generations", self.log_val_generations >= 0, "must be >= 0 (0 = off)")
        require(self, prefix, "nnodes", self.nnodes >= 1, "must be >= 1")
        require(self, prefix, "nproc_per_node", self.nproc_per_node >= 1, "must be >= 1")


KEY_ALIASES = {
    "learning_rate": "lr", "max_grad_norm": "clip_grad", "grad_clip": "clip_grad", "clip_grad_norm": "clip_grad",
    "adam_epsilon": "eps", "epsilon": "eps", "adam_betas": "betas", "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule", "scheduler": "lr_schedule", "num_warmup_steps": "warmup_steps",
    "lr_warmup_steps": "warmup_steps", "lr_warmup_steps_ratio": "warmup_ratio", "max_steps": "total_steps",
    "total_training_steps": "total_steps", "num_train_epochs": "total_epochs", "epochs": "total_epochs",
    "save_steps": "save_freq", "eval_steps": "val_freq", "test_freq": "val_freq", "save_total_limit": "keep_last",
    "per_device_train_batch_size": "micro_batch_size_per_gpu",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size_per_gpu", "r": "rank", "lora_rank": "rank",
    "lora_alpha": "alpha", "lora_dropout": "dropout", "max_seq_length": "max_length", "max_seq_len": "max_length",
    "model_name_or_path": "path", "enable_gradient_checkpointing": "gradient_checkpointing",
}
"""Names other frameworks (Hugging Face's Trainer, TRL, peft, verl) give a key of ours, by its last part: an unknown
key's error suggests ours in the same section (`actor.optim.learning_rate` -> `actor.optim.lr`), where spelling
alone would point elsewhere (`clip_grad`)."""


class _Command:
    """What the config of each training command (`COMMAND_CONFIGS`) shares."""

    key_aliases = KEY_ALIASES
    validates_before_train = False
    """Whether trainer.val_before_train is read (`shardrl train` only)."""

    @classmethod
    def other_command_hint(cls, path: str, data: dict) -> str | None:
        """For a file the loader refused: when its top-level keys are another command's (a `shardrl dpo` file given
        to `shardrl train` has engine, optim and dpo), which command reads it and how to run it; else None."""
        names = {str(k) for k in data}
        mine = {f.name for f in dataclasses.fields(cls)}
        if names <= mine:
            return None
        fits = [c for c, other in COMMAND_CONFIGS.items()
                if other is not cls and names <= {f.name for f in dataclasses.fields(other)}]
        whole = [c for c in fits if not unknown_keys(COMMAND_CONFIGS[c], data)]  # rm.yaml: dpo and rm, not sft
        if not (fits := whole or fits):
            return None
        named = set(re.split(r"[^a-z]+", os.path.basename(path).lower()))
        first, *others = sorted(fits, key=lambda c: c not in named)  # rm.yaml fits sft, dpo and rm: rm first
        this = next(c for c, other in COMMAND_CONFIGS.items() if other is cls)
        foreign = sorted(names - mine)
        plan = "" if first == "train" else f" --trainer {first}"
        also = f" (or {', '.join(f'`shardrl {c}`' for c in others)})" if others else ""
        return (f"config file {path!r} looks like a `shardrl {first}`{also} config, not a "
                f"`shardrl {this}` one ({', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} no "
                f"`shardrl {this}` key{'' if len(foreign) == 1 else 's'}): run it with `shardrl {first} {path}`, "
                f"or plan it with `shardrl plan {path}{plan}`")

    def ignored_settings(self) -> list[str]:
        """Settings this config gives that nothing will read, each as a line to warn with (a run goes on)."""
        lines = []
        validates = self.trainer.val_freq or (self.trainer.val_before_train and self.validates_before_train)
        if self.data.val_files and not validates:
            lines.append(f"data.val_files={self.data.val_files} is never read: trainer.val_freq=0 turns validation "
                         "off (set trainer.val_freq to validate every that many steps)")
        if validates and not self.data.val_files:
            given = (f"trainer.val_freq={self.trainer.val_freq}" if self.trainer.val_freq
                     else "trainer.val_before_train=true")
            lines.append(f"{given} is never used: data.val_files is empty, so there is nothing to validate on (give "
                         "data.val_files=[...] to validate)")
        lora, off = self.model.lora, LoRAConfig()
        if not lora.rank:
            given = [f"model.lora.{k}" for k in ("alpha", "dropout", "target_modules", "use_rslora")
                     if getattr(lora, k) != getattr(off, k)]
            if given:
                lines.append(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but model.lora.rank=0: "
                             "LoRA is off and every weight trains (set model.lora.rank to train adapters)")
        default_budget = EngineConfig().max_token_len_per_gpu
        seen = set()
        for key, engine in self.engines():
            setting = (engine.use_dynamic_bsz, engine.max_token_len_per_gpu)
            if engine.use_dynamic_bsz or engine.max_token_len_per_gpu == default_budget or setting in seen:
                continue  # (a role that took the actor's engine settings is the actor's line)
            seen.add(setting)
            lines.append(f"{key}.max_token_len_per_gpu={engine.max_token_len_per_gpu} is never read: it is the token "
                         f"budget of dynamic micro-batches, and {key}.use_dynamic_bsz=false cuts micro-batches by "
                         f"{key}.micro_batch_size_per_gpu={engine.micro_batch_size_per_gpu} samples instead (set "
                         f"{key}.use_dynamic_bsz=true to cut them by tokens)")
        return lines

    def engines(self) -> list[tuple[str, EngineConfig]]:
        """Each engine section of this config and its key."""
        return [("engine", self.engine)]


@dataclass
class Config(_Command):
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (and tokenizer)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (GAE only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and batch size."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function or model."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and in-reward KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, checkpoints, logging, launch."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Disaggregated placement and asynchronous (off-policy) generation."""

    @staticmethod
    def unknown_key_hint(key: str) -> str | None:
        """The native key for a verl name (`trainer.test_freq` -> `trainer.val_freq`), for the unknown-key error."""
        from shardrl.compat.verl.translate import native_hint

        return native_hint(key)

    INHERITED = {"ref": ("engine",), "critic": ("engine", "ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "shuffle"),
                 "reward": ("engine",)}
    """What a role takes from the actor unless set for it (verl's `oc.select` defaults): every engine setting
    (dtype, micro-batching, dynamic batches, sharding, offload, sequence parallel) and the critic's loop."""

    def inherit(self, given: set[str]) -> None:
        """Let total_epochs alone decide the run's length unless total_steps is given too; fill each role's `INHERITED` settings that `given` (the keys the file and overrides set) does not name
        from the actor's: with an fp32 actor the reference computes in fp32 too, so the on-policy KL is 0."""
        epochs_decide(self.trainer, given)
        for role, names in self.INHERITED.items():
            section = getattr(self, role)
            for name in names:
                value = getattr(self.actor, name)
                if name == "engine":
                    for f in dataclasses.fields(EngineConfig):
                        if f"{role}.engine.{f.name}" not in given:
                            setattr(section.engine, f.name, copy.deepcopy(getattr(value, f.name)))
                elif f"{role}.{name}" not in given:
                    setattr(section, name, value)

    validates_before_train = True

    def engines(self) -> list[tuple[str, EngineConfig]]:
        return [(f"{role}.engine", getattr(self, role).engine) for role in ("actor", "ref", "critic", "reward")]

    def ignored_settings(self) -> list[str]:
        lines = super().ignored_settings()
        mt = self.rollout.multi_turn
        if not mt.enable and (mt.tools or mt.interaction_path or mt.tool_config_path):
            given = ("rollout.multi_turn.tools" if mt.tools else "rollout.multi_turn.interaction_path"
                     if mt.interaction_path else "rollout.multi_turn.tool_config_path")
            lines.append(f"{given} is set but rollout.multi_turn.enable=false: the rollout is single-turn and uses no "
                         "tools (set rollout.multi_turn.enable=true)")
        return lines

    def validate(self, prefix: str) -> None:
        require(self, prefix, "trainer.export_lora_adapter", not self.trainer.export_lora_adapter
                or self.model.lora.rank > 0, "needs model.lora.rank > 0 (there are no adapters to write)")
        if self.model.lora.rank > 0:  # (the engine refuses these too; here `shardrl plan` does, before any ledger)
            require(self, prefix, "actor.engine.strategy", self.actor.engine.strategy == "fsdp2",
                    "must be fsdp2 with model.lora (FSDP1's flat parameters cannot hold a frozen base beside "
                    "trained adapters)")
            require(self, prefix, "actor.engine.offload_params", not self.actor.engine.offload_params,
                    "is not supported with model.lora (the frozen base is stored in param_dtype already, half an fp32 "
                    "model): set it false")
        for role in ("actor", "ref", "critic"):
            require(self, prefix, "model.load_weights", self.model.load_weights != "random_shards"
                    or getattr(self, role).engine.strategy == "fsdp2",
                    f"random_shards needs FSDP2 (each rank draws its own shards); {role}.engine.strategy is fsdp")
        require(self, prefix, "rollout.lora_sync", self.rollout.lora_sync in (None, "full")
                or self.async_rl.rollout_ranks == 0, "unmerged and merged sync a colocated rollout; rollout ranks of "
                "their own (async_rl.rollout_ranks > 0) receive the merged model whole: set full or drop it")
        batch = self.data.train_batch_size
        estimator = ADVANTAGE_ESTIMATORS[self.algorithm.adv_estimator]
        for section in ("actor", "critic") if estimator.needs_critic else ("actor",):
            mini = getattr(self, section).ppo_mini_batch_size
            require(self, prefix, f"{section}.ppo_mini_batch_size", mini <= batch and batch % mini == 0,
                    f"must divide data.train_batch_size={batch} (both count prompts); nearest valid: "
                    f"{nearest(mini, divisors(batch))}")
        group_baseline = [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.group_baseline]
        require(self, prefix, "rollout.n", not estimator.group_baseline or self.rollout.n >= 2,
                f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} compares responses within a prompt's "
                "group, so it needs rollout.n >= 2")
        require(self, prefix, "algorithm.filter_groups.enable",
                not self.algorithm.filter_groups.enable or estimator.group_baseline,
                f"drops groups whose rewards are all equal, which only a group baseline ({', '.join(group_baseline)}) "
                f"leaves without advantage; set algorithm.adv_estimator to one, or filter_groups.enable=false")
        if self.async_rl.rollout_ranks:
            require(self, prefix, "async_rl.partial_rollout", not (self.async_rl.partial_rollout
                                                               and self.rollout.multi_turn.enable),
                    "is not supported with rollout.multi_turn.enable (weights change between generate calls "
                    "only there, i.e. between turns); set one of them to false")
            require(self, prefix, "algorithm.filter_groups.enable", not self.algorithm.filter_groups.enable,
                    "dynamic sampling is not supported with async_rl.rollout_ranks > 0 (the rollout ranks generate "
                    "one batch per step); set filter_groups.enable=false or async_rl.rollout_ranks=0")
            require(self, prefix, "trainer.val_freq", self.trainer.val_freq == 0 or not self.data.val_files,
                    "validation is not supported with async_rl.rollout_ranks > 0 (the training ranks hold no "
                    "rollout); set trainer.val_freq=0 or async_rl.rollout_ranks=0")
        require(self, prefix, "trainer.total_epochs", self.trainer.total_epochs is None or not self.async_rl.rollout_ranks,
                "is not supported with async_rl.rollout_ranks > 0 (the rollout ranks do not read the training set); "
                "set trainer.total_steps")
        require(self, prefix, "algorithm.rollout_is", self.async_rl.max_staleness == 0 or self.algorithm.rollout_is,
                f"async_rl.max_staleness={self.async_rl.max_staleness} trains on samples of an older policy: set "
                "algorithm.rollout_is=true so the loss weighs them by the sampler's log-probs (the behaviour "
                "policy), or async_rl.max_staleness=0")
        ob, mt = self.reward.overlong_buffer, self.rollout.multi_turn
        # the limit a response is shaped against: a conversation's budget for multi-turn rollouts
        limit_key, limit = (("rollout.multi_turn.max_response_tokens", mt.max_response_tokens) if mt.enable
                            else ("rollout.max_new_tokens", self.rollout.max_new_tokens))
        require(self, prefix, "reward.overlong_buffer.len", not ob.enable or ob.len <= limit,
                f"must be <= {limit_key}={limit} (the penalty spans the last len tokens before it); lower it or "
                f"raise {limit_key}")


def epochs_decide(trainer: TrainerConfig, given: set[str]) -> None:
    """With trainer.total_epochs and no total_steps given, the epochs alone decide the run's length (total_steps'
    default does not cap them)."""
    if trainer.total_epochs is not None and "trainer.total_steps" not in given:
        trainer.total_steps = None


class _OfflineRunLength(_Command):
    def inherit(self, given: set[str]) -> None:
        epochs_decide(self.trainer, given)


@dataclass
class OfflineDataConfig:
    """The data of an offline trainer (`shardrl sft`, `dpo`, `rm`): rows from files, a fixed number a step."""

    train_files: list[str] = field(default_factory=list)
    """Files of rows (parquet / jsonl / json)."""
    val_files: list[str] = field(default_factory=list)
    """Files whose loss (and, for pairs, accuracy) is reported as val/* every trainer.val_freq steps."""
    max_length: int = 1024
    """Tokens of one sequence at most (prompt and completion; each of a pair's two)."""
    truncation: Literal["error", "drop", "right"] = "error"
    """A sequence over max_length: raise, drop the row, or cut it on the right."""
    skip_bad_rows: bool = False
    """Drop (and count) rows that cannot be trained on instead of raising."""
    batch_size: int = 32
    """Rows per optimizer step (global: conversations, or preference pairs); the engine cuts them into
    micro-batches."""
    shuffle: bool = True
    """Shuffle the rows each epoch."""
    seed: int = 0
    """Seed of the shuffle."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_length", self.max_length >= 2, "must be >= 2")
        require(self, prefix, "batch_size", self.batch_size >= 1, "must be >= 1 (rows)")


@dataclass
class SFTDataConfig(OfflineDataConfig):
    messages_key: str = "messages"
    """Column holding a chat: a list of {role, content} messages; every assistant turn is trained on."""
    prompt_key: str = "prompt"
    """Without a messages column: the prompt (a string, or a list of messages)."""
    response_key: str = "response"
    """Without a messages column: the assistant's reply."""


@dataclass
class PreferenceDataConfig(OfflineDataConfig):
    prompt_key: str = "prompt"
    """The prompt (a string, or a list of messages); a row without it holds two whole conversations in chosen and
    rejected, and the prompt is the messages they share."""
    chosen_key: str = "chosen"
    """The preferred completion (a string, or a list of messages)."""
    rejected_key: str = "rejected"
    """The other completion."""


@dataclass
class SFTConfig(_OfflineRunLength):
    """`shardrl sft`: supervised fine-tuning on the same engine, run folder and loggers as `shardrl train`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (and its tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching (dynamic by default: packed micro-batches of up to
    max_token_len_per_gpu tokens)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The optimizer and its schedule."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Conversations and batch size."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""


@dataclass
class DPOSettings:
    loss_type: PreferenceLossName = "sigmoid"
    """`shardrl.algos.preference.PREFERENCE_LOSSES`: sigmoid (DPO), ipo, simpo (reference-free)."""
    beta: float = 0.1
    """The inverse temperature of the implicit reward (TRL's `beta`)."""
    label_smoothing: float = 0.0
    """The share of pairs assumed mislabelled (conservative DPO; sigmoid and simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (TRL's `simpo_gamma`)."""
    ref_model_path: str | None = None
    """The reference policy's folder; None: model.path (the policy before training). Unused by simpo."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "beta", self.beta > 0, "must be > 0")
        require(self, prefix, "label_smoothing", 0 <= self.label_smoothing < 0.5, "must be in [0, 0.5)")


@dataclass
class DPOConfig(_OfflineRunLength):
    """`shardrl dpo`: offline preference training (DPO, IPO, SimPO) on prompt/chosen/rejected rows."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train (and its tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching of the policy and the reference (a pair's two sequences always
    share a micro-batch; micro_batch_size_per_gpu counts pairs)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """The optimizer and its schedule."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs and batch size (pairs)."""
    dpo: DPOSettings = field(default_factory=DPOSettings)
    """The loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""


@dataclass
class RMSettings:
    center_rewards_coefficient: float = 0.0
    """Adds this times (r_chosen + r_rejected)^2 to each pair's loss, keeping rewards near zero (TRL's name)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "center_rewards_coefficient", self.center_rewards_coefficient >= 0, "must be >= 0")


@dataclass
class RMConfig(_OfflineRunLength):
    """`shardrl rm`: a Bradley-Terry reward model (a scalar head on a causal LM) on prompt/chosen/rejected rows;
    its HF export (trainer.export_hf) is a sequence classifier that `reward.model_path` loads."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to start from: a causal LM (its LM head is replaced by a new scalar head) or a reward model."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(use_dynamic_bsz=True))
    """Sharding, precision and micro-batching (a pair's two sequences share a micro-batch;
    micro_batch_size_per_gpu counts pairs)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The optimizer and its schedule."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs and batch size (pairs)."""
    rm: RMSettings = field(default_factory=RMSettings)
    """The loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length (optimizer steps), checkpoints, logging, launch."""


COMMAND_CONFIGS = {"train": Config, "sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig}
"""The config each training command reads (`shardrl train` also `plan` and `serve`)."""


def load_config(path: str | None = None, overrides: Iterable[str] = (), cls: type[T] = Config) -> T:
    """Defaults of `cls`, then the YAML file at `path`, then `key=value` overrides; validated.

    Raises `ConfigError` (a `ValueError`) naming the dotted key for any bad key, value or file.
    """
    return load(cls, path, overrides)
