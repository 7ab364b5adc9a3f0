"""Reading a Hugging Face model config the same way everywhere."""

from __future__ import annotations


def text_config(hf_config):
    """The language model's part of `hf_config`: its text config for a multimodal model, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a config says how many positions its model was built for (GPT-2: n_positions)."""


def context_length(hf_config) -> tuple[int, str] | None:
    """(positions, the config key that says so) of the model's context; None where its config says none."""
    config = text_config(hf_config)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def check_context(hf_config, longest: int, what: str, where: str, fix: str) -> None:
    """A ValueError when `longest` tokens (`what`: how they add up) do not fit the context of the model at `where`:
    past it, absolute position embeddings fail with an index error and rotary ones run on positions the model
    never learned."""
    context = context_length(hf_config)
    if context is not None and longest > context[0]:
        raise ValueError(f"{what} is {longest} tokens, past the context of {where} ({context[1]}={context[0]} in its "
                         f"config.json): {fix}, or use a model with a longer context")
