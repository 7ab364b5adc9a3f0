"""A vision-language model in the engine: the images a micro-batch carries, its M-RoPE positions, packed, and the
vision tower frozen or trained (issue 61).

A batch carries each row's images in the per-row field `multi_modal_inputs` (verl's name): a dict with
`pixel_values` (P_i, D), the row's patches, and `image_grid_thw` (k_i, 3), each image's (temporal, height, width)
patch grid; None or {} for a row without images. A micro-batch is a cut of rows, so it carries its rows' images
and nothing else; `stack_images` joins them in row order, the order of the placeholders in the micro-batch. Rows
repeating images (a GRPO group's n samples of one prompt) have the tower run once over the distinct ones
(`micro_batch_images`), its features spliced into every row that holds them (`spliced_embeddings`).

Positions: the decoder rotates queries and keys by a (temporal, height, width) position per token (M-RoPE), which
the model's own `get_rope_index` computes per row from its ids and image grids (text tokens advance all three by 1;
an image's tokens take its patch grid's coordinates). The rows are numbered on the padded (B, T) batch and then
laid out like the tokens: packed, the (3, N) positions of the real tokens are prefixed with the plain per-sequence
positions (0, 1, ... restarting per row), the 4-row form HF's Qwen-VL decoders read as "text positions for the
packed attention mask, then M-RoPE".

The decoder run is the HF model's base (`model.model`: embeddings, the vision tower's output spliced at the
placeholders, the language model), so every step that places image features is HF's own. Under Ulysses sequence
parallelism (sp > 1) a rank holds a contiguous piece of the packed row, and with it only some of the placeholders:
`vision_sequence_piece` runs the tower on all the micro-batch's images on every rank of the group, splices them
into the whole row's embeddings, and hands the language model this rank's piece of them (and of the positions, and
of Qwen3-VL's deepstack features).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from shardrl.engine.attention import attention_kwargs
from shardrl.models.vision import (image_token_id, is_vision_language, per_image_features,  # noqa: F401
                                   stack_images, vision_family)

MULTI_MODAL_KEY = "multi_modal_inputs"
"""The per-row batch field holding a row's `pixel_values` and `image_grid_thw`."""


def check_vision_engine(hf_config, head: str) -> None:
    """A ValueError for what the engine does not do with a vision-language model yet (said with the setting).
    (LoRA is built: its adapters go on the language model only, `engine.lora.inject_lora`; so is Ulysses,
    `vision_sequence_piece`; so is a critic's value head, on the VL base's last hidden states.)"""
    if not is_vision_language(hf_config):
        return
    if head == "score":
        raise ValueError(f"a reward model on the vision-language model {hf_config.model_type!r} is not supported yet "
                         "(reward models with images are a later step of issue 61); give reward.model_path a text "
                         "sequence classifier, or score with reward.function_path")


def freeze_vision_tower(lm: nn.Module) -> int:
    """Stops training the vision tower (patch embedding, blocks, merger): its parameters keep their weights and
    get no gradient, as verl's freeze_vision_tower. Returns the number of parameters frozen."""
    tower = lm.get_submodule(vision_family(lm.config).vision_tower)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def mrope_position_ids(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """(3, B, T) M-RoPE positions of the padded batch (0 at padding), by the model's `get_rope_index`."""
    model = lm.model
    params = inspect.signature(model.get_rope_index).parameters
    kwargs = dict(image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    if "mm_token_type_ids" in params:  # transformers >= 5.2x: the modality of each token, 1 at image placeholders
        kwargs["mm_token_type_ids"] = (input_ids == image_token_id(lm.config)).int()
    if image_grid_thw is None:  # no image in the micro-batch: text positions, the same on all three axes
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return position_ids[None].expand(3, -1, -1)
    with torch.no_grad():
        position_ids, _ = model.get_rope_index(input_ids, **kwargs)
    return position_ids


def idle_vision_tower(lm: nn.Module, device: torch.device) -> torch.Tensor:
    """0 times the vision tower's output on one blank image of 2 x 2 merged patches: added to a micro-batch without
    images, so that every rank runs the tower's forward and backward in every micro-batch. Under FSDP each of its
    blocks is a round of collectives (gather, reduce-scatter); a rank whose rows have no image would otherwise skip
    the rounds the others run, and the job would hang."""
    visual = lm.get_submodule(vision_family(lm.config).vision_tower)
    merge = visual.spatial_merge_size
    patch_dim = visual.patch_embed.proj.weight.shape[1:].numel()  # channels x temporal x patch x patch
    grid = torch.tensor([[1, merge, merge]], device=device)
    blank = torch.zeros(merge * merge, patch_dim, device=device)
    out = lm.model.get_image_features(blank, grid, return_dict=True)
    features = [out.pooler_output, getattr(out, "deepstack_features", None)]  # (Qwen3-VL: deepstack's too)
    return sum(f.float().sum() for f in _tensors(features)) * 0.0


def _tensors(nested) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for item in (nested or []) for t in _tensors(item)]


def vision_decoder_inputs(lm: nn.Module, decoder_inputs: dict, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor, flat_index: torch.Tensor, packed: bool,
                          images: dict[str, torch.Tensor]) -> dict:
    """`decoder_inputs` (a text layout's: input_ids and position_ids, with an attention mask when padded) made
    the VL base model's: M-RoPE positions in the same layout, and the micro-batch's images."""
    mrope = mrope_position_ids(lm, input_ids, attention_mask, images.get("image_grid_thw"))  # (3, B, T)
    inputs = dict(decoder_inputs)
    if packed:  # (4, 1, N): the per-sequence text positions (the packed mask), then M-RoPE of the real tokens
        text = decoder_inputs["position_ids"]  # (1, N)
        inputs["position_ids"] = torch.cat([text, mrope.flatten(1)[:, flat_index]])[:, None]
    else:
        inputs["position_ids"] = mrope
    inputs.update(images)
    return inputs


def vision_sequence_piece(lm: nn.Module, decoder_inputs: dict, ids: torch.Tensor, text_positions: torch.Tensor,
                          local: slice, group) -> dict:
    """Ulysses: the language model's inputs for this rank's `local` piece of a packed row.

    `decoder_inputs` are the row's (`vision_decoder_inputs`, packed: position_ids (4, 1, N), the images); `ids` and
    `text_positions` (N_p,) the row padded to a multiple of sp (`split_sequence`). Every rank of the group runs the
    vision tower on all the images and splices them into the whole row's embeddings, then keeps its piece: the
    gradient reaching the tower on a rank is that of the placeholders in its piece alone, so the group's gradient
    reduction sums each placeholder's once (the same as the text tokens' embeddings). The padding's M-RoPE rows
    repeat its text positions."""
    mrope = decoder_inputs["position_ids"][1:, 0]  # (3, N)
    n = mrope.shape[1]
    mrope = torch.cat([mrope, text_positions[n:].expand(3, -1)], 1)  # (3, N_p)
    position_ids = torch.cat([text_positions[None], mrope])[:, None, local]  # (4, 1, n_local)
    inputs = dict(position_ids=position_ids, **attention_kwargs(text_positions[None], group))
    if "pixel_values" in decoder_inputs:
        embeds, is_image, deepstack = spliced_embeddings(lm, decoder_inputs, ids)
        if deepstack is not None:  # Qwen3-VL: added to the early layers' output at the placeholders of the piece
            first, last = int(is_image[:local.start].sum()), int(is_image[:local.stop].sum())
            inputs["visual_pos_masks"] = is_image[local][None]  # (1, n_local)
            inputs["deepstack_visual_embeds"] = [layer[first:last] for layer in deepstack]
    else:
        embeds = lm.get_input_embeddings()(ids)  # (N_p, H)
    inputs["inputs_embeds"] = embeds[local][None]  # (1, n_local, H)
    return inputs


IMAGE_KEYS = ("pixel_values", "image_grid_thw", "distinct_grid_thw", "image_copies")
"""The decoder inputs that carry a micro-batch's images (`micro_batch_images`)."""


def distinct_images(rows: list | None) -> tuple[list[dict], list[int]]:
    """The rows' images (each a row's `multi_modal_inputs`; rows without images left out) once each, and for each
    row with images the index of its images among those. A GRPO group's n rows carry one prompt's images (the same
    objects: `trainer.generation`); rows whose tensors are other objects of the same values count as copies too."""
    kept: list[dict] = []
    copies: list[int] = []
    for row in rows or []:
        if not (row and row.get("image_grid_thw") is not None and len(row["image_grid_thw"])):
            continue
        # (the last kept first: a group's rows come together)
        match = next((j for j in reversed(range(len(kept))) if _same_images(kept[j], row)), None)
        if match is None:
            kept.append(row)
            match = len(kept) - 1
        copies.append(match)
    return kept, copies


def _same_images(a: dict, b: dict) -> bool:
    if a is b or (a["pixel_values"] is b["pixel_values"] and a["image_grid_thw"] is b["image_grid_thw"]):
        return True
    pa, pb = torch.as_tensor(a["pixel_values"]), torch.as_tensor(b["pixel_values"])
    ga, gb = torch.as_tensor(a["image_grid_thw"]).reshape(-1), torch.as_tensor(b["image_grid_thw"]).reshape(-1)
    return (pa.shape == pb.shape and torch.equal(ga, gb) and torch.equal(pa[:1], pb[:1])  # (most differ at once)
            and torch.equal(pa, pb))


def micro_batch_images(rows: list | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The images of a micro-batch's rows (`stack_images`), each distinct one once (`distinct_images`): where rows
    repeat images (a GRPO group's n samples of one prompt), `pixel_values` and `distinct_grid_thw` are the distinct
    images', `image_copies` gives for each image of the rows in order its index among them, and `image_grid_thw`
    stays every row's (the M-RoPE positions read it). The tower then runs once for all the copies: their features
    are the same, and autograd sums the copies' gradients into the tower as it sums those of n runs."""
    kept, copies = distinct_images(rows)
    images = stack_images(kept, device)
    if len(kept) == len(copies):
        return images
    counts = [len(torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3)) for row in kept]
    starts = [sum(counts[:j]) for j in range(len(kept))]
    order = [starts[j] + i for j in copies for i in range(counts[j])]
    grid = images["image_grid_thw"]
    return {"pixel_values": images["pixel_values"], "distinct_grid_thw": grid,
            "image_grid_thw": grid[torch.tensor(order, device=grid.device)], "image_copies": order}


def spliced_embeddings(lm: nn.Module, decoder_inputs: dict, ids: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """(the embeddings of `ids` with the micro-batch's image features at their placeholders, the placeholder mask,
    Qwen3-VL's deepstack features (a layer's: one row per placeholder, in order) or None). The tower runs once over
    the distinct images of `decoder_inputs` (`micro_batch_images`), its features then placed in the rows' order."""
    embeds = lm.get_input_embeddings()(ids)
    grid = decoder_inputs.get("distinct_grid_thw", decoder_inputs["image_grid_thw"])
    out = lm.model.get_image_features(decoder_inputs["pixel_values"], grid, return_dict=True)
    per_image, deep = per_image_features(out, grid, lm.config.vision_config.spatial_merge_size)
    order = decoder_inputs.get("image_copies") or range(len(per_image))
    placed = lambda parts: torch.cat([parts[j] for j in order])  # noqa: E731  (in the rows' order)
    features = placed(per_image).to(embeds.dtype)  # (I, H): one row per placeholder, in order
    is_image = ids == image_token_id(lm.config)
    if int(is_image.sum()) != features.shape[0]:
        raise ValueError(f"the micro-batch has {int(is_image.sum())} image placeholder tokens but its images "
                         f"give {features.shape[0]} features: each row's multi_modal_inputs must be its own")
    embeds = embeds.masked_scatter(is_image[..., None], features)
    return embeds, is_image, [placed(layer) for layer in deep] if deep else None


def embedded_inputs(lm: nn.Module, decoder_inputs: dict) -> dict:
    """`decoder_inputs` (the VL base's, `vision_decoder_inputs`) as the language model's: the ids embedded with the
    images spliced in (`spliced_embeddings`), the rest as they were."""
    inputs = {k: v for k, v in decoder_inputs.items() if k not in IMAGE_KEYS and k != "input_ids"}
    embeds, is_image, deepstack = spliced_embeddings(lm, decoder_inputs, decoder_inputs["input_ids"])
    inputs["inputs_embeds"] = embeds
    if deepstack is not None:
        inputs["visual_pos_masks"], inputs["deepstack_visual_embeds"] = is_image, deepstack
    return inputs
