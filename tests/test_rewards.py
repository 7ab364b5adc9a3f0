import logging

import pytest
import torch

from shardrl.rewards.manager import (
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



def test_verls_data_sources_score_as_verl_and_the_lenient_reading_keeps_its_name():
    """openai/gsm8k, the data_source verl's preprocessing writes, scores as verl's own gsm8k scorer (a reward
    curve compares with verl's); shardrl's lenient reading stays the built-in of data_source gsm8k."""
    from shardrl.rewards.manager import builtin_scorer

    cases = [("#### 66.", "66"), ("####66", "66"), ("#### 66.00", "66"), ("#### $66", "66"), ("#### 66", "66.0"),
             ("#### 66", "66")]
    assert [builtin_scorer("openai/gsm8k")("openai/gsm8k", a, t) for a, t in cases] == [0, 0, 0, 0, 0, 1]
    assert [gsm8k_score("gsm8k", a, t) for a, t in cases] == [1, 1, 1, 1, 1, 1]
    math = builtin_scorer("DigitalLearningGmbH/MATH-lighteval")
    assert math("DigitalLearningGmbH/MATH-lighteval", "so \\boxed{\\dfrac12}", "\\frac{1}{2}") == 1.0
    assert builtin_scorer("aime2024")("aime2024", "Answer: 12", "12")["score"] == 1.0
    assert builtin_scorer("AIME2024") is None  # verl's prefix is lower case
    scores, metrics = RewardManager().score([item("Answer: 7", "7", "math_dapo"), item("Answer: 8", "7", "math_dapo")])
    assert scores.tolist() == [1.0, -1.0] and metrics["reward/acc"] == (1.0, 2.0)  # DAPO's dict: score, acc (and pred)


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
    with pytest.raises(ValueError, match=r"data_source 'mystery'; known: \[.*'arith', 'gsm8k'.*'openai/gsm8k'\] and aime\*"):
        RewardManager().score([item("1", "1"), item("1", "1", data_source="mystery")])


def test_manager_user_fn_dict_results():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        correct = float(solution_str == ground_truth)
        return {"score": 2 * correct - 1, "correct": correct, "length": len(solution_str), "note": "text is skipped"}

    scores, metrics = RewardManager(fn).score([item("ab", "ab", "anything"), item("abcd", "ab", "anything")])
    assert scores.tolist() == [1.0, -1.0]
    assert metrics["reward/correct"] == (1.0, 2.0) and metrics["reward/length"] == (6.0, 2.0)  # (sum, count)
    assert "reward/note" not in metrics and metrics["reward/num_errors"] == 0


def test_a_reward_dict_cannot_overwrite_the_trainers_own_reward_metrics():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "mean": 123.0, "correct": 1.0}

    with pytest.raises(ValueError, match=r"failed on all 2 samples.*returned the key\(s\) \['mean'\], which shardrl "
                                         r"logs itself as reward/<key>"):
        RewardManager(fn).score([item("a", "a"), item("b", "b")])


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
    with caplog.at_level(logging.WARNING, logger="shardrl.rewards.manager"):
        scores, metrics = manager.score([item("ok", ""), item("boom", ""), item("nodict", ""), item("nan", "")])
        scores2, metrics2 = manager.score([item("boom", ""), item("ok", "")])
    assert scores.tolist() == [1.0, -0.5, -0.5, -0.5]
    assert metrics["reward/num_errors"] == 3 and metrics2["reward/num_errors"] == 1
    assert scores2.tolist() == [-0.5, 1.0]
    warnings = [r for r in caplog.records if r.name == "shardrl.rewards.manager"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "RuntimeError: parser exploded" in text and "Traceback" in text


# ---------------------------------------------------------------- a reward that always fails, verl's extra_info


@pytest.mark.parametrize("body,first_error", [
    ("return None", "TypeError: reward function returned NoneType None, not a number"),
    ("return float('nan')", "ValueError: reward function returned a non-finite score nan"),
    ("return '1.0'", "TypeError: reward function returned str '1.0', not a number"),
    ("return {'value': 1.0}", "ValueError: reward function returned a dict without 'score': keys ['value']"),
    ("return {'score': 'high'}", "TypeError: reward function returned str 'high', not a number"),
    ("return 1e39", "ValueError: reward function returned the score 1e+39, beyond what float32 holds"),
    ("return -1e39", "ValueError: reward function returned the score -1e+39, beyond what float32 holds"),
    ("raise KeyError('answer')", "KeyError: 'answer'"),
])
def test_every_sample_failing_is_an_error_quoting_the_first_failure(body, first_error):
    namespace = {}
    exec(f"def fn(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n", namespace)
    manager = RewardManager(namespace["fn"])
    with pytest.raises(ValueError, match="failed on all 3 samples of this step") as info:
        manager.score([item("1", "1"), item("2", "2"), item("3", "3")])
    assert "(data_source='arith') " + first_error in str(info.value)
    # a caller scoring a share of a global batch decides itself, from the count
    scores, metrics = manager.score([item("1", "1"), item("2", "2")], fail_if_all_fail=False)
    assert scores.tolist() == [0.0, 0.0] and metrics["reward/num_errors"] == 2
    assert first_error in str(manager.all_failed_error(8)) and "all 8 samples" in str(manager.all_failed_error(8))


def test_a_float32_size_score_is_kept():
    scores, metrics = RewardManager(lambda *a: 3e38).score([item("1", "1")])
    assert scores.tolist() == [pytest.approx(3e38, rel=1e-6)] and metrics["reward/num_errors"] == 0


def test_wrong_signature_is_refused_at_load(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("def compute_score(solution_str, truth):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"compute_score\(solution_str, truth\) \(compute_score in .*rw.py'\) cannot "
                                         r"be called with a reward function's arguments: missing a required argument: "
                                         r"'truth'.*verl's names"):
        load_reward_function(str(path))
    no_response = tmp_path / "nr.py"
    no_response.write_text("def compute_score(data_source, ground_truth):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"takes no solution_str"):
        load_reward_function(str(no_response))
    with pytest.raises(ValueError, match=r"reward_kwargs \['bonus'\]: got an unexpected keyword argument 'bonus'"):
        load_reward_function(str(path.with_name("ok.py").write_text(
            "def compute_score(solution_str, ground_truth):\n    return 1.0\n") and path.with_name("ok.py")),
            reward_kwargs={"bonus": 1})
    with pytest.raises(ValueError, match=r"reward_kwargs \['ground_truth'\] are the reward function's own"):
        RewardManager(lambda solution_str, ground_truth: 1.0, reward_kwargs={"ground_truth": 1})


def test_verl_scorer_signatures_are_bound_by_name(tmp_path):
    """verl's own scorer files start with solution_str (`gsm8k.compute_score(solution_str, ground_truth,
    method="strict", format_score=0.0, score=1.0)`): bound by position they would get the data source as the
    response; by name each gets its own argument, and reward_kwargs reach the others."""
    path = tmp_path / "verl_like.py"
    path.write_text("def compute_score(solution_str, ground_truth, method='strict', format_score=0.0, score=1.0):\n"
                    "    answer = solution_str.split('####')[-1].strip() if method == 'strict' else solution_str[-1]\n"
                    "    return score if answer == ground_truth else format_score\n")
    manager = RewardManager(load_reward_function(str(path)))
    assert manager.score([item("#### 8", "8"), item("#### 7", "8")])[0].tolist() == [1.0, 0.0]
    kwargs = {"method": "flexible", "format_score": 0.25}
    manager = RewardManager(load_reward_function(str(path), reward_kwargs=kwargs), reward_kwargs=kwargs)
    assert manager.score([item("so 8", "8"), item("so 7", "8")])[0].tolist() == [1.0, 0.25]
    seen = []
    RewardManager(lambda solution_str, ground_truth, extra_info: seen.append(sorted(extra_info)) or 1.0).score(
        [{"data_source": "d", "response_text": "x", "extra": {"ground_truth": "1", "extra_info": {"index": 3}}}])
    assert seen == [["ground_truth", "index"]]


def test_sys_exit_in_a_reward_file_says_so(tmp_path):
    at_import = tmp_path / "exits.py"
    at_import.write_text("import sys\nsys.exit(3)\ndef compute_score(*a):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"exits.py' called sys.exit\(3\) while being imported"):
        load_reward_function(str(at_import))
    in_fn = tmp_path / "exits_later.py"
    in_fn.write_text("import sys\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    if solution_str == 'x':\n        sys.exit('bad sample')\n    return 1.0\n")
    manager = RewardManager(load_reward_function(str(in_fn)))
    with pytest.raises(ValueError, match=r"called sys.exit\('bad sample'\) on a sample \(data_source='arith'\)"):
        manager.score([item("1", "1"), item("x", "1")])


def test_called_by_keyword_like_verl_or_by_position():
    calls = []

    def verl_style(solution_str, ground_truth, **kwargs):  # verl calls by keyword: this works there
        calls.append((solution_str, ground_truth, sorted(kwargs)))
        return 1.0

    def positional(ds, text, truth, info=None):
        calls.append((ds, text, truth))
        return 0.5

    RewardManager(verl_style).score([item("7", "8")])
    RewardManager(positional).score([item("7", "8")])
    RewardManager(lambda *args: calls.append(args) or 0.0).score([item("7", "8")])
    assert calls == [("7", "8", ["data_source", "extra_info"]), ("arith", "7", "8"), ("arith", "7", "8", {})]


def test_reward_extra_info_is_the_rows_own_with_the_rest_merged_in():
    from shardrl.rewards.manager import reward_extra_info

    row_extra = {"extra_info": {"split": "train", "index": 0, "ability": "kept"},
                 "reward_model": {"style": "rule", "ground_truth": "4"}, "ability": "math", "ground_truth": "4"}
    assert reward_extra_info(row_extra) == {"split": "train", "index": 0, "ability": "kept",
                                            "reward_model": {"style": "rule", "ground_truth": "4"}, "ground_truth": "4"}
    assert reward_extra_info({"ground_truth": "4", "level": 2}) == {"ground_truth": "4", "level": 2}
    assert reward_extra_info(None) == {}


def test_a_verl_reward_file_scores_a_verl_parquet_row_unchanged(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardrl.data.prompts import load_prompt_dataset
    from shardrl.tokenizer import build_char_tokenizer

    rows = [{"data_source": "my_math", "prompt": [{"role": "user", "content": f"{i}+2=?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train" if i < 2 else "test", "index": i}} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    reward_file = tmp_path / "verl_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'my_math', data_source\n"
        "    bonus = 0.5 if extra_info['split'] == 'train' else 0.0\n"
        "    return float(solution_str.strip() == ground_truth) + bonus + 10 * extra_info['index']\n")
    dataset = load_prompt_dataset([str(tmp_path / "train.parquet")], build_char_tokenizer())
    manager = RewardManager(load_reward_function(str(reward_file)))
    items = [{"data_source": row["data_source"], "response_text": text, "extra": row["extra"]}
             for row, text in zip(dataset, ["2", "9", "4"])]
    scores, metrics = manager.score(items)
    assert metrics["reward/num_errors"] == 0
    assert scores.tolist() == [1.5, 10.5, 21.0]


# ---------------------------------------------------------------- reward workers (reward.num_workers, timeout_s)
SLOW_REWARD = """
import os, sys, time

def compute_score(solution_str, ground_truth, extra_info=None, pid_file=None):
    if solution_str == "slow":
        time.sleep(60)
    if solution_str == "exit":
        sys.exit(4)
    if pid_file:
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.3)
    return float(solution_str == ground_truth)
"""


@pytest.mark.multiproc
def test_reward_workers_score_in_parallel_and_stop_a_sample_past_its_time_limit(tmp_path):
    from shardrl.rewards.pool import RewardPool

    path = tmp_path / "slow.py"
    path.write_text(SLOW_REWARD)
    pids = tmp_path / "pids.txt"
    kwargs = {"pid_file": str(pids)}
    pool = RewardPool(2, 2.0, str(path), "compute_score", kwargs)
    manager = RewardManager(load_reward_function(str(path), reward_kwargs=kwargs), -1.0, kwargs, pool)
    try:
        scores, metrics = manager.score([item(str(i % 3), "1") for i in range(8)] + [item("slow", "1")])
        assert scores.tolist() == [0.0, 1.0, 0.0] * 2 + [0.0, 1.0, -1.0]  # the slow one: reward.on_error_score
        assert metrics["reward/num_errors"] == 1 and metrics["reward/num_timeouts"] == 1
        assert "took longer than reward.timeout_s=2 s" in manager.first_error
        assert len(set(pids.read_text().split())) == 2  # both workers scored
        # the stopped worker was replaced: the pool goes on
        assert manager.score([item("1", "1"), item("2", "1")])[0].tolist() == [1.0, 0.0]
        with pytest.raises(ValueError, match=r"called sys.exit\(4\) on a sample"):
            manager.score([item("1", "1"), item("exit", "1")])
    finally:
        manager.close()
    builtin = RewardManager(pool=RewardPool(1, None))  # the built-in scorers, by data source, in a worker
    try:
        scores, metrics = builtin.score([item("#### 66", "66", "openai/gsm8k"), item("#### 66.", "66", "openai/gsm8k")])
        assert scores.tolist() == [1.0, 0.0] and "reward/num_timeouts" not in metrics
    finally:
        builtin.close()
