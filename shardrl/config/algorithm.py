"""The RL roles and the algorithm: `ActorConfig` (with `RouterReplayConfig`), `RefConfig`, `CriticConfig`,
`AlgorithmConfig` (with `FilterGroupsConfig`) and `AsyncConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from shardrl.config.engine import EngineConfig, OptimConfig
from shardrl.config.checks import check_async
from shardrl.config.load import require
from shardrl.config.names import ADVANTAGE_ESTIMATORS, LOSS_MODES

KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
"""verl's KL estimator names (shardrl.algos.kl): k3 = low_var_kl (clamped); a "+" takes k2's gradient."""
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
EstimatorName = Literal[tuple(ADVANTAGE_ESTIMATORS)]  # the registries are the lists of names
LossModeName = Literal[tuple(LOSS_MODES)]


def _validate_ppo_loop(section: Any, prefix: str) -> None:
    require(section, prefix, "ppo_mini_batch_size", section.ppo_mini_batch_size >= 1, "must be >= 1 (prompts)")
    require(section, prefix, "ppo_epochs", section.ppo_epochs >= 1, "must be >= 1")


@dataclass
class RouterReplayConfig:
    mode: Literal["disabled", "R2", "R3"] = "disabled"
    """A mixture of experts' routing in the update (verl's actor.router_replay.mode). "R2": the old-log-prob
    pass records each token's experts per MoE layer and every update forward is routed as it was (the expert
    choice stays the old policy's; the weights are this forward's, so the router still learns); logs
    actor/router_replay_mismatch, the share of (token, layer) routings the update would have chosen
    otherwise. It replays nothing when the old log-probs come from the update's own forward (one optimizer
    step per training step). "R3": the fast rollout records each token's experts as it generates, and the
    old-log-prob pass and every update forward are routed as the rollout was (single-turn, rollout.backend
    fast); the mismatch then counts the routings the trainer would have chosen otherwise than the rollout."""


@dataclass
class ActorConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the policy."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the policy."""
    ppo_mini_batch_size: int = 4
    """Prompts per optimizer step (global); a step's batch gives train_batch_size / this updates per epoch."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    shuffle: bool = True
    """Shuffle samples before cutting mini-batches."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (larger = "clip-higher")."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound on the loss for negative advantages; must be > 1."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add KL(policy || ref) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token policy, entropy and KL losses are reduced to one number (verl's actor.loss_agg_mode)."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped), a "+" suffix for k2's gradient."""
    router_aux_loss_coef: float = 0.0
    """A mixture of experts: weight of HF's load-balancing loss (HF's name; `load_balancing_loss_func` over each
    micro-batch's tokens, weighted by its share of the mini-batch's loss tokens) added to the actor's loss; logs
    actor/router_aux_loss. 0: off (RL post-training usually leaves the router's balance alone). Being a function
    of a whole micro-batch, not a sum over tokens, its value depends on how the batch is cut."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Mixtures of experts: replay a recorded routing in the update (`RouterReplayConfig`)."""
    recompute_old_log_probs: Literal["auto", "always"] = "auto"
    """"always": a forward pass over the step's batch computes the old log-probs before the update. "auto":
    skip that pass when it provably equals the update's own forward (one optimizer step per training step:
    ppo_mini_batch_size == data.train_batch_size and ppo_epochs == 1; no KL in the reward, which needs the
    old log-probs before the advantages; dropout off); the PPO ratio is then exactly 1, so the update uses
    the detached log-probs of its own forward as the old ones. The choice is logged at start-up."""
    loss_mode: LossModeName = "vanilla"
    """Policy loss (verl's actor.policy_loss.loss_mode): "vanilla" PPO clip (per-token ratio, dual-clip);
    "gspo": GSPO, one length-normalized ratio per sequence, clipped per sequence; "gspo_token": GSPO-token,
    that ratio's value with a gradient per token and each token's own advantage (verl's "gspo"). GSPO's paper
    uses loss_agg_mode=seq-mean-token-mean and tight clips (clip_ratio_low=3e-4, clip_ratio_high=4e-4);
    clip_ratio_c is not used by the GSPO modes. A sequence's ratio needs the whole sequence in one loss call,
    which holds for every layout: micro-batches (fixed or dynamic, packed or padded) are cut between sequences,
    and under Ulysses sp the loss sees the gathered whole rows. `shardrl.algos.gspo`.
    The 2025-26 losses (`shardrl.algos.policy_variants`, verl's names and formulas): "cispo" (MiniMax-M1: REINFORCE
    weighted by the stopped ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]); "sapo" (a soft gate,
    tau_pos / tau_neg, instead of the clip; verl aggregates it seq-mean-token-mean); "geo_mean" (GMPO: the
    geometric mean of the token ratios per sequence, each log-ratio clipped to [-clip_ratio_low, clip_ratio_high];
    seq-mean-token-mean is the paper's mean over sequences); "dppo_tv" / "dppo_kl" (DPPO: tokens whose probability
    moved past a total-variation / binary-KL bound, clip_ratio_high for A > 0 and clip_ratio_low otherwise, are
    masked; the rest get REINFORCE weighted by the stopped ratio truncated at clip_ratio_c)."""
    tau_pos: float = 1.0
    """SAPO (loss_mode=sapo): the gate's temperature for tokens with a positive advantage; larger fades the
    gradient faster as the ratio leaves 1 (verl's actor.tau_pos)."""
    tau_neg: float = 1.05
    """SAPO: the gate's temperature for tokens with a zero or negative advantage (verl's actor.tau_neg)."""

    def validate(self, prefix: str) -> None:
        _validate_ppo_loop(self, prefix)
        require(self, prefix, "clip_ratio_low", 0 <= self.clip_ratio_low < 1, "must be in [0, 1)")
        require(self, prefix, "clip_ratio_high", self.clip_ratio_high >= 0, "must be >= 0")
        require(self, prefix, "clip_ratio_c", self.clip_ratio_c > 1, "must be > 1 (dual-clip bound)")
        require(self, prefix, "kl_loss_coef", self.kl_loss_coef >= 0, "must be >= 0")
        require(self, prefix, "router_aux_loss_coef", self.router_aux_loss_coef >= 0, "must be >= 0")
        require(self, prefix, "tau_pos", self.tau_pos > 0, "must be > 0 (SAPO's gate temperature)")
        require(self, prefix, "tau_neg", self.tau_neg > 0, "must be > 0 (SAPO's gate temperature)")


@dataclass
class RefConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the frozen reference policy (used for KL)."""


@dataclass
class TeacherConfig:
    model_path: str | None = None
    """Model folder (or hub id) of the teacher of on-policy distillation (algorithm.adv_estimator=opd): a frozen
    causal LM that scores each sampled token, built as the reference is (forward only, the policy's layout, the
    policy's model settings), from this path. Its tokenizer must encode as the policy's (same ids). With
    `by_data_source`: the teacher of the data sources that map names no other (None: each must be named there)."""
    by_data_source: dict = field(default_factory=dict)
    """Multi-teacher distillation (MOPD): `{data_source: model folder}`, each row scored by its data source's
    teacher (one forward-only engine per distinct folder, all on `engine`'s settings). A training row whose data
    source is neither here nor covered by `model_path` is refused at start."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding, batching and offload of the teacher (forward only; taken from the actor's unless set)."""

    def paths(self) -> list[str]:
        """Every teacher folder, once each: model_path first (when set), then by_data_source's in key order."""
        named = [self.by_data_source[k] for k in sorted(self.by_data_source)]
        return list(dict.fromkeys([*([self.model_path] if self.model_path else []), *named]))

    def key(self, path: str) -> str:
        """The config key that names the teacher folder `path` (for messages)."""
        if path == self.model_path:
            return "teacher.model_path"
        return f"teacher.by_data_source.{next(k for k, v in sorted(self.by_data_source.items()) if v == path)}"


@dataclass
class OPDConfig:
    kl_coef: float = 1.0
    """Weight of the per-token reverse KL to the teacher in the advantage: each token's advantage is
    -kl_coef * (log p_student - log p_teacher) at the sampled token."""
    reward_coef: float = 0.0
    """Weight of the verifier's GRPO advantage (the reward's group-normalized score, broadcast over the tokens)
    added to it; 0: pure distillation, the reward only logged."""
    baseline: str = "group"
    """What each token's reverse-KL reward is compared against: group (minus the mean reward of the prompt's other
    samples at the same response position: a leave-one-out baseline, the same expected gradient with less variance;
    a group of one has none), or none (the reward itself, the per-token estimator of Thinking Machines' OPD). group
    by default: it learned faster on every seed of bench/distill.py (bench/RESULTS.md, "On-policy distillation")."""
    top_k: int = 0
    """> 0: also train the student toward the teacher's whole distribution at each response token, not only its
    score of the sampled token: the teacher's k likeliest tokens there (and their log-probs) are a target, the loss
    gains `top_k_coef` x the forward KL sum_i p_teacher(i) (log p_teacher(i) - log p_student(i)) over those k
    (the GKD / on-policy-distillation-with-logits form; the teacher's mass outside its top k is left out; a teacher
    head with more rows than the student's takes its top k among the student's ids),
    aggregated as the policy loss (actor.loss_agg_mode). It gives the student the right token where it sampled a
    wrong one. 0: the sampled token's reverse KL only (in the advantage). Costs the teacher a top-k per token
    and the student's head a gather of k log-probs per token in the update."""
    top_k_coef: float = 1.0
    """Weight of the top-k forward-KL loss term (with top_k > 0)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "kl_coef", self.kl_coef >= 0, "must be >= 0")
        require(self, prefix, "reward_coef", self.reward_coef >= 0, "must be >= 0")
        require(self, prefix, "baseline", self.baseline in ("none", "group"), "must be none or group")
        require(self, prefix, "top_k", 0 <= self.top_k <= 1024, "must be in [0, 1024] (0: off)")
        require(self, prefix, "top_k_coef", self.top_k_coef > 0, "must be > 0 (turn the term off with top_k=0)")
        require(self, prefix, "kl_coef", self.kl_coef > 0 or self.reward_coef > 0 or self.top_k > 0,
                "and reward_coef are both 0 with top_k 0: nothing would be trained; set one > 0")


@dataclass
class CriticConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sharding and batching of the value model (used by GAE)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the value model."""
    ppo_mini_batch_size: int = 4
    """Prompts per critic optimizer step (global)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    shuffle: bool = True
    """Shuffle samples before cutting the critic's mini-batches (taken from actor.shuffle unless set)."""
    cliprange_value: float = 0.5
    """Value clip: new values stay within this of the old ones."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token value losses are reduced to one number (verl's critic.loss_agg_mode)."""
    model_path: str | None = None
    """Model folder (or hub id) of the critic; None starts from the actor's model."""
    model_override_config: dict = field(default_factory=dict)
    """Attributes set over the critic's HF config, as model.override_config for the policy (which the critic does
    not take, as in verl: its critic.model.override_config)."""

    def validate(self, prefix: str) -> None:
        _validate_ppo_loop(self, prefix)
        require(self, prefix, "cliprange_value", self.cliprange_value > 0, "must be > 0")


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling, as verl's DAPO recipe runs it: generate batches of data.gen_batch_size prompts,
    keep the groups (a prompt's rollout.n responses) whose `metric` is not all equal (a group of one response is
    kept), and generate more until data.train_batch_size groups are kept; the step trains on the first
    train_batch_size of them (in the order drawn), spread evenly over the ranks. Logs
    dynamic_sampling/num_gen_batches (batches drawn; verl's train/num_gen_batches) and
    dynamic_sampling/informative_frac (the share of the drawn groups kept)."""
    metric: str = "seq_reward"
    """What a group must differ in: "seq_reward" (the reward, with reward.overlong_buffer's penalty; verl's),
    "seq_final_reward" (the same here: no KL penalty in the reward, as algorithm.use_kl_in_reward is applied
    after the filter), "score" (the reward function's own score, before any shaping), or another key of the
    dict the reward function returns, e.g. "acc" (verl's math_dapo and shardrl's built-in DAPO scorer return it)."""
    max_num_gen_batches: int = 10
    """At most this many generation batches a step; a step that needs more stops the run with an error (the data
    are too hard or too easy for the policy: every group is all right or all wrong). 0: no limit (verl's)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "max_num_gen_batches", self.max_num_gen_batches >= 0,
                "must be >= 0 (generation batches per step; 0: no limit)")
        require(self, prefix, "metric", bool(self.metric), "must name what groups are filtered by (seq_reward, "
                "score, acc, ...)")


@dataclass
class AlgorithmConfig:
    adv_estimator: EstimatorName = "grpo"
    """How advantages are estimated (`shardrl.algos.ADVANTAGE_ESTIMATORS`); "gae" needs the critic."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False is Dr. GRPO)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract a KL(policy || ref) penalty from the token rewards."""
    kl_penalty: KLEstimator = "k1"
    """KL estimator of the in-reward penalty (names as `actor.kl_loss_type`)."""
    kl_coef: float = 0.001
    """Weight of the in-reward KL penalty (initial value when adaptive)."""
    kl_target: float | None = None
    """Target KL of the adaptive controller; None keeps `kl_coef` fixed."""
    kl_horizon: int = 10000
    """Horizon of the adaptive KL controller, in samples."""
    opd: OPDConfig = field(default_factory=OPDConfig)
    """On-policy distillation's weights (adv_estimator=opd, with teacher.model_path)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (verl's algorithm.filter_groups); needs a group baseline (grpo, rloo, ...)."""
    rollout_is: bool | None = None
    """Correct for the rollout-training mismatch (the sampler's log-probs differ from the trainer's, e.g. bf16
    fast rollout; null: on with rollout.quantization=fp8, off otherwise): weight each token's policy loss by
    pi_trainer(old) / pi_sampler, detached
    (`shardrl.algos.rollout_correction`). In truncate mode with actor.recompute_old_log_probs=auto's shortcut
    (one mini-batch, one epoch) the weights come from the update's own forward; mask mode needs the old
    log-probs before the update, so it turns the shortcut off. Mismatch metrics (rollout/logprob_abs_diff, _max, rollout/kl
    per sequence, rollout/k3_kl) are logged either way; with this on also rollout_is/weight_mean,
    rollout_is/truncated_frac and rollout_is/masked_frac."""
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token"
    """"token": a ratio per token (TIS); "sequence": the product of a sequence's token ratios; "geometric":
    their geometric mean (length-independent); the sequence levels put one weight on all of a sequence's tokens."""
    rollout_is_mode: Literal["truncate", "mask", "reject"] = "truncate"
    """"truncate": cap the weights at rollout_is_threshold; "mask": drop from the loss (MIS; IcePop at level token)
    the tokens (level token) or whole sequences (level sequence, geometric) whose weight leaves
    [rollout_is_threshold_lower, rollout_is_threshold], the rest weighted by their ratio; "reject": drop the same,
    weigh the rest by 1 (verl's rollout_rs alone). Dropped tokens give no gradient (rollout_is/masked_frac)."""
    rollout_is_threshold: float = 2.0
    """The cap (truncate) or upper bound of the band (mask)."""
    rollout_is_threshold_lower: float | None = None
    """The lower bound of the band (mask); null is 1 / rollout_is_threshold."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "gamma", 0 <= self.gamma <= 1, "must be in [0, 1]")
        require(self, prefix, "lam", 0 <= self.lam <= 1, "must be in [0, 1]")
        require(self, prefix, "kl_coef", self.kl_coef >= 0, "must be >= 0")
        require(self, prefix, "kl_target", self.kl_target is None or self.kl_target > 0, "must be > 0 or null")
        require(self, prefix, "kl_horizon", self.kl_horizon >= 1, "must be >= 1")
        require(self, prefix, "rollout_is_threshold", self.rollout_is_threshold > 1, "must be > 1 (e.g. 2.0)")
        lower = self.rollout_is_threshold_lower
        require(self, prefix, "rollout_is_threshold_lower", lower is None or 0 <= lower < 1,
                "must be in [0, 1) or null (1 / rollout_is_threshold)")


@dataclass
class AsyncConfig:
    """Disaggregated, asynchronous RL (shardrl.trainer.async_rl): some ranks only generate, the others only
    train, and generation runs ahead of training within a staleness bound."""

    rollout_ranks: int = 0
    """Ranks (processes, GPUs) that only generate: the last `rollout_ranks` of the world; the others train
    (FSDP/HSDP/sp as configured, over their own ranks). 0 = colocated: every rank generates and trains in
    turn, synchronously."""
    max_staleness: int = 0
    """How many updates behind the policy being trained the policy that generated a batch is: the batch of
    step k is generated with the weights of update max(k - max_staleness, first). 0 = the rollout waits for
    the newest weights (the synchronous run's numbers, on separate ranks); 1 = one-step off-policy
    (generating step k+1 while step k trains); 2+ = a deeper queue. Needs algorithm.rollout_is (the sampler's
    log-probs as the behaviour policy) when > 0."""
    weight_bucket_mb: int = 256
    """Weights stream to the rollout ranks in buckets of about this many MiB (one broadcast each)."""
    partial_rollout: bool = False
    """Weights that the training ranks push while a rollout rank generates are loaded at once, between two
    decode steps (the fast engine's host syncs; every step with rollout.backend=hf), instead of after the
    generate call: responses in flight continue under the new weights (their KV cache so far is kept), and
    each token records the version that sampled it (`token_version`; the batch's `policy_version` is each
    response's first). The training ranks then wait less for the rollout to take the weights. Needs
    max_staleness >= 1 to change anything (at 0 the rollout never generates while weights are pushed)."""

    def validate(self, prefix: str) -> None:
        require(self, prefix, "rollout_ranks", self.rollout_ranks >= 0,
                "must be >= 0 (0 = colocated; k = the last k ranks only generate)")
        require(self, prefix, "max_staleness", self.max_staleness >= 0, "must be >= 0 (0 = on-policy)")
        require(self, prefix, "weight_bucket_mb", self.weight_bucket_mb >= 1, "must be >= 1 (MiB)")
        check_async(self, prefix)
