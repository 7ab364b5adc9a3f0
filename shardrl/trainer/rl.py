"""`RLTrainer`: one SPMD program per rank running the step loop of DESIGN.md.

    prompts (this rank's share) -> rollout.generate (n per prompt, weights synced from the actor)
    -> rewards -> old/ref log-probs, values -> advantages -> critic update -> actor update
    -> weight sync -> metrics -> checkpoint every k steps -> validation every k steps
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardrl.algos import AdaptiveKLController, FixedKLController
from shardrl.batch import Batch
from shardrl.checkpoint import CheckpointManager
from shardrl.config import Config, config_to_dict
from shardrl.data import PromptLoader, collate_prompts, load_prompt_dataset
from shardrl.distributed import ParallelDims
from shardrl.engine import build_engine
from shardrl.engine.model import DTYPES, load_hf_config, require_folder
from shardrl.layout import GIB, derive_layout, format_layout
from shardrl.memory import phase_ledger, update_and_cache_gib
from shardrl.modelconfig import text_config
from shardrl.rewards import RewardManager, load_reward_function
from shardrl.rollout import SamplingParams, build_rollout
from shardrl.rollout.multiturn import MultiTurnRollout, score_with_interaction
from shardrl.algos.aggregate import masked_metric
from shardrl.trainer.defaults import old_log_probs_from_update, resolve_device_defaults
from shardrl.trainer.metrics import Max, MetricsLogger, Min, Sum, SumCount, mean_over_ranks, reduce_over_ranks
from shardrl.trainer.perf import model_shape, rl_step_flops, throughput_metrics
from shardrl.trainer.run_folder import check_writable, choose_run_dir, claim_run_dir
from shardrl.trainer.sampling import apply_rollout_is, draw_informative_groups, mismatch_step_metrics, shape_overlong
from shardrl.trainer.updates import actor_loss_fn, compute_advantages, critic_loss_fn, run_updates

log = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(cfg: Config):
    import transformers

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        raise ValueError("no tokenizer: set model.path (a local HF model folder) or model.tokenizer_path")
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    if not any((require_folder(key, path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one "
                         "there with tokenizer.save_pretrained(folder), or set model.tokenizer_path to a folder "
                         "that has one")
    try:
        if _generic_tokenizer(Path(path)):
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _generic_tokenizer(folder: Path) -> bool:
    """Whether the folder's tokenizer is a plain `tokenizer.json` saved by the generic fast class (a tokenizer
    built with the `tokenizers` library, like the demo's). Loaded through AutoTokenizer, such a folder gets the
    tokenizer class of its model type when it holds a config.json (transformers 5: a qwen2 folder's
    Qwen2Tokenizer replaces the pre-tokenizer with its own BPE split and drops the demo's spaces), so it is
    loaded as saved instead."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (ValueError, OSError):
        return False
    return name in ("TokenizersBackend", "PreTrainedTokenizerFast")


def check_vocab_sizes(cfg: Config, tokenizer_size: int) -> None:
    """Every model that reads the tokenizer's ids (policy, critic, reward model) has an embedding row for
    each: a token id past the vocabulary fails only mid-run (an index error, or a CUDA device assert)."""
    tokenizer_at = cfg.model.tokenizer_path or cfg.model.path
    models = [("model.path", cfg.model.path, cfg.model.tiny, "causal_lm")]
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.model_path:
        models.append(("critic.model_path", cfg.critic.model_path, None, "causal_lm"))
    if cfg.reward.model_path:
        models.append(("reward.model_path", cfg.reward.model_path, None, "seq_cls"))
    for key, path, tiny, task in models:
        config = load_hf_config(path, tiny, cfg.model.trust_remote_code, task)
        vocab = getattr(text_config(config), "vocab_size", None)
        if vocab is not None and vocab < tokenizer_size:
            where = f"{key}={path!r}" if path else "model.tiny"
            raise ValueError(
                f"{where} has a vocabulary of {vocab} tokens, smaller than the tokenizer's {tokenizer_size} "
                f"(from {tokenizer_at!r}): ids >= {vocab} have no embedding. Use the tokenizer made for this model "
                f"(model.tokenizer_path), or grow the model's embeddings to match: "
                f"model.resize_token_embeddings({tokenizer_size}); model.save_pretrained(folder)")


class RLTrainer:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = derive_layout(cfg, cfg.trainer.nnodes, self.world // cfg.trainer.nnodes)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tokenizer = load_tokenizer(cfg)
        self._say(format_layout(self.layout))

        # the cheap checks before the expensive work: data, reward file and vocabularies before any model loads
        d = cfg.data
        self.train_set = load_prompt_dataset(d.train_files, self.tokenizer, d.prompt_key, d.max_prompt_length,
                                             d.truncation, d.skip_bad_rows)
        self.val_set = None
        if d.val_files:
            self.val_set = load_prompt_dataset(d.val_files, self.tokenizer, d.prompt_key, d.max_prompt_length,
                                               d.truncation, d.skip_bad_rows)
        fn = load_reward_function(cfg.reward.function_path, cfg.reward.function_name) if cfg.reward.function_path else None
        self.rewards = RewardManager(fn, cfg.reward.on_error_score)
        check_vocab_sizes(cfg, len(self.tokenizer))
        policy_config = load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code, "causal_lm")
        # before config.yaml is written
        cfg, choices = resolve_device_defaults(cfg, policy_config, self._memory_gib(cfg, policy_config))
        self.cfg = cfg
        self.old_from_update, why = old_log_probs_from_update(cfg)
        self._say("\n".join([*choices, f"old log-probs: {why}"]))
        # the run can start: its folder is created and locked only now (keep this after the checks above
        # and before the engines below)
        claim_run_dir(cfg, run_dir)

        # engines: actor trains; ref only when a KL needs it; critic only for GAE
        total = cfg.trainer.total_steps * self.layout.actor.num_updates
        # the run's meshes, built once; engines of one layout share them (and their communicators)
        self.parallel_dims = ParallelDims.from_config(cfg)
        meshes = self.parallel_dims.for_engine
        self.actor = build_engine(cfg.model, cfg.actor.engine, cfg.actor.optim, total_steps=total,
                                  mesh=meshes(cfg.actor.engine))
        self.mesh = self.actor.mesh
        self.ref = None
        if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            self.ref = build_engine(cfg.model, cfg.ref.engine, None, mesh=meshes(cfg.ref.engine))
        self.critic = None
        if cfg.algorithm.adv_estimator == "gae":
            critic_model = cfg.model if cfg.critic.model_path is None else dataclasses.replace(
                cfg.model, path=cfg.critic.model_path, tiny=None)
            self.critic = build_engine(critic_model, cfg.critic.engine, cfg.critic.optim, head="value",
                                       total_steps=cfg.trainer.total_steps * self.layout.critic.num_updates,
                                       mesh=meshes(cfg.critic.engine))
        try:  # for the perf/ metrics; a model config without the usual names goes without FLOP counts
            self.flop_shapes = (model_shape(self.actor.hf_config),
                                model_shape(self.critic.hf_config, head_outputs=1) if self.critic else None)
        except ValueError as e:
            self.flop_shapes = None
            self._say(f"no perf/step_tflop or MFU metrics: {e}")
        self._say(f"mesh: {self.mesh.describe()}; actor FSDP units: {self.actor.num_fsdp_units()}; "
                  f"per-rank prompts {self.layout.prompts_per_rank}, samples {self.layout.samples_per_rank}")

        # data loader, rollout, reward model
        self.loader = PromptLoader(self.train_set, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed,
                                   dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size)
        rollout_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        ro = cfg.rollout
        fast_kwargs = dict(max_batch=ro.max_batch, sync_every=ro.sync_every, compile=ro.compile,
                           attention=ro.attention, sampler=ro.sampler) if ro.backend == "fast" else {}
        self.rollout = build_rollout(ro.backend, self.actor.hf_config, self.tokenizer, self.device, rollout_dtype,
                                     micro_batch_size=ro.micro_batch_size, **fast_kwargs)
        if ro.multi_turn.enable:  # the agent loop drives the backend's generate in rounds, tools in between
            self.rollout = MultiTurnRollout.from_config(self.rollout, self.tokenizer, ro.multi_turn)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        self.reward_model = None
        if cfg.reward.model_path:
            rm_cfg = dataclasses.replace(cfg.model, path=cfg.reward.model_path, tiny=None)
            self.reward_model = build_engine(rm_cfg, cfg.reward.engine, None, head="score", mesh=meshes(cfg.reward.engine))
        algo = cfg.algorithm
        self.kl_ctrl = (AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon) if algo.kl_target
                        else FixedKLController(algo.kl_coef))
        self.shuffle_gen = torch.Generator().manual_seed(self._shuffle_seed(0))
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.trainer.keep_last)
        self.step = 0
        self._weights_stale = True
        self.val_generations: list[dict] = []  # rank 0: the last validation's samples, for the logger

    # ---- helpers ----------------------------------------------------------------------------------
    def _memory_gib(self, cfg: Config, hf_config) -> tuple[float, float] | None:
        """(the ledger's update peak plus the rollout's cache, this GPU's size) in GiB; None on CPU or for a
        model the ledger cannot size."""
        if self.device.type != "cuda" or cfg.rollout.free_cache_engine is not None:
            return None
        try:
            need = update_and_cache_gib(phase_ledger(cfg, self.layout, hf_config))
        except (ValueError, AttributeError, KeyError) as e:
            self._say(f"the memory ledger cannot size this model ({e}); the rollout frees its cache for training")
            return None
        return need, torch.cuda.get_device_properties(self.device).total_memory / GIB

    def _say(self, text: str) -> None:
        if self.rank == 0:
            for line in text.splitlines():
                log.info(line)

    def _phase_peak_gib(self) -> float | None:
        """GiB that PyTorch's allocator held at most on this GPU since the last call (a phase's peak; not
        nvidia-smi's figure, which adds the allocator's cache and CUDA's own memory); None on CPU."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def _perf_metrics(self, seq_lens: torch.Tensor, response_lens: torch.Tensor, peaks: dict) -> dict:
        """This rank's part of the perf/ and memory/ metrics (`seq_lens`: real tokens per sample, prompt +
        response; `response_lens`: the tokens the policy's head scores; `peaks`: GiB per phase);
        `perf.throughput_metrics` makes the rates from the global sums."""
        out = {"perf/total_num_tokens": Sum(float(seq_lens.sum()))}
        if self.flop_shapes is not None:
            policy, critic = self.flop_shapes
            inference = int(not self.old_from_update) + int(self.ref is not None)  # old log-probs, reference
            flops = rl_step_flops(seq_lens, policy, inference, self.cfg.actor.ppo_epochs, critic,
                                  self.cfg.critic.ppo_epochs, response_lens)
            out["perf/step_tflop"] = Sum(flops / 1e12)
        # the largest rank's (of this dp group; sp peers hold about as much)
        out.update({f"memory/{phase}_peak_gib": Max(gib) for phase, gib in peaks.items() if gib is not None})
        return out

    def _engines(self) -> dict:
        return {k: v for k, v in (("actor", self.actor), ("critic", self.critic)) if v is not None}

    def _sync_weights(self) -> None:
        """Actor -> rollout, one tensor at a time (every rank iterates: the gather is collective)."""
        self.rollout.resume()
        if not self._weights_stale:
            return
        dtype = DTYPES["bfloat16"] if self.device.type == "cuda" else None
        self.rollout.load_weights(self.actor.export_weights(dtype))
        self._weights_stale = False

    def _generate(self, items: list[dict], sampling: SamplingParams) -> Batch:
        prompts = collate_prompts(items, self.tokenizer.pad_token_id)
        self._sync_weights()  # every rank: the export's gathers are collectives
        batch = None
        # the ranks of an sp group train on one batch: sp rank 0 generates it, the others receive it
        if self.mesh.sp_rank == 0:
            per_sample = {"samples": items} if isinstance(self.rollout, MultiTurnRollout) else {}  # interaction state
            out = self.rollout.generate(prompts["input_ids"].to(self.device),
                                        prompts["attention_mask"].to(self.device), sampling, **per_sample)
            batch = out.to_batch().to("cpu")
        if self.device.type == "cuda" and self.cfg.rollout.free_cache_engine:
            self.rollout.release()  # colocated: training takes the memory generation held
        if self.mesh.sp_size > 1:
            shared = [batch]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(self.mesh.sp_group, 0), group=self.mesh.sp_group)
            batch = shared[0]
        rows = batch["prompt_index"].tolist()
        batch["data_source"] = [items[i]["data_source"] for i in rows]
        batch["extra"] = [items[i]["extra"] for i in rows]
        return batch

    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        # (RLTrainer._score_responses, not self's: tests call _score on a stand-in holding only the scoring parts)
        if "num_turns" in batch:  # a multi-turn batch: the interaction's rewards, or the reward function's
            return score_with_interaction(batch, lambda b: RLTrainer._score_responses(self, b))
        return RLTrainer._score_responses(self, batch)

    def _score_responses(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        if self.reward_model is not None:
            scores = self.reward_model.infer_batch(batch.select(["input_ids", "attention_mask"]))["scores"].cpu()
            return scores, {}
        items = [{"data_source": ds, "response_text": text, "extra": extra}
                 for ds, text, extra in zip(batch["data_source"], batch["response_text"], batch["extra"])]
        scores, metrics = self.rewards.score(items, fail_if_all_fail=False)
        # all samples failing stops the run; decided on the global count so that every rank agrees
        counts = mean_over_ranks({"errors": metrics["reward/num_errors"], "samples": len(items)}, self.mesh.dp_group)
        if counts["samples"] > 0 and counts["errors"] == counts["samples"]:
            raise self.rewards.all_failed_error(round(counts["samples"] * self.mesh.dp_size))
        return scores, metrics

    def _draw_round(self, seed: int, round_index: int) -> tuple[Batch, torch.Tensor, dict]:
        """Dynamic sampling's extra rounds: the next prompts, generated (another sampling seed per round) and
        scored, with the overlong shaping."""
        batch = self._generate(next(self.loader), dataclasses.replace(self.sampling, seed=seed + 7919 * round_index))
        scores, reward_metrics = self._score(batch)
        scores, overlong = shape_overlong(batch, scores, self.cfg.reward.overlong_buffer, self.sampling.max_new_tokens)
        return batch, scores, {**reward_metrics, **overlong}

    # ---- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, t0 = self.cfg, time.perf_counter()
        self._phase_peak_gib()  # each phase's peak from here on
        items = next(self.loader)
        # a fresh, reproducible sampling stream per step and rank (a resumed run draws the same)
        seed = self.cfg.rollout.seed + 100_003 * self.step + self.mesh.dp_rank
        batch = self._generate(items, dataclasses.replace(self.sampling, seed=seed))
        t_gen = time.perf_counter()
        peaks = {"gen": self._phase_peak_gib()}
        scores, reward_metrics = self._score(batch)
        scores, overlong = shape_overlong(batch, scores, cfg.reward.overlong_buffer, self.sampling.max_new_tokens)
        reward_metrics, sample_metrics = {**reward_metrics, **overlong}, {}
        if cfg.algorithm.filter_groups.enable:  # DAPO dynamic sampling: more rounds until enough informative groups
            first = (batch, scores, reward_metrics)
            batch, scores, reward_metrics, more = draw_informative_groups(
                lambda r: first if r == 0 else self._draw_round(seed, r), self.layout.prompts_per_rank,
                cfg.algorithm.filter_groups.max_num_gen_batches, self.mesh.dp_group)
            sample_metrics.update(more)
        mask = batch["loss_mask"].float()
        temp = self.sampling.logprob_temperature

        def token_mean(values):  # reduced over the ranks as sum / count: a mean over the whole batch's tokens
            return SumCount(*map(float, masked_metric(values, mask)))

        metrics = dict(sample_metrics)
        if not self.old_from_update:  # else the update's forward gives them and these two metrics
            old = self.actor.infer_batch(batch, temperature=temp, with_entropy=True)
            batch["old_log_probs"] = old["log_probs"].cpu()
            metrics["actor/entropy"] = token_mean(old["entropy"].cpu())  # the sampling policy's
            metrics.update(mismatch_step_metrics(batch))  # rollout/logprob_abs_diff (and _max), rollout/kl, k3_kl
        if self.ref is not None:
            batch["ref_log_probs"] = self.ref.infer_batch(batch, temperature=temp)["log_probs"].cpu()
            if not self.old_from_update:
                metrics["kl/actor_ref"] = token_mean(batch["old_log_probs"] - batch["ref_log_probs"])
        if self.critic is not None:
            batch["old_values"] = self.critic.infer_batch(batch)["values"].cpu()
        metrics.update(compute_advantages(batch, scores, cfg.algorithm, self.kl_ctrl.value, self.mesh.dp_group))
        # after the advantages: a rejected sample still counts in its group's baseline; without the old pass,
        # the update's loss computes the weights from its own forward
        in_loss_is = cfg.algorithm if cfg.algorithm.rollout_is and self.old_from_update else None
        if cfg.algorithm.rollout_is and in_loss_is is None:
            metrics.update(apply_rollout_is(batch, cfg.algorithm))
        t_prep = time.perf_counter()
        peaks["prep"] = self._phase_peak_gib()

        agg = cfg.actor.loss_agg_mode
        # each engine's update is a phase: what offload_optimizer moved to the CPU comes back for it only
        if self.critic is not None:
            critic_loss = critic_loss_fn(cfg.critic, cfg.critic.loss_agg_mode)
            with self.critic.training():
                metrics.update(run_updates(self.critic, batch, critic_loss, self.layout.critic.mini_batch_samples_per_rank,
                                           cfg.critic.ppo_epochs, True, self.shuffle_gen, "critic"))
        with self.actor.training():
            actor_loss = actor_loss_fn(cfg.actor, agg, self.old_from_update, in_loss_is)
            metrics.update(run_updates(self.actor, batch, actor_loss,
                                       self.layout.actor.mini_batch_samples_per_rank, cfg.actor.ppo_epochs,
                                       cfg.actor.shuffle, self.shuffle_gen, "actor", temperature=temp,
                                       with_entropy=bool(cfg.actor.entropy_coeff) or self.old_from_update))
        self._weights_stale = True
        t_end = time.perf_counter()
        peaks["update"] = self._phase_peak_gib()

        lengths = batch["response_mask"].sum(-1).float()
        seq_lens = batch["attention_mask"].sum(-1).float()  # real tokens per sample: prompt + response
        n = float(len(batch))
        metrics.update({
            "reward/mean": SumCount(float(scores.sum()), n),
            "reward/max": Max(float(scores.max())),
            "reward/min": Min(float(scores.min())),
            # failures add up over ranks; a reward function's own keys are means over this rank's samples
            "reward/num_errors": Sum(float(reward_metrics.pop("reward/num_errors", 0.0))),
            **{k: SumCount(float(v) * n, n) for k, v in reward_metrics.items() if k != "reward/score"},
            "response/length_mean": SumCount(float(lengths.sum()), n),
            "response/length_max": Max(float(lengths.max())),
            "response/length_min": Min(float(lengths.min())),
            "prompt/length_mean": SumCount(float((seq_lens - lengths).sum()), n),
            **self._perf_metrics(seq_lens, lengths, peaks),
            "response/clip_frac": SumCount(float((lengths >= self.sampling.max_new_tokens).sum()), n),
            "timing/gen_s": t_gen - t0,
            "timing/prep_s": t_prep - t_gen,
            "timing/update_s": t_end - t_prep,
            "timing/step_s": t_end - t0,
        })
        metrics = reduce_over_ranks(metrics, self.mesh.dp_group)
        metrics.update(throughput_metrics(metrics, self.world, self.device.type == "cuda"))
        if cfg.algorithm.use_kl_in_reward:  # every rank: the whole batch's KL and sample count
            self.kl_ctrl.update(metrics["kl/in_reward"], len(batch) * self.mesh.dp_size)
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy responses to every validation prompt; the mean reward over all of them (all ranks), and for
        multi-turn rollouts the shares of conversations that called a tool and that called tools without an
        error, and the mean tool calls. Rank 0 keeps its first `trainer.log_val_generations` samples in
        `val_generations`."""
        sampling = SamplingParams.from_config(self.cfg.rollout, n=1, greedy=True)
        dp, r = self.mesh.dp_size, self.mesh.dp_rank
        # every rank runs the same number of generate calls (weight sync and scoring are collective):
        # a rank with fewer prompts repeats one and drops its scores
        index = list(range(r, len(self.val_set), dp))
        real = len(index)
        index += [index[0] if index else 0] * (-(-len(self.val_set) // dp) - real)
        items = [self.val_set[i] for i in index]
        scores, calls, errors = [], [], []
        # data.val_batch_size prompts per round over all ranks (ceil(that / dp) per rank); None: one round
        val_batch = self.cfg.data.val_batch_size
        per_round = -(-val_batch // dp) if val_batch else max(len(items), 1)
        self.val_generations = []
        wanted = self.cfg.trainer.log_val_generations if self.rank == 0 else 0
        for start in range(0, len(items), per_round):
            chunk = items[start:start + per_round]
            batch = self._generate(chunk, sampling)
            s, _ = self._score(batch)
            scores.append(s)
            if "num_tool_calls" in batch:
                calls.append(torch.as_tensor(batch["num_tool_calls"]).float())
                errors.append(torch.as_tensor(batch["num_tool_errors"]).float())
            for row in range(min(len(batch), wanted - len(self.val_generations), real - start)):  # real prompts
                item = chunk[int(batch["prompt_index"][row])]
                self.val_generations.append({"prompt": item["prompt_text"], "response": batch["response_text"][row],
                                             "reward": float(s[row]),
                                             "ground_truth": item["extra"].get("ground_truth")})
        local = torch.cat(scores)[:real] if scores else torch.zeros(0)
        n = float(len(local))
        metrics = {"val/reward_mean": SumCount(float(local.sum()), n)}
        if calls:  # every rank's batches are multi-turn or none are
            c, e = torch.cat(calls)[:real], torch.cat(errors)[:real]
            metrics.update({"val/multi_turn/tool_call_rate": SumCount(float((c > 0).sum()), n),
                            "val/multi_turn/clean_call_rate": SumCount(float(((c > 0) & (e == 0)).sum()), n),
                            "val/multi_turn/num_tool_calls_mean": SumCount(float(c.sum()), n)})
        return reduce_over_ranks(metrics, self.mesh.dp_group)

    # ---- the loop ---------------------------------------------------------------------------------
    def _shuffle_seed(self, step: int) -> int:
        """Seed of this dp rank's mini-batch shuffle stream for a run that starts at `step` (0: a fresh run)."""
        return self.cfg.data.seed + 1000 * self.mesh.dp_rank + 1_000_003 * step

    def _trainer_state(self) -> dict:
        return {"loader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}

    def save(self) -> None:
        # `extra` (rank 0's) holds the global state, valid at any world size: the loader's position counts
        # global prompts and the KL controller follows global numbers. Each dp rank's own state (its shuffle
        # generator differs) goes under the fixed key dp_rank_{r}, written by the first rank of its sp group.
        extra = {"step": self.step, **self._trainer_state()}
        rank_extra = {}
        if self.mesh.sp_rank == 0:
            rank_extra[f"dp_rank_{self.mesh.dp_rank}"] = {"dp_size": self.mesh.dp_size, **self._trainer_state(),
                                                         "shuffle_gen": self.shuffle_gen.get_state()}
        path = self.checkpoints.save(self.step, self._engines(), extra, rank_extra)
        self._say(f"saved checkpoint {path}")

    def maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        if resume == "never":
            return
        ckpt = (self.checkpoints.load_latest(self._engines()) if resume == "auto"
                else self.checkpoints.load(resume, self._engines()))
        if ckpt is None:
            self._say("resume=auto: no complete checkpoint yet, starting fresh")
            return
        self.step = int(ckpt.extra["step"])
        mine = ckpt.rank_extra(f"dp_rank_{self.mesh.dp_rank}")
        if mine is not None and mine["dp_size"] == self.mesh.dp_size:
            state = mine  # the same dp layout: each dp rank continues exactly where it stopped
        else:
            # another dp layout (or a checkpoint without per-rank state): there is no saved stream for this
            # dp rank, so the global state, and a shuffle stream derived from data.seed, the step and dp rank
            state = dict(ckpt.extra, shuffle_gen=None)
            self._say(f"checkpoint {ckpt.path} was saved with another data-parallel layout; each rank's shuffle "
                      f"stream restarts from data.seed, step {self.step} and its dp rank")
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if state["shuffle_gen"] is not None:
            self.shuffle_gen.set_state(state["shuffle_gen"])
        else:
            self.shuffle_gen.manual_seed(self._shuffle_seed(self.step))
        self._say(f"resumed from {ckpt.path} at step {self.step}")

    def fit(self) -> Path:
        cfg = self.cfg
        self.checkpoints.clean_stale()  # what a crash mid-save or mid-delete left
        self.maybe_resume()
        logger = MetricsLogger(self.run_dir, cfg.trainer.logger, cfg.trainer.total_steps, self.step,
                               cfg.trainer.project_name, cfg.trainer.experiment_name, config_to_dict(cfg))
        self.records = logger.records  # rank 0: the steps logged, for summary.json and the reward curve
        try:
            while self.step < cfg.trainer.total_steps:
                metrics = self.train_step()
                self.step += 1
                if self.val_set is not None and cfg.trainer.val_freq and (
                        self.step % cfg.trainer.val_freq == 0 or self.step == cfg.trainer.total_steps):
                    metrics.update(self.validate())
                    logger.log_generations(self.step, self.val_generations)
                logger.log(self.step, metrics)
                if cfg.trainer.save_freq and (self.step % cfg.trainer.save_freq == 0
                                              or self.step == cfg.trainer.total_steps):
                    self.save()
        finally:
            logger.close()
        if cfg.trainer.export_hf:
            path = self.actor.save_hf(self.run_dir / "hf_model", self.tokenizer)
            self._say(f"wrote the trained actor as a Hugging Face model folder: {path}")
        return self.run_dir


def prepare_run_dir(cfg: Config) -> Path:
    """The run folder (`run_folder.choose_run_dir`), the same on every rank, checked writable before anything
    loads. Nothing is created here: RLTrainer claims the folder once its cheap checks pass."""
    run_dir = choose_run_dir(cfg)
    check_writable(run_dir)
    return run_dir


def summarize(records: list[dict]) -> dict:
    """Steps done, mean train reward of the first and last few steps, last validation reward; {} if no step."""
    if not records:
        return {}
    summary = {"steps": records[-1]["step"]}
    rewards = [r["reward/mean"] for r in records if r.get("reward/mean") is not None]
    if rewards:
        k = max(1, min(5, len(rewards) // 4))
        summary.update(reward_first=sum(rewards[:k]) / k, reward_last=sum(rewards[-k:]) / k)
    val = [r["val/reward_mean"] for r in records if r.get("val/reward_mean") is not None]
    if val:
        summary["val_last"] = val[-1]
    return summary


def write_summary(run_dir: Path, records: list[dict] | None = None) -> dict:
    """`summary.json` of `records` (the trainer's in-memory log; None reads the folder's metrics.jsonl)."""
    if records is None:
        from shardrl.trainer.metrics import read_metrics

        path = run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
    summary = summarize(records)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
