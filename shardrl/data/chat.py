"""Supervised rows: conversations tokenized with the loss on the assistant's tokens only.

A row is either
- `messages`: a chat, a list of {"role", "content"} (verl's multi-turn SFT parquet, TRL's conversational format);
  every assistant turn is trained on, every other turn (system, user, tool) is context; or
- `prompt` and `response` columns (or `completion`, TRL's name: see `response_column`): the prompt a string
  (rendered with the chat template as a user turn when the tokenizer has one, as verl's SFT data is; without one
  plain text, `plain_sequence`, as TRL's: BOS where the tokenizer adds one, prompt, response, EOS) or a list of
  messages, the response the assistant's reply. Only the response is trained on (as TRL trains a completion):
  assistant turns inside the prompt are context.
Messages are checked by `data.messages` (roles system, user, assistant, tool; an assistant turn may be tool calls
with null content, which the template renders); an error names the message (`messages[2]: ...`).

The chat is rendered turn by turn with the tokenizer's chat template: before an assistant turn the template's
generation prompt (its assistant header) is context, and what the turn adds after it (the reply and its
end-of-turn marker) is the target. Each piece is tokenized on its own and the pieces are concatenated, so the mask
is exact whatever the tokenizer's merges do at the seams. Chat rows and a tokenizer without a template are refused
(`model.chat_template` sets one): they would train as bare text, without roles or an end of turn.

A preference row (DPO, reward models) is `prompt`, `chosen` and `rejected` columns, each a string or a list of
messages (TRL's plain and conversational formats); without a prompt column the prompt is the messages the two
conversations share; a `margin` column (TRL's, a number) is kept for the reward model's loss. Each of chosen and
rejected is tokenized as prompt + completion, its loss mask on the completion's assistant tokens only. Three
strings are plain text, as in TRL and as `shardrl train` takes a string prompt (`plain_sequence`): BOS where the tokenizer adds one (Llama, Gemma), the prompt's tokens, then the
completion's and EOS, no chat template (an SFT prompt/response row follows verl's SFT data instead where the
tokenizer has a template: its string prompt is a user turn).

Bad rows (an unparsable JSON line, a missing column, an unknown role, an empty reply, chosen equal to rejected, a
template that is not prefix-consistent or leaves no assistant token, a row longer than `max_length` when truncation
is "error") are counted; `skip_bad_rows` drops them with a warning, otherwise the first is an error naming the file
and row. A file none of whose rows has the columns the trainer reads is an error naming them and the file's keys
(skip_bad_rows would drop every row).

An unpaired row (KTO; TRL's unpaired preference format) is `prompt`, `completion` and a boolean `label` (true:
desirable), the prompt and completion tokenized as a pair's prompt and chosen completion are.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

from jinja2 import TemplateError

from shardrl.data.messages import check_messages, is_empty_reply
from shardrl.data.prompts import SET_TEMPLATE, UnreadableRow, check_columns, read_rows

log = logging.getLogger(__name__)


@dataclass
class ChatDataset:
    """Tokenized conversations: item i is {"input_ids": list[int], "loss_mask": list[int], "index": int}."""

    items: list[dict]
    stats: dict
    files: list[str]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class SettingProblem(ValueError):
    """What no row of the file would do with the run's settings: it stops the load naming the row, never dropped
    as a bad row (data.skip_bad_rows)."""


class MissingTemplate(SettingProblem):
    """Chat rows and a tokenizer without a chat template, or with one that fails on every chat: a setting to fix,
    not a row to drop."""


def require_template(tokenizer) -> None:
    """A `MissingTemplate` unless the tokenizer has a chat template: without one a chat trains as bare text, its
    contents run together with no roles and no end of turn (TRL refuses it too)."""
    if not getattr(tokenizer, "chat_template", None):
        raise MissingTemplate("the row is chat messages but the tokenizer has no chat template, so it would train "
                              f"as bare text without roles or an end of turn; {SET_TEMPLATE}")


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        # a prompt/response row of plain text (chat rows were refused by `require_template`)
        return "".join(m["content"] for m in messages)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:  # the template's own raise_exception (e.g. roles out of order), or a bad message
        if _fails_on_any_chat(tokenizer, str(e)):
            raise MissingTemplate(f"the chat template fails on every chat, even a plain user/assistant exchange: {e}; "
                                  "fix the template (model.chat_template, or the tokenizer folder's own)") from None
        raise ValueError(f"the chat template fails on this chat: {e}") from None


def _fails_on_any_chat(tokenizer, error: str) -> bool:
    """Whether the template fails with `error` on a plain user/assistant exchange too: then the fault is the
    template's, not the row's (dropping rows would drop them all)."""
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        tokenizer.apply_chat_template(plain, tokenize=False)
    except TemplateError as e:
        return str(e) == error
    return False


def tokenize_chat(tokenizer, messages: list[dict], train_from: int = 0,
                  names: list[str] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a chat: 1 on each assistant turn's reply and end-of-turn from message
    `train_from` on (an SFT row's response, or a preference pair's completion, follows a prompt that may hold
    assistant turns), 0 elsewhere. `names[i]` is message i as an error names it (default "message i")."""
    names = names or [f"message {i}" for i in range(len(messages))]
    ids, mask, text = [], [], ""
    if not any(m.get("role") == "assistant" for m in messages[train_from:]):
        raise ValueError(f"no assistant message to train on (roles: {[m.get('role') for m in messages]})")
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and i >= train_from:
            context = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
            pieces = [(context, 0), (_render(tokenizer, messages[: i + 1], generation_prompt=False), 1)]
        else:
            pieces = [(_render(tokenizer, messages[: i + 1], generation_prompt=False), 0)]
        for rendered, target in pieces:
            if not rendered.startswith(text):
                raise ValueError(f"{names[i]}: the chat template renders an earlier part of the chat differently "
                                 "once this message follows, so the assistant's tokens cannot be told apart; use a "
                                 "prefix-consistent template")
            piece = rendered[len(text):]
            if target and not piece.strip():
                raise ValueError(f"{names[i]}: the assistant's turn renders empty")
            new = tokenizer.encode(piece, add_special_tokens=False) if piece else []
            ids += new
            mask += [target] * len(new)
            text = rendered
    if not any(mask):
        raise ValueError("the chat template leaves no assistant token to train on")
    return ids, mask


def _replies(messages: list[dict], names: list[str]) -> list[dict]:
    """`messages` whose assistant turns are trained on: an empty one is an error naming it."""
    for message, name in zip(messages, names):
        if message["role"] == "assistant" and is_empty_reply(message):
            raise ValueError(f"{name}: the assistant's reply is empty (no content and no tool_calls)")
    return messages


RESPONSE_COLUMNS = ("response", "completion")
"""The columns an SFT row's reply is read from when `data.response_key` is unset, the first the row has: verl's SFT
name, then TRL's prompt-completion one."""


def response_column(row: dict, response_key: str | None) -> str:
    """The column holding a prompt/response row's reply: `response_key` when set, else the first of
    `RESPONSE_COLUMNS` the row has (the first when it has none, for the error)."""
    if response_key is not None:
        return response_key
    return next((k for k in RESPONSE_COLUMNS if k in row), RESPONSE_COLUMNS[0])


def row_messages(row, messages_key: str, prompt_key: str, response_key: str | None
                 ) -> tuple[list[dict], int, list[str]]:
    """A row as (chat, the index of its first trained message, each message's name for errors) (see the module
    docstring), or a ValueError saying which column or message is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    if messages_key in row:
        messages = check_messages(row[messages_key], messages_key)
        names = [f"{messages_key}[{i}]" for i in range(len(messages))]
        return _replies(messages, names), 0, names
    missing = [k for k in (prompt_key, response_column(row, response_key)) if k not in row]
    if missing:
        either = "" if response_key else f" (or {' or '.join(map(repr, RESPONSE_COLUMNS[1:]))})"
        raise ValueError(f"the row has neither '{messages_key}' nor {missing}{either}; its columns: {sorted(row)}")
    response_key = response_column(row, response_key)
    prompt, response = row[prompt_key], row[response_key]
    if not isinstance(response, str) or not response.strip():
        raise ValueError(f"'{response_key}' must be a non-empty string")
    if isinstance(prompt, str):
        prompt, names = [{"role": "user", "content": prompt}], [prompt_key]
    elif isinstance(prompt, list):
        prompt = check_messages(prompt, prompt_key)
        names = [f"{prompt_key}[{i}]" for i in range(len(prompt))]
    else:
        raise ValueError(f"'{prompt_key}' must be a string or a list of messages")
    # the response alone is trained on (as TRL trains a completion): the prompt's assistant turns are context
    return [*prompt, {"role": "assistant", "content": response}], len(prompt), [*names, response_key]


def _as_messages(value, key: str, role: str = "user") -> list[dict]:
    """A column that holds a string (one `role` message) or a list of {'role', 'content'} messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"'{key}' is empty")
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be a string or a non-empty list of {{'role', 'content'}} messages")
    return check_messages(value, key)


def pair_messages(row, prompt_key: str, chosen_key: str, rejected_key: str) -> tuple[list[dict], list[dict], list[dict]]:
    """A preference row as (prompt, chosen, rejected) messages (TRL's formats: plain strings or conversations,
    the prompt explicit or, without a prompt column, the messages the two conversations share)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    missing = [k for k in (chosen_key, rejected_key) if k not in row]
    if missing:
        raise ValueError(f"the row has no {missing}; its columns: {sorted(row)}")
    chosen = _as_messages(row[chosen_key], chosen_key, "assistant")
    rejected = _as_messages(row[rejected_key], rejected_key, "assistant")
    if prompt_key in row:
        prompt = _as_messages(row[prompt_key], prompt_key)
    else:  # implicit prompt: the shared leading messages
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        # a user (or system) turn past the shared prefix: the two answer different prompts, a pair that teaches nothing
        if any(m["role"] in ("user", "system") for m in chosen + rejected):
            raise ValueError(
                f"without a '{prompt_key}' column, '{chosen_key}' and '{rejected_key}' must share everything but the "
                f"last assistant turn; they differ at message {shared} ({chosen_key}[{shared}] is a "
                f"'{chosen[0]['role']}' turn, {rejected_key}[{shared}] a '{rejected[0]['role']}' turn)")
    if chosen == rejected:
        raise ValueError("chosen and rejected are the same")
    return prompt, chosen, rejected


def pair_margin(row: dict) -> float:
    """A pair's `margin` column (TRL's reward-model datasets: how much better chosen is; the loss is
    -log s(r_c - r_r - margin)), 0 without one."""
    margin = row.get("margin", 0.0)
    if margin is None:  # (a Parquet column where some rows have none)
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"'margin' must be a finite number, found {margin!r}")
    return float(margin)


def _tokenize_pair(tokenizer, row, keys) -> dict:
    prompt, chosen, rejected = pair_messages(row, *keys)
    margin = {"margin": pair_margin(row)}
    prompt_key, chosen_key, rejected_key = keys
    if all(isinstance(row.get(k), str) for k in keys):  # plain text, as TRL and shardrl's RL prompts take it
        return _plain_pair(tokenizer, row[prompt_key], row[chosen_key], row[rejected_key]) | margin
    if any(isinstance(row.get(k), list) for k in keys):  # (two strings without a prompt may be plain text)
        require_template(tokenizer)
    out = {}
    for name, key, completion in (("chosen", chosen_key, chosen), ("rejected", rejected_key, rejected)):
        # a completion's messages are named by their place in the column (its first ones may be the prompt)
        first = len(row[key]) - len(completion) if isinstance(row[key], list) else None
        names = _prompt_names(row, prompt_key, chosen_key, len(prompt)) + [
            key if first is None else f"{key}[{first + j}]" for j in range(len(completion))]
        _replies(completion, names[len(prompt):])
        ids, mask = tokenize_chat(tokenizer, prompt + completion, train_from=len(prompt), names=names)
        out[f"{name}_ids"], out[f"{name}_mask"] = _end_at_eos(tokenizer, ids, mask)
    return out | margin


def _prompt_names(row: dict, prompt_key: str, chosen_key: str, n: int) -> list[str]:
    """A pair's n prompt messages as errors name them: the prompt column's, or the leading ones of chosen."""
    if prompt_key not in row:
        return [f"{chosen_key}[{i}]" for i in range(n)]
    return [f"{prompt_key}[{i}]" for i in range(n)] if isinstance(row[prompt_key], list) else [prompt_key] * n


def bos_ids(tokenizer) -> list[int]:
    """[BOS] when the tokenizer starts a text with it (`tokenizer("x")` does for Llama and Gemma), else []: plain
    text is tokenized as TRL (and an RL run's string prompt) tokenizes it, with the tokenizer's special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    return [bos] if tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else []


def plain_sequence(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of plain text, no template: BOS where the tokenizer adds one, the prompt's tokens, then the
    completion's and EOS, the targets (as TRL tokenizes a plain prompt-completion row; an RL run's string prompt is
    its text with the same BOS, and a sampled response ends at EOS). The two are tokenized apart, so the mask is
    exact whatever the merges at the seam."""
    context = bos_ids(tokenizer) + tokenizer.encode(prompt, add_special_tokens=False)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    target = tokenizer.encode(completion, add_special_tokens=False) + eos
    return context + target, [0] * len(context) + [1] * len(target)


def _plain_pair(tokenizer, prompt: str, chosen: str, rejected: str) -> dict:
    """A plain-text pair: each of chosen and rejected a `plain_sequence` after the prompt."""
    out = {}
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        out[f"{name}_ids"], out[f"{name}_mask"] = plain_sequence(tokenizer, prompt, completion)
    return out


def _tokenize_unpaired(tokenizer, row, keys) -> dict:
    """An unpaired row (TRL's: prompt, completion, label): `input_ids`/`loss_mask` as a pair's chosen sequence,
    `prompt_length` (where the completion's tokens start: a KL row puts another row's completion there) and
    `label`."""
    prompt_key, completion_key, label_key = keys
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"the row has no {missing}; its columns: {sorted(row)}")
    label = row[label_key]
    if not isinstance(label, bool):
        raise ValueError(f"'{label_key}' must be true (a desirable completion) or false, found {label!r}")
    prompt = _as_messages(row[prompt_key], prompt_key)
    completion = _as_messages(row[completion_key], completion_key, "assistant")
    if isinstance(row[prompt_key], str) and isinstance(row[completion_key], str):
        ids, mask = plain_sequence(tokenizer, row[prompt_key], row[completion_key])
    else:
        require_template(tokenizer)
        names = _prompt_names(row, prompt_key, completion_key, len(prompt))
        names += [completion_key if isinstance(row[completion_key], str) else f"{completion_key}[{j}]"
                  for j in range(len(completion))]
        _replies(completion, names[len(prompt):])
        ids, mask = _end_at_eos(tokenizer, *tokenize_chat(tokenizer, prompt + completion, len(prompt), names))
    return {"input_ids": ids, "loss_mask": mask, "prompt_length": mask.index(1), "label": label}


def _end_at_eos(tokenizer, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """A completion ends at its end-of-sequence token, as a sampled one does: what a template writes after the last
    EOS (ChatML's newline) is dropped, so a reward model reads its score where an RL rollout's response ends."""
    eos = tokenizer.eos_token_id
    if eos is None or eos not in ids:
        return ids, mask
    end = len(ids) - ids[::-1].index(eos)
    if tokenizer.decode(ids[end:]).strip():
        return ids, mask
    return ids[:end], mask[:end]


def _tokenize_sft(tokenizer, row, keys) -> dict:
    messages, train_from, names = row_messages(row, *keys)
    messages_key, prompt_key, _ = keys
    if messages_key in row or not isinstance(row[prompt_key], str):  # (a string prompt may be plain text)
        require_template(tokenizer)
    elif not getattr(tokenizer, "chat_template", None):  # plain text, as TRL trains it: ended by EOS
        ids, mask = plain_sequence(tokenizer, messages[0]["content"], messages[1]["content"])
        return {"input_ids": ids, "loss_mask": mask}
    ids, mask = tokenize_chat(tokenizer, messages, train_from, names)
    return {"input_ids": ids, "loss_mask": mask}


# what a file of each kind must hold in some row (`check_columns`): (usable(row), the columns, their reader)
COLUMNS = {
    "sft": lambda messages, prompt, response: (
        lambda row: messages in row or (prompt in row and response_column(row, response) in row),
        f"{messages!r} (data.messages_key), or {prompt!r} and "
        f"{' or '.join(map(repr, RESPONSE_COLUMNS)) if response is None else repr(response)} "
        "(data.prompt_key, data.response_key)",
        "shardrl sft"),
    "pairs": lambda prompt, chosen, rejected: (
        lambda row: chosen in row and rejected in row,
        f"{chosen!r} and {rejected!r} (data.chosen_key, data.rejected_key), {prompt!r} (data.prompt_key) optional",
        "shardrl dpo and shardrl rm"),
    "unpaired": lambda prompt, completion, label: (
        lambda row: prompt in row and completion in row and label in row,
        f"{prompt!r}, {completion!r} and {label!r} (data.prompt_key, data.completion_key, data.label_key)",
        "shardrl kto"),
}
SEQUENCES = {"sft": (("input_ids", "loss_mask"),),
             "pairs": (("chosen_ids", "chosen_mask"), ("rejected_ids", "rejected_mask")),
             "unpaired": (("input_ids", "loss_mask"),)}


def load_chat_dataset(files: list[str], tokenizer, max_length: int, truncation: str = "error",
                      skip_bad_rows: bool = False, messages_key: str = "messages", prompt_key: str = "prompt",
                      response_key: str | None = None, image_key: str | None = None) -> ChatDataset:
    """Every row of `files` (JSONL, JSON or Parquet) tokenized; `truncation` of a row over `max_length`:
    "error", "drop" (counted), or "right" (cut at max_length; it keeps its first assistant tokens). `image_key`:
    a text model's image column (data.image_key); a row with images there is refused, not trained as its text
    alone."""
    return load_rows(files, lambda _: _text_only(image_key, partial(_tokenize_sft, tokenizer), "data.image_key"),
                     (messages_key, prompt_key, response_key), "sft", max_length, truncation, skip_bad_rows)


VL_FIX = ("Use a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with its processor, or drop the column from "
          "the rows")
PREFERENCE_FIX = ("shardrl dpo, kto and rm do not read images yet (shardrl sft and RL do): drop the column from the "
                  "rows, or train on them with shardrl sft or shardrl train")


def _text_only(image_key: str | None, tokenize: Callable, setting: str | None = None, fix: str = VL_FIX) -> Callable:
    """`tokenize(row, keys)` for a text model, refusing a row with images in its `image_key` column (named by
    `setting` where a setting chose it), with `fix`: the model would train on the row's text alone (a setting
    problem: every such row of the file is refused alike, none dropped as a bad row)."""
    named = f", {setting}" if setting else ""

    def tokenize_row(row, keys):
        images = row.get(image_key) if image_key and isinstance(row, dict) else None
        if images is not None and (not isinstance(images, (list, tuple)) or len(images)):
            raise SettingProblem(f"the row has images (its {image_key!r} column{named}) but the model is a text "
                                 f"model: it would train on the text alone. {fix}")
        return tokenize(row, keys)
    return tokenize_row


def load_preference_dataset(files: list[str], tokenizer, max_length: int, truncation: str = "error",
                            skip_bad_rows: bool = False, prompt_key: str = "prompt", chosen_key: str = "chosen",
                            rejected_key: str = "rejected", image_key: str | None = "images") -> ChatDataset:
    """Preference pairs of `files`: item i holds chosen_ids/chosen_mask and rejected_ids/rejected_mask, the
    masks on the completions only; `max_length` and `truncation` apply to each of the two sequences. A row with
    images (its `image_key` column, TRL's `images`) is refused: no preference trainer reads them yet."""
    return load_rows(files, lambda _: _text_only(image_key, partial(_tokenize_pair, tokenizer), fix=PREFERENCE_FIX),
                     (prompt_key, chosen_key, rejected_key), "pairs", max_length, truncation, skip_bad_rows)


def with_nested_columns(row, keys) -> object:
    """`row` with a column for each dotted key of `keys` that names no column but a field of a dict column
    (`extra_info.question`: row["extra_info"]["question"], verl's SFT prompt_dict_keys); other rows as they are."""
    if not isinstance(row, dict):
        return row
    for key in keys:
        if key is None or key in row or "." not in key:
            continue
        value, found = row, True
        for part in key.split("."):
            found = isinstance(value, dict) and part in value
            if not found:
                break
            value = value[part]
        if found:
            row = {**row, key: value}
    return row


def load_unpaired_dataset(files: list[str], tokenizer, max_length: int, truncation: str = "error",
                          skip_bad_rows: bool = False, prompt_key: str = "prompt", completion_key: str = "completion",
                          label_key: str = "label", image_key: str | None = "images") -> ChatDataset:
    """Unpaired preference rows of `files` (KTO): item i holds input_ids/loss_mask (the mask on the completion),
    prompt_length and label (true: desirable). A row with images (its `image_key` column) is refused, as in
    `load_preference_dataset`."""
    return load_rows(files, lambda _: _text_only(image_key, partial(_tokenize_unpaired, tokenizer),
                                                 fix=PREFERENCE_FIX),
                     (prompt_key, completion_key, label_key), "unpaired", max_length, truncation, skip_bad_rows)


def load_rows(files: list[str], reader: Callable[[str], Callable], keys: tuple, kind: str, max_length: int,
              truncation: str, skip_bad_rows: bool) -> ChatDataset:
    """The items of `files`' rows of `kind` (`COLUMNS`), each made by `reader(path)(row, keys)` (a file's reader: an
    image row's relative paths are the file's folder's), bad and over-long rows counted (see the module doc). An
    item with `keep_length` (its image placeholders' end) is not cut shorter: it is dropped instead."""
    items, stats = [], {"rows": 0, "bad": 0, "too_long": 0, "truncated": 0, "loss_tokens": 0}
    shortest = None  # of the rows dropped as too long
    for path in files:
        tokenize_row = reader(path)
        rows = [(number, with_nested_columns(row, keys)) for number, row in read_rows(path, keep_bad_lines=True)]
        check_columns(path, rows, *COLUMNS[kind](*keys))
        for number, row in rows:
            stats["rows"] += 1
            try:
                if isinstance(row, UnreadableRow):
                    raise ValueError(row.problem)
                item = tokenize_row(row, keys)
            except SettingProblem as e:  # the tokenizer's, not the row's: no row of the file would do
                raise ValueError(f"{path}: row {number}: {e}") from None
            except ValueError as e:
                stats["bad"] += 1
                if not skip_bad_rows:
                    raise ValueError(f"{path}: row {number}: {e} (data.skip_bad_rows=true drops such rows)") from None
                if stats["bad"] == 1:
                    log.warning("%s: row %d: %s; dropping it (later bad rows are only counted)", path, number, e)
                continue
            longest = max(len(item[ids]) for ids, _ in SEQUENCES[kind])
            if longest > max_length:
                keep = item.get("keep_length", 0)  # an image row's placeholders end there: no cut before it
                if truncation == "error":
                    fix = ("set data.truncation to drop or right" if keep <= max_length else
                           f"its images' placeholders end at token {keep}, so no right cut keeps them: lower "
                           "data.max_pixels, or set data.truncation=drop")
                    raise ValueError(f"{path}: row {number} has {longest} tokens, more than data.max_length="
                                     f"{max_length}; raise it, or {fix}")
                if truncation == "drop" or not all(any(item[m][:max_length]) for _, m in SEQUENCES[kind]) \
                        or keep > max_length:
                    stats["too_long"] += 1
                    shortest = min(shortest or longest, longest)
                    continue
                for ids, m in SEQUENCES[kind]:
                    item[ids], item[m] = item[ids][:max_length], item[m][:max_length]
                stats["truncated"] += 1
            stats["loss_tokens"] += sum(sum(item[m]) for _, m in SEQUENCES[kind])
            items.append({**item, "index": len(items)})
    if not items and stats["too_long"]:
        right = (" (truncation=right cuts no row before its first loss token, nor through its images' "
                 "placeholders)" if truncation == "right" else "")
        raise ValueError(f"no usable rows in {files}: {stats['too_long']} row(s) longer than data.max_length="
                         f"{max_length}{right}, the shortest {shortest} tokens, and {stats['bad']} bad; raise "
                         f"data.max_length (stats: {stats})")
    if not items:
        raise ValueError(f"no usable rows in {files} (stats: {stats})")
    log.info("loaded %d %s from %d file(s): %d rows, %d bad, %d too long, %d truncated; %d loss tokens",
             len(items), {"sft": "conversations", "pairs": "preference pairs", "unpaired": "unpaired rows"}[kind],
             len(files), stats["rows"],
             stats["bad"], stats["too_long"], stats["truncated"], stats["loss_tokens"])
    return ChatDataset(items, stats, list(files))


def collate_chats(items: list[dict], pad_id: int):
    """A right-padded `Batch` of `input_ids`, `attention_mask` and `loss_mask`, each (B, T); rows with images
    (`data.image_chat`) add the per-row field `multi_modal_inputs` (None for a row without), which the engine's
    micro-batches carry with their rows."""
    batch = _collate([(item["input_ids"], item["loss_mask"]) for item in items], pad_id)
    if any(item.get("multi_modal_inputs") for item in items):
        batch["multi_modal_inputs"] = [item.get("multi_modal_inputs") for item in items]
    return batch


def collate_pairs(items: list[dict], pad_id: int):
    """Preference pairs as a right-padded `Batch` of 2 x len(items) rows: chosen, rejected, chosen, ... (the
    engine's `group_size=2` keeps each pair in one micro-batch), and `margin` (2P,), each pair's on both its rows."""
    import torch

    batch = _collate([(item[f"{name}_ids"], item[f"{name}_mask"]) for item in items
                      for name in ("chosen", "rejected")], pad_id)
    batch["margin"] = torch.tensor([item.get("margin", 0.0) for item in items for _ in range(2)], dtype=torch.float32)
    return batch


def collate_unpaired(items: list[dict], pad_id: int, max_length: int):
    """Unpaired rows as a right-padded `Batch`: input_ids, attention_mask, loss_mask (B, T) and label (B,) (1.0:
    desirable), with the KL rows as kl_input_ids, kl_attention_mask, kl_loss_mask (B, T'): row i's prompt followed
    by row i-1's completion (cyclically, as TRL's KTO pairs them within a device's batch), cut at max_length."""
    import torch

    batch = collate_chats(items, pad_id)
    batch["label"] = torch.tensor([float(item["label"]) for item in items])
    kl_rows = []
    for item, other in zip(items, items[-1:] + items[:-1]):
        start, cut = item["prompt_length"], other["prompt_length"]
        ids = (item["input_ids"][:start] + other["input_ids"][cut:])[:max_length]
        kl_rows.append((ids, ([0] * start + other["loss_mask"][cut:])[:max_length]))
    kl = _collate(kl_rows, pad_id)
    for key in ("input_ids", "attention_mask", "loss_mask"):
        batch[f"kl_{key}"] = kl[key]
    return batch


def _collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    from shardrl.batch import Batch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention[r, :len(ids)] = 1
        loss_mask[r, :len(ids)] = torch.tensor(mask)
    return Batch({"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask})
