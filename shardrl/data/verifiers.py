"""A verifiers environment (`rollout.env`) loaded once, and its dataset as prompt rows.

Each row of the environment's dataset (`env.get_dataset()`, or `env.get_eval_dataset()` for validation: its
`prompt` messages, `answer`, `info`, `task`, `example_id`) becomes one prompt row,

    {"prompt": row["prompt"], "data_source": "verifiers/<env>", "verifiers_input": row}

whose episode (`shardrl.rollout.episodes.verifiers_env`) hands `verifiers_input` to the environment's own rollout
unchanged.
"""

from __future__ import annotations

import json

INSTALL_HINT = "verifiers is not installed: pip install 'shardrl[envs]' (or pip install verifiers)"
_LOADED: dict[str, object] = {}


def load_verifiers_env(spec: str, env_args: dict | None = None):
    """The `vf.Environment` of `rollout.env` (`verifiers:ENV_ID` or `path/to/env.py:function`), loaded once a
    process for the same spec and arguments."""
    key = json.dumps([spec, env_args or {}], sort_keys=True, default=repr)
    if key in _LOADED:
        return _LOADED[key]
    try:
        import verifiers as vf
    except ImportError:
        raise ValueError(f"rollout.env={spec!r} needs verifiers, but {INSTALL_HINT}") from None
    if spec.startswith("verifiers:"):
        try:
            env = vf.load_environment(spec.split(":", 1)[1], **(env_args or {}))
        except (TypeError, RuntimeError) as e:  # (verifiers wraps its loader's errors: a bad argument among them)
            raise ValueError(f"rollout.env={spec!r} with rollout.env_args={env_args or {}}: the environment's loader "
                             f"refused them: {e}") from None
        except ValueError as e:  # (an environment not installed: verifiers says which package)
            raise ValueError(f"rollout.env={spec!r}: {e}") from None
        except KeyError as e:
            raise ValueError(missing_column(spec, e)) from e
    else:
        from shardrl.config.userfile import import_user_file

        path, _, name = spec.rpartition(":")
        module = import_user_file(path, f"rollout.env={spec!r}: the environment file", "shardrl_env_")
        loader = getattr(module, name, None)
        if not callable(loader):
            raise ValueError(f"rollout.env={spec!r}: {path} defines no function {name!r}")
        check_arguments(loader, env_args or {}, f"rollout.env={spec!r}")
        try:
            env = loader(**(env_args or {}))
        except KeyError as e:
            raise ValueError(missing_column(spec, e)) from e
    if not isinstance(env, vf.Environment):
        raise ValueError(f"rollout.env={spec!r} gave a {type(env).__name__}, not a verifiers Environment")
    check_rubric(vf, env, f"rollout.env={spec!r}")
    _LOADED[key] = env
    return env


def missing_column(spec: str, error: KeyError) -> str:
    """What a KeyError while an environment was built most likely means: its dataset lacks a column verifiers reads
    (a `question` to make each `prompt` from, where the rows have no `prompt` messages)."""
    return (f"rollout.env={spec!r}: building the environment failed on a missing key {error}; a verifiers dataset "
            "needs a 'prompt' column (chat messages) or a 'question' column (made into one), and an 'answer' where "
            "its rubric reads one: rename the dataset's columns (dataset.rename_column)")


def check_rubric(vf, env, what: str) -> None:
    """Refuses an environment whose rubric cannot give an episode its reward: group reward functions, none (verifiers'
    default `vf.Rubric()`, whose `score_rollout` asserts on every episode), all weighing 0 (metrics only), or
    scoring turned off (`score_rollouts=False`: every reward 0)."""
    rubric = env.rubric
    if rubric.has_group_rewards:
        raise ValueError(f"{what}: the environment's rubric has group reward functions (scoring a prompt's episodes "
                         "together: def f(completions, ...) -> list[float]); shardrl runs each episode on its own "
                         "through the run's endpoint and cannot score them as a group yet: use reward functions of "
                         "one episode (def f(completion, ...) -> float)")
    if not getattr(env, "score_rollouts", True):
        raise ValueError(f"{what}: the environment was made with score_rollouts=False, so verifiers scores every "
                         "episode 0 and nothing is learned; leave score_rollouts at True")
    rubrics = rubric.rubrics if isinstance(rubric, vf.RubricGroup) else [rubric]
    plain = [r for r in rubrics if type(r).score_rollout is vf.Rubric.score_rollout]  # (a subclass scores its way)
    if any(not r.funcs for r in plain):
        raise ValueError(f"{what}: the environment's rubric has no reward functions (verifiers' default rubric, where "
                         "none is given), so no episode can be scored; give it one: rubric=vf.Rubric(funcs=[f]) with "
                         "def f(completion, answer, **kwargs) -> float")
    if len(plain) == len(rubrics) and not any(w for r in plain for w in r.weights):
        raise ValueError(f"{what}: every reward function's weight is 0 in the environment's rubric (metrics only), "
                         "so every episode's reward is 0 and nothing is learned; give one a weight (vf.Rubric(funcs="
                         "[...], weights=[...]))")


def check_arguments(loader, env_args: dict, what: str) -> None:
    """Refuses `rollout.env_args` that `loader`'s signature does not take, naming the ones it does."""
    import inspect

    try:
        inspect.signature(loader).bind(**env_args)
    except TypeError as e:
        params = [p for p in inspect.signature(loader).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        takes = ", ".join(p.name for p in params) or "no arguments"
        raise ValueError(f"{what}: rollout.env_args={env_args} do not fit {loader.__name__}({takes}): {e}") from None


def env_name(spec: str) -> str:
    """`verifiers:gsm8k` -> gsm8k; `envs/my_env.py:load_environment` -> my_env."""
    if spec.startswith("verifiers:"):
        return spec.split(":", 1)[1]
    return spec.rpartition(":")[0].rsplit("/", 1)[-1].removesuffix(".py")


def environment_rows(env, spec: str, split: str = "train") -> list[dict]:
    """The prompt rows of `env`'s dataset (split "train") or of its evaluation dataset ("val": [] without one)."""
    if split == "val":
        if env.build_eval_dataset() is None:  # (get_eval_dataset would fall back to the training set)
            return []
        dataset = env.get_eval_dataset()
    else:
        if env.build_dataset() is None:
            raise ValueError(f"rollout.env={spec!r}: the environment has no dataset to train on")
        dataset = env.get_dataset()
    source = f"verifiers/{env_name(spec)}"
    return [{"prompt": row["prompt"], "data_source": source, "verifiers_input": dict(row)} for row in dataset]
