"""The fast rollout's device side: the slots' state (`SlotState`, sized once, its addresses fixed for the CUDA graphs
that read it), the sampler, `decode_step`, one token for every live slot as a small function over that state
(gpt-fast's `decode_one_token`), and `DecodeRunner`, which runs it eagerly or as CUDA graphs; also the choice of
the attention and sampler kernels. The host loop around it is `shardrl.rollout.fast.scheduler` and
`shardrl.rollout.fast.rollout.FastRollout`."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from shardrl.rollout.base import MAX_TOP_LOGPROBS, SamplingParams, likeliest_tokens
from shardrl.rollout.fast.kernel_support import triton_head_dim
from shardrl.rollout.fast.attention import SDPADecodeAttention, TritonDecodeAttention

log = logging.getLogger(__name__)

GREEDY, SAMPLE, TRUNCATED = "greedy", "sample", "truncated"  # sampling modes; one graph each
RAW = "raw"  # sampled as TRUNCATED, its log-probs the raw logits' (temperature 1): a server's raw_logprobs


def sample_tokens(logits, mode: str, noise, temperature, top_k, top_p, banned: torch.Tensor | None = None):
    """Tokens (B,) and their log softmax(logits / T) (B,) from logits (B, V) (taken in fp32), without a host sync.
    Sampling is Gumbel-max: argmax(log p - log E) with E ~ Exp(1) in `noise` (B, V). TRUNCATED (and RAW) keeps
    the `top_k` best tokens, then those whose better-ranked mass is below `top_p` (HF's order; top_k = V and
    top_p = 2 keep every token). RAW's log-probs are log softmax(logits), the model's own. `banned` (k,): ids never
    chosen (a VL model's image placeholders), masked before the truncation, as HF's suppression before its warpers;
    the log-probs keep their mass (the model's whole distribution, what the trainer recomputes)."""
    logits = logits.float()  # here, so that a compiled sampler fuses the cast into its first pass
    scaled = logits if mode == GREEDY else logits / temperature
    chosen = scaled if banned is None else scaled.index_fill(-1, banned, float("-inf"))
    if mode == GREEDY:
        tokens = chosen.argmax(-1)
    elif mode == SAMPLE:
        tokens = (chosen - noise.log()).argmax(-1)
    else:
        ranked, order = chosen.sort(-1, descending=True)  # (B, V)
        rank = torch.arange(ranked.shape[-1], device=ranked.device)
        ranked = ranked.masked_fill(rank >= top_k, float("-inf"))
        probs = torch.softmax(ranked, -1)
        ranked = ranked.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
        choice = (ranked - noise.log()).argmax(-1, keepdim=True)
        tokens = order.gather(-1, choice).squeeze(-1)
    scored = logits if mode == RAW else scaled
    # the sampled token's log softmax, without writing the (B, V) log-probs
    return tokens, scored.gather(-1, tokens[:, None]).squeeze(-1) - scored.logsumexp(-1)


def reported_logits(logits: torch.Tensor, mode: str, temperature: torch.Tensor) -> torch.Tensor:
    """The fp32 logits of the distribution a step of `mode` reports log-probs in (`sample_tokens`' `scored`)."""
    logits = logits.float()
    return logits if mode in (GREEDY, RAW) else logits / temperature


def sampling_mode(sampling: SamplingParams) -> str:
    if sampling.is_greedy:
        return GREEDY
    if sampling.raw_log_probs:  # (the fused kernel and SAMPLE's graph score at the sampling temperature)
        return RAW
    return TRUNCATED if sampling.top_k > 0 or sampling.top_p < 1 else SAMPLE


def uses_fused_sampler(fused_sample, mode: str) -> bool:
    """Whether a step of `mode` samples with the fused kernel (when there is one): top-k/top-p sort in torch."""
    return fused_sample is not None and mode not in (TRUNCATED, RAW)


@dataclass
class SlotState:
    """All a decode step reads and writes, on the device, for B slots. Addresses never change while it
    lives (the CUDA graphs point at them). W = the cache's max_seq bounds a slot's generated tokens."""

    kv: torch.Tensor  # (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim), see fast.model and fast.paged
    table: torch.Tensor  # (B, max_seq / block_size) long: each slot's blocks (0, the scratch block, past them)
    tokens: torch.Tensor  # (B,) long: the token each slot feeds next (sampled, not yet in the cache)
    lengths: torch.Tensor  # (B,) long: tokens in the slot's cache = position of the token fed next
    done: torch.Tensor  # (B,) bool: finished, or empty
    num_generated: torch.Tensor  # (B,) long
    max_new: torch.Tensor  # (B,) long: the slot's response limit
    out_tokens: torch.Tensor  # (B, W) long
    out_log_probs: torch.Tensor  # (B, W) float32
    noise: torch.Tensor | None  # (B, V) float32: Exp(1) noise of the next step the torch sampler samples
    seed: torch.Tensor  # (1,) long: the fused sampler's noise key for the next sampled step
    temperature: torch.Tensor  # () float32
    top_k: torch.Tensor  # () long; V when off
    top_p: torch.Tensor  # () float32; 2 when off
    eos: torch.Tensor  # (k,) long: the ids that end a response (`stop_token_ids`)
    max_seq: int  # cache positions a slot may use
    banned: torch.Tensor | None = None  # (k,) long: ids never sampled (a VL model's image placeholders)
    rope_delta: torch.Tensor | None = None  # (B,) long: a VL model's M-RoPE offset of the slot's decode positions
    step_routes: torch.Tensor | None = None  # (B, L, k) long: a step's experts per routed layer (record_routing)
    out_routes: torch.Tensor | None = None  # (B, W, L, k) int16: response token j's experts, as it was fed
    shared: torch.Tensor | None = None  # (B,) long: entries a slot's shared-prefix group reads for it (cascade)
    groups: torch.Tensor | None = None  # (B / 2, M) long: each group's slots, -1 after them (cascade)
    # (B, W, MAX_TOP_LOGPROBS): each response token's likeliest tokens, made when a call first asks for them
    out_top_ids: torch.Tensor | None = None  # long
    out_top_log_probs: torch.Tensor | None = None  # float32

    def top_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The likeliest tokens' buffers, made at their first use (before a graph that writes them takes their
        addresses); a call that asks for none never makes them."""
        if self.out_top_ids is None:
            shape, device = (*self.out_tokens.shape, MAX_TOP_LOGPROBS), self.out_tokens.device
            self.out_top_ids = torch.zeros(shape, dtype=torch.long, device=device)
            self.out_top_log_probs = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.out_top_ids, self.out_top_log_probs

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def allocate(cls, kv_shape: tuple, dtype: torch.dtype, device: torch.device, num_slots: int, max_seq: int,
                 block_size: int, vocab_size: int, stop_ids: list[int], route_shape: tuple | None = None,
                 cascade_members: int | None = None, banned: list[int] | None = None,
                 mrope: bool = False) -> "SlotState":
        """Empty slots: every slot done, the cache `kv_shape` zeros; `route_shape` (L, k) records routing,
        `cascade_members` makes the shared-prefix groups' tensors; `banned` ids are never sampled, `mrope` keeps
        the slots' M-RoPE offsets (a vision-language model)."""
        b, long = num_slots, dict(dtype=torch.long, device=device)
        extra = {}
        if banned:
            extra["banned"] = torch.tensor(banned, **long)
        if mrope:
            extra["rope_delta"] = torch.zeros(b, **long)
        if route_shape is not None:
            extra.update(step_routes=torch.zeros(b, *route_shape, **long),
                         out_routes=torch.full((b, max_seq, *route_shape), -1, dtype=torch.int16, device=device))
        if cascade_members is not None:
            extra.update(shared=torch.zeros(b, **long),
                         groups=torch.full((max(1, b // 2), cascade_members), -1, **long))
        return cls(
            kv=torch.zeros(kv_shape, dtype=dtype, device=device),
            table=torch.zeros(b, -(-max_seq // block_size), **long), max_seq=max_seq,
            tokens=torch.zeros(b, **long), lengths=torch.zeros(b, **long),
            done=torch.ones(b, dtype=torch.bool, device=device), num_generated=torch.zeros(b, **long),
            max_new=torch.ones(b, **long), out_tokens=torch.zeros(b, max_seq, **long),
            out_log_probs=torch.zeros(b, max_seq, dtype=torch.float32, device=device),
            noise=None,  # made when a step of the torch sampler first needs it
            seed=torch.zeros(1, **long),
            temperature=torch.ones((), device=device), top_k=torch.full((), vocab_size, **long),
            top_p=torch.full((), 2.0, device=device),
            eos=torch.tensor(stop_ids or [-1], **long),  # -1: no EOS, never sampled
            **extra,
        )


def decode_step(st: SlotState, model, block, mode: str, seq_len: int, width: int, sample=sample_tokens,
                fused_sample=None, top: int = 0) -> None:
    """One token for every live slot among the first `width` (the others must be empty): `model.decode` reads the
    first `seq_len` cache positions through `block`, `sample` (or `fused_sample`, where it samples `mode`) picks
    the next tokens; `top` > 0 also records the `top` likeliest tokens (`st.top_buffers`, made already); reads
    and writes only views of `st` (capturable)."""
    w = width
    tokens_in, lengths, done, num_generated = st.tokens[:w], st.lengths[:w], st.done[:w], st.num_generated[:w]
    out_tokens, out_log_probs = st.out_tokens[:w], st.out_log_probs[:w]
    active = ~done
    routes = None if st.out_routes is None else st.step_routes[:w]
    rope_offset = None if st.rope_delta is None else st.rope_delta[:w]
    logits = model.decode(tokens_in, lengths, st.kv, st.table[:w], seq_len, block, routes, rope_offset)  # (w, V)
    if uses_fused_sampler(fused_sample, mode):  # (never with banned ids: `fused_sampler`)
        tokens, log_probs = fused_sample(logits, mode == GREEDY, st.temperature, st.seed)
    else:
        noise = None if st.noise is None else st.noise[:w]
        tokens, log_probs = sample(logits, mode, noise, st.temperature, st.top_k, st.top_p, st.banned)
    tokens = torch.where(active, tokens, tokens_in)
    slots = torch.arange(w, device=tokens.device)
    if routes is not None:  # the fed token is response token num_generated - 1
        fed = (num_generated - 1).clamp(min=0, max=st.out_routes.shape[1] - 1)
        out_routes = st.out_routes[:w]
        out_routes[slots, fed] = torch.where(active[:, None, None], routes.to(torch.int16), out_routes[slots, fed])
    col = num_generated.clamp(max=out_tokens.shape[1] - 1)
    out_tokens[slots, col] = torch.where(active, tokens, out_tokens[slots, col])
    out_log_probs[slots, col] = torch.where(active, log_probs, out_log_probs[slots, col])
    if top:  # (after the sampler: what it samples is the same with or without them)
        ids, values = likeliest_tokens(reported_logits(logits, mode, st.temperature), top, tokens, log_probs)
        out_ids, out_values = st.out_top_ids[:w, :, :top], st.out_top_log_probs[:w, :, :top]
        out_ids[slots, col] = torch.where(active[:, None], ids, out_ids[slots, col])
        out_values[slots, col] = torch.where(active[:, None], values, out_values[slots, col])
    num_generated.add_(active.long())
    lengths.add_(active.long())
    done.logical_or_((tokens[:, None] == st.eos).any(-1) | (num_generated >= st.max_new[:w]))
    tokens_in.copy_(tokens)


class DecodeRunner:
    """Runs `decode_step` over a `SlotState`: eagerly, or (`cuda_graphs`) as a CUDA graph replay, one graph per
    (mode, seq_len, width, cascade) captured on first use. Each run first draws its step's noise from the call's
    generator. The graphs hold the addresses of one state: `drop_graphs` when it (or the weights) go. A step that
    records the likeliest tokens (`top` > 0) is a graph of its own."""

    def __init__(self, model, block, sample, fused_sample, cuda_graphs: bool, device: torch.device,
                 vocab_size: int):
        self.model, self.block, self.sample, self.fused_sample = model, block, sample, fused_sample
        self.cuda_graphs, self.device, self.vocab_size = cuda_graphs, device, vocab_size
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (mode, seq_len, width, cascade, top)
        self.captures = 0  # decode graphs captured so far (each a new (mode, seq_len, width, cascade, top))
        self.keys: set[tuple] = set()  # every graph captured so far (resume() recaptures them)
        self.stream = None  # the warm-up stream of every capture (see `capture`)
        self.pool = None  # the graphs' memory pool, one per state: a step keeps nothing between replays

    def step(self, st: SlotState, mode: str, seq_len: int, width: int, top: int = 0) -> None:
        decode_step(st, self.model, self.block, mode, seq_len, width, self.sample, self.fused_sample, top)

    def run(self, st: SlotState, mode: str, seq_len: int, generator: torch.Generator, width: int,
            cascade: bool = False, top: int = 0) -> None:
        """One step: its noise drawn, then the step run eagerly or replayed (captured first if new)."""
        if mode == GREEDY:
            pass  # no noise
        elif uses_fused_sampler(self.fused_sample, mode):
            st.seed.random_(0, 2**62, generator=generator)  # the fused sampler's fresh noise
        else:
            self.torch_sampler_noise(st)[:width].exponential_(generator=generator)
        if top:
            st.top_buffers()
        if not self.cuda_graphs:
            self.set_cascade(st, cascade)
            self.step(st, mode, seq_len, width, top)
            return
        graph = (self.graphs.get((mode, seq_len, width, cascade, top))
                 or self.capture(st, mode, seq_len, width, cascade, top))
        graph.replay()

    def set_cascade(self, st: SlotState, on: bool) -> None:
        """Whether the next decode steps run (or are captured) with the shared-prefix groups (a state that has
        them: the cascade is on)."""
        if st.groups is not None:
            self.block.attention.cascade = (st.shared, st.groups) if on else None

    def torch_sampler_noise(self, st: SlotState) -> torch.Tensor:
        """The noise buffer of the torch sampler, made at its first use (the fused sampler needs none)."""
        if st.noise is None:
            st.noise = torch.ones(st.num_slots, self.vocab_size, dtype=torch.float32, device=self.device)
        return st.noise

    def capture(self, st: SlotState, mode: str, seq_len: int, width: int, cascade: bool = False,
                top: int = 0, warm: bool = True) -> torch.cuda.CUDAGraph:
        """Captures the step of (mode, seq_len, width, cascade, top) over `st`. `warm`: run it eagerly first (lazy
        initialization, compilation: a step's first capture needs it). `resume()` recaptures steps this process
        captured before, over a new state of the same shapes, without: the two eager steps were most of a
        capture's host time (about 37 ms a graph on an H200, the device idle meanwhile, every step of a run that
        frees the cache for its update). A capture that fails without them is made again with them."""
        if not warm:
            try:
                return self._capture(st, mode, seq_len, width, cascade, top, warm=False)
            except RuntimeError as e:  # (a first use this process had not seen after all)
                log.warning("a decode graph's recapture without warm-up failed (%s); warming it up", e)
        return self._capture(st, mode, seq_len, width, cascade, top, warm=True)

    def _capture(self, st: SlotState, mode: str, seq_len: int, width: int, cascade: bool, top: int,
                 warm: bool) -> torch.cuda.CUDAGraph:
        if mode != GREEDY and not uses_fused_sampler(self.fused_sample, mode):
            self.torch_sampler_noise(st)  # before the graph takes its address (resume() recaptures here)
        if top:
            st.top_buffers()  # (likewise)
        step = lambda st, mode, seq_len, width: self.step(st, mode, seq_len, width, top)  # noqa: E731
        if self.stream is None:
            # one side stream for every capture: cuBLAS keeps a workspace (32 MiB on an H200) per stream it has
            # run on, for the life of the process, so a new stream per resume() leaked 32 MiB a step
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        self.set_cascade(st, cascade)
        if warm:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.warm_up(step, st, mode, seq_len, width)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step(st, mode, seq_len, width)
        self.graphs[(mode, seq_len, width, cascade, top)] = graph
        self.captures += 1
        self.keys.add((mode, seq_len, width, cascade, top))
        return graph

    @staticmethod
    def warm_up(step_fn, st: SlotState, mode: str, seq_len: int, width: int, num_steps: int = 2) -> None:
        """Runs `step_fn` (lazy init, compilation) and puts the per-slot counters back, so a capture may
        happen in the middle of a generate: what the steps wrote past the counters (cache entries, tokens)
        is rewritten by the next real step or lies beyond the lengths, masked."""
        counters = (st.tokens, st.lengths, st.done, st.num_generated)
        saved = [t.clone() for t in counters]
        for _ in range(num_steps):
            step_fn(st, mode, seq_len, width)
        for t, s in zip(counters, saved):
            t.copy_(s)

    def drop_graphs(self) -> None:
        """Drops the captured graphs (stale once the weights' addresses or the decode step's structure change)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


def decode_attention(name: str, device: torch.device, head_dim: int) -> SDPADecodeAttention | TritonDecodeAttention:
    """The decode attention `name` asks for; "auto" takes triton where it can run, else sdpa."""
    if name not in ("auto", "triton", "sdpa"):
        raise ValueError(f"attention={name!r} must be 'auto', 'triton' or 'sdpa'")
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):  # (the interpreter: asked by name)
        return SDPADecodeAttention()
    problem = triton_problem(device, head_dim)
    if problem is None:
        return TritonDecodeAttention()
    if name == "auto":
        return SDPADecodeAttention()
    raise ValueError(f"attention='triton' needs {problem}; use attention='sdpa'")


def triton_problem(device: torch.device, head_dim: int | None = None) -> str | None:
    """What a Triton kernel lacks here (None if it can run); `head_dim` for the attention kernel."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"a CUDA device (here {device.type}; on the CPU only under Triton's interpreter)"
    if head_dim is not None and not triton_head_dim(head_dim):
        return f"a power-of-two head dim >= 16 (here {head_dim})"
    if importlib.util.find_spec("triton") is None:
        return "the triton package (it comes with PyTorch's CUDA wheels on Linux)"
    return None


def fused_sampler(name: str, device: torch.device, attention, banned: bool = False):
    """`fused_sample` if the sampler `name` asks for it (or "auto" finds the Triton `attention`), else None.
    `banned`: some ids are never sampled (a VL model's placeholders), which the fused kernel cannot mask ("auto":
    the torch sampler)."""
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"sampler={name!r} must be 'auto', 'triton' or 'torch'")
    if banned and name == "triton":
        raise ValueError("sampler='triton' cannot keep a vision-language model's image placeholders from being "
                         "sampled; use sampler='torch' (or 'auto')")
    if banned:
        return None
    if name == "triton" and (problem := triton_problem(device)) is not None:
        raise ValueError(f"sampler='triton' needs {problem}; use sampler='torch'")
    if name == "torch" or (name == "auto" and not isinstance(attention, TritonDecodeAttention)):
        return None
    from shardrl.rollout.fast.sample_kernel import fused_sample

    return fused_sample
