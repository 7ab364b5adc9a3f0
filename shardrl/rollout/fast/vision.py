"""The fast rollout's images: a vision-language model (`shardrl.models.families.FAST_VL_TYPES`, issue 61) generates
from each prompt's images as HF's `generate` does, the HF rollout being the reference.

    prefill  the vision tower (HF's own module, `model.visual`) runs once per prompt and call, over the images of
             the prompts a prefill chunk starts (its n samples, admitted together or later, read the same output);
             its features replace the placeholder tokens' embeddings, and (Qwen3-VL, deepstack) its early blocks'
             features are added to the placeholders' hidden states after the first decoder layers. The decoder
             rotates by the prompt's M-RoPE positions, from the model's own `get_rope_index`.
    decode   a token at cache position p has M-RoPE position p + delta on all three axes (delta = the prompt's
             largest position + 1 - its length, `rope_deltas` in HF): the plain rotary table at p + delta, a
             per-slot offset in the slots' state (`SlotState.rope_delta`), so a decode step stays one graph.

The prefix cache and the prefill's sharing of equal prompts key a prompt by its tokens with each image placeholder
standing as its image's digest (`identity`): two prompts with the same ids and other pixels share nothing.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardrl.models.vision import image_token_id, per_image_features, stack_images


@dataclass
class PrefillImages:
    """What a prefill chunk (U prompts, right-padded to L) of a vision-language model reads besides its ids."""

    positions: torch.Tensor  # (3, U, L) long: the tokens' M-RoPE positions (0 at padding)
    index: torch.Tensor | None = None  # (M,) long: flat indices (into U * L) of the placeholders given features
    features: torch.Tensor | None = None  # (M, hidden): the tower's output for them, in that order
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per first layers: (M, hidden) added after it


class VisionDecoder(nn.Module):
    """HF's layout of a vision-language model's base, so that parameters carry HF's names
    (`model.language_model.layers.0...`, `model.visual...`): the fast decoder as `language_model`, HF's vision tower
    as `visual`. `layers`, `embed_tokens` and `norm` read through to the decoder (what `FastCausalLM` uses)."""

    def __init__(self, language_model: nn.Module, visual: nn.Module):
        super().__init__()
        self.language_model, self.visual = language_model, visual

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm


def vision_tower(config, tower_class: type) -> nn.Module:
    """HF's vision tower (`tower_class`, the class of HF's `model.visual` for the VL `config`) with SDPA attention, as
    the HF rollout's, built on the current device."""
    return tower_class._from_config(config.vision_config, attn_implementation="sdpa")


def reset_tower_buffers(tower: nn.Module, device) -> None:
    """The tower's buffers (its rotary frequencies) made anew in fp32, as HF builds them: after `to_empty` (which
    leaves them uninitialised) and a cast of the whole model (which would round them)."""
    for name, module in tower.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        assert hasattr(module, "config"), f"vision tower buffers at {name!r} of a module without a config"
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for key in own:
            setattr(module, key, getattr(fresh, key).to(device))


class ImageEncoder:
    """A VL model's M-RoPE positions and image features, by HF's own code: `get_rope_index` of the model's base
    (built on meta: it reads only the config) and `get_image_features` with the rollout's tower (`tower()`)."""

    def __init__(self, hf_config, tower):
        import transformers

        with torch.device("meta"):
            self.base = transformers.AutoModelForImageTextToText.from_config(hf_config).model
        self.tower = tower  # () -> the rollout's tower (its model's `model.visual`)
        self.image_id = image_token_id(hf_config)
        self.placeholder_ids = [i for i in (hf_config.image_token_id, getattr(hf_config, "video_token_id", None))
                                if i is not None]
        self.merge = hf_config.vision_config.spatial_merge_size
        self.typed = "mm_token_type_ids" in inspect.signature(self.base.get_rope_index).parameters

    def rope_index(self, ids: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(positions (3, L) long, delta) of one prompt's ids (L,) with images of patch grids `grid` (k, 3):
        M-RoPE positions, and the offset of its decode positions from its cache positions."""
        row = ids[None]
        kwargs = {"mm_token_type_ids": (row == self.image_id).int()} if self.typed else {}
        positions, delta = self.base.get_rope_index(row, image_grid_thw=grid, **kwargs)
        return positions[:, 0], int(delta.reshape(-1)[0])

    @torch.no_grad()
    def encode(self, images: list[dict]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """One tower run over the images of several prompts (each a `multi_modal_inputs` with images): per prompt,
        (features (P_i, hidden), deepstack features [(P_i, hidden)] per layer they join), P_i its placeholders."""
        tower = self.tower()
        device = next(tower.parameters()).device
        stacked = stack_images(images, device)
        self.base.visual = tower  # (the meta base computes with the rollout's tower)
        out = self.base.get_image_features(stacked["pixel_values"].to(tower.dtype), stacked["image_grid_thw"],
                                           return_dict=True)
        per_image, deep = per_image_features(out, stacked["image_grid_thw"], self.merge)
        result, first = [], 0
        for row in images:
            count = len(torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3))
            features = torch.cat(per_image[first:first + count])
            result.append((features, [torch.cat(layer[first:first + count]) for layer in deep]))
            first += count
        return result


def image_digests(images: dict) -> list[int]:
    """One negative int64 per image of a prompt's `multi_modal_inputs` (never a token id): a digest of its pixels
    and patch grid, which stands for each of its placeholders in the prompt's `identity`."""
    grids = torch.as_tensor(images["image_grid_thw"]).long().reshape(-1, 3)
    pixels = torch.as_tensor(images["pixel_values"])
    digests, first = [], 0
    for grid in grids:
        count = int(grid.prod())  # its patches (rows of pixel_values)
        h = hashlib.blake2b(grid.cpu().numpy().tobytes(), digest_size=8)
        h.update(pixels[first:first + count].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(-1 - (int.from_bytes(h.digest(), "little") >> 1))
        first += count
    return digests


def identity(tokens: list[int], images: dict | None, placeholder: int, merge: int) -> list[int]:
    """`tokens` with each image's placeholders replaced by its digest (`image_digests`): what the prefix cache and
    the prefill's sharing of equal prompts key a prompt by. Unchanged for a prompt without images."""
    if not images or images.get("image_grid_thw") is None or not len(images["image_grid_thw"]):
        return tokens
    grids = torch.as_tensor(images["image_grid_thw"]).long().reshape(-1, 3)
    counts = [int(g.prod()) // merge**2 for g in grids]  # placeholders per image
    if tokens.count(placeholder) != sum(counts):
        raise ValueError(f"a prompt has {tokens.count(placeholder)} image placeholders and images of {sum(counts)} "
                         "features; render prompt and images together with the model's processor")
    digests = iter([d for d, c in zip(image_digests(images), counts) for _ in range(c)])
    return [next(digests) if t == placeholder else t for t in tokens]


class CallImages:
    """One generate call's images (a vision-language model), by prompt b: its M-RoPE positions and delta, made once;
    its tower output, made by the first prefill that needs it and kept until all its n rows are admitted (rows
    admitted later, or prefilled again past a cached prefix, read it: one tower run per prompt and call)."""

    def __init__(self, encoder: ImageEncoder, images: list[dict | None], n: int):
        self.encoder, self.images, self.n = encoder, images, n
        self.rope: dict[int, tuple[torch.Tensor, int]] = {}  # b -> ((3, P) CPU positions, delta)
        self.features: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # b -> `ImageEncoder.encode`'s
        self.waiting: dict[int, int] = {}  # b -> its rows not admitted yet (n until its first is)
        self.encoded = 0  # images run through the tower in this call

    def with_images(self, b: int) -> bool:
        row = self.images[b] if b < len(self.images) else None  # (a stream's rows come without images)
        return bool(row) and row.get("image_grid_thw") is not None and len(row["image_grid_thw"]) > 0

    def identity(self, b: int, tokens: list[int]) -> list[int]:
        """Prompt b's ids with each placeholder standing as its image's digest (`identity`)."""
        if not self.with_images(b):
            return tokens
        return identity(tokens, self.images[b], self.encoder.image_id, self.encoder.merge)

    def rope_of(self, b: int, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Prompt b's (M-RoPE positions (3, P) on the CPU, delta), from its `identity` tokens."""
        if not self.with_images(b):  # text positions on all three axes
            return torch.arange(len(tokens)).expand(3, -1), 0
        if b not in self.rope:
            ids = torch.tensor([self.encoder.image_id if t < 0 else t for t in tokens])  # (the real ids)
            grid = torch.as_tensor(self.images[b]["image_grid_thw"]).long().reshape(-1, 3).cpu()  # (may come on CUDA)
            self.rope[b] = self.encoder.rope_index(ids, grid)
        return self.rope[b]

    def prefill_inputs(self, order: list[int], tokens: list[list[int]], starts: list[int], length: int,
                       to_device) -> PrefillImages:
        """The `PrefillImages` of a chunk: prompts `order` (their `identity` tokens `tokens`) from `starts` on,
        right-padded to `length`; the tower runs (once, over all of them) for those not encoded yet that still
        have placeholders to prefill. `to_device` moves CPU tensors to the device without waiting for it."""
        positions = torch.zeros(3, len(order), length, dtype=torch.long)
        spots = []  # per prompt: the offsets (past its start) of the placeholders it prefills
        for i, (b, toks, start) in enumerate(zip(order, tokens, starts)):
            positions[:, i, : len(toks) - start] = self.rope_of(b, toks)[0][:, start:]
            spots.append([j - start for j in range(start, len(toks)) if toks[j] < 0])
        need = [b for b, spot in zip(order, spots) if spot and b not in self.features]
        if need:
            for b, encoded in zip(need, self.encoder.encode([self.images[b] for b in need])):
                self.features[b] = encoded
            self.encoded += sum(len(torch.as_tensor(self.images[b]["image_grid_thw"]).reshape(-1, 3)) for b in need)
        inputs = PrefillImages(to_device(positions))
        parts = [(i, b, toks, start, spot) for i, (b, toks, start, spot) in enumerate(zip(order, tokens, starts, spots))
                 if spot]
        if not parts:
            return inputs
        index, rows = [], []
        for i, b, toks, start, spot in parts:
            index += [i * length + j for j in spot]
            first = sum(1 for t in toks[:start] if t < 0)  # the placeholders of the cached prefix: not prefilled
            rows.append((b, first, first + len(spot)))
        features = [self.features[b] for b, _, _ in rows]
        inputs.index = to_device(index)
        inputs.features = torch.cat([f[lo:hi] for (f, _), (_, lo, hi) in zip(features, rows)])
        inputs.deepstack = [torch.cat([deep[layer][lo:hi] for (_, deep), (_, lo, hi) in zip(features, rows)])
                            for layer in range(len(features[0][1]))]
        return inputs

    def admitted(self, prompts: list[int]) -> None:
        """One row of each of `prompts` (a list with repeats) is admitted: a prompt's tower output goes with its last."""
        for b in prompts:
            self.waiting[b] = self.waiting.get(b, self.n) - 1
            if self.waiting[b] == 0:
                self.features.pop(b, None)
