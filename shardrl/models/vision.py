"""Vision-language models: which HF model types shardrl reads as an image encoder beside a language model, and
where their parts sit (issue 61).

A vision-language model here is HF's `*ForConditionalGeneration` of a family in `VL_FAMILIES`: a vision tower
(`model.visual`: patch embedding, blocks, merger) whose output replaces the image placeholder tokens' embeddings,
and a decoder with multimodal rotary positions (M-RoPE: a (temporal, height, width) position per token, from the
model's own `get_rope_index`). What the engine does with one: `shardrl.engine.vision`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionFamily:
    vision_tower: str = "model.visual"
    """The vision tower's module path inside the HF model (what `model.freeze_vision_tower` freezes)."""
    language_model: str = "model.language_model"
    """The decoder's module path inside the HF model."""


VL_FAMILIES = {
    "qwen2_5_vl": VisionFamily(),
    "qwen2_vl": VisionFamily(),
    "qwen3_vl": VisionFamily(),
}

NEXT_STEP = ("vision-language RL: the engine's forward is built; the rollout is not yet (issue 61, phase 2: the "
             "fast rollout's image prefill with M-RoPE decode positions, then the trainer and sft with images)")
"""What a VL model that meets a part not built for it yet is told (the rollout, the trainer, sft)."""


def is_vision_language(hf_config) -> bool:
    """Whether `hf_config` is a vision-language model shardrl knows (`VL_FAMILIES`)."""
    return getattr(hf_config, "model_type", None) in VL_FAMILIES and hasattr(hf_config, "vision_config")


def vision_family(hf_config) -> VisionFamily:
    return VL_FAMILIES[hf_config.model_type]


def image_token_id(hf_config) -> int:
    """The id of the placeholder token each image's merged patches replace (`<|image_pad|>` in Qwen)."""
    token = getattr(hf_config, "image_token_id", None)
    if token is None:
        raise ValueError(f"the {hf_config.model_type!r} config has no image_token_id; a vision-language model's "
                         "config.json names its image placeholder token there")
    return int(token)


def refuse_vision_language(hf_config, where: str) -> None:
    """A ValueError naming `where` (the rollout, the trainer, sft) for a VL model it does not handle yet."""
    if is_vision_language(hf_config):
        raise ValueError(f"{where}: {hf_config.model_type!r} is a vision-language model; {NEXT_STEP}")
