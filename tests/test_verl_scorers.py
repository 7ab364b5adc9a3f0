"""shardrl.rewards.scorers scores as verl's built-in rule scorers do.

Every expected figure in this file was produced by running verl's own functions (verl commit b178a3cd:
verl/utils/reward_score/gsm8k.py, math_reward.py, math_dapo.py, and default_compute_score for the rows without
options), not by the module under test.
"""

import inspect

import pytest

from shardrl.rewards.scorers import (
    VERL_SCORERS,
    dapo_reward,
    gsm8k_reward,
    math_reward,
    score_dapo,
    score_gsm8k,
    score_math,
    verl_reward,
    verl_scorer_for,
)

SCORERS = {"gsm8k": score_gsm8k, "math": score_math, "dapo": score_dapo}
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "math": "lighteval/MATH", "dapo": "math_dapo"}

# (family, solution_str, ground_truth, options, verl's score); the scores were produced by verl commit b178a3cd's
# functions: compute_score(solution_str, ground_truth, **options) of the family's file, which with no options equals
# default_compute_score(DATA_SOURCES[family], solution_str, ground_truth).
VERL_TABLE = [
    ("gsm8k", "so 60 + 6 = 66\n#### 66", "66", {}, 1.0),
    ("gsm8k", "#### 66.", "66", {}, 0.0),
    ("gsm8k", "####66", "66", {}, 0.0),
    ("gsm8k", "#### 66.00", "66", {}, 0.0),
    ("gsm8k", "#### $66", "66", {}, 0.0),
    ("gsm8k", "#### 66", "66.0", {}, 0.0),
    ("gsm8k", "####  66", "66", {}, 0.0),
    ("gsm8k", "#### 1,234", "1234", {}, 1.0),
    ("gsm8k", "#### -5", "-5", {}, 1.0),
    ("gsm8k", "first #### 5 then #### 6", "6", {}, 1.0),
    ("gsm8k", "first #### 5 then #### 6", "5", {}, 0.0),
    ("gsm8k", "The answer is 66", "66", {}, 0.0),
    ("gsm8k", "#### 66", 66, {}, 0.0),
    ("gsm8k", "#### 66" + "." * 300, "66", {}, 0.0),
    ("gsm8k", "#### 66" + "a" * 296, "66", {}, 0.0),
    ("gsm8k", "#### 66" + "a" * 293, "66", {}, 1.0),
    ("gsm8k", "x" * 400 + "#### 66", "66", {}, 1.0),
    ("gsm8k", "#### 65", "66", {"format_score": 0.1}, 0.1),
    ("gsm8k", "no answer here", "66", {"format_score": 0.1}, 0.0),
    ("gsm8k", "#### 66", "66", {"score": 2.0}, 2.0),
    ("gsm8k", "The answer is 66", "66", {"method": "flexible"}, 1.0),
    ("gsm8k", "The answer is 66.", "66", {"method": "flexible"}, 0.0),
    ("gsm8k", "She pays $1,000", "1000", {"method": "flexible"}, 0.0),
    ("gsm8k", "She pays $1,000", "1,000", {"method": "flexible"}, 1.0),
    ("gsm8k", "66, and that is all", "66", {"method": "flexible"}, 0.0),
    ("gsm8k", "66 apples and 3 pears", "3", {"method": "flexible"}, 1.0),
    ("gsm8k", "#### 66", "66", {"method": "flexible"}, 1.0),
    ("gsm8k", "it drops to -7", "-7", {"method": "flexible"}, 1.0),
    ("gsm8k", "it is 5 . .", "5", {"method": "flexible"}, 1.0),
    ("gsm8k", "well . . .", ".", {"method": "flexible"}, 1.0),
    ("gsm8k", "no numbers", "66", {"method": "flexible", "format_score": 0.1}, 0.0),
    ("gsm8k", "maybe 65", "66", {"method": "flexible", "format_score": 0.1}, 0.1),
    ("gsm8k", "66 then " + "z" * 300, "66", {"method": "flexible"}, 0.0),
    ("math", r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{\frac12}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{0.5}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{.5}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{1/2}", r"\frac{1}{2}", {}, 1.0),
    ("math", r"\boxed{\tfrac{3}{4}}", "3/4", {}, 1.0),
    ("math", r"\boxed{3/04}", r"\frac{3}{4}", {}, 0.0),
    ("math", r"\boxed{\frac1{72}}", r"\frac{1}{72}", {}, 1.0),
    ("math", r"\boxed{5\text{ cm}}", "5", {}, 1.0),
    ("math", r"\boxed{90^\circ}", "90", {}, 1.0),
    ("math", r"\boxed{90^{\circ}}", "90", {}, 1.0),
    ("math", r"\boxed{50\%}", "50", {}, 1.0),
    ("math", r"\boxed{\$5}", "5", {}, 1.0),
    ("math", r"\boxed{$5$}", "5", {}, 0.0),
    ("math", r"\boxed{k = 3}", "3", {}, 1.0),
    ("math", r"\boxed{x+y=3}", "3", {}, 0.0),
    ("math", r"\boxed{\sqrt2}", r"\sqrt{2}", {}, 1.0),
    ("math", r"\boxed{\left( 1, 2 \right)}", "(1,2)", {}, 1.0),
    ("math", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", {}, 1.0),
    ("math", r"\boxed{1} then \boxed{2}", "2", {}, 1.0),
    ("math", r"\boxed{1} then \boxed{2}", "1", {}, 0.0),
    ("math", "the answer is 2", "2", {}, 0.0),
    ("math", r"\boxed{\frac{1}{2}", r"\frac{1}{2}", {}, 0.0),
    ("math", r"\boxed{5} and \boxed", "5", {}, 0.0),
    ("math", r"\boxed\frac{1}{2}", r"\frac{1}{2}", {}, 0.0),
    ("math", r"so \boxed 5", "5", {}, 1.0),
    ("math", r"$\boxed 5$ and \boxed{6}", "5", {}, 1.0),
    ("math", r"$\boxed 5$ and \boxed{6}", "6", {}, 0.0),
    ("math", r"\fbox{5}", "5", {}, 0.0),
    ("math", r"\boxed{5}", 5, {}, 0.0),
    ("math", r"\boxed{}", "", {}, 1.0),
    ("math", r"\boxed{1\text{ m}\text{ s}}", r"1\text{ m}\text{ s}", {}, 1.0),
    ("math", r"\boxed{1\text{ m}\text{ s}}", "1", {}, 0.0),
    ("math", r"\boxed{\sqrt}", r"\sqrt", {}, 1.0),
    ("math", r"\boxed{10}" + "x" * 400, "10", {}, 1.0),
    ("dapo", "Answer: 12", "12", {}, {"score": 1.0, "acc": True, "pred": "12"}),
    ("dapo", "Answer: 12,000", "12000", {}, {"score": 1.0, "acc": True, "pred": "12000"}),
    ("dapo", "Answer: 12000", "12,000", {}, {"score": 1.0, "acc": True, "pred": "12000"}),
    ("dapo", "Answer: 12", "12,000", {}, {"score": -1.0, "acc": False, "pred": "12"}),
    ("dapo", r"answer: $\frac{1}{2}$", r"\frac{1}{2}", {}, {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("dapo", r"Answer: \frac{1}{2}", r"$\frac{1}{2}$", {}, {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("dapo", r"Answer: \frac12", r"\frac{1}{2}", {}, {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("dapo", r"Answer: \frac1{2}", r"\frac{1}{2}", {}, {"score": -1.0, "acc": False, "pred": "\\frac{1}{{}2}"}),
    ("dapo", "Answer: 1/2", r"\frac{1}{2}", {}, {"score": -1.0, "acc": False, "pred": "1/2"}),
    ("dapo", r"ANSWER : \boxed{5}", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", "Answer: 5 cm", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", "Answer: 90^\\circ", "90", {}, {"score": 1.0, "acc": True, "pred": "90"}),
    ("dapo", r"Answer: \text{(A)}", "(A)", {}, {"score": 1.0, "acc": True, "pred": "(A)"}),
    ("dapo", "Answer: x = 5", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", "The final answer is 5", "5", {}, {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ("dapo", "Answer:\n5", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", "Answer: 4\nAnswer: 5", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", "Answer: 5" + "x" * 300, "5", {}, {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ("dapo", "x" * 400 + "Answer: 5", "5", {}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", r"so \boxed{5}", "5", {"strict_box_verify": True}, {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", r"\boxed{ 5}", "5", {"strict_box_verify": True}, {"score": -1.0, "acc": False, "pred": " 5"}),
    ("dapo", r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", {"strict_box_verify": True},
     {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("dapo", r"\boxed{5}" + "x" * 100, "5", {"strict_box_verify": True}, {"score": -1.0, "acc": False, "pred": None}),
    ("dapo", "Answer: 5", "5", {"strict_box_verify": True}, {"score": -1.0, "acc": False, "pred": None}),
    ("dapo", r"\boxed{5}" + "y" * 100, "5", {"strict_box_verify": True, "pause_tokens_index": [0, 0, 0, 100]},
     {"score": 1.0, "acc": True, "pred": "5"}),
    ("dapo", r"\boxed{5}" + "y" * 100, "5", {"strict_box_verify": True, "pause_tokens_index": [0, 0, 0, 105]},
     {"score": -1.0, "acc": False, "pred": None}),
]


@pytest.mark.parametrize("family,solution_str,ground_truth,options,expected", VERL_TABLE)
def test_scores_as_verl(family, solution_str, ground_truth, options, expected):
    assert SCORERS[family](solution_str, ground_truth, **options) == expected
    data_source = DATA_SOURCES[family]
    reward = verl_reward(data_source, solution_str, ground_truth, None, **options)
    assert reward == expected
    if family == "dapo":
        assert type(reward["acc"]) is bool
    else:
        assert type(reward) is float


@pytest.mark.parametrize("data_source,scorer", [
    ("openai/gsm8k", gsm8k_reward),
    ("lighteval/MATH", math_reward),
    ("DigitalLearningGmbH/MATH-lighteval", math_reward),
    ("HuggingFaceH4/MATH-500", math_reward),
    ("math_dapo", dapo_reward),
    ("math", dapo_reward),
    ("math_dapo_reasoning", dapo_reward),
    ("aime", dapo_reward),
    ("aime2024", dapo_reward),
    ("aime_2025", dapo_reward),
    ("AIME2024", None),  # verl's prefix test is case-sensitive
    ("my_aime", None),
    ("gsm8k", None),
    ("openai/gsm8k_v2", None),
    ("", None),
])
def test_scorer_for_data_source(data_source, scorer):
    assert verl_scorer_for(data_source) is scorer


def test_aime_prefix_scores_as_verl():
    # verl's default_compute_score for these two calls
    assert verl_reward("aime2024", "Answer: 3", "3") == {"score": 1.0, "acc": True, "pred": "3"}
    assert verl_reward("aime_2025", r"\boxed{3}", "3") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def test_options_reach_the_scorer():
    assert verl_reward("openai/gsm8k", "it is 66", "66") == 0.0
    assert verl_reward("openai/gsm8k", "it is 66", "66", method="flexible") == 1.0
    assert verl_reward("openai/gsm8k", "#### 65", "66", format_score=0.25) == 0.25
    assert verl_reward("math_dapo", r"\boxed{5}", "5")["score"] == -1.0
    assert verl_reward("math_dapo", r"\boxed{5}", "5", strict_box_verify=True)["score"] == 1.0


def test_unknown_option_or_data_source_is_an_error():
    with pytest.raises(TypeError):
        verl_reward("lighteval/MATH", r"\boxed{5}", "5", method="flexible")
    with pytest.raises(ValueError, match="no verl rule scorer"):
        verl_reward("codecontests", "print(1)", "1")


def test_verl_errors_become_value_and_type_errors():
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        score_gsm8k("#### 5", "5", method="loose")  # verl: AssertionError
    with pytest.raises(TypeError, match="str ground truth"):
        score_dapo("Answer: 5", 5)  # verl: AttributeError, 'int' object has no attribute 'split'
    with pytest.raises(ValueError, match="4 indices"):
        score_dapo(r"\boxed{5}", "5", strict_box_verify=True, pause_tokens_index=[100])  # verl: AssertionError
    # strict_box_verify compares without normalizing, so verl takes an int ground truth there (and misses)
    assert score_dapo(r"\boxed{5}", 5, strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": "5"}


def test_reward_functions_take_the_reward_call():
    # shardrl, like verl, calls a reward function with these four keywords
    for reward in {*VERL_SCORERS.values(), verl_reward}:
        inspect.signature(reward).bind(data_source="math", solution_str="", ground_truth="", extra_info=None)
