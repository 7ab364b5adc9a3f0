"""Model FLOPs of an RL step, for `perf/*` metrics (throughput, MFU).

Model FLOPs, not hardware FLOPs: what the model's arithmetic needs for the tokens of the step, whatever the
implementation does on top (activation-checkpointing recomputation, padding, placeholder micro-batches
are not counted), as in the PaLM paper's MFU. Per token of a sequence of `s` real tokens, a forward costs

    2 * N  +  4 * L * d_attn * (i + 1)      (i: the token's position, 0-based; causal attention)

where N is the number of parameters in matrix products per token (`model_shape`), L the layers and d_attn
= heads x head_dim (the width of QK^T and of attention x V). Summed over a sequence: 2*N*s + 2*L*d_attn*s*(s+1).
A backward costs twice the forward, so a training pass costs 3x; generation costs one forward over the
prompt and the response (a KV cache computes each token once).

The output head is counted only where its result is read (`scored_lens`): in RL, at the positions that predict
a response token. Generation reads the vocabulary's logits for each new token only, and the engine's forward
projects only the response positions (`PolicyModel.forward`'s `score_from`); a prompt's own next-token
probabilities are never needed, so counting them would credit work nobody has to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardrl.models.families import gated_mlp, moe_layer_count, num_experts
from shardrl.models.config import text_config

H200_BF16_MEASURED_TFLOPS = 788.0
"""The dense bf16 matrix rate measured on one H200 (a large bf16 matmul, bench/); `perf/mfu_measured`."""
H200_BF16_SPEC_TFLOPS = 989.0
"""NVIDIA's dense bf16 spec of an H200 (and H100 SXM), without sparsity; `perf/mfu_spec`."""



@dataclass(frozen=True)
class ModelShape:
    num_params: int
    """Parameters in matrix products per token: the decoder layers' attention and MLP matrices (the active
    experts of an MoE layer) plus the output head. The input embedding is a lookup and is left out; the head
    is a matmul every token, tied to the embedding or not. Biases and norms are left out (no matmul)."""
    num_layers: int
    attn_dim: int
    """num_attention_heads x head_dim: the width of the attention score and value products."""
    head_params: int = 0
    """The part of `num_params` in the output head (hidden x vocabulary, or hidden x 1 for a value head)."""


def model_shape(hf_config, head_outputs: int | None = None) -> ModelShape:
    """The `ModelShape` of a Hugging Face decoder config (Llama/Qwen/Mistral-style or GPT-2-style names).
    `head_outputs`: the output head's width, the vocabulary by default (1 for a value head)."""
    c = text_config(hf_config)

    def first(*names, default=None):
        for name in names:
            value = getattr(c, name, None)
            if value is not None:
                return value
        if default is None:
            raise ValueError(f"cannot count the FLOPs of a {type(c).__name__}: it has none of {names}")
        return default

    hidden = first("hidden_size", "n_embd", "d_model")
    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head")
    kv_heads = first("num_key_value_heads", default=heads)
    head_dim = first("head_dim", default=hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v (fewer heads with GQA)
    matrices = 3 if gated_mlp(c) else 2
    dense = matrices * hidden * first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    routed = moe_layer_count(c)
    if routed:  # MoE: the router, the experts a token is routed to, and a shared expert if there is one
        expert = first("moe_intermediate_size", "intermediate_size")
        shared = getattr(c, "shared_expert_intermediate_size", None) or 0
        moe = matrices * hidden * (c.num_experts_per_tok * expert + shared) + hidden * num_experts(c)
        body = layers * attention + routed * moe + (layers - routed) * dense  # dense layers (mlp_only_layers)
    else:
        body = layers * (attention + dense)
    head = hidden * (first("vocab_size") if head_outputs is None else head_outputs)
    return ModelShape(num_params=body + head, num_layers=layers, attn_dim=heads * head_dim, head_params=head)


def forward_flops(shape: ModelShape, seq_lens: torch.Tensor, scored_lens: torch.Tensor | None = None) -> float:
    """FLOPs of one forward over sequences of `seq_lens` real tokens each (causal attention included), the
    output head run at `scored_lens` positions of each (all of them when None)."""
    s = seq_lens.to(torch.float64)
    head_tokens = s.sum() if scored_lens is None else scored_lens.to(torch.float64).sum()
    body = shape.num_params - shape.head_params
    return float(2 * body * s.sum() + 2 * shape.head_params * head_tokens
                 + 2 * shape.num_layers * shape.attn_dim * (s * (s + 1)).sum())


def rl_step_flops(seq_lens: torch.Tensor, policy: ModelShape, num_policy_forwards: int, actor_epochs: int,
                  critic: ModelShape | None = None, critic_epochs: int = 0,
                  response_lens: torch.Tensor | None = None) -> float:
    """Model FLOPs of one RL step on sequences of `seq_lens` real tokens (prompt + response) each: generation
    (one policy forward), `num_policy_forwards` inference-only forwards of the policy's shape (old log-probs,
    reference), `actor_epochs` training passes (forward + backward, 3 forwards each); with a critic, its
    value forward and `critic_epochs` training passes. A reward model's forward is not counted. The policy's
    head runs at `response_lens` positions of each sequence (every position when None)."""
    total = forward_flops(policy, seq_lens, response_lens) * (1 + num_policy_forwards + 3 * actor_epochs)
    if critic is not None:
        total += forward_flops(critic, seq_lens) * (1 + 3 * critic_epochs)
    return total


def throughput_metrics(metrics: dict[str, float], num_gpus: int, on_cuda: bool) -> dict[str, float]:
    """Rates of a step from its reduced metrics: the whole batch's `perf/total_num_tokens` (prompt + response
    tokens of every sample, each counted once however many passes read it) and `perf/step_tflop` (model
    FLOPs, `rl_step_flops`) over `timing/step_s` (the whole step: generation, rewards, inference passes,
    updates) and `num_gpus` (every process of the run). MFU against an H200's bf16 rate, measured and spec,
    on CUDA only: on a CPU, or another GPU, those peaks mean nothing (tflop_per_s_per_gpu still holds)."""
    step_s = metrics["timing/step_s"]
    out = {"perf/tokens_per_s_per_gpu": metrics["perf/total_num_tokens"] / step_s / num_gpus}
    if "perf/step_tflop" in metrics:
        tflops = metrics["perf/step_tflop"] / step_s / num_gpus
        out["perf/tflop_per_s_per_gpu"] = tflops
        if on_cuda:
            out["perf/mfu_measured"] = tflops / H200_BF16_MEASURED_TFLOPS
            out["perf/mfu_spec"] = tflops / H200_BF16_SPEC_TFLOPS
    return out
