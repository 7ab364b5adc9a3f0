"""Reading a Hugging Face model config the same way everywhere."""

from __future__ import annotations


def text_config(hf_config):
    """The language model's part of `hf_config`: its text config for a multimodal model, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a config says how many positions its model was built for (GPT-2: n_positions)."""


def context_length(hf_config) -> tuple[int, str] | None:
    """(positions, what in its config says so) of the model's context; None where its config says none."""
    config = text_config(hf_config)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            # rotary scaling (YaRN, dynamic, linear) that keeps max_position_embeddings at the trained length
            # stretches it by its factor (Qwen2.5's YaRN: 32768 x 4)
            scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
            factor = scaling.get("factor") if isinstance(scaling, dict) else None
            if isinstance(factor, (int, float)) and factor > 1:
                original = scaling.get("original_max_position_embeddings") or value
                if factor * original > value:
                    return int(factor * original), f"{key}={value}, rope scaling x{factor:g} of {original}"
            return value, f"{key}={value}"
    return None


def check_context(hf_config, longest: int, what: str, where: str, fix: str) -> None:
    """A ValueError when `longest` tokens (`what`: how they add up) do not fit the context of the model at `where`:
    past it, absolute position embeddings fail with an index error and rotary ones run on positions the model
    never learned."""
    context = context_length(hf_config)
    if context is not None and longest > context[0]:
        raise ValueError(f"{what} is {longest} tokens, past the context of {where} ({context[0]} positions: "
                         f"{context[1]} in its config.json): {fix}, or use a model with a longer context")
