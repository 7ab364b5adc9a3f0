"""Variable-length (packed) causal attention, plugged into HF models through their own extension
point, `AttentionInterface.register` (and no mask function: HF then builds no mask for it).

With padding removed, a micro-batch is one row of several sequences. HF's `sdpa` then needs a dense
block-diagonal (N, N) mask and computes every block, masked or not; the varlen kernel (FlashAttention
through `torch.nn.attention.varlen`) reads the sequence boundaries (`cu_seq_lens`) and computes only the
causal blocks of each sequence. On CPU, or where the kernel is missing, the same function runs SDPA per
sequence (slow, exact; it exists so the plumbing is tested everywhere).
"""

from __future__ import annotations

import copy
import inspect
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardrl.engine.logprob import nonzero_known
from shardrl.engine.ulysses import expand_kv_heads, head_to_seq, seq_to_head

ATTN_NAME = "shardrl_varlen"

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # torch < 2.10
    _varlen_attn, _VARLEN_PARAMS = None, set()


def varlen_available() -> bool:
    return _varlen_attn is not None and torch.cuda.is_available()


def cu_seq_lens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """position_ids (1, N) restarting at 0 per sequence -> cumulative lengths (S+1,) int32, max length."""
    pos = position_ids.flatten()
    starts = (pos == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, max_len


def attention_kwargs(position_ids: torch.Tensor, sp_group=None, lengths: Sequence[int] | None = None) -> dict:
    """What the varlen function reads: sequence boundaries, the longest length, whether all sequences
    have that length (then it runs batched SDPA), and the Ulysses group. `lengths`: the packed rows' real tokens
    as the host knows them (`RowSizes.lengths`): the bounds are then found without a host sync."""
    if lengths is None:
        cu, max_len = cu_seq_lens_from_position_ids(position_ids)
    else:
        seqs = [n for n in lengths if n]
        pos = position_ids.flatten()
        starts = nonzero_known(pos == 0, len(seqs))
        cu, max_len = F.pad(starts, (0, 1), value=pos.numel()).to(torch.int32), max(seqs, default=0)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len,
                  uniform_lengths=max_len * (cu.numel() - 1) == position_ids.numel())
    if sp_group is not None:
        kwargs["sp_group"] = sp_group
    return kwargs


def _causal_varlen(q, k, v, cu, max_len, scale, uniform: bool = False, window: int | None = None,
                   softcap: float | None = None):
    """q (N, Hq, D), k/v (N, Hkv, D) -> (N, Hq, D). `uniform`: every sequence is `max_len` long (a batch
    without padding), so the row is a (S, max_len) batch and plain causal SDPA serves it. `window`: each query
    sees only the last `window` keys, itself included (HF's `sliding_window`); `softcap`: scores become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2's `attn_logit_softcapping`). Either one takes
    the padded path (`_padded_causal`, or its per-sequence form past the size limit)."""
    hq, hkv = q.shape[1], k.shape[1]
    if window is not None and window >= max_len:
        window = None  # no sequence here is longer than the window
    if (window is not None or softcap) and q.shape[0]:
        if (cu.numel() - 1) * hq * max_len * max_len <= PADDED_ATTENTION_MAX_SCORES:
            return _padded_causal(q, k, v, cu, max_len, scale, window, softcap)
        bounds = cu.tolist()
        pieces = [_padded_causal(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], device=q.device), e - s, scale,
                                 window, softcap) for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces)
    if uniform and max_len > 0:
        s = q.shape[0] // max_len
        qb, kb, vb = (t.reshape(s, max_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))  # (S, H, L, D)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        return out.transpose(1, 2).reshape(q.shape)
    if q.is_cuda and _varlen_attn is not None and q.dtype in (torch.float16, torch.bfloat16):
        kwargs = {"scale": scale}
        if hq != hkv:
            if "enable_gqa" in _VARLEN_PARAMS:
                kwargs["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        if "is_causal" in _VARLEN_PARAMS:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
        return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    if q.shape[0] and (cu.numel() - 1) * hq * max_len * max_len <= PADDED_ATTENTION_MAX_SCORES:
        return _padded_causal(q, k, v, cu, max_len, scale)
    # reference path: SDPA on each sequence (many small calls: the host's time, on a GPU)
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, n, D)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=hq != hkv)[0].transpose(0, 1))
    return torch.cat(outs)


PADDED_ATTENTION_MAX_SCORES = 2**26
"""Above this many attention scores (sequences x heads x longest^2), `_padded_causal` would hold too large a
score matrix (SDPA's math kernel, as on CPU, materializes it) and the per-sequence loop runs instead."""


def _padded_causal(q, k, v, cu, max_len: int, scale, window: int | None = None, softcap: float | None = None):
    """Every sequence at once: the packed rows scattered into a (S, H, max_len, D) batch padded to the longest,
    one SDPA call with a mask that is causal (within `window`) and hides each sequence's padding keys,
    gathered back. (A padding query row still sees a key, so no row is all-masked.) One call instead of one
    per sequence: on a GPU the per-sequence loop's launches dominated small models (fp32, where the varlen
    kernel does not run). With `softcap` the scores are formed explicitly (SDPA has no soft-cap)."""
    hq, hkv = q.shape[1], k.shape[1]
    lens = (cu[1:] - cu[:-1]).long()
    num_seqs, dev = lens.numel(), q.device
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=dev), lens, output_size=q.shape[0])  # (N,) each
    # token's sequence (its size given: no host sync)
    pos = torch.arange(q.shape[0], device=dev) - cu[:-1].long()[seq]  # (N,) its position there

    def padded(t):
        out = t.new_zeros(num_seqs, max_len, t.shape[1], t.shape[2])
        out[seq, pos] = t
        return out.transpose(1, 2)  # (S, H, L, D)

    keys = torch.arange(max_len, device=dev)
    visible = keys[None, :] <= keys[:, None]  # (L, L) causal
    if window is not None:
        visible &= keys[None, :] > keys[:, None] - window
    mask = visible[None] & (keys[None, None, :] < lens[:, None, None])  # (S, L, L)
    if window is not None:  # a padding query past a short sequence's window would see no key: key 0, unused
        mask |= (keys[None, :, None] >= lens[:, None, None]) & (keys[None, None, :] == 0)
    qb, kb, vb = padded(q), padded(k), padded(v)
    if not softcap:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv)
        return out.transpose(1, 2)[seq, pos]
    kb, vb = kb.repeat_interleave(hq // hkv, dim=1), vb.repeat_interleave(hq // hkv, dim=1)
    scores = (qb @ kb.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (S, H, L, L)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(vb.dtype) @ vb
    return out.transpose(1, 2)[seq, pos]


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-function signature: query (1, Hq, N, D), key/value (1, Hkv, N, D) ->
    (attn_output (1, N, Hq, D), None)."""
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None:
        cu, max_len = cu_seq_lens_from_position_ids(kwargs["position_ids"])
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n, H, D)
    group = kwargs.get("sp_group")
    uniform = bool(kwargs.get("uniform_lengths", False))
    # what HF's attention layers pass (Mistral, Qwen2/3 and Gemma sliding-window layers; Gemma 2's soft-cap)
    limits = dict(window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    if group is None:
        return _causal_varlen(q, k, v, cu, max_len, scaling, uniform, **limits).unsqueeze(0), None
    # Ulysses: this rank's tokens of all heads -> all tokens of this rank's heads, and back
    sp = dist.get_world_size(group)
    k, v = expand_kv_heads(k, sp), expand_kv_heads(v, sp)
    q, k, v = (seq_to_head(t, group) for t in (q, k, v))  # (N, H/sp, D)
    out = _causal_varlen(q, k, v, cu, max_len, scaling, uniform, **limits)  # (N, H/sp, D)
    return head_to_seq(out, group).unsqueeze(0), None  # (1, n, H, D)


VISION_ATTN_NAME = "shardrl_flash_segments"
"""The vision towers' attention (`segments_attention_forward`). HF's Qwen-VL vision blocks hand the bounds of their
segments (each image, or each window of one) to an attention whose name holds "flash", and call any other once a
segment: at 128 images of 16 windows that is some 58,000 small calls a tower forward, a GPU's host time. The name is
set on a built model's vision config (`use_segments_attention`), past `from_config`'s check, which would look for a
FlashAttention kernel by it."""


def segments_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-function signature, bidirectional within segments: query/key/value (1, H, N, D), the segments'
    bounds `cu_seq_lens_q` (S+1,) (one segment without them) -> (attn_output (1, N, H, D), None). The segments of
    one length run as one batched SDPA call: a window layer's windows are one length but those at an image's edge,
    a full layer's segments one length an image size."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    cu = kwargs.get("cu_seq_lens_q")
    bounds = cu.tolist() if cu is not None else [0, q.shape[0]]  # (one host sync a layer, as HF's own loop)
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    sdpa = dict(scale=scaling, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1])

    def batched(t, count: int, length: int):  # (count * length, H, D) -> (count, H, length, D)
        return t.reshape(count, length, t.shape[1], t.shape[2]).transpose(1, 2)

    groups = list(by_length.items())
    if len(groups) == 1 and len(groups[0][1]) * groups[0][0] == q.shape[0]:  # one length, back to back: no gather
        length, starts = groups[0]
        out = F.scaled_dot_product_attention(*(batched(t, len(starts), length) for t in (q, k, v)), **sdpa)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])[None], None
    # the tokens gathered once in the groups' order, split into the groups (views: a slice's backward would allocate
    # a whole tensor a group), a call each, joined and put back once: a fixed number of whole-size tensors, however
    # many lengths (a put and three gathers a group grew with them: slower than HF's own loop at many image sizes)
    idx = torch.cat([(torch.tensor(starts)[:, None] + torch.arange(length)).flatten() for length, starts in groups])
    idx = idx.to(q.device)
    sizes = [len(starts) * length for length, starts in groups]
    parts = zip(*(t[idx].split(sizes) for t in (q, k, v)))
    outs = [F.scaled_dot_product_attention(*(batched(t, len(starts), length) for t in part), **sdpa)
            .transpose(1, 2).reshape(len(starts) * length, q.shape[1], v.shape[2])
            for (length, starts), part in zip(groups, parts)]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2]).index_put((idx,), torch.cat(outs))
    return out[None], None


def use_segments_attention(model) -> None:
    """Gives a vision-language model's vision tower `segments_attention_forward` (registered by its name): the
    tower's modules get a copy of the vision config naming it; the model's own config keeps HF's name, so that the
    other models built from it (the fast rollout's, a reference's) need no such function, and nothing saved names it."""
    from transformers import AttentionInterface

    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return
    AttentionInterface.register(VISION_ATTN_NAME, segments_attention_forward)
    own = copy.copy(vision)
    own._attn_implementation = VISION_ATTN_NAME
    for module in model.modules():
        if getattr(module, "config", None) is vision:
            module.config = own


def register_varlen_attention() -> str:
    """Registers the attention function under ATTN_NAME, and no mask function: HF then makes no mask for it (the
    packed row's bounds are the kwargs), before its check of the position ids for packed sequences, which reads a
    flag back from the device in every forward (a host sync). A registered mask function, even one that made
    nothing, kept that check."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)
    return ATTN_NAME


def resolve_attn_implementation(name: str, remove_padding: bool, sp: int = 1) -> str:
    """'auto' -> the varlen kernel on CUDA with padding removed, else 'sdpa'; other names pass through.
    Sequence parallelism (sp > 1) always uses the varlen function, where the all-to-all lives."""
    if sp > 1:
        if not remove_padding:
            raise ValueError("ulysses_sequence_parallel_size > 1 needs model.use_remove_padding=true (packed input)")
        if name not in ("auto", ATTN_NAME):
            raise ValueError(f"ulysses_sequence_parallel_size > 1 runs attention through shardrl's varlen function; "
                             f"set model.attn_implementation=auto (got {name!r})")
        return register_varlen_attention()
    if name == ATTN_NAME and not remove_padding:  # (it reads the packed row's bounds; a padded batch has none)
        raise ValueError(f"model.attn_implementation={ATTN_NAME} attends over packed rows and needs "
                         "model.use_remove_padding=true; with padding kept, set model.attn_implementation=auto or sdpa")
    if name == ATTN_NAME or (name == "auto" and remove_padding and varlen_available()):
        return register_varlen_attention()
    return "sdpa" if name == "auto" else name
