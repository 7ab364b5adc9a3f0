"""The reward of a reasoning-gym row (data_source `reasoning_gym/<task>`, `shardrl.data.reasoning_gym`): the task's
own `score_answer(answer, entry)`, unchanged, on the answer read from the response by the row's `answer_format`:

- `answer_tag` (the default): the text inside the response's last <answer>...</answer>, stripped, as
  reasoning-gym's `extract_answer` reads it (and as its system prompts ask); no tags: no answer, score 0;
- `whole`: the whole response up to an end-of-sequence marker, stripped.

The entry is the row's `extra_info.reasoning_gym_entry`; a composite entry is scored by the dataset that made it
(its `metadata.source_dataset`). An answer the task's scorer cannot read (a few raise on one, prime_factorization's
`int()` on "two times three", where the others return 0) scores 0: a reply in the wrong format is a wrong answer, not
an error of the reward function; a scorer that raises on the entry's own answer too is one.
"""

from __future__ import annotations

import functools

PREFIX = "reasoning_gym/"
ANSWER_FORMATS = ("answer_tag", "whole")


@functools.cache
def _score_fn(task: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def extract_reasoning_gym_answer(response: str, answer_format: str = "answer_tag") -> str | None:
    if answer_format == "whole":
        return response.strip()
    if answer_format != "answer_tag":
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    from reasoning_gym.utils import extract_answer

    return extract_answer(response, tag_name="answer")


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth=None, extra_info: dict | None = None,
                        cut_at_eos=lambda text: text) -> float:
    entry = (extra_info or {}).get("reasoning_gym_entry")
    if not isinstance(entry, dict):
        raise ValueError(f"a {data_source!r} row needs its reasoning-gym entry under extra_info.reasoning_gym_entry "
                         "(data.reasoning_gym writes it); this row has none")
    task = (entry.get("metadata") or {}).get("source_dataset") or data_source[len(PREFIX):]
    answer = extract_reasoning_gym_answer(cut_at_eos(solution_str), extra_info.get("answer_format", "answer_tag"))
    score = _score_fn(task)
    try:
        return float(score(answer, entry))
    except Exception:
        score(entry.get("answer"), entry)  # (raises again where the entry, not the answer, is what it cannot read)
        return 0.0
