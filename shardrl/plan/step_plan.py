"""What each RL step does, decided once from the config: `StepPlan`.

The trainer, the layout, the memory ledger and `shardrl plan` read one plan, so they agree on which roles exist
(a critic for an estimator that needs values, a reference for a KL term, a reward model), whether the old
log-probs need a pass of their own, where rollout correction runs, and what the scorer and the rollout do. No code
decides from the keys a batch happens to hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardrl.algos import ADVANTAGE_ESTIMATORS, Estimator
from shardrl.config.schema import Config


@dataclass(frozen=True)
class StepPlan:
    estimator: Estimator
    """`ADVANTAGE_ESTIMATORS[algorithm.adv_estimator]`: what it needs (critic, group baseline, whitening)."""
    uses_ref: bool
    """A reference policy runs: a KL loss or a KL penalty in the reward reads its log-probs."""
    reward_model: bool
    """Scores come from a reward model (`reward.model_path`), not a function."""
    old_from_update: bool
    """The update takes its old log-probs from its own forward, detached: no pass before it
    (`old_log_probs_from_update`)."""
    old_from_update_why: str
    rollout_is: Literal["off", "batch", "loss"]
    """Rollout correction's importance weights: none; computed on the batch before the update; or in the loss from
    the update's own forward (with `old_from_update`, truncate mode)."""
    multi_turn: bool
    """The agent loop drives the rollout (tools, an interaction); its batches carry turn and tool counts."""
    dynamic_sampling: bool
    """DAPO: more rounds until enough informative groups (`algorithm.filter_groups`)."""
    disaggregated: bool
    """Rollout ranks generate, training ranks train (`async_rl.rollout_ranks`)."""
    partial_rollout: bool
    """Weights may change inside a response (async only): its tokens carry their policy versions."""
    update_entropy: bool
    """The update's forward computes the entropy: for the entropy bonus, or to report the sampling policy's
    entropy when there is no pass before the update."""
    router_replay: str = "disabled"
    """A mixture of experts: "R2" records the routing in the old-log-prob pass and the update replays it
    (`actor.router_replay.mode`; "disabled" where there is no such pass); "R3": the rollout's recorded routing
    is replayed in the old-log-prob pass and the update."""

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    distill_top_k: int = 0
    """On-policy distillation with the teacher's top-k (`algorithm.opd.top_k`): the teacher pass also returns its k
    likeliest tokens per response token, and the actor's loss adds the forward KL to them."""

    @property
    def uses_teacher(self) -> bool:
        """On-policy distillation: the teacher (teacher.model_path) scores the sampled tokens before the advantages."""
        return self.estimator.needs_teacher

    def roles(self) -> list[str]:
        """The engines this plan builds, in order (the reward model is scored with, never trained)."""
        return ["actor", *(["ref"] if self.uses_ref else []), *(["teacher"] if self.uses_teacher else []),
                *(["critic"] if self.needs_critic else []),
                *(["reward"] if self.reward_model else [])]

    @classmethod
    def from_config(cls, cfg: Config) -> StepPlan:
        algo = cfg.algorithm
        old_from_update, why = old_log_probs_from_update(cfg)
        rollout_is = "off" if not cfg.rollout_correction() else ("loss" if old_from_update else "batch")
        return cls(
            estimator=ADVANTAGE_ESTIMATORS[algo.adv_estimator],
            uses_ref=cfg.actor.use_kl_loss or algo.use_kl_in_reward,
            reward_model=bool(cfg.reward.model_path),
            old_from_update=old_from_update,
            old_from_update_why=why,
            rollout_is=rollout_is,
            multi_turn=cfg.rollout.multi_turn.enable or cfg.rollout.runs_agent(),
            dynamic_sampling=algo.filter_groups.enable,
            disaggregated=cfg.async_rl.rollout_ranks > 0,
            partial_rollout=cfg.async_rl.partial_rollout,
            update_entropy=bool(cfg.actor.entropy_coeff) or old_from_update,
            router_replay=("disabled" if old_from_update and cfg.actor.router_replay.mode == "R2"
                           else cfg.actor.router_replay.mode),
            distill_top_k=algo.opd.top_k if ADVANTAGE_ESTIMATORS[algo.adv_estimator].needs_teacher else 0,
        )

    def describe(self) -> str:
        """One line for the log."""
        return (f"step plan: roles {', '.join(self.roles())}; old log-probs: {self.old_from_update_why}; "
                f"rollout correction: {self.rollout_is}; {'multi-turn' if self.multi_turn else 'single-turn'}"
                f"{'; dynamic sampling' if self.dynamic_sampling else ''}"
                f"{f'; router replay {self.router_replay}' if self.router_replay != 'disabled' else ''}"
                f"{'; disaggregated' if self.disaggregated else ''}")


def old_log_probs_from_update(cfg: Config) -> tuple[bool, str]:
    """Whether the actor update may take its old log-probs from its own forward (detached), skipping the
    forward pass that computes them before the update; and why, in words.

    Exact when that forward is the pass the old log-probs would come from: the parameters the old pass
    would see are the ones the update's only optimizer step starts from (one mini-batch, one epoch; the
    engine's `train_batch` runs each micro-batch forward once), at the same temperature (the trainer passes
    the rollout's `logprob_temperature` to both), and without dropout (training runs in train mode). Nothing
    may read the old log-probs before the update: KL in the reward does (it shapes the advantages). The
    rollout correction's truncated weights (algorithm.rollout_is, mode truncate) are then computed in the loss
    from the same detached forward; mask mode is not, as it changes the token count the loss divides by."""
    a = cfg.actor
    if a.recompute_old_log_probs == "always":
        return False, "actor.recompute_old_log_probs=always"
    blockers = []
    if a.ppo_mini_batch_size != cfg.data.train_batch_size:
        blockers.append(f"{cfg.data.train_batch_size // a.ppo_mini_batch_size} mini-batches per step "
                        f"(actor.ppo_mini_batch_size={a.ppo_mini_batch_size} < data.train_batch_size="
                        f"{cfg.data.train_batch_size})")
    if a.ppo_epochs != 1:
        blockers.append(f"actor.ppo_epochs={a.ppo_epochs}")
    if cfg.algorithm.use_kl_in_reward:
        blockers.append("algorithm.use_kl_in_reward reads them before the advantages")
    if ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator].needs_teacher:
        blockers.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} reads them (the student's) for the "
                        "advantages")
    if cfg.rollout_correction() and cfg.algorithm.rollout_is_mode in ("mask", "reject"):
        blockers.append(f"algorithm.rollout_is_mode={cfg.algorithm.rollout_is_mode} drops tokens from the loss mask "
                        "before the update, "
                        "and the loss is normalized by that mask's token count")
    if not cfg.model.disable_dropout:
        blockers.append("model.disable_dropout=false (the update's forward may draw dropout masks)")
    if blockers:
        return False, "recomputed before the update (actor.recompute_old_log_probs=auto): " + "; ".join(blockers)
    return True, ("taken from the update's own forward, detached (actor.recompute_old_log_probs=auto: one "
                  "mini-batch, one epoch, so the PPO ratio is exactly 1 there); no separate forward pass")
