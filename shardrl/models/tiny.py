"""Tiny configs of the model families (`shardrl.models.families`), by model type: HF config kwargs for models small
enough to build, train and generate with on a CPU in tests, benchmarks' smoke runs and the demo."""

from __future__ import annotations

TINY_MODELS = {
    # Qwen2: biases on q/k/v, untied head
    "qwen2": dict(model_type="qwen2", vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False),
    # Llama with the head tied to the embedding
    "llama": dict(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True),
}
# mixtures of experts (hidden and expert sizes multiples of 8: HF's grouped_mm experts take them)
TINY_MOE_MODELS = {
    # Qwen3-MoE: softmax, top-k, renormalized (norm_topk_prob); q/k norms
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=101, hidden_size=32, intermediate_size=64,
                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      max_position_embeddings=256, tie_word_embeddings=False),
    # Mixtral: top-2 of 4, always renormalized
    "mixtral": dict(model_type="mixtral", vocab_size=101, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=256, tie_word_embeddings=False),
    # OLMoE: top-2 of 8, not renormalized; q/k norms over the whole projection
    "olmoe": dict(model_type="olmoe", vocab_size=101, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=100, pad_token_id=1),
}


def tiny_config(kind: str) -> dict:
    """A tiny model's HF kwargs by name: a dense family (`TINY_MODELS`) or a mixture of experts."""
    return {**TINY_MODELS, **TINY_MOE_MODELS}[kind]
