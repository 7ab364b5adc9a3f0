"""Rule rewards, user reward files, and the manager that scores a batch of responses without dying.

A reward function is called as verl calls it, by parameter name (`bind_reward_function`): it receives those of
data_source, solution_str, ground_truth and extra_info (verl's names) that it names, all four if it takes
**kwargs, plus `reward.reward_kwargs`; a function naming none of them takes the four by position. `extra_info` is
the row's own `extra_info` dict (verl's meaning), with the row's other fields (e.g. `reward_model`, `ability`, a
top-level `ground_truth`) merged in under the keys that `extra_info` does not already use. A dict result must
hold "score"; its other numeric keys become metrics `reward/<key>` (batch means). A score must be a finite number
a float32 holds. Built-ins are looked up by data_source (`builtin_scorer`); a user file replaces them all.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import traceback
from decimal import Decimal, InvalidOperation

import torch

from shardrl.config.userfile import import_user_file
from shardrl.metrics import SumCount
from shardrl.rewards.reasoning_gym import PREFIX as REASONING_GYM_PREFIX, reasoning_gym_score
from shardrl.rewards.scorers import VERL_SCORERS, verl_scorer_for

logger = logging.getLogger(__name__)

# End-of-sequence markers of common chat models, in case a response was decoded with its special tokens.
EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")


def _cut_at_eos(text: str) -> str:
    for marker in EOS_MARKERS:
        text = text.split(marker, 1)[0]
    return text


def arith_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """1.0 if the response's first line (before any EOS marker), stripped, is exactly the ground truth."""
    answer = _cut_at_eos(solution_str).split("\n", 1)[0].strip()
    return 1.0 if answer == str(ground_truth).strip() else 0.0


_STRICT_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def _normalize_number(text: str) -> str:
    """'1,234.' -> '1234'; '18.00' -> '18'; '-0.50' -> '-0.5'. Non-numbers come back stripped."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return text
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return str(value.normalize())


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style response, normalized, or None when there is none.

    strict: the number after the last "####". flexible: the last number anywhere in the response.
    """
    if method == "strict":
        matches = _STRICT_ANSWER.findall(solution_str)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return _normalize_number(matches[-1]) if matches else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None,
                method: str = "strict") -> float:
    """1.0 if the extracted answer equals the ground truth (which may itself be a full '#### 42' solution)."""
    answer = extract_gsm8k_answer(_cut_at_eos(solution_str), method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    return 1.0 if answer == _normalize_number(truth) else 0.0


def gsm8k_flexible_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    return gsm8k_score(data_source, solution_str, ground_truth, extra_info, method="flexible")


REWARD_FUNCTIONS = {
    "arith": arith_score,
    "gsm8k": gsm8k_score,  # shardrl's lenient reading ("#### 66." and "#### $66" count); verl's is openai/gsm8k
    "gsm8k_flexible": gsm8k_flexible_score,
    **VERL_SCORERS,  # verl's data sources, scored exactly as verl scores them: openai/gsm8k, MATH, DAPO math
}
"""The built-in scorers by data_source; `builtin_scorer` also sends verl's aime* sources to DAPO's, as verl does,
and reasoning_gym/<task> to the task's own scorer."""


def _reasoning_gym_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info, cut_at_eos=_cut_at_eos)


def builtin_scorer(data_source: str):
    """The built-in reward function of `data_source`, or None."""
    if data_source.startswith(REASONING_GYM_PREFIX):
        return _reasoning_gym_score
    return REWARD_FUNCTIONS.get(data_source) or verl_scorer_for(data_source)


def load_reward_function(path: str, name: str = "compute_score", reward_kwargs: dict | None = None):
    """Import the user's reward file at `path` and return its function `name`, checked to be callable with a
    reward function's arguments (and `reward_kwargs`) as `bind_reward_function` binds them."""
    if not os.path.isfile(path):
        file, _, fn = path.rpartition(":")
        hint = (f"; the function's name goes in reward.function_name: reward.function_path={file} "
                f"reward.function_name={fn}") if file and os.path.isfile(file) else ""
        raise ValueError(f"reward function file not found: {path!r}{hint}")
    module = import_user_file(path, "reward function file", "shardrl_user_reward_")
    module_name = module.__name__
    if not hasattr(module, name):
        defined = sorted(
            attr for attr, value in vars(module).items()
            if callable(value) and not attr.startswith("_") and getattr(value, "__module__", None) == module_name
        )
        raise ValueError(
            f"reward function file {path!r} defines no {name!r}; callables it defines: {defined or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{name!r} in {path!r} is a {type(fn).__name__}, not a function")
    bind_reward_function(fn, reward_kwargs, f"{name} in {path!r}")  # a signature it cannot serve: said now
    return fn


REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def bind_reward_function(fn, reward_kwargs: dict | None = None, where: str | None = None):
    """`fn` as `call(data_source, solution_str, ground_truth, extra_info)`, its parameters bound as verl binds
    them, by name: each of REWARD_ARGS that `fn` names is passed by keyword (all four when it takes **kwargs),
    the others are not, and `reward_kwargs` (verl's `custom_reward_function.reward_kwargs`) are added. So verl's
    own scorers, `compute_score(solution_str, ground_truth, method="strict", ...)`, get the right arguments. A
    function naming none of them (and with no **kwargs) takes the four positionally, shardrl's older form. A
    ValueError, naming `where`, for a function these arguments cannot call."""
    kwargs = dict(reward_kwargs or {})
    where = where or getattr(fn, "__name__", repr(fn))
    clash = sorted(set(kwargs) & set(REWARD_ARGS))
    if clash:
        raise ValueError(f"reward_kwargs {clash} are the reward function's own arguments, passed per sample; "
                         "leave them out of reward_kwargs")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: the call will tell
        return lambda *args: fn(*args, **kwargs)
    params = sig.parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.name in REWARD_ARGS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if takes_any or named:
        passed = REWARD_ARGS if takes_any else tuple(named)
        if "solution_str" not in passed:
            raise ValueError(f"{getattr(fn, '__name__', 'the reward function')}{sig} ({where}) takes no solution_str "
                             "(the response to score) and no **kwargs; name a parameter solution_str (verl's name)")
        try:
            sig.bind(**dict.fromkeys(passed), **kwargs)
        except TypeError as e:
            raise ValueError(_signature_error(fn, sig, where, e, kwargs)) from None

        def call(*args):
            return fn(**{k: v for k, v in zip(REWARD_ARGS, args) if k in passed}, **kwargs)
        return call
    try:
        sig.bind(*REWARD_ARGS, **kwargs)
    except TypeError as e:
        raise ValueError(_signature_error(fn, sig, where, e, kwargs)) from None
    return lambda *args: fn(*args, **kwargs)


def _signature_error(fn, sig, where: str, error: TypeError, kwargs: dict) -> str:
    name = getattr(fn, "__name__", "compute_score")
    given = f" and reward_kwargs {sorted(kwargs)}" if kwargs else ""
    return (f"{name}{sig} ({where}) cannot be called with a reward function's arguments{given}: {error}. A reward "
            f"function takes, by name, any of {', '.join(REWARD_ARGS)} (verl's names; solution_str and ground_truth "
            f"at least), e.g. def {name}(data_source, solution_str, ground_truth, extra_info=None); its other "
            "parameters need defaults or a value in reward_kwargs")


def reward_extra_info(extra: dict | None) -> dict:
    """The `extra_info` a reward function gets for a row whose fields other than prompt and data_source
    are `extra`: the row's own `extra_info` dict (as verl passes it), plus the row's other fields under
    the keys it does not use. A row without an `extra_info` dict gets its other fields."""
    extra = extra or {}
    own = extra.get("extra_info")
    if not isinstance(own, dict):
        return dict(extra)
    return {**{k: v for k, v in extra.items() if k != "extra_info"}, **own}


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_score(value) -> float:
    """`value` as a reward, or an error saying why it is not one."""
    if value is None or isinstance(value, (str, bytes, dict, list, tuple)):
        text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TypeError(f"reward function returned {type(value).__name__} {text}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    if abs(score) > _FLOAT32_MAX:
        raise ValueError(f"reward function returned the score {score:g}, beyond what float32 holds (|x| <= 3.4e38)")
    return score


def check_ground_truths(dataset) -> None:
    """A ValueError when rows of `dataset` (a `data.PromptDataset`) whose data_source a built-in
    scorer scores have no ground truth: that scorer would compare every response with None and score 0 without
    a word. The error names the fields those rows do have. Rows whose data_source no built-in scorer scores are
    refused too (at load, not when the first of them is drawn, perhaps hours in)."""
    unknown: dict[str, int] = {}
    for item in dataset.items:
        if builtin_scorer(item["data_source"]) is None:
            unknown[item["data_source"]] = unknown.get(item["data_source"], 0) + 1
    if unknown:
        said = ", ".join(f"{source!r} ({count} rows)" for source, count in sorted(unknown.items())[:5])
        raise ValueError(
            f"{', '.join(map(str, dataset.files))}: no built-in reward function scores the data_source of "
            f"{sum(unknown.values())} of {len(dataset)} rows: {said}{' and more' if len(unknown) > 5 else ''}; "
            f"known: {sorted(REWARD_FUNCTIONS)}, aime* and reasoning_gym/<task>. Set those rows' data_source to one "
            "of these, or score with your own reward.function_path")
    missing = [item for item in dataset.items if builtin_scorer(item["data_source"]) is not None
               and (item["extra"] or {}).get("ground_truth") is None]
    if missing:
        first = missing[0]
        fields = sorted(["prompt", "data_source", *(first["extra"] or {})])
        raise ValueError(
            f"{', '.join(map(str, dataset.files))}: {len(missing)} of {len(dataset)} rows have no ground truth, and "
            f"their data_source {first['data_source']!r} is scored by a built-in scorer that compares the response "
            f"with it (the first such row has the fields {fields}); put the answer under 'ground_truth' (or "
            "reward_model.ground_truth, as verl does), or score with your own reward.function_path")


RESERVED_REWARD_KEYS = frozenset({"mean", "max", "min", "num_errors", "num_timeouts", "overlong_penalty_mean"})
"""Keys of a reward function's dict that would overwrite the trainer's own `reward/` metrics."""


def score_item(fn, item: dict) -> tuple[float, dict]:
    """(score, metrics) of one item (data_source, response_text, ground_truth, extra) by the bound reward function
    `fn`; raises what the function raises, or why its result is no score."""
    extra = item.get("extra") or {}
    ground_truth = item["ground_truth"] if "ground_truth" in item else extra.get("ground_truth")
    result = fn(item["data_source"], item["response_text"], ground_truth, reward_extra_info(extra))
    metrics = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score': keys {sorted(result)}")
        taken = sorted(set(result) & RESERVED_REWARD_KEYS)
        if taken:
            raise ValueError(f"reward function returned the key(s) {taken}, which shardrl logs itself as "
                             f"reward/<key> (the batch's own {', '.join(sorted(RESERVED_REWARD_KEYS))}); "
                             "rename them in the returned dict")
        metrics = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float, bool))}
        result = result["score"]
    return _as_score(result), metrics


class RewardManager:
    """Scores a batch of responses with a user function or the built-in for each row's data_source.

    One sample whose reward function raises (or returns something unusable) gets `on_error_score` and is
    counted in `reward/num_errors`; the first such error is logged with its traceback, once. When every
    sample of a call fails, nothing can be learned: `score` raises a ValueError quoting the first failure
    (a caller that scores a share of a global batch passes `fail_if_all_fail=False` and decides on the
    global count with `all_failed_error`). A function that calls sys.exit is an error at once.
    """

    def __init__(self, fn=None, on_error_score: float = 0.0, reward_kwargs: dict | None = None, pool=None):
        """`fn`: the user's reward function (None: each row's built-in by data_source); `reward_kwargs` are
        passed to it on every call (verl's custom_reward_function.reward_kwargs); `pool`: a
        `rewards.pool.RewardPool` that scores the samples instead, in parallel and with a time limit each (it
        loads the same function itself)."""
        self.fn = None if fn is None else bind_reward_function(fn, reward_kwargs)
        self.pool = pool
        self.on_error_score = float(on_error_score)
        self._logged_error = False
        self.first_error = None
        """The last `score` call's first failure, "(data_source=...) Type: message", or None."""

    def _function_for(self, data_source: str):
        if self.fn is not None:
            return self.fn
        fn = builtin_scorer(data_source)
        if fn is None:
            raise ValueError(
                f"no built-in reward function for data_source {data_source!r}; known: {sorted(REWARD_FUNCTIONS)} "
                "and aime*. Give a reward function file, or set the rows' data_source to one of these"
            )
        return fn

    @staticmethod
    def _try(fn, item: dict):
        """`score_item`'s result, or the exception it raised (SystemExit too, as a value)."""
        try:
            return score_item(fn, item)
        except SystemExit as e:
            return e
        except Exception as e:
            return e

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def all_failed_error(self, num_samples: int) -> ValueError:
        return ValueError(
            f"the reward function failed on all {num_samples} samples of this step, so there is nothing to learn "
            f"from; the first failure {self.first_error}. Fix the reward function (a sample whose reward fails "
            "scores reward.on_error_score only while others succeed)"
        )

    def score(self, items: list[dict], fail_if_all_fail: bool = True) -> tuple[torch.Tensor, dict]:
        """(scores (B,) float32, metrics) for items holding data_source, response_text, ground_truth, extra."""
        scores, metrics, _ = self.score_with_values(items, fail_if_all_fail)
        return scores, metrics

    def score_with_values(self, items: list[dict], fail_if_all_fail: bool = True
                          ) -> tuple[torch.Tensor, dict, dict[str, torch.Tensor]]:
        """`score`'s (scores, metrics) and each numeric key of the function's dict per sample (B,) float32,
        NaN for a sample without it (a failed one): what dynamic sampling filters by (e.g. "acc"). In the metrics a
        key of the function's dict is a `SumCount` over the samples that have it, so that over ranks (or batches)
        it stays the mean over those samples, however many each piece holds."""
        fns = [self._function_for(item["data_source"]) for item in items]  # config errors raise here
        scores, extra_values, num_errors, num_timeouts = [], {}, 0, 0
        self.first_error = None
        results = self.pool.score(items) if self.pool is not None else [self._try(fn, item) for fn, item in zip(fns, items)]
        for item, result in zip(items, results):
            if isinstance(result, SystemExit):  # would end the run with no word of why
                raise ValueError(f"the reward function called sys.exit({result.code!r}) on a sample (data_source="
                                 f"{item.get('data_source')!r}); a reward function must return a score") from None
            if isinstance(result, BaseException):
                e = result
                num_errors += 1
                num_timeouts += isinstance(e, TimeoutError)
                if self.first_error is None:
                    self.first_error = f"(data_source={item.get('data_source')!r}) {type(e).__name__}: {e}"
                if not self._logged_error:
                    self._logged_error = True
                    logger.warning(
                        "reward function failed on a sample (data_source=%r), scoring it %s; later failures are "
                        "only counted in reward/num_errors. %s: %s\n%s",
                        item.get("data_source"), self.on_error_score, type(e).__name__, e,
                        "".join(traceback.format_exception(e)),
                    )
                score, metrics = self.on_error_score, {}
            else:
                score, metrics = result
            for key, value in metrics.items():
                extra_values.setdefault(key, [math.nan] * len(scores)).append(value)
            scores.append(score)
            for values in extra_values.values():  # (a key this sample's dict lacks)
                values.extend([math.nan] * (len(scores) - len(values)))
        if fail_if_all_fail and items and num_errors == len(items):
            raise self.all_failed_error(len(items))
        out = {"reward/num_errors": num_errors}
        if self.pool is not None and self.pool.timeout_s is not None:
            out["reward/num_timeouts"] = num_timeouts
        if scores:
            out["reward/score"] = sum(scores) / len(scores)
        for key, values in extra_values.items():
            present = [v for v in values if not math.isnan(v)]
            out[f"reward/{key}"] = SumCount(float(sum(present)), float(len(present)))
        per_sample = {k: torch.tensor(v, dtype=torch.float32) for k, v in extra_values.items()}
        return torch.tensor(scores, dtype=torch.float32), out, per_sample
