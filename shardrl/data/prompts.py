"""Prompt datasets: load JSONL/Parquet prompt files, tokenize once, and serve dp-sharded batches.

A row holds the prompt under `prompt_key` (a string, or a list of chat messages rendered with the
tokenizer's chat template and checked by `data.messages`: roles system, user, assistant, tool), an optional
`data_source` (picks the reward function) and any other fields, which travel along as the row's `extra` (e.g.
`ground_truth`). verl-style rows that keep the answer in
`reward_model: {ground_truth: ...}` get `extra["ground_truth"]` too. A reward function's `extra_info` is
the row's own `extra_info` field with the rest of `extra` merged in (`shardrl.rewards.manager.reward_extra_info`).

Row numbers in messages are 1-based: the line number in a JSONL file, the row index in a Parquet file.
"""

from __future__ import annotations

import json
import logging
import os
from typing import NamedTuple

import torch

from shardrl.data.messages import check_messages

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
SET_TEMPLATE = ("set model.chat_template to the model's Jinja chat template (the text, or a file holding it), or "
                "use a tokenizer folder that has one")
TRUNCATION_MODES = ("drop", "error", "left", "right")


class PromptDataset:
    """Tokenized prompts; item i is `{"prompt_ids", "prompt_text", "data_source", "extra", "index", "prompt"}`
    (`prompt`: the row's own, a string or chat messages)."""

    def __init__(self, items: list[dict], stats: dict, files: list[str]):
        self.items = items
        self.stats = stats
        self.files = files

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class UnreadableRow(NamedTuple):
    """A JSON line that does not parse, in place of its row (`read_rows(keep_bad_lines=True)`): a bad row that
    data.skip_bad_rows drops and counts like any other."""

    problem: str


def read_rows(path: str, keep_bad_lines: bool = False) -> list[tuple[int, object]]:
    """(1-based row number, row) pairs of one file; rows are whatever the file holds (checked later). A JSONL
    line that does not parse is an error, or with `keep_bad_lines` an `UnreadableRow` for the caller to count."""
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder, not a data file: list its files (data.train_files=[a.parquet, "
                         f"b.parquet]) or name one")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if ext in (".jsonl", ".json"):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of row 1
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at offset "
                             f"{e.start}); save the file as UTF-8") from None
        if text.lstrip().startswith("["):  # a .json file holding one array of rows
            try:
                return list(enumerate(json.loads(text), start=1))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from e
        rows = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((line_number, json.loads(line)))
            except json.JSONDecodeError as e:
                if _one_object(text):  # e.g. a pretty-printed object: not lines of rows
                    raise ValueError(f"{path}: holds one JSON object, not rows: a .json data file is one array "
                                     "of row objects ([{...}, {...}]), or use JSON lines (.jsonl, one row object a "
                                     "line)") from None
                problem = f"not valid JSON ({e.msg} at column {e.colno})"
                if not keep_bad_lines:
                    raise ValueError(f"{path}: row {line_number}: {problem}") from None
                rows.append((line_number, UnreadableRow(problem)))
        return rows
    raise ValueError(
        f"unsupported data file type {ext or '(no extension)'!r} for {path!r}; "
        f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
    )


def _short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_row(row, prompt_key: str) -> str | None:
    """None if the row is usable, else what is wrong with it (for the error message)."""
    if isinstance(row, UnreadableRow):
        return row.problem
    if not isinstance(row, dict):
        return f"expected a JSON object, found {type(row).__name__} {_short_repr(row)}"
    if prompt_key not in row:
        return f"no {prompt_key!r} key; available keys: {sorted(row)}"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return None if prompt.strip() else f"the {prompt_key!r} string is empty; a prompt needs text"
    if isinstance(prompt, list):
        try:
            check_messages(prompt, prompt_key)
        except ValueError as e:
            return str(e)
        return None
    return (
        f"{prompt_key!r} must be a string or a non-empty list of {{'role': str, 'content': str}} messages, "
        f"found {type(prompt).__name__} {_short_repr(prompt)}; available keys: {sorted(row)}"
    )


# (keys a row holds, what a file of such rows is, the command that reads it), the first that fits
FILE_KINDS = ((("chosen", "rejected"), "a preference file (prompt/chosen/rejected)", "shardrl dpo and shardrl rm"),
              (("messages",), "an SFT file (messages)", "shardrl sft"),
              (("prompt", "completion", "label"), "an unpaired preference file (prompt/completion/label)",
               "shardrl kto"),
              (("prompt", "response"), "an SFT file (prompt/response)", "shardrl sft"),
              (("prompt", "completion"), "an SFT file (prompt/completion)", "shardrl sft"),
              (("prompt",), "an RL prompt file (prompt)", "shardrl train"))


def check_columns(path: str, rows: list, usable, wanted: str, reader: str) -> None:
    """A ValueError when no row of the file holds the columns its trainer reads (`usable(row)` false for every
    row): what `reader` (e.g. "shardrl dpo") reads (`wanted`), the keys the rows have, and which command reads
    such a file. Said once for the file, where data.skip_bad_rows would drop every row."""
    objects = [row for _, row in rows if isinstance(row, dict)]
    if not objects or any(usable(row) for row in objects):
        return
    keys = set().union(*objects)
    kind = next(((what, by) for needed, what, by in FILE_KINDS if set(needed) <= keys), None)
    looks = f"; this looks like {kind[0]}, a file for {kind[1]}" if kind and reader not in kind[1] else ""
    raise ValueError(f"{path}: no row has the columns for {reader}: {wanted}; the rows' keys: "
                     f"{sorted(map(str, keys))[:30]}{looks}")


def _extra_fields(row: dict, prompt_key: str) -> dict:
    extra = {k: v for k, v in row.items() if k not in (prompt_key, "data_source")}
    reward_model = extra.get("reward_model")
    if "ground_truth" not in extra and isinstance(reward_model, dict) and "ground_truth" in reward_model:
        extra["ground_truth"] = reward_model["ground_truth"]
    return extra


def _max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (its longest vocabulary entry, special tokens included;
    a byte-level entry spells each byte as one character): a text longer than n times this is more than
    n tokens, which is known without tokenizing it."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab())))
    except (AttributeError, NotImplementedError, TypeError, ValueError):  # no readable vocabulary: a wide bound
        return 256


class InMemoryRows(NamedTuple):
    """Rows made in memory (e.g. by `data.reasoning_gym`), read like a file's: `name` stands for the file's path in
    messages."""

    name: str
    rows: list


class _Prompt(NamedTuple):
    """A row whose prompt passed the checks, rendered to text (not yet tokenized)."""

    path: str
    row_number: int
    text: str
    is_chat: bool
    data_source: str
    extra: dict
    prompt: object  # the row's own prompt: a string or chat messages


def load_prompt_dataset(
    files: list[str | InMemoryRows] | str,
    tokenizer,
    prompt_key: str = "prompt",
    max_prompt_length: int = 256,
    truncation: str = "drop",
    skip_bad_rows: bool = False,
    tools: list[dict] | None = None,
) -> PromptDataset:
    """Read, check, render and tokenize every prompt of `files` (JSONL, JSON array, or Parquet, or `InMemoryRows`).

    truncation: what to do with a prompt longer than `max_prompt_length` tokens: "drop" the row,
    "error", or keep its "left" (last tokens) or "right" (first tokens) part.
    skip_bad_rows: skip (and count) rows without a usable prompt instead of raising.
    tools: tool schemas a chat prompt's template is given (`apply_chat_template(tools=...)`), or None.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise ValueError("no prompt files given")
    stats = {"num_rows_read": 0, "num_skipped_bad": 0, "num_dropped_too_long": 0, "num_truncated": 0}
    sources, files = files, [f.name if isinstance(f, InMemoryRows) else f for f in files]  # (names, for messages)
    prompts = _render_prompts(sources, tokenizer, prompt_key, max_prompt_length, truncation, skip_bad_rows, tools,
                              stats)
    items, shortest_dropped = _tokenized_items(prompts, tokenizer, max_prompt_length, truncation, skip_bad_rows,
                                               stats)
    stats["num_rows"] = len(items)
    logger.info(
        "loaded %d prompts from %d file(s): %d rows read, %d bad rows skipped, %d too long dropped, %d truncated",
        stats["num_rows"], len(files), stats["num_rows_read"], stats["num_skipped_bad"],
        stats["num_dropped_too_long"], stats["num_truncated"],
    )
    if not items and stats["num_dropped_too_long"]:
        shortest = f"the shortest prompt is {shortest_dropped} tokens" if shortest_dropped else "all are far longer"
        raise ValueError(
            f"no usable prompts in {files}: every one is longer than max_prompt_length={max_prompt_length}, "
            f"{shortest} (a chat template adds its own tokens: role markers, a default system prompt); raise "
            "data.max_prompt_length")
    if not items:
        raise ValueError(f"no usable prompts in {files} (stats: {stats})")
    return PromptDataset(items, stats, files)


def _render_prompts(files: list[str | InMemoryRows], tokenizer, prompt_key: str, max_prompt_length: int,
                    truncation: str, skip_bad_rows: bool, tools: list[dict] | None, stats: dict) -> list[_Prompt]:
    """Every usable row of `files` with its prompt as text (chat messages through the tokenizer's template); a
    text too long for any tokenization to fit is dropped, refused or cut here, before the tokenizer sees it."""
    has_chat_template = getattr(tokenizer, "chat_template", None) is not None
    # a prompt of more characters than this is surely too long: it is dropped, refused or cut to this many
    # characters before the tokenizer sees it (a 20 MB row would otherwise be tokenized in full first)
    max_chars = 2 * max_prompt_length * _max_token_chars(tokenizer)
    prompts = []
    for path in files:
        if isinstance(path, InMemoryRows):
            path, rows = path.name, list(enumerate(path.rows, start=1))
        else:
            rows = read_rows(path, keep_bad_lines=True)
        check_columns(path, rows, lambda row: prompt_key in row, f"the prompt under {prompt_key!r} "
                      "(data.prompt_key: set it to the key that holds the prompts)", "shardrl train")
        for row_number, row in rows:
            stats["num_rows_read"] += 1
            problem = _check_row(row, prompt_key)
            if problem is not None:
                if skip_bad_rows:
                    stats["num_skipped_bad"] += 1
                    continue
                raise ValueError(f"{path}: row {row_number}: {problem} (set data.skip_bad_rows=true to skip and "
                                 "count such rows)")
            prompt = row[prompt_key]
            if isinstance(prompt, list):
                if not has_chat_template:
                    raise ValueError(
                        f"{path}: row {row_number}: the prompt is a list of chat messages but the tokenizer "
                        f"has no chat template; {SET_TEMPLATE}, or give plain-string prompts"
                    )
                prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                       **({"tools": tools} if tools else {}))
            if len(prompt) > max_chars:
                if truncation == "error":
                    raise ValueError(
                        f"{path}: row {row_number}: prompt is {len(prompt)} characters, more than max_prompt_length="
                        f"{max_prompt_length} tokens can hold (set truncation to 'drop', 'left' or 'right')")
                if truncation == "drop":
                    stats["num_dropped_too_long"] += 1
                    continue
                prompt = prompt[-max_chars:] if truncation == "left" else prompt[:max_chars]  # cut below as usual
            data_source = row.get("data_source")
            data_source = "default" if data_source is None else str(data_source)
            prompts.append(_Prompt(path, row_number, prompt, isinstance(row[prompt_key], list), data_source,
                                   _extra_fields(row, prompt_key), row[prompt_key]))
    return prompts


def _tokenized_items(prompts: list[_Prompt], tokenizer, max_prompt_length: int, truncation: str,
                     skip_bad_rows: bool, stats: dict) -> tuple[list[dict], int | None]:
    """The dataset's items: each prompt tokenized, checked and fitted to `max_prompt_length`; and the length of the
    shortest prompt dropped as too long (None if none was)."""
    # Templated text already holds the model's special tokens; a raw string gets the tokenizer's own (e.g. BOS).
    all_ids = [None] * len(prompts)
    for is_chat in (True, False):
        positions = [i for i, p in enumerate(prompts) if p.is_chat == is_chat]
        if positions:
            encoded = tokenizer([prompts[i].text for i in positions], add_special_tokens=not is_chat)["input_ids"]
            for i, ids in zip(positions, encoded):
                all_ids[i] = ids

    items, shortest_dropped = [], None
    for (path, row_number, text, _, data_source, extra, raw), ids in zip(prompts, all_ids):
        if not ids:
            if skip_bad_rows:
                stats["num_skipped_bad"] += 1
                continue
            raise ValueError(f"{path}: row {row_number}: the prompt {_short_repr(text)} tokenizes to nothing "
                             "(set data.skip_bad_rows=true to skip and count such rows)")
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"{path}: row {row_number}: prompt is {len(ids)} tokens, longer than "
                    f"max_prompt_length={max_prompt_length} (set truncation to 'drop', 'left' or 'right')"
                )
            if truncation == "drop":
                stats["num_dropped_too_long"] += 1
                shortest_dropped = min(shortest_dropped or len(ids), len(ids))
                continue
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            text = tokenizer.decode(ids)
            stats["num_truncated"] += 1
        items.append(
            {"prompt_ids": list(ids), "prompt_text": text, "data_source": data_source, "extra": extra,
             "index": len(items), "prompt": raw}  # the row's own prompt (a string or chat messages), for agents
        )
    return items, shortest_dropped


class PromptLoader:
    """Endless, resumable iterator of per-rank prompt batches over epochs.

    Every rank draws the same global batch of `batch_size` prompts (shuffled per epoch with seed + epoch)
    and takes its contiguous slice of `batch_size // dp_size`. With drop_last=False the epoch's last,
    short batch is filled up from the start of that epoch's order, so every batch is full on every rank.
    The state (epoch, position in prompts) is global, so a run can resume at another dp size.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, dp_rank: int = 0, dp_size: int = 1):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if batch_size % dp_size != 0:
            raise ValueError(
                f"batch_size={batch_size} prompts does not divide over dp_size={dp_size} ranks; "
                f"use a batch size that is a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.position = 0  # prompts of this epoch's order already served
        self._order_epoch, self._order = None, None

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(n, generator=generator).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        n = len(self.dataset)
        end_of_epoch = self.position + self.batch_size > n if self.drop_last else self.position >= n
        if end_of_epoch:
            self.epoch += 1
            self.position = 0
        order = self._epoch_order()
        global_ids = order[self.position : self.position + self.batch_size]
        global_ids += order[: self.batch_size - len(global_ids)]  # fill a short last batch (drop_last=False)
        self.position += self.batch_size
        per_rank = self.batch_size // self.dp_size
        rank_ids = global_ids[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [self.dataset[i] for i in rank_ids]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.dataset):
            raise ValueError(
                f"loader state was saved over {state['num_rows']} prompts but this dataset has "
                f"{len(self.dataset)}; the data changed, so the saved position means nothing"
            )
        if state["seed"] != self.seed:
            logger.warning("loader state has seed %d, this loader %d; using the saved one", state["seed"], self.seed)
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order_epoch, self._order = None, None


def collate_prompts(items: list[dict], pad_id: int) -> dict:
    """Left-pad prompts to the batch's longest: input_ids, attention_mask (B, P) plus per-row lists."""
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    width = max(len(item["prompt_ids"]) for item in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)  # (B, P)
    for row, item in enumerate(items):
        ids = item["prompt_ids"]
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "data_source": [item["data_source"] for item in items],
        "extra": [item["extra"] for item in items],
        "index": [item["index"] for item in items],
        "prompt_text": [item["prompt_text"] for item in items],
    }
