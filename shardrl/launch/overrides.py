"""The overrides a `shardrl train` run applies: the built-in demo's when the command line names no model or data, or
a verl command line translated."""

from __future__ import annotations

import logging

RUN_SOURCE_KEYS = ("model.path", "model.tiny", "model.tokenizer_path", "data.train_files", "data.val_files")
"""Override keys (and their sub-keys) that name a model or data: with any of them and no config file, a run is the
user's own and starts from the plain defaults, not the demo's."""


def names_run_source(override: str) -> bool:
    key = override.split("=", 1)[0].strip()
    return any(key == k or key.startswith(k + ".") for k in RUN_SOURCE_KEYS)


def resolve_overrides(config: str | None, overrides: list[str], make_demo_assets: bool = True) -> list[str]:
    """The overrides a run applies: with no config file and no override naming a model or data
    (`RUN_SOURCE_KEYS`), the built-in demo's settings come first (the user's overrides win: `shardrl train
    trainer.total_steps=50` is a shorter demo). A run configured on the command line alone starts from the
    plain defaults, as it would with an empty YAML file. `make_demo_assets=False` (`shardrl plan`) only names
    the demo's folder, which its first run makes."""
    if config is not None or any(names_run_source(o) for o in overrides):
        return list(overrides)
    from shardrl.trainer.demo import DEMO_ASSETS, demo_overrides, prepare_demo_assets

    assets = prepare_demo_assets(DEMO_ASSETS) if make_demo_assets else DEMO_ASSETS
    return demo_overrides(assets.resolve()) + list(overrides)


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
