"""Per-token log-probs and entropy without holding `tokens x vocab` fp32 logits at once, and the
packing (padding removal) of a micro-batch into one row that HF models read through `position_ids`.

Convention: `log_probs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`, so a log-prob sits on the
token it scores and a response mask applies to it directly; the first token of a sequence has 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (bf16/fp16 go up); fp64 stays fp64 rather than being cut down by .float()."""
    return torch.promote_types(dtype, torch.float32)


def _log_normalizer(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(logits / T) over the vocabulary, (n,) in the accumulation dtype."""
    return torch.logsumexp(logits.to(_acc_dtype(logits.dtype)) / temperature, dim=-1)


def _grad_logits(logits: torch.Tensor, logz: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """d/dlogits of sum(grad * log_softmax(logits / T)[target]) = (onehot - softmax(logits / T)) * grad / T,
    in the logits' dtype."""
    scale = (grad.to(logz.dtype) / temperature)[:, None]  # (n, 1)
    probs = torch.exp(logits.to(logz.dtype) / temperature - logz[:, None])  # (n, V)
    hit = torch.arange(logits.shape[-1], device=logits.device)[None] == targets[:, None]
    return ((hit.to(logz.dtype) - probs) * scale).to(logits.dtype)


TRITON_HEAD = True
"""On CUDA, run the passes over a chunk's logits as the Triton kernels of `shardrl.engine.head_kernel` (one read
in forward, a read and a write in backward). False: the compiled torch functions below, which
bench/engine.py and bench/logprob.py keep as their baseline rows."""


def _triton_head(logits: torch.Tensor) -> bool:
    return TRITON_HEAD and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _head_passes(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target], the normalizers and (with_entropy) the entropies, (n,) each, in the
    accumulation dtype, without an fp32 copy of the logits on CUDA."""
    if _triton_head(logits):
        from shardrl.engine.head_kernel import head_forward

        return head_forward(logits, targets, temperature, with_entropy)
    if with_entropy:
        logz, entropy = _kernel("entropy", _entropy_terms, logits)(logits, temperature)
    else:
        logz, entropy = _kernel("logz", _log_normalizer, logits)(logits, temperature), None
    return logits.gather(-1, targets[:, None]).squeeze(-1).to(logz.dtype) / temperature - logz, logz, entropy


def _head_grad(logits, targets, logz, entropy, grad_lp, grad_ent, temperature: float) -> torch.Tensor:
    """d/dlogits of sum(grad_lp * log p[target] + grad_ent * H), in the logits' dtype; `grad_ent` None: the
    entropy took no gradient."""
    if _triton_head(logits):
        from shardrl.engine.head_kernel import head_backward

        return head_backward(logits, targets, logz, entropy, grad_lp, grad_ent, temperature)
    if grad_ent is None:
        return _kernel("grad", _grad_logits, logits)(logits, logz, targets, grad_lp, temperature)
    return _kernel("grad_entropy", _grad_logits_entropy, logits)(logits, logz, entropy, targets, grad_lp, grad_ent,
                                                                 temperature)


_FUSED: dict[str, Callable] = {}


def _kernel(name: str, fn: Callable, like: torch.Tensor) -> Callable:
    """`fn` compiled (one fused pass over the `n x V` logits instead of several, each reading and writing
    fp32 copies) on CUDA; eager elsewhere, where the compile time would not pay off."""
    if like.device.type != "cuda":
        return fn
    if name not in _FUSED:
        _FUSED[name] = torch.compile(fn, dynamic=True)
    return _FUSED[name]


def _log_prob_forward(hidden, weight, bias, targets, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the normalizers, (n,) each, without an fp32 copy of the logits
    on CUDA (the normalizer reads the logits once)."""
    logits = F.linear(hidden, weight, bias)  # (n, V)
    return _head_passes(logits, targets, temperature, with_entropy=False)[:2]


def _input_grads(ctx, dlogits, hidden, weight, bias) -> tuple:
    """The gradients of hidden, weight and bias (those asked for) from the logits' gradient."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_h = dlogits @ weight if need_h else None
    grad_w = dlogits.t() @ hidden if need_w else None
    grad_b = dlogits.sum(0) if need_b and bias is not None else None
    return grad_h, grad_w, grad_b


class _ChunkLogProb(torch.autograd.Function):
    """log softmax(hidden @ W.T + b)[target] / T for one chunk of tokens, keeping only `hidden`, `W`, `b`
    and the (n,) normalizers for backward: the chunk's logits are recomputed there, and their gradient is
    formed in one pass, in the logits' dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float):
        logp, logz = _log_prob_forward(hidden, weight, bias, targets, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        logits = F.linear(hidden, weight, bias)
        dlogits = _head_grad(logits, targets, logz, None, grad, None, ctx.temperature)
        return (*_input_grads(ctx, dlogits, hidden, weight, bias), None, None)


def _entropy_terms(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalizers logsumexp(logits / T) and the entropies of softmax(logits / T), (n,) each, in the
    accumulation dtype: two reductions over the logits, no (n, V) fp32 copy kept (compiled on CUDA)."""
    scaled = logits.to(_acc_dtype(logits.dtype)) / temperature
    logz = torch.logsumexp(scaled, dim=-1)
    probs = torch.exp(scaled - logz[:, None])
    return logz, logz - (probs * scaled).sum(-1)


def _grad_logits_entropy(logits: torch.Tensor, logz: torch.Tensor, entropy: torch.Tensor, targets: torch.Tensor,
                         grad_lp: torch.Tensor, grad_ent: torch.Tensor, temperature: float) -> torch.Tensor:
    """d/dlogits of sum(grad_lp * log p[target] + grad_ent * H) with p = softmax(logits / T):
    (grad_lp * (onehot - p) - grad_ent * p * (log p + H)) / T, in the logits' dtype."""
    log_p = logits.to(logz.dtype) / temperature - logz[:, None]  # (n, V)
    probs = torch.exp(log_p)
    hit = torch.arange(logits.shape[-1], device=logits.device)[None] == targets[:, None]
    g_lp, g_ent = grad_lp.to(logz.dtype)[:, None], grad_ent.to(logz.dtype)[:, None]
    return ((g_lp * (hit.to(logz.dtype) - probs) - g_ent * probs * (log_p + entropy[:, None]))
            / temperature).to(logits.dtype)


class _ChunkLogProbEntropy(torch.autograd.Function):
    """`_ChunkLogProb` with the entropy of each token's distribution as a second output, differentiable too:
    the chunk's logits are recomputed in backward and their gradient (both outputs' parts) formed in one pass.
    An entropy read only as a metric (no gradient flows into it) costs backward nothing extra."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float):
        logits = F.linear(hidden, weight, bias)  # (n, V)
        logp, logz, entropy = _head_passes(logits, targets, temperature, with_entropy=True)
        ctx.save_for_backward(hidden, weight, bias, targets, logz, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, targets, logz, entropy = ctx.saved_tensors
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        logits = F.linear(hidden, weight, bias)
        grad_lp = torch.zeros_like(logz) if grad_lp is None else grad_lp
        dlogits = _head_grad(logits, targets, logz, entropy, grad_lp, grad_ent, ctx.temperature)
        return (*_input_grads(ctx, dlogits, hidden, weight, bias), None, None)


def _chunk_logprob(hidden, weight, bias, targets, temperature: float, with_entropy: bool,
                   softcap: float | None = None):
    logits = F.linear(hidden, weight, bias)  # (n, V)
    logits = logits.to(_acc_dtype(logits.dtype))
    if softcap:  # Gemma 2's final_logit_softcapping, as HF's forward applies it (before the temperature)
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # (n,)
    if not with_entropy:
        return logp, None
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)  # (n,)
    return logp, entropy


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) (and entropy) of `hidden @ weight.T`, `chunk_size` tokens at a time.

    hidden (N, H), targets (N,). Under autograd only one chunk's logits exist at a time, in backward too:
    log-probs alone go through `_ChunkLogProb` (logits recomputed, their gradient formed in one pass), with
    entropy through `_ChunkLogProbEntropy` (the same, both outputs differentiable). `softcap`: logits =
    softcap * tanh(logits / softcap) first (the model config's `final_logit_softcapping`); such chunks take the
    autograd path (checkpointed under autograd).
    """
    logps, ents = [], []
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # an empty input still runs one (empty) chunk: the result keeps its dtype, its entropy and its place in
    # the autograd graph, which a rank's one-token placeholder micro-batch relies on
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, targets[start : start + chunk_size])
        if recompute and not with_entropy and not softcap:
            lp, ent = _ChunkLogProb.apply(*args, temperature), None
        elif recompute and not softcap:
            lp, ent = _ChunkLogProbEntropy.apply(*args, temperature)
        elif recompute:
            lp, ent = checkpoint(_chunk_logprob, *args, temperature, with_entropy, softcap, use_reentrant=False)
        elif not with_entropy and not softcap:
            lp, ent = _log_prob_forward(*args, temperature)[0], None
        else:
            lp, ent = _chunk_logprob(*args, temperature, with_entropy, softcap)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)
    entropy = torch.cat(ents) if with_entropy else None
    return logp, entropy


@torch.no_grad()
def chunked_log_probs_top1(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`chunked_log_probs` without autograd, plus whether each target is the argmax of its logits (N,) bool:
    its logit the largest (a tie counts, so the answer does not depend on how argmax breaks ties), read from
    the same chunk of logits as the log-prob, so it costs one max over the vocabulary, not another projection.
    Temperature and softcap are monotone: the argmax is the raw logits'."""
    logps, ents, hits = [], [], []
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        logits = F.linear(h, weight, bias)  # (n, V)
        hits.append(logits.gather(-1, t[:, None]).squeeze(-1) >= logits.max(-1).values)
        if softcap:
            lp, ent = _chunk_logprob(h, weight, bias, t, temperature, with_entropy, softcap)
        else:
            lp, _, ent = _head_passes(logits, t, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None), torch.cat(hits)


def _scaled_logits(hidden, weight, bias, temperature: float, softcap: float | None) -> torch.Tensor:
    """(n, V) logits / T in the accumulation dtype (softcap first, as `_chunk_logprob`)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(_acc_dtype(logits.dtype))
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature if temperature != 1.0 else logits


@torch.no_grad()
def chunked_top_k(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                  temperature: float = 1.0, chunk_size: int = 1024, softcap: float | None = None,
                  vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` likeliest tokens of each position's distribution softmax(logits / T) and their log-probs, (N, k)
    each (ids long, log-probs in the accumulation dtype), `chunk_size` positions at a time (a distillation
    teacher's targets). `vocab`: only ids below it are candidates (a student's vocabulary, where the teacher's head
    has more rows), their log-probs still normalized over the whole row."""
    ids, logps = [], []
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        logits = _scaled_logits(hidden[start: start + chunk_size], weight, bias, temperature, softcap)
        values, top = (logits - torch.logsumexp(logits, -1, keepdim=True))[:, :vocab].topk(k, dim=-1)
        ids.append(top)
        logps.append(values)
    return torch.cat(ids), torch.cat(logps)


def _log_probs_at(hidden, weight, bias, targets, ids, temperature: float, with_entropy: bool,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = _scaled_logits(hidden, weight, bias, temperature, softcap)
    logz = torch.logsumexp(logits, -1, keepdim=True)  # (n, 1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz.squeeze(-1)
    entropy = logz.squeeze(-1) - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else logp.new_zeros(0)
    return logp, entropy, logits.gather(-1, ids) - logz


def chunked_log_probs_at(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         ids: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024,
                         with_entropy: bool = False, softcap: float | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`chunked_log_probs` (log p(targets) (N,), entropy) and, from the same chunks of logits, log softmax(logits / T)
    at `ids` (N, k) for each position, all differentiable: the student of a distillation toward its teacher's top-k
    tokens (one pass over the head for both). Under autograd each chunk is checkpointed, so only one chunk's logits
    exist at a time, in backward too."""
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents, ats = [], [], []
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        piece = slice(start, start + chunk_size)
        args = (hidden[piece], weight, bias, targets[piece], ids[piece], temperature, with_entropy, softcap)
        lp, ent, at = checkpoint(_log_probs_at, *args, use_reentrant=False) if recompute else _log_probs_at(*args)
        logps.append(lp)
        ents.append(ent)
        ats.append(at)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None), torch.cat(ats)


@dataclass
class Packed:
    """A micro-batch with padding removed: all real tokens in one row."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N), restarting at 0 for every sequence
    flat_index: torch.Tensor  # (N,) where each packed token sits in the flattened (B*T) batch
    shape: tuple[int, int]  # (B, T) of the padded batch


# CUDA's nonzero_static came in torch 2.7 (pytorch#141838); before it, and on an empty input (which crashed on CUDA
# before 2.9, pytorch#162578), nonzero_known falls back to nonzero and its sync
NONZERO_STATIC_CUDA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


def nonzero_known(flags: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the True entries of the 1-D `flags`, of which the caller knows there are `count`:
    `nonzero().squeeze(-1)` without its host sync (the result's size is not read back). A wrong count would
    silently pad or cut the indices, so the device checks it (asynchronously: a CUDA error at the next sync)."""
    if flags.numel() == 0 or (flags.is_cuda and not NONZERO_STATIC_CUDA):
        return flags.nonzero().squeeze(-1)
    torch._assert_async(flags.sum() == count, "nonzero_known: the host's count of True entries is wrong")
    return torch.nonzero_static(flags, size=count).squeeze(-1)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_tokens: int | None = None) -> Packed:
    """`num_tokens`: the real tokens of the batch, as the host knows them (no host sync; see `nonzero_known`)."""
    mask = attention_mask.bool()
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    flags = mask.flatten()
    flat_index = flags.nonzero().squeeze(-1) if num_tokens is None else nonzero_known(flags, num_tokens)  # (N,)
    return Packed(
        input_ids=input_ids.flatten()[flat_index].unsqueeze(0),
        position_ids=position_ids.flatten()[flat_index].unsqueeze(0),
        flat_index=flat_index,
        shape=tuple(input_ids.shape),
    )


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """(N,) per packed token -> (B, T) with zeros at padding."""
    rows = packed.flat_index // packed.shape[1]
    cols = packed.flat_index % packed.shape[1]
    # out-of-place, and not a view: FSDP2's pre-backward hook sits on the module's output
    return values.new_zeros(packed.shape).index_put((rows, cols), values)


def next_token_log_probs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_start: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs aligned to the scored token for one row of tokens.

    hidden (N, H), input_ids (N,), seq_start (N,) bool: True where a sequence begins (nothing scores
    that token). Returns log_probs (N,) and entropy (N,) (entropy of the distribution that produced
    the token), both 0 at sequence starts.
    """
    lp, ent = chunked_log_probs(
        hidden[:-1], weight, bias, input_ids[1:], temperature, chunk_size, with_entropy
    )
    lp = F.pad(lp, (0, 1))  # the last position predicts nothing here
    ent = F.pad(ent, (0, 1)) if ent is not None else None
    return shift_to_scored_token(lp, seq_start), (shift_to_scored_token(ent, seq_start) if ent is not None else None)


def shift_to_scored_token(per_position: torch.Tensor, seq_start: torch.Tensor) -> torch.Tensor:
    """(N,) values computed at position i about token i+1 -> (N,) aligned to the token they score:
    out[j] = per_position[j-1], and 0 where a sequence starts (nothing scores its first token)."""
    return F.pad(per_position[:-1], (1, 0)) * (~seq_start)
