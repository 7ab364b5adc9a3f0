"""Generation: `RolloutConfig` (sampling), with the fast backend's settings (`FastRolloutConfig`), its multi-turn
(`MultiTurnConfig`), agent (`AgentConfig`) and validation-sampling (`ValSamplingConfig`) sections."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Literal

from shardrl.config.checks import check_multi_turn, check_rollout
from shardrl.config.load import require


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
        require(self, prefix, "max_calls_per_turn", self.max_calls_per_turn >= 1, "must be >= 1")
        require(self, prefix, "max_turns", self.max_turns >= 0, "must be >= 0 (0: no limit but max_response_tokens)")
        require(self, prefix, "max_response_tokens", self.max_response_tokens >= 1, "must be >= 1")
        require(self, prefix, "tool_timeout_s", self.tool_timeout_s > 0, "must be > 0 (seconds)")
        require(self, prefix, "max_tool_output_chars", self.max_tool_output_chars >= 1, "must be >= 1")
        require(self, prefix, "num_tool_workers", self.num_tool_workers >= 1, "must be >= 1")
        require(self, prefix, "tool_turn_template", "{output}" in self.tool_turn_template,
                "must hold the placeholder {output} (where the tool's answer goes)")
        require(self, prefix, "call_end", bool(self.call_end), "must be a non-empty string (it ends a model turn)")
        check_multi_turn(self, prefix)


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
    tool_call_parser: str = "auto"
    """How the endpoint reads a reply's tool calls into `tool_calls` when a call gives `tools` (vLLM's names:
    hermes, llama3_json, mistral; auto: told from the chat template, else hermes). The trained tokens are the
    sampled ones whatever it reads; a reply that looks like a call but does not parse stays text and is counted
    (`agent/tool_parse_failures_mean`)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "entrypoint", self.entrypoint is None or (":" in self.entrypoint and
                                                                       self.entrypoint.split(":", 1)[0].endswith(".py")),
                "must be 'path/to/file.py:function'")
        require(self, prefix, "timeout_s", self.timeout_s > 0, "must be > 0 (seconds)")
        require(self, prefix, "max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        require(self, prefix, "max_response_tokens", self.max_response_tokens >= 1, "must be >= 1")
        require(self, prefix, "tool_call_parser",
                self.tool_call_parser in ("auto", "hermes", "llama3_json", "mistral"),
                "must be auto, hermes, llama3_json or mistral")


def check_sampling(section, prefix: str) -> None:
    """The sampler's bounds, for training's sampling and validation's alike."""
    require(section, prefix, "n", section.n >= 1, "must be >= 1")
    require(section, prefix, "temperature", section.temperature == 0 or 1e-5 <= section.temperature <= 1e4,
            "must be 0 (greedy) or in [1e-5, 1e4]")
    require(section, prefix, "top_p", 0 < section.top_p <= 1, "must be in (0, 1]")
    require(section, prefix, "top_k", 0 <= section.top_k < 2**31, "must be in [0, 2**31) (0 = off)")


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
        check_sampling(self, prefix)


@dataclass
class FastRolloutConfig:
    """The fast backend's settings (`rollout.backend=fast`, `shardrl.rollout.fast`): its decode slots, cache, host
    syncs and kernels. The hf backend reads none of them."""

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

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_batch", self.max_batch is None or self.max_batch >= 1, "must be >= 1 or null")
        require(self, prefix, "sync_every", self.sync_every >= 1, "must be >= 1")
        require(self, prefix, "kv_cache_tokens", self.kv_cache_tokens is None or self.kv_cache_tokens >= 1,
                "must be >= 1 or null")


@dataclass
class Fp8Config:
    """FP8 weights of the fast rollout (`rollout.quantization=fp8`, `shardrl.rollout.fast.fp8`)."""

    block_size: int | None = None
    """null: one scale per output channel; B: one per B x B tile of each linear weight (DeepSeek's and Qwen's FP8
    checkpoints use 128); each q/k/v/o and gate/up/down weight's sides must be multiples of B."""
    activations: Literal["none", "dynamic"] = "none"
    """none: weight-only (the FP8 weights dequantized to the model's dtype for each matmul); dynamic: the
    activations quantized to FP8 too, each token by its own amax, and `torch._scaled_mm` (CUDA, compute
    capability >= 8.9, per-channel scales)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "block_size", self.block_size is None or self.block_size >= 1, "must be >= 1 or null")
        require(self, prefix, "activations", self.activations == "none" or self.block_size is None,
                "dynamic runs with per-channel scales; block scales (block_size) run weight-only: set one back")


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
    """Prompts per generate call (hf); with `fast`, prompts x n sets the decode slots unless fast.max_batch does."""
    fast: FastRolloutConfig = field(default_factory=FastRolloutConfig)
    """The fast backend's settings (`rollout.fast.max_batch`, ...)."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8 (fast backend): the rollout's decoder linear layers (q/k/v/o, gate/up/down) hold FP8 E4M3 weights with
    fp32 scales, quantized from the trainer's weights at each weight sync; embeddings, norms, the LM head, routed
    experts and the KV cache keep the model's dtype. The sampler then differs more from the trainer, so
    algorithm.rollout_is left null turns on. See `rollout.fp8`."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8's scales and activations (`rollout.fp8.block_size`, `rollout.fp8.activations`)."""
    free_cache_engine: bool | None = None
    """CUDA, rollout and training on the same GPUs: free the rollout's KV cache and CUDA graphs while the
    actor trains, and rebuild them before the next generation (a cost per step: bench/RESULTS.md, "Current
    figures: Whole step settings"; the allocator's cached blocks go back to the driver with them). null: free
    them only when the memory ledger (`shardrl plan`) says that the update's peak plus the cache would not fit in 80%
    of the GPU (`plan.defaults.KEEP_CACHE_FRACTION`)."""
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
    env: str | None = None
    """A verifiers environment (`vf.Environment`) run unchanged as the episodes, its dataset the prompts and its
    rubric the reward (`shardrl.rollout.episodes.verifiers_env`): `verifiers:ENV_ID` (an installed environment,
    `vf.load_environment(ENV_ID, **env_args)`) or `path/to/env.py:load_environment` (a function returning one).
    Its rollouts call the policy through the agent endpoint, as `agent.entrypoint`'s do (the agent section's
    other settings apply). Null: no environment."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments of the environment's loader."""
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampling of validation (greedy, n=1 by default)."""

    renamed_keys = {name: f"fast.{name}" for name in (
        "max_batch", "kv_cache_tokens", "sync_every", "compile", "attention", "sampler", "prefix_cache", "cascade")}
    """Keys that moved under `rollout.fast`: the loader still takes them here, with a note."""

    def response_budget(self) -> tuple[str, int]:
        """The tokens a response may reach, and the key that sets them: an agent's episode is bounded by
        agent.max_response_tokens, a multi-turn conversation (model and tool turns) by multi_turn.max_response_tokens,
        a single turn by max_new_tokens. The run's `Plan` holds it; the layout, the token-budget checks, the memory
        ledger and overlong shaping read it there."""
        if self.runs_agent():
            return "rollout.agent.max_response_tokens", self.agent.max_response_tokens
        if self.multi_turn.enable:
            return "rollout.multi_turn.max_response_tokens", self.multi_turn.max_response_tokens
        return "rollout.max_new_tokens", self.max_new_tokens

    def runs_agent(self) -> bool:
        """Whether episodes run against the agent endpoint: the user's (`agent.entrypoint`) or an environment's."""
        return bool(self.agent.entrypoint or self.env)

    def fast_only_keys(self) -> list[str]:
        """The fast-backend-only keys set away from their defaults."""
        unset = {"fast.max_batch": (None,), "fast.kv_cache_tokens": (None,), "fast.compile": (None,),
                 "fast.attention": ("auto",), "fast.sampler": ("auto",),
                 "lora_sync": (None, "full"),  # full: what the hf backend does anyway
                 "quantization": ("none",)}
        keys = [k for k, defaults in unset.items() if operator.attrgetter(k)(self) not in defaults]
        return keys + (["multi_turn.overlap_tools"] if self.multi_turn.overlap_tools else [])

    def validate(self, prefix: str) -> None:
        check_sampling(self, prefix)
        require(self, prefix, "max_new_tokens", self.max_new_tokens >= 1, "must be >= 1")
        require(self, prefix, "micro_batch_size", self.micro_batch_size >= 1, "must be >= 1")
        check_rollout(self, prefix)
