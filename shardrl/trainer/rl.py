"""The RL step loop of docs/design.md, one SPMD program per rank: `RLTrainer`.

    prompts (this rank's share) -> a batch from the batch source (colocated: generated here with the actor's
    newest weights; disaggregated: received from a rollout rank, `async_rl`) -> scores (`Scorer`) -> DAPO rounds
    -> old/ref log-probs, values, advantages, rollout correction (`prepare`) -> critic update -> actor update
    (`updates`) -> metrics over the dp ranks -> checkpoint every k steps -> validation every k steps

What each step does is the run's `Plan` (its `StepPlan`, layout and response budget), decided once at start-up;
the parts (generation, scoring, preparation, update, train state) do not know about each other. The loop around the
step (resume, validation, checkpoints, logging, export) is `trainer.base.Trainer.fit`. Left out here: the
placement of generation (the batch source's), device defaults (`plan.defaults`), the run folder and its lock
(`run_folder`), launch (`shardrl.launch`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.batch import Batch
from shardrl.trainer.datasets import load_datasets
from shardrl.config.schema import Config
from shardrl.config.checks import check_router_replay_settings, group_of_one_warning
from shardrl.config.load import ConfigError
from shardrl.data.prompts import PromptLoader
from shardrl.engine.model import load_hf_config
from shardrl.plan.layout import format_layout
from shardrl.plan.plan import Plan
from shardrl.compat.verl.metric_names import with_verl_names
from shardrl.metrics import Max, Min, Sum, SumCount, reduce_metrics
from shardrl.models.config import check_context
from shardrl.plan.perf import model_shape, rl_step_flops, throughput_metrics
from shardrl.rewards.pool import RewardPool
from shardrl.rewards.manager import RewardManager, check_ground_truths, load_reward_function
from shardrl.rollout import SamplingParams
from shardrl.plan.step_plan import StepPlan
from shardrl.rewards.model_inputs import reward_model_inputs
from shardrl.tokenizer import load_tokenizer
from shardrl.rollout.build import the_device
from shardrl.trainer.generation import Generation, export_for_rollout, lora_sync_for
from shardrl.trainer.base import Placement, Trainer
from shardrl.trainer.prepare import prepare
from shardrl.trainer.roles import Roles, check_teacher_tokenizer, check_vocab_sizes
from shardrl.trainer.teachers import check_teacher_sources
from shardrl.trainer.run_folder import claim_run_dir
from shardrl.trainer.sampling import draw_groups, filter_metric
from shardrl.trainer.scoring import Scorer
from shardrl.trainer.state import TrainState, resolve_total_epochs
from shardrl.trainer.updates import actor_loss_from_plan, critic_loss_fn, run_updates
from shardrl.trainer.validation import validate

log = logging.getLogger(__name__)


def check_router_replay(cfg: Config, policy_config, say, steps: StepPlan | None = None) -> None:
    """actor.router_replay.mode=R2 and actor.router_aux_loss_coef need a mixture of experts (R2: with routers
    shardrl knows); with no old-log-prob pass R2 replays nothing (said). `steps`: the run's step plan."""
    from shardrl.engine.moe import is_moe, router_rule

    check_router_replay_settings(cfg)  # what the config alone decides; the rest needs the model
    if cfg.actor.router_aux_loss_coef > 0 and not is_moe(policy_config):
        raise ConfigError(f"actor.router_aux_loss_coef={cfg.actor.router_aux_loss_coef:g} needs a mixture-of-experts "
                          f"model; {policy_config.model_type!r} is dense: set it to 0")
    mode = cfg.actor.router_replay.mode
    if mode == "disabled":
        return
    if not is_moe(policy_config):
        raise ConfigError(f"actor.router_replay.mode={mode} needs a mixture-of-experts model; "
                          f"{policy_config.model_type!r} is dense: set actor.router_replay.mode=disabled")
    if mode == "R3":
        from shardrl.models.families import check_supported

        try:
            check_supported(policy_config)
        except ValueError as e:
            raise ConfigError(f"actor.router_replay.mode=R3 needs the fast rollout, which cannot run this model "
                              f"({e}); use mode R2") from None

    try:
        router_rule(policy_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mode == "R2" and (steps or StepPlan.from_config(cfg)).old_from_update:
        say(f"actor.router_replay.mode={mode} replays nothing here: the old log-probs come from the update's own "
            "forward (one optimizer step per training step), which routes as the policy that is trained")


class LocalBatches:
    """The colocated batch source: this rank's rollout generates with the actor's newest weights (synced one
    tensor at a time before a step's first generate call); on an sp group, its first rank generates and the
    others receive the batch."""

    def __init__(self, cfg: Config, generation: Generation, actor, mesh, device: torch.device):
        self.cfg, self.generation, self.actor, self.mesh, self.device = cfg, generation, actor, mesh, device
        self.stale, self.sync_s = True, 0.0  # this step's weight sync seconds (0 when the sync came before it)
        self.lora_sync = lora_sync_for(cfg, actor, generation.rollout, device)  # LoRA: the adapters alone

    def start(self, state: TrainState) -> None:
        pass  # the weights are synced before the first generate call

    def batch(self, step: int, items: list[dict], round_index: int = 0) -> Batch:
        """Step `step`'s batch of `items` (round `round_index` of dynamic sampling: another seed per round)."""
        if round_index == 0:  # a sync made for validation before the step is not this step's
            self.sync_s = 0.0
        return self.generate(items, self.generation.step_sampling(step, self.mesh.dp_rank, round_index))

    def generate(self, items: list[dict], sampling) -> Batch:
        rollout = self.generation.rollout
        rollout.resume()
        if self.stale:  # every rank: the export's gathers are collectives
            t0 = time.perf_counter()
            if self.lora_sync is not None:
                self.lora_sync.sync()
            else:
                rollout.load_weights(export_for_rollout(self.actor, self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stale, self.sync_s = False, time.perf_counter() - t0
        batch = self.generation.generate(items, sampling) if self.mesh.sp_rank == 0 else None
        if self.device.type == "cuda" and self.cfg.rollout.free_cache_engine:
            rollout.release()  # colocated: training takes the memory generation held
        if self.mesh.sp_size > 1:
            shared = [batch]
            first = dist.get_global_rank(self.mesh.sp_group, 0)
            dist.broadcast_object_list(shared, src=first, group=self.mesh.sp_group)
            batch = shared[0]
        return batch

    def after_step(self, step: int, metrics: dict) -> dict:
        self.stale = True  # the update changed the actor
        return {}


class RLTrainer(Trainer):
    name, config_cls = "train", Config
    resume_settings = ("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo", "algorithm.gamma",
                       "algorithm.lam", "algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_coef",
                       "algorithm.kl_target", "actor.loss_mode", "actor.loss_agg_mode", "actor.use_kl_loss",
                       "actor.kl_loss_type", "actor.kl_loss_coef", "critic.loss_agg_mode")
    demo_without_config = True

    def reads_setting(self, key: str) -> bool:
        return self.plan.steps.needs_critic or not key.startswith("critic.")  # (no critic: no critic loss)

    def __init__(self, cfg: Config, run_dir: Path, batch_source=None, plan: Plan | None = None):
        """`batch_source(trainer)` makes the step's batch source (default: `LocalBatches`, colocated)."""
        super().__init__(cfg, run_dir, plan)
        cfg, self.steps = self.cfg, self.plan.steps
        self.device = the_device()
        self.tokenizer = load_tokenizer(cfg)
        self._say(format_layout(self.layout))
        self._said_no_spread = False  # (no_spread_warning's line, said once)
        for line in filter(None, [*cfg.ignored_settings(), group_of_one_warning(cfg)]):
            if self.rank == 0:
                log.warning(line)
        # the cheap checks before the expensive work: data, reward file and vocabularies before any model loads
        policy_config = load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code, "causal_lm",
                                       override=cfg.model.override_config)
        self.train_set, self.val_set = load_datasets(cfg, self.tokenizer, policy_config)  # (a VL model's: images)
        if cfg.rollout.env and self.val_set is None and self.rank == 0:
            asked = [f"trainer.val_freq={cfg.trainer.val_freq}"] if cfg.trainer.val_freq else []
            asked += ["trainer.val_before_train=true"] if cfg.trainer.val_before_train else []
            if asked:
                log.warning(f"{' and '.join(asked)} validate nothing: rollout.env={cfg.rollout.env}'s environment "
                            "has no evaluation dataset (give it eval_dataset=..., or turn validation off)")
        if cfg.trainer.total_epochs is not None:  # before anything reads total_steps (the LR schedule, config.yaml)
            self._say(resolve_total_epochs(cfg.trainer, len(self.train_set), self.prompts_drawn))
        fn = (load_reward_function(cfg.reward.function_path, cfg.reward.function_name, cfg.reward.reward_kwargs)
              if cfg.reward.function_path else None)
        if fn is None and not cfg.reward.model_path and not cfg.rollout.multi_turn.interaction_path \
                and not cfg.rollout.runs_agent():  # (an agent may score its episodes itself)
            for dataset in filter(None, (self.train_set, self.val_set)):  # the built-in scorers need the answers
                check_ground_truths(dataset)
        self.reward_inputs = (reward_model_inputs(cfg.reward.model_path, self.tokenizer, cfg.model.trust_remote_code)
                              if self.steps.reward_model else None)
        if self.reward_inputs is not None:
            self._say(f"reward.model_path={cfg.reward.model_path!r} has its own tokenizer, unlike the policy's: each "
                      "conversation is decoded and re-tokenized with its tokenizer and chat template before scoring")
        if self.steps.uses_teacher:
            check_teacher_tokenizer(cfg, self.tokenizer)
            check_teacher_sources(cfg, (item["data_source"] for item in self.train_set.items))
        check_vocab_sizes(cfg, len(self.tokenizer), self.steps,
                          len(self.reward_inputs.reward) if self.reward_inputs is not None else None)
        longest = max(len(item["prompt_ids"]) for dataset in filter(None, (self.train_set, self.val_set))
                      for item in dataset.items)
        # one generate call's reach (a conversation or an episode longer than the context ends where it fills it)
        check_context(policy_config, longest + cfg.rollout.max_new_tokens,
                      f"the longest prompt ({longest} tokens) plus rollout.max_new_tokens={cfg.rollout.max_new_tokens}",
                      f"model.path={cfg.model.path!r}" if cfg.model.path else "model.tiny",
                      "lower rollout.max_new_tokens, or data.max_prompt_length (longer prompts are then dropped or cut: "
                      "data.truncation)")
        check_router_replay(cfg, policy_config, self._say, self.steps)
        if cfg.rollout.agent.entrypoint:  # a missing file or a sync function: refused before any model is built
            from shardrl.rollout.episodes.agent import load_entrypoint

            load_entrypoint(cfg.rollout.agent.entrypoint)
        self.plan.resolve_device(policy_config, self.device, self._say)
        self.cfg = cfg = self.plan.config  # (resolved: before config.yaml is written)
        self._say("\n".join([*self.plan.choices, self.steps.describe()]))
        claim_run_dir(cfg, run_dir)  # the run can start: its folder is created and locked only now

        num_updates = {"actor": self.layout.actor.num_updates,
                       "critic": self.layout.critic.num_updates if self.layout.critic else 0}
        self.roles = Roles.build(cfg, self.steps, num_updates)
        if cfg.actor.router_aux_loss_coef > 0:
            self.roles.actor.enable_router_aux_loss()
        self.mesh = self.roles.mesh
        self.flop_shapes = flop_shapes(self.roles, self._say)
        ep = cfg.actor.engine.expert_parallel_size
        experts = f"; actor experts spread over ep={ep} ranks (world // ep = {self.mesh.world_size // ep} hold each)" \
            if ep > 1 else ""
        self._say(f"mesh: {self.mesh.describe()}{experts}; actor FSDP units: {self.roles.actor.num_fsdp_units()}; "
                  f"per-rank prompts {self.layout.prompts_per_rank}, samples {self.layout.samples_per_rank}")
        loader = PromptLoader(self.train_set, self.prompts_drawn, cfg.data.shuffle, cfg.data.seed,
                              dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size)
        self.generation = None if self.steps.disaggregated else Generation(cfg, self.roles.actor.hf_config,
                                                                           self.tokenizer, self.device,
                                                                           colocated=True)
        if self.steps.reward_model:
            self.roles.add_reward_model(cfg)
        r = cfg.reward
        pool = (RewardPool(max(r.num_workers, 1), r.timeout_s, r.function_path, r.function_name, r.reward_kwargs)
                if (r.num_workers or r.timeout_s) and not r.model_path else None)
        self.scorer = Scorer(RewardManager(fn, r.on_error_score, r.reward_kwargs, pool), self.roles.reward_model,
                             self.mesh.dp_group, self.steps.multi_turn, cfg.reward.overlong_buffer,
                             self.plan.max_response_tokens, cfg.reward.missing_eos_penalty, self.reward_inputs)
        self.state = TrainState(cfg, loader, self.mesh.dp_rank, self.mesh.dp_size, self.mesh.sp_rank)
        self.source = (batch_source or (lambda t: LocalBatches(t.cfg, t.generation, t.roles.actor, t.mesh,
                                                               t.device)))(self)
        self.logprob_temperature = SamplingParams.from_config(cfg.rollout).logprob_temperature  # the sampler's

    # ---- what the launcher asks -------------------------------------------------------------------
    @classmethod
    def build_plan(cls, cfg: Config, nnodes: int, nproc_per_node: int) -> Plan:
        return Plan.for_rl(cfg, nnodes, nproc_per_node)

    @classmethod
    def check_launch(cls, cfg: Config, nnodes: int, nproc_per_node: int) -> None:
        if cfg.async_rl.rollout_ranks:  # (rollout ranks do not train)
            from shardrl.trainer.placement import check_rollout_ranks

            check_rollout_ranks(cfg.async_rl.rollout_ranks, nnodes * nproc_per_node)
            cls.build_plan(cfg, 1, nnodes * nproc_per_node - cfg.async_rl.rollout_ranks)
        else:
            cls.build_plan(cfg, nnodes, nproc_per_node)

    @classmethod
    @contextlib.contextmanager
    def placement(cls, cfg: Config, owns_group: bool):
        """Colocated: every rank trains and generates. Disaggregated (async_rl.rollout_ranks): from here the default
        group holds this rank's side only; a rollout rank runs its whole side here (and yields None), a training
        rank trains on the batches the rollout ranks send."""
        if not cfg.async_rl.rollout_ranks:
            yield Placement()
            return
        from shardrl.trainer.async_rl import RemoteBatches, run_rollout_side
        from shardrl.trainer.placement import split_world

        split, ok = split_world(cfg), False
        try:
            if split.is_rollout:
                run_rollout_side(cfg, split)
                ok = True
                yield None
            else:
                yield Placement({"batch_source": lambda t: RemoteBatches(t, split)}, one_node=True)
                ok = True
        finally:  # after a failure the other side may be gone: no world group again then
            split.close(restore_world=ok and not owns_group, failed=not ok)

    @property
    def prompts_drawn(self) -> int:
        """Prompts of one global batch the loader serves: a step's, or dynamic sampling's generation batch
        (verl's loader serves data.gen_batch_size, and counts an epoch's steps in them)."""
        return self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    def _prefix_counts(self) -> tuple[int, int] | None:
        generation = getattr(self.source, "generation", None)  # (a colocated rollout; not the rollout ranks')
        return generation.prefix_counts() if generation is not None else None

    def _phase_peak_gib(self) -> float | None:
        """GiB that PyTorch's allocator held at most on this GPU since the last call (a phase's peak; not
        nvidia-smi's figure, which adds the allocator's cache and CUDA's own memory); None on CPU."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    # ---- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, plan, step, t0 = self.cfg, self.steps, self.state.step, time.perf_counter()
        self._phase_peak_gib()  # each phase's peak from here on
        counts = self._prefix_counts()
        batch = self.source.batch(step, next(self.state.loader))
        t_gen = time.perf_counter()
        peaks = {"gen": self._phase_peak_gib()}
        scores, reward_metrics, values = self.scorer.score_with_values(batch)
        metrics = {"timing/reward_s": time.perf_counter() - t_gen}
        if plan.dynamic_sampling:  # DAPO: more generation batches until enough groups differ in the metric
            filtering, first = cfg.algorithm.filter_groups, (batch, scores, reward_metrics, values)

            def draw(k):
                if k == 0:
                    drawn, s, rm, v = first
                else:
                    drawn = self.source.batch(step, next(self.state.loader), round_index=k)
                    s, rm, v = self.scorer.score_with_values(drawn)
                return drawn, s, rm, filter_metric(filtering.metric, s, v)
            batch, scores, reward_metrics, sampling_metrics = draw_groups(
                draw, cfg.data.train_batch_size, filtering.max_num_gen_batches, self.mesh.dp_group, filtering.metric)
            metrics.update(sampling_metrics)
        if counts is not None:  # the share of the step's prompt tokens the rollout read from its prefix cache
            cached, run = (b - a for a, b in zip(counts, self._prefix_counts()))
            metrics["rollout/prompt_cached_frac"] = SumCount(float(cached), float(cached + run))
        temp = self.logprob_temperature
        metrics.update(prepare(batch, scores, plan, self.roles, cfg.algorithm, self.state.kl_ctrl.value, temp))
        t_prep = time.perf_counter()
        peaks["prep"] = self._phase_peak_gib()
        metrics.update(self._update(batch, temp))
        t_end = time.perf_counter()
        peaks["update"] = self._phase_peak_gib()
        metrics.update(batch_metrics(batch, scores, reward_metrics, self.plan.max_response_tokens,
                                     cfg.data.max_prompt_length))
        metrics.update(self._perf_metrics(batch, peaks))
        metrics.update({"timing/gen_s": t_gen - t0, "timing/prep_s": t_prep - t_gen,
                        "timing/update_s": t_end - t_prep, "timing/step_s": t_end - t0,
                        "timing/update_weights_s": getattr(self.source, "sync_s", 0.0),
                        "training/epoch": self.state.loader.epoch})
        metrics = reduce_metrics(metrics, self.mesh.dp_group)
        metrics.update(throughput_metrics(metrics, self.world, self.device.type == "cuda"))
        if cfg.algorithm.use_kl_in_reward:  # every rank: the whole batch's KL and sample count
            self.state.kl_ctrl.update(metrics["kl/in_reward"], len(batch) * self.mesh.dp_size)
        metrics.update(self.source.after_step(step, metrics))
        line = None if self._said_no_spread else no_spread_warning(cfg, plan.estimator.group_baseline, step, metrics)
        if line:
            self._said_no_spread = True
            if self.rank == 0:
                log.warning(line)
        return metrics

    def _update(self, batch: Batch, temp: float) -> dict:
        """The critic's update, then the actor's; each engine's update is a phase (what offload_optimizer moved
        to the CPU comes back for it only)."""
        cfg, roles, metrics = self.cfg, self.roles, {}
        if roles.critic is not None:
            t0 = time.perf_counter()
            with roles.critic.training():
                # (the policy's routing is the actor's to replay: a mixture-of-experts critic routes its own way)
                critic_batch = batch.select([k for k in batch.keys() if k != "routed_experts"])
                metrics.update(run_updates(roles.critic, critic_batch,
                                           critic_loss_fn(cfg.critic, cfg.critic.loss_agg_mode),
                                           self.layout.critic.mini_batch_samples_per_rank, cfg.critic.ppo_epochs,
                                           cfg.critic.shuffle, self.state.shuffle_gen, "critic"))
            metrics["timing/update_critic_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with roles.actor.training():
            metrics.update(run_updates(roles.actor, batch, actor_loss_from_plan(cfg.actor, cfg.algorithm, self.steps),
                                       self.layout.actor.mini_batch_samples_per_rank, cfg.actor.ppo_epochs,
                                       cfg.actor.shuffle, self.state.shuffle_gen, "actor", temperature=temp,
                                       with_entropy=self.steps.update_entropy))
        metrics["timing/update_actor_s"] = time.perf_counter() - t0
        return metrics

    def _perf_metrics(self, batch: Batch, peaks: dict) -> dict:
        """This rank's part of the perf/ and memory/ metrics (`peaks`: GiB per phase); `perf.throughput_metrics`
        makes the rates from the global sums."""
        seq_lens = batch["attention_mask"].sum(-1).float()  # real tokens per sample: prompt + response
        out = {"perf/total_num_tokens": Sum(float(seq_lens.sum()))}
        if self.flop_shapes is not None:
            policy, critic = self.flop_shapes
            inference = int(not self.steps.old_from_update) + int(self.steps.uses_ref)  # old log-probs, reference
            flops = rl_step_flops(seq_lens, policy, inference, self.cfg.actor.ppo_epochs, critic,
                                  self.cfg.critic.ppo_epochs, batch["response_mask"].sum(-1).float())
            out["perf/step_tflop"] = Sum(flops / 1e12)
        # the largest rank's (of this dp group; sp peers hold about as much)
        out.update({f"memory/{phase}_peak_gib": Max(gib) for phase, gib in peaks.items() if gib is not None})
        return out

    def validate(self) -> dict[str, float]:
        """`validation.validate` with this run's generation and scorer; rank 0 keeps its first
        `trainer.log_val_generations` samples in `val_generations`."""
        if self.generation is None:
            raise ValueError("validation is not supported with async_rl.rollout_ranks > 0; set trainer.val_freq=0")
        keep = self.cfg.trainer.log_val_generations if self.rank == 0 else 0
        metrics, self.val_generations = validate(
            self.cfg, self.val_set, self.source.generate, lambda b: self.scorer.score(b, shape=False),
            self.mesh.dp_rank, self.mesh.dp_size, self.mesh.dp_group, self.steps.multi_turn, keep)
        return metrics

    # ---- what the loop asks (`Trainer.fit`) ---------------------------------------------------------
    def checkpoint_engines(self) -> dict:
        return self.roles.trained()

    def state_dict(self) -> tuple[dict, dict]:
        return self.state.state_dict(), self.state.rank_state_dicts()

    def load_state(self, ckpt) -> str | None:
        return self.state.load(ckpt)

    def start(self) -> None:
        self.source.start(self.state)

    def before_first_step(self, logger) -> None:
        if self.cfg.trainer.val_before_train and self.val_set is not None and self.step == 0:
            val = self.validate()
            logger.log(0, with_verl_names(val, 0) if self.cfg.trainer.verl_metric_names else val, advance=False)
            logger.log_generations(0, self.val_generations)

    def close(self) -> None:
        self.scorer.rewards.close()  # the reward workers, if any

    def exported_engine(self):
        return self.roles.actor


def flop_shapes(roles: Roles, say):
    """The policy's and the critic's shapes for the perf/ metrics; None (and a line) for a model config without
    the usual names."""
    try:
        return (model_shape(roles.actor.hf_config),
                model_shape(roles.critic.hf_config, head_outputs=1) if roles.critic else None)
    except ValueError as e:
        say(f"no perf/step_tflop or MFU metrics: {e}")
        return None


def group_spread(index: torch.Tensor, scores: torch.Tensor) -> dict:
    """reward/group_spread_frac: the share of this rank's groups (a prompt's responses, `index` (N,)) of two or more
    whose scores `(N,)` are not all equal, the groups a group baseline learns from (a group sits on one rank); {}
    without such groups (rollout.n=1)."""
    _, group, sizes = torch.unique(index.cpu(), return_inverse=True, return_counts=True)  # (N,), (G,)
    if not bool((sizes > 1).any()):
        return {}
    scores = scores.float().cpu()
    high = torch.full((len(sizes),), -torch.inf).scatter_reduce(0, group, scores, "amax")  # (G,)
    low = torch.full((len(sizes),), torch.inf).scatter_reduce(0, group, scores, "amin")  # (G,)
    spread = (high > low) & (sizes > 1)
    return {"reward/group_spread_frac": SumCount(float(spread.sum()), float((sizes > 1).sum()))}


def no_spread_warning(cfg: Config, group_baseline: bool, step: int, metrics: dict) -> str | None:
    """The line for a step in which no group's rewards differ, under an estimator whose advantage is then 0 (a group
    baseline, no KL in the reward): the reward teaches that step nothing."""
    if not group_baseline or cfg.algorithm.use_kl_in_reward or metrics.get("reward/group_spread_frac") != 0.0:
        return None
    return (f"step {step + 1}: in no group of rollout.n={cfg.rollout.n} responses do the rewards differ "
            f"(reward/group_spread_frac 0, reward/mean {metrics.get('reward/mean', float('nan')):.3g}), so every "
            f"advantage of algorithm.adv_estimator={cfg.algorithm.adv_estimator} is 0 and the step learns nothing "
            "from the reward. If this lasts: the reward may want a format the policy never writes (read the "
            "validation generations; reasoning-gym's tasks want the answer inside <answer></answer>), or the "
            "prompts are all too hard or all solved; a warm start (shardrl sft) on the format, a larger rollout.n "
            "or other data give it spread. Said once a run")


def batch_metrics(batch: Batch, scores: torch.Tensor, reward_metrics: dict, max_response_tokens: int,
                  max_prompt_length: int | None = None) -> dict:
    """This rank's reward and length metrics of a step's batch, for `reduce_metrics`."""
    lengths = batch["response_mask"].sum(-1).float()
    seq_lens = batch["attention_mask"].sum(-1).float()
    n = float(len(batch))
    reward_metrics = dict(reward_metrics)
    return {
        **group_spread(batch["prompt_index"], scores),
        "reward/mean": SumCount(float(scores.sum()), n),
        "reward/max": Max(float(scores.max())),
        "reward/min": Min(float(scores.min())),
        # failures add up over ranks; a reward function's own keys are means over this rank's samples
        "reward/num_errors": Sum(float(reward_metrics.pop("reward/num_errors", 0.0))),
        **({"reward/num_timeouts": Sum(float(reward_metrics.pop("reward/num_timeouts")))}
           if "reward/num_timeouts" in reward_metrics else {}),
        # (a reward function's own keys: (sum, count) pairs over the samples that have them)
        **{k: v if isinstance(v, SumCount) else SumCount(float(v) * n, n) for k, v in reward_metrics.items()
           if k != "reward/score"},
        "response/length_mean": SumCount(float(lengths.sum()), n),
        "response/length_max": Max(float(lengths.max())),
        "response/length_min": Min(float(lengths.min())),
        "prompt/length_mean": SumCount(float((seq_lens - lengths).sum()), n),
        "prompt/length_max": Max(float((seq_lens - lengths).max())),
        "prompt/length_min": Min(float((seq_lens - lengths).min())),
        "response/clip_frac": SumCount(float((lengths >= max_response_tokens).sum()), n),  # hit the budget
        "response/num_tokens": Sum(float(lengths.sum())),
        **({"prompt/clip_frac": SumCount(float(((seq_lens - lengths) >= max_prompt_length).sum()), n)}
           if max_prompt_length else {}),
    }
