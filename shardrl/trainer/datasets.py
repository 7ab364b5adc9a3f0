"""The prompt sets of an RL run, tokenized, each prompt with the tools a multi-turn rollout shows it."""

from __future__ import annotations

from shardrl.config.schema import Config
from shardrl.data.prompts import load_prompt_dataset
from shardrl.rollout.episodes.interactions import prompt_tool_schemas


def load_datasets(cfg: Config, tokenizer) -> tuple[list, list | None]:
    """The training and validation prompt sets (None without `data.val_files`)."""
    d = cfg.data
    tools = prompt_tool_schemas(cfg.rollout.multi_turn)  # the tools a multi-turn prompt shows, if any

    def load(files):
        return load_prompt_dataset(files, tokenizer, d.prompt_key, d.max_prompt_length, d.truncation, d.skip_bad_rows,
                                   tools)
    return load(d.train_files), (load(d.val_files) if d.val_files else None)
