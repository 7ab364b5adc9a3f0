"""Rule rewards that score exactly as verl's built-in ones, so that reward curves of shardrl and verl runs compare.

Three families, each as verl's `verl.utils.reward_score` scores it (checked against commit b178a3cd):
    gsm8k  (`gsm8k.py`)        the number after "#### " (strict) or the last number (flexible), compared as a string
    MATH   (`math_reward.py`)  the last \\boxed{...}, normalized the Hendrycks way, 1.0 or 0.0
    DAPO   (`math_dapo.py`)    the last "Answer: ..." line, normalized the Minerva way, {"score": 1.0 | -1.0, ...}

Each family has a scorer verl users call directly, `score_*(solution_str, ground_truth, ...)`, and a reward function
with shardrl's (and verl's) signature, `*_reward(data_source, solution_str, ground_truth, extra_info=None, **options)`.
VERL_SCORERS and `verl_scorer_for` map verl's data_source names to the reward functions, as verl's
`default_compute_score` dispatches; `verl_reward` is that dispatch as one reward function.

verl's quirks are kept, since matching its numbers is the point: gsm8k strict needs exactly one space after "####" and
compares "66.0" with "66" as different strings; gsm8k flexible keeps trailing dots and commas ("42." is not "42");
MATH never scores \\fbox (its unboxing asserts on it); DAPO reads only the last 300 characters. Where verl asserts or
raises inside a scorer and then catches it, the score it ends with is returned; where it lets the error out, so do we.
One difference: verl's `default_compute_score` drops keyword options (reward_kwargs reach only a custom function),
while these reward functions pass them on, so `method="flexible"` works; without options they score as verl does.
"""

from __future__ import annotations

import re

# verl reads only the tail of a response: its answers come at the end, and regexes on long strings are slow.
TAIL_CHARS = 300

# ---------------------------------------------------------------- gsm8k

_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER = re.compile(r"-?[0-9.,]+")


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's gsm8k scorer reads in the last 300 characters of `solution_str`, or None.

    strict: the last "#### <number>" (one space exactly), commas removed. flexible: the last run of digits, dots and
    commas (with an optional leading minus) that is not a lone ".", commas kept; a run of only "." when nothing else.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        # verl also strips "$" from the match, which the pattern never lets in
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _GSM8K_NUMBER.findall(tail)
    if not found:
        return None
    return next((number for number in reversed(found) if number != "."), ".")


def score_gsm8k(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """`score` when the answer equals `ground_truth` as a string (no numeric parsing), `format_score` when there is an
    answer that differs, 0.0 when there is none."""
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# ---------------------------------------------------------------- MATH (Hendrycks)


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the "}" that closes the "{" at `open_at`, or None when it is never closed."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def math_boxed_answer(solution_str: str) -> str | None:
    """What verl's MATH scorer takes as the answer, or None (it then scores 0.0).

    Any "\\boxed " (with a space) wins: the text after the last one, up to the next "$". Else the braced content of the
    last "\\boxed", which must open a brace right away; verl also finds a last \\fbox{...} but then fails to unbox it.
    """
    if "\\boxed " in solution_str:
        return solution_str.split("\\boxed ")[-1].split("$")[0]
    start = solution_str.rfind("\\boxed")
    if start < 0 or not solution_str.startswith("\\boxed{", start):
        return None
    end = _closing_brace(solution_str, start + len("\\boxed"))
    return None if end is None else solution_str[start + len("\\boxed{"):end]


# Applied in order, before the units are cut; "" deletes.
_MATH_REWRITES = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)


def _brace_sqrt_args(text: str) -> str | None:
    """\\sqrt3 -> \\sqrt{3}; None where verl fails (a \\sqrt with nothing after it)."""
    if "\\sqrt" not in text:
        return text
    head, *pieces = text.split("\\sqrt")
    for piece in pieces:
        if not piece:
            return None
        head += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return head


def _brace_frac_args(text: str) -> str | None:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; None where verl fails (a \\frac with nothing after
    it); `text` unchanged when a \\frac has a single character after it."""
    head, *pieces = text.split("\\frac")
    for piece in pieces:
        if not piece:
            return None
        if piece[0] == "{":
            head += "\\frac" + piece
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            head += "\\frac{" + piece[0] + "}" + piece[1:]
        else:
            head += "\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return head


def _slash_to_frac(text: str) -> str:
    """"3/4" -> "\\frac{3}{4}" when both sides are integers written plainly; else `text`."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
        plain = text == f"{num}/{den}"
    except ValueError:
        return text
    return f"\\frac{{{num}}}{{{den}}}" if plain else text


def normalize_math_answer(answer: str) -> str | None:
    """`answer` normalized as verl's MATH scorer does (its `strip_string`), or None where that normalization fails;
    verl then compares the raw strings."""
    for old, new in _MATH_REWRITES:
        answer = answer.replace(old, new)
    if "\\text{ " in answer:  # units, on the right
        value, *units = answer.split("\\text{ ")
        if len(units) != 1:
            return None
        answer = value
    answer = answer.replace("\\\\%", "").replace("\\%", "")
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if not answer:
        return answer
    if answer[0] == ".":
        answer = "0" + answer
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> " 3"
        answer = sides[1]
    answer = _brace_sqrt_args(answer)
    if answer is None:
        return None
    answer = _brace_frac_args(answer.replace(" ", ""))
    if answer is None:
        return None
    if answer == "0.5":
        answer = "\\frac{1}{2}"
    return _slash_to_frac(answer)


def math_answers_equal(answer: str, ground_truth) -> bool:
    """verl's MATH equivalence: the normalized strings are equal, or the raw ones where either fails to normalize."""
    if not isinstance(ground_truth, str):
        return answer == ground_truth
    normalized, normalized_truth = normalize_math_answer(answer), normalize_math_answer(ground_truth)
    if normalized is None or normalized_truth is None:
        return answer == ground_truth
    return normalized == normalized_truth


def score_math(solution_str: str, ground_truth) -> float:
    """1.0 when the last boxed answer is equivalent to `ground_truth`, else 0.0 (also with no box)."""
    answer = math_boxed_answer(solution_str)
    return 1.0 if answer is not None and math_answers_equal(answer, ground_truth) else 0.0


# ---------------------------------------------------------------- DAPO (Minerva)

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_NO_ANSWER = "[INVALID]"

# Applied in order; then every removed expression is deleted, also in order.
_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# (pattern, replacement), applied in order. `.` stops at a newline, so the first one works line by line.
_DAPO_TEX_REWRITES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r".*?\$(.*?)\$.*", r"$\1$"),  # keep the first $...$ of a line
    (r"\\text\{(.*?)\}", r"\1"),
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),
    (r"frac([^{])(.)", r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}; \frac1{2} -> \frac{1}{{}2} (sic)
    (r"sqrt([^{])", r"sqrt{\1}"),
))


def normalize_dapo_answer(answer: str) -> str:
    """`answer` normalized as verl's DAPO scorer does (Minerva's `normalize_final_answer`)."""
    answer = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in _DAPO_REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in _DAPO_TEX_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # "12,000" -> "12000"
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_boxed_answer(text: str) -> str | None:
    """The braced content of the last "\\boxed{" in `text`, or None when there is none or it is never closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = _closing_brace(text, start + len("\\boxed"))
    return None if end is None else text[start + len("\\boxed{"):end]


def score_dapo(solution_str: str, ground_truth, strict_box_verify: bool = False,
               pause_tokens_index: list[int] | None = None) -> dict:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}, from the last 300 characters of `solution_str`.

    Default: the last "Answer: ..." line (any case), normalized, against the normalized ground truth; "pred" is
    "[INVALID]" (normalized) when there is none. strict_box_verify: the last \\boxed{...} of the last 100 characters
    (or of those from 100 before `pause_tokens_index[-1]`, which holds 4 indices), compared unnormalized; "pred" is
    None when there is no box.
    """
    tail = solution_str[-TAIL_CHARS:]
    if strict_box_verify:
        if pause_tokens_index is None:
            window = tail[-100:]
        elif len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {len(pause_tokens_index)}")
        else:
            window = tail[pause_tokens_index[-1] - 100:]
        pred = dapo_boxed_answer(window)
        correct = bool(pred == ground_truth)
    else:
        if not isinstance(ground_truth, str):
            raise TypeError(f"the DAPO scorer needs a str ground truth, got {type(ground_truth).__name__}")
        found = _ANSWER_LINE.findall(tail)
        pred = normalize_dapo_answer(found[-1] if found else _NO_ANSWER)
        correct = pred == normalize_dapo_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ---------------------------------------------------------------- reward functions and verl's dispatch


def gsm8k_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, *,
                 method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's "openai/gsm8k" reward: `score_gsm8k`, strict unless `method="flexible"`."""
    return float(score_gsm8k(solution_str, ground_truth, method, format_score, score))


def math_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """verl's MATH reward ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")."""
    return score_math(solution_str, ground_truth)


def dapo_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, *,
                strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None) -> dict:
    """verl's DAPO reward ("math_dapo", "math", "math_dapo_reasoning", "aime*"): `score_dapo`'s dict."""
    return score_dapo(solution_str, ground_truth, strict_box_verify, pause_tokens_index)


VERL_SCORERS = {
    "openai/gsm8k": gsm8k_reward,
    "lighteval/MATH": math_reward,
    "DigitalLearningGmbH/MATH-lighteval": math_reward,
    "HuggingFaceH4/MATH-500": math_reward,
    "math_dapo": dapo_reward,
    "math": dapo_reward,
    "math_dapo_reasoning": dapo_reward,
}
"""verl data_source -> the reward function verl's `default_compute_score` scores it with; besides these, every
data_source starting with "aime" is DAPO's (`verl_scorer_for`)."""


def verl_scorer_for(data_source: str):
    """The reward function verl scores `data_source` with, or None when verl's rule scorers here have none."""
    if data_source in VERL_SCORERS:
        return VERL_SCORERS[data_source]
    if isinstance(data_source, str) and data_source.startswith("aime"):
        return dapo_reward
    return None


def verl_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None,
                **options) -> float | dict:
    """The reward of `verl_scorer_for(data_source)`, with `options` passed on; a ValueError for a data_source
    it has none for (verl raises NotImplementedError)."""
    scorer = verl_scorer_for(data_source)
    if scorer is None:
        raise ValueError(f"no verl rule scorer for data_source {data_source!r}; known: {sorted(VERL_SCORERS)} "
                         "and any name starting with 'aime'")
    return scorer(data_source, solution_str, ground_truth, extra_info, **options)
