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

NOT_BUILT = {
    "offline": "dpo, kto and rm with images are not built yet (issue 61); shardrl sft (the warm start) and RL "
               "training (shardrl train) are",
    "disaggregated": "separate rollout ranks do not carry images yet (issue 61); leave async_rl.rollout_ranks at 0 "
                     "(colocated)",
    "episodes": "multi-turn and agent episodes with images are not built yet (issue 61); single-turn GRPO/PPO "
                "(rollout.multi_turn.enable=false, no rollout.agent.entrypoint) is",
}
"""What a VL model that meets a part not built for it yet is told, by part."""


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


def refuse_vision_language(hf_config, where: str, part: str) -> None:
    """A ValueError naming `where` (a setting or a command) for a VL model meeting a part (`NOT_BUILT`) not built
    for it yet."""
    if is_vision_language(hf_config):
        raise ValueError(f"{where}: {hf_config.model_type!r} is a vision-language model; {NOT_BUILT[part]}")


def per_image_features(out, grid: "torch.Tensor", merge: int) -> tuple[list, list[list]]:
    """HF's `get_image_features` output for images of patch grids `grid` (k, 3) as (each image's features
    (tokens_i, hidden), and per deepstack layer (Qwen3-VL) each image's): HF gives each as a list of one tensor an
    image or, by version (transformers 5.17's deepstack), one tensor joined over the images."""
    import torch

    sizes = (grid.prod(-1) // merge ** 2).tolist()

    def split(features) -> list:
        return list((features if torch.is_tensor(features) else torch.cat(list(features))).split(sizes))

    return split(out.pooler_output), [split(layer) for layer in (getattr(out, "deepstack_features", None) or [])]


def stack_images(rows: list | None, device: "torch.device") -> dict[str, "torch.Tensor"]:
    """Rows' images (each a row's `multi_modal_inputs` or None) in row order, the order of their placeholders in
    the rows: {"pixel_values": (sum P_i, D), "image_grid_thw": (sum k_i, 3)}, or {} when no row has one."""
    import torch  # (the tables above are read without torch: `shardrl.models.families`)

    rows = [r for r in (rows or []) if r and r.get("image_grid_thw") is not None and len(r["image_grid_thw"])]
    if not rows:
        return {}
    return {"pixel_values": torch.cat([torch.as_tensor(r["pixel_values"]) for r in rows]).to(device),
            "image_grid_thw": torch.cat([torch.as_tensor(r["image_grid_thw"]).long().reshape(-1, 3)
                                         for r in rows]).to(device)}
