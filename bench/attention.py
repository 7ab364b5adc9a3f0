"""Packed causal attention of the training engine on var_512's micro-batches: the kernel it runs against
the alternatives, forward and backward, one layer of the Qwen2-1.5B shape (12 query heads, 2 K/V heads,
head dim 128), summed over all micro-batches of one update (x28 for the model's layers).

Rows (each checked against the first: output and q/k/v gradients):
- fa2_varlen: FlashAttention-2 varlen (`torch.nn.attention.varlen`), what the engine runs today;
- cudnn_ragged: cuDNN's attention on the same packed row, sequence boundaries as ragged offsets
  (`aten._cudnn_attention_forward` with cum_seq), K/V heads expanded for it;
- padded_<backend>: each micro-batch scattered into one (S, H, L, D) batch padded to its longest sequence,
  plain causal SDPA (right padding: a real query never sees a padded key), gathered back;
- njt_<backend>: the packed row as nested jagged tensors (no padding), SDPA with that backend;
- the same rows on micro-batches cut from the length-sorted samples (`--partitions sorted`), where a
  micro-batch's sequences have near lengths and padding costs little.

A row that fails prints its error and where it was raised, and the next row runs. On torch 2.11 (H200) both
cuDNN rows without padding fail (bench/RESULTS.md, "Current figures: Attention backends"). `njt_cudnn` fails
with an illegal memory access, which breaks the process's CUDA context for every later row, so it runs only
when named, and last.

    python bench/attention.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import append_jsonl  # noqa: E402

HQ, HKV, D = 12, 2, 128


def var_lengths(seqs: int = 512, prompt: int = 256, new: int = 1024) -> list[int]:
    """bench/engine.py's var_batch lengths (prompt + response), the same draw."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.empty(seqs).exponential_(1 / 400, generator=g).long() + 1).clamp(max=new)
    return (lengths + prompt).tolist()


def micro_batches(lengths: list[int], budget: int, partition: str) -> list[list[int]]:
    from shardrl.engine.microbatch import balanced_partition, num_dynamic_micro_batches

    if partition == "balanced":
        parts = balanced_partition(lengths, num_dynamic_micro_batches(lengths, budget))
        return [[lengths[i] for i in p] for p in parts]
    out, cur = [], []
    for n in sorted(lengths, reverse=True):
        if sum(cur) + n > budget:
            out.append(cur)
            cur = []
        cur.append(n)
    return out + [cur]


def cudnn_ragged(q, k, v, cu, max_len, scale):
    return _CudnnRagged.apply(q, k, v, cu, max_len, scale)


class _CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device), cu, cu,
            ctx.max_len, ctx.max_len, 0.0, True, scale=ctx.scale)
        n = dk.shape[0]
        dk = dk.view(n, HKV, HQ // HKV, D).sum(2)
        dv = dv.view(n, HKV, HQ // HKV, D).sum(2)
        return dq, dk, dv, None, None, None


def padded(q, k, v, cu, max_len, scale, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = (cu[1:] - cu[:-1]).long()
    s = lens.numel()
    seq = torch.repeat_interleave(torch.arange(s, device=q.device), lens)
    pos = torch.arange(q.shape[0], device=q.device) - cu[:-1].long()[seq]

    def pad(t):
        out = t.new_zeros(s, max_len, t.shape[1], t.shape[2])
        return out.index_put((seq, pos), t).transpose(1, 2)

    qb, kb, vb = pad(q), pad(k), pad(v)
    if backend == "cudnn":  # cuDNN's SDPA takes no GQA here: K/V heads expanded
        kb, vb = kb.repeat_interleave(HQ // HKV, dim=1), vb.repeat_interleave(HQ // HKV, dim=1)
    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    with sdpa_kernel(kinds[backend]):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                             enable_gqa=kb.shape[1] != qb.shape[1])
    return out.transpose(1, 2)[seq, pos]


def njt(q, k, v, cu, max_len, scale, backend):
    """Nested jagged tensors over the packed row (no padding), SDPA with one backend; K/V heads expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    offsets = cu.long()
    k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    qn, kn, vn = (torch.nested.nested_tensor_from_jagged(t, offsets, max_seqlen=max_len).transpose(1, 2)
                  for t in (q, k, v))  # (S, H, j, D)
    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    with sdpa_kernel(kinds[backend]):
        out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, scale=scale)
    return out.transpose(1, 2).values()


def fa2(q, k, v, cu, max_len, scale):
    from shardrl.engine.attention import _causal_varlen

    return _causal_varlen(q, k, v, cu, max_len, scale)


ROWS = {"fa2_varlen": fa2, "cudnn_ragged": cudnn_ragged,
        "padded_cudnn": lambda *a: padded(*a, "cudnn"), "padded_flash": lambda *a: padded(*a, "flash"),
        "njt_cudnn": lambda *a: njt(*a, "cudnn"), "njt_flash": lambda *a: njt(*a, "flash")}


def run(args):
    torch.manual_seed(0)
    lengths = var_lengths()
    scale = D ** -0.5
    records = []
    for partition in args.partitions.split(","):
        mbs = micro_batches(lengths, args.budget, partition)
        inputs = []
        for lens in mbs:
            n = sum(lens)
            cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
            q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
            inputs.append((q, k, v, cu, max(lens), dout))
        flops = sum(4 * HQ * D * sum(n * (n + 1) / 2 for n in lens) for lens in mbs) * 3.5  # fwd + bwd (2.5x)
        padded_ratio = sum(len(lens) * max(lens) ** 2 for lens in mbs) / sum(n * n for lens in mbs for n in lens)
        reference = None
        for name in args.rows.split(","):
            fn = ROWS[name]

            def step(check=False):
                outs = []
                for q, k, v, cu, max_len, dout in inputs:
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    out = fn(qq, kk, vv, cu, max_len, scale)
                    out.backward(dout)
                    if check:
                        outs.append([t.float() for t in (out.detach(), qq.grad, kk.grad, vv.grad)])
                return outs

            try:
                got = step(check=True)
            except Exception as e:  # a backend that does not run here: say so and go on
                where = traceback.extract_tb(e.__traceback__)[-1]
                records.append({"bench": "attention", "partition": partition, "row": name, "error": repr(e)[:300],
                                "at": f"{os.path.basename(where.filename)}:{where.lineno} {where.line}"})
                print(json.dumps(records[-1]), flush=True)
                continue
            if reference is None:
                reference = got
            err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
                      for ga, gb in zip(got, reference) for a, b in zip(ga, gb))
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            s = start.elapsed_time(end) / 1e3 / args.iters
            records.append({"bench": "attention", "partition": partition, "row": name, "micro_batches": len(mbs),
                            "layer_s": round(s, 5), "model_s": round(28 * s, 4), "tflops": round(flops / s / 1e12, 1),
                            "padded_scores_ratio": round(padded_ratio, 3), "max_rel_err_vs_first": round(err, 5)})
            print(json.dumps(records[-1]), flush=True)
    append_jsonl(args.out, records)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="fa2_varlen,cudnn_ragged,padded_cudnn,padded_flash,njt_flash")
    p.add_argument("--partitions", default="balanced,sorted")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    run(p.parse_args())
