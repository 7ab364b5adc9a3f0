"""A run's plan, derived once from its config and passed down: `Plan`.

    config --Plan.for_rl--> step plan (`StepPlan`: roles, passes), response budget, layout (`derive_layout`)
           --resolve_device--> the device's defaults (`defaults`) filled into the plan's copy of the config

The trainer, its roles, the memory ledger and `shardrl plan` read these from the plan; none derives them again
(a second derivation is where two copies start to disagree). The config a run loaded is never changed: what the run
resolves (the world it runs on, nulls chosen by device, total_steps from total_epochs) goes into the plan's copy,
which is the run folder's config.yaml.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from shardrl.plan.defaults import lora_sync_choice, memory_gib, resolve_device_defaults
from shardrl.plan.layout import Layout, OfflineLayout, derive_layout, derive_offline_layout
from shardrl.plan.step_plan import StepPlan


@dataclass
class Plan:
    config: object
    """The run's config with what the run resolved filled in: a copy (the loaded config stays as loaded)."""
    layout: Layout | OfflineLayout
    """Per-rank sizes of a step on the run's world."""
    steps: StepPlan | None = None
    """What each RL step does (None for an offline trainer)."""
    response: tuple[str, int] | None = None
    """The response budget, (key, tokens) (`RolloutConfig.response_budget`): what a response may reach (an agent's
    episode: rollout.agent.max_response_tokens). None for an offline trainer."""
    choices: list[str] = field(default_factory=list)
    """A line for each null the run resolved (`resolve_device`), for the log."""

    @classmethod
    def for_rl(cls, cfg, nnodes: int, nproc_per_node: int) -> Plan:
        """The plan of an RL run (`shardrl train`) on `nnodes x nproc_per_node` ranks; a `ValueError` for a layout
        that cannot work."""
        steps = StepPlan.from_config(cfg)
        response = cfg.rollout.response_budget()
        layout = derive_layout(cfg, nnodes, nproc_per_node, steps, response)
        resolved, choices = _on_world(cfg, nnodes, nproc_per_node), []
        if resolved.algorithm.rollout_is is None:
            resolved.algorithm.rollout_is = resolved.rollout_correction()
            if resolved.algorithm.rollout_is:
                choices.append("algorithm.rollout_is=true (null: on with rollout.quantization=fp8, whose sampler "
                               "differs more from the trainer; set false to train uncorrected)")
        return cls(resolved, layout, steps, response, choices)

    @classmethod
    def for_offline(cls, cfg, trainer: str, nnodes: int, nproc_per_node: int) -> Plan:
        """The plan of offline trainer `trainer` (`shardrl sft|dpo|rm`)."""
        return cls(_on_world(cfg, nnodes, nproc_per_node),
                   derive_offline_layout(cfg, trainer, nnodes, nproc_per_node))

    @property
    def max_response_tokens(self) -> int:
        return self.response[1]

    def resolve_device(self, hf_config, device, say=None) -> None:
        """The nulls that depend on the device (rollout.lora_sync with LoRA, rollout.backend, *.engine.compile,
        rollout.free_cache_engine), chosen for `device` and the policy's `hf_config` into `config`; a line each
        in `choices`. `say`: where the memory ledger says it cannot size the model."""
        cfg, lines = self.config, []
        if cfg.rollout.lora_sync is None and cfg.model.lora.rank > 0:  # first: the cache's choice counts a copy
            cfg.rollout.lora_sync, why = lora_sync_choice(cfg, self.layout, hf_config, device)
            lines.append(f"rollout.lora_sync={cfg.rollout.lora_sync} (null: {why})")
        cfg, more = resolve_device_defaults(cfg, hf_config, memory_gib(cfg, self.layout, hf_config, device, say))
        self.config, self.choices = cfg, self.choices + lines + more


def _on_world(cfg, nnodes: int, nproc_per_node: int):
    """A copy of `cfg` saying the world the run has (torchrun's, whatever the config said)."""
    cfg = copy.deepcopy(cfg)
    cfg.trainer.nnodes, cfg.trainer.nproc_per_node = nnodes, nproc_per_node
    return cfg
