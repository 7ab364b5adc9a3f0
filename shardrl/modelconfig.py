"""Reading a Hugging Face model config the same way everywhere."""

from __future__ import annotations


def text_config(hf_config):
    """The language model's part of `hf_config`: its text config for a multimodal model, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
