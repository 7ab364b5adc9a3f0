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



# vision-language models (issue 61): a decoder as small as the ones above and a two-block vision tower; the token ids
# of the image placeholder and its brackets sit at the top of the vocabulary. mrope_section halves head_dim (8).
_VL_TOKENS = dict(image_token_id=124, video_token_id=125, vision_start_token_id=126, vision_end_token_id=127)
TINY_VL_MODELS = {
    "qwen2_5_vl": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False, **_VL_TOKENS,
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        # window attention over 2x2 merged patches (window_size / patch_size / merge), the last block full
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1])),
    "qwen3_vl": dict(
        model_type="qwen3_vl", tie_word_embeddings=False, **_VL_TOKENS,
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        # deepstack: the first block's features are added into the decoder's first layer
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0])),
}


def tiny_config(kind: str) -> dict:
    """A tiny model's HF kwargs by name: a dense family (`TINY_MODELS`), a mixture of experts or a vision-language
    model (`TINY_VL_MODELS`)."""
    return {**TINY_MODELS, **TINY_MOE_MODELS, **TINY_VL_MODELS}[kind]
