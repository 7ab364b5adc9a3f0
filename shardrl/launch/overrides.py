"""The overrides a `shardrl train` run applies: the built-in demo's when the command line names no model or data, or
a verl command line translated."""

from __future__ import annotations

import logging

RUN_SOURCE_KEYS = ("model.path", "model.tiny", "model.tokenizer_path", "data.train_files", "data.val_files",
                   "data.reasoning_gym", "rollout.env")
"""Override keys (and their sub-keys) that name a model or data: with any of them and no config file, a run is the
user's own and starts from the plain defaults, not the demo's."""


def names_run_source(override: str) -> bool:
    key = override.split("=", 1)[0].strip()
    return any(key == k or key.startswith(k + ".") for k in RUN_SOURCE_KEYS)


EXAMPLES = ("demo", "reasoning_gym")
"""The built-in examples of `shardrl train --example NAME`: the demo (`trainer.demo`, also what `shardrl train` runs
with no config, model or data) and GRPO on a reasoning-gym task (`trainer.reasoning_gym_example`)."""


def example_settings(example: str, make_assets: bool = True):
    """(assets folder, overrides) of a built-in example; its assets are made on first use unless not `make_assets`
    (`shardrl plan` only names the folder, which the example's first run makes)."""
    if example == "demo":
        from shardrl.trainer.demo import DEMO_ASSETS as assets, demo_overrides as overrides, \
            prepare_demo_assets as prepare
    elif example == "reasoning_gym":
        from shardrl.trainer.reasoning_gym_example import ASSETS as assets, example_overrides as overrides, \
            prepare_example_assets as prepare
    else:
        raise ValueError(f"--example {example!r}: no such built-in example; known: {', '.join(EXAMPLES)}")
    assets = prepare(assets) if make_assets else assets
    return assets, overrides(assets.resolve())


def resolve_overrides(config: str | None, overrides: list[str], make_demo_assets: bool = True,
                      example: str | None = None) -> list[str]:
    """The overrides a run applies: with no config file and no override naming a model or data
    (`RUN_SOURCE_KEYS`), the built-in demo's settings come first (the user's overrides win: `shardrl train
    trainer.total_steps=50` is a shorter demo). A run configured on the command line alone starts from the
    plain defaults, as it would with an empty YAML file. `example` (`--example NAME`, one of `EXAMPLES`): that
    example's settings come first, whatever the overrides name. `make_demo_assets=False` (`shardrl plan`) only
    names the example's folder, which its first run makes."""
    if example is not None:
        if config is not None:
            raise ValueError(f"--example {example} runs a built-in example, which takes key=value overrides but no "
                             f"config file ({config!r}); drop one of them")
    elif config is not None or any(names_run_source(o) for o in overrides):
        return list(overrides)
    _, settings = example_settings(example or "demo", make_demo_assets)
    return settings + list(overrides)


def verl_overrides(config: str | None, args: list[str], config_path: str | None = None,
                   config_name: str | None = None, trainer: str = "train") -> list[str]:
    """`shardrl train --verl` (`shardrl sft --verl`: `trainer="sft"`): verl's key=value arguments (after those of
    verl's `--config-path/--config-name` YAML) translated (`shardrl.compat.verl.translate`, `.sft`), the translation
    shown."""
    from shardrl.compat.verl.translate import config_file_args, translate

    if trainer == "sft":
        from shardrl.compat.verl.sft import translate_sft as translate

    if config is not None:
        raise ValueError(f"--verl takes verl's key=value arguments only, not a config file ({config!r}); drop "
                         "--verl to run a shardrl config, or give verl's --config-path DIR --config-name NAME")
    if config_path is not None or config_name is not None:  # (Hydra's defaults: main_ppo's config, verl's tree)
        args = config_file_args(config_path, config_name, "sft_trainer" if trainer == "sft" else "ppo_trainer") + args
    translation = translate(args)
    if trainer != "sft" and not any(o.startswith("model.path=") for o in translation.overrides):
        raise ValueError("the verl command line gives no actor_rollout_ref.model.path (a local model folder)")
    logging.getLogger("shardrl").info(translation.describe())
    return translation.overrides
