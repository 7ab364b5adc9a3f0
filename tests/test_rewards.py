import logging

import pytest
import torch

from shardrl.rewards import (
    REWARD_FUNCTIONS,
    RewardManager,
    arith_score,
    extract_gsm8k_answer,
    gsm8k_score,
    load_reward_function,
)


# ---------------------------------------------------------------- arith


@pytest.mark.parametrize("response,expected", [
    ("19", 1.0),
    (" 19 ", 1.0),
    ("19\n12+7=19", 1.0),      # only the first line counts
    ("19<eos>garbage", 1.0),
    ("19<|im_end|>", 1.0),
    ("191", 0.0),
    ("1 9", 0.0),
    ("19.0", 0.0),             # exact match, not numeric
    ("\n19", 0.0),             # empty first line
    ("", 0.0),
])
def test_arith(response, expected):
    assert arith_score("arith", response, "19") == expected


def test_arith_int_ground_truth():
    assert arith_score("arith", "7", 7) == 1.0


# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize("text,strict,flexible", [
    ("so 3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234.", "1234", "1234"),
    ("first #### 5 then #### 6 apples", "6", "6"),
    ("####72", "72", "72"),
    ("#### $18", "18", "18"),
    ("#### -3.50", "-3.5", "-3.5"),
    ("#### 18.00", "18", "18"),
    ("the answer is 42.", None, "42"),
    ("she pays $1,000,000 in total.", None, "1000000"),
    ("10 apples and 2.5 pears", None, "2.5"),
    ("no numbers at all", None, None),
    ("#### 12 because 3 times 4", "12", "4"),
])
def test_extract_gsm8k_answer(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_extract_gsm8k_bad_method():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_gsm8k_answer("1", "loose")


def test_gsm8k_score():
    assert gsm8k_score("gsm8k", "3 dozen is 36\n#### 36", "36") == 1.0
    assert gsm8k_score("gsm8k", "#### 1,080", "1080") == 1.0
    assert gsm8k_score("gsm8k", "#### 1080", "1,080") == 1.0
    assert gsm8k_score("gsm8k", "#### 35", "36") == 0.0
    assert gsm8k_score("gsm8k", "the answer is 36", "36") == 0.0  # strict needs ####
    assert gsm8k_score("gsm8k", "the answer is 36", "36", method="flexible") == 1.0
    assert gsm8k_score("gsm8k", "#### 36", "6 * 6 = 36\n#### 36") == 1.0  # full solution as ground truth
    assert gsm8k_score("gsm8k", "#### 36<eos>#### 40", "36") == 1.0  # text after EOS ignored
    assert REWARD_FUNCTIONS["gsm8k_flexible"]("gsm8k", "it is 36.", "36") == 1.0
    assert REWARD_FUNCTIONS["openai/gsm8k"] is gsm8k_score


# ---------------------------------------------------------------- user reward files


def test_load_reward_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("import math\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str == ground_truth)\n\ndef other(*a):\n    return 0.5\n")
    fn = load_reward_function(str(path))
    assert fn("x", "ab", "ab") == 1.0 and fn("x", "ab", "b") == 0.0
    assert load_reward_function(str(path), name="other")() == 0.5


def test_load_reward_function_missing_file(tmp_path):
    with pytest.raises(ValueError, match="reward function file not found: .*absent.py'$"):
        load_reward_function(str(tmp_path / "absent.py"))
    (tmp_path / "score.py").write_text("def f(*a):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"file not found: .*score.py:f'; the function's name goes in "
                                         r"reward.function_name: reward.function_path=.*score.py reward.function_name=f$"):
        load_reward_function(f"{tmp_path / 'score.py'}:f")


def test_load_reward_function_import_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import does_not_exist_xyz\n")
    with pytest.raises(ValueError, match=r"broken\.py' failed to import: ModuleNotFoundError: .*does_not_exist_xyz"):
        load_reward_function(str(path))
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def compute_score(:\n")
    with pytest.raises(ValueError, match="failed to import: SyntaxError"):
        load_reward_function(str(syntax))


def test_load_reward_function_missing_name_lists_callables(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("import os\nfrom math import sqrt\n\ndef score_a(*a):\n    return 1\n\n"
                    "class Scorer:\n    pass\n\ndef _private():\n    pass\n\nTHRESHOLD = 3\n")
    with pytest.raises(ValueError, match=r"defines no 'compute_score'; callables it defines: \['Scorer', 'score_a'\]"):
        load_reward_function(str(path))


def test_load_reward_function_not_callable(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("compute_score = 3\n")
    with pytest.raises(ValueError, match="'compute_score' in .* is a int, not a function"):
        load_reward_function(str(path))


# ---------------------------------------------------------------- RewardManager


def item(response, ground_truth, data_source="arith", extra=None):
    return {"data_source": data_source, "response_text": response, "ground_truth": ground_truth, "extra": extra or {}}


def test_manager_builtin_by_data_source():
    scores, metrics = RewardManager().score([
        item("19", "19"), item("18", "19"), item("#### 36", "36", "gsm8k"), item("36", "36", "gsm8k"),
    ])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["reward/num_errors"] == 0 and metrics["reward/score"] == 0.5


def test_manager_ground_truth_from_extra():
    scores, _ = RewardManager().score([{"data_source": "arith", "response_text": "7", "extra": {"ground_truth": "7"}}])
    assert scores.tolist() == [1.0]


def test_manager_unknown_data_source():
    with pytest.raises(ValueError, match=r"data_source 'mystery'; known: \['arith', 'gsm8k'"):
        RewardManager().score([item("1", "1"), item("1", "1", data_source="mystery")])


def test_manager_user_fn_dict_results():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        correct = float(solution_str == ground_truth)
        return {"score": 2 * correct - 1, "correct": correct, "length": len(solution_str), "note": "text is skipped"}

    scores, metrics = RewardManager(fn).score([item("ab", "ab", "anything"), item("abcd", "ab", "anything")])
    assert scores.tolist() == [1.0, -1.0]
    assert metrics["reward/correct"] == 0.5 and metrics["reward/length"] == 3.0
    assert "reward/note" not in metrics and metrics["reward/num_errors"] == 0


def test_manager_tolerates_errors_and_logs_once(caplog):
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("parser exploded")
        if solution_str == "nodict":
            return {"value": 1.0}
        if solution_str == "nan":
            return float("nan")
        return 1.0

    manager = RewardManager(fn, on_error_score=-0.5)
    with caplog.at_level(logging.WARNING, logger="shardrl.rewards"):
        scores, metrics = manager.score([item("ok", ""), item("boom", ""), item("nodict", ""), item("nan", "")])
        scores2, metrics2 = manager.score([item("boom", "")])
    assert scores.tolist() == [1.0, -0.5, -0.5, -0.5]
    assert metrics["reward/num_errors"] == 3 and metrics2["reward/num_errors"] == 1
    assert scores2.tolist() == [-0.5]
    warnings = [r for r in caplog.records if r.name == "shardrl.rewards"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "RuntimeError: parser exploded" in text and "Traceback" in text
