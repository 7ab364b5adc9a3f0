"""verl's names for shardrl's step metrics (`trainer.verl_metric_names`): the same numbers under the keys a verl
dashboard reads, added beside shardrl's own (decided once: aliases, so that shardrl's names stay stable).

`VERL_NAMES` maps one shardrl key to verl's; `with_verl_names` adds those and the ones verl derives: `timing_s/gen`
without the weight sync (verl times that as `timing_s/update_weights`), `perf/time_per_step`, `perf/throughput`
(tokens per second per GPU), `timing_per_token_ms/<phase>` (a phase's milliseconds over the tokens it reads:
response tokens for generation, all tokens otherwise), `training/global_step`, and validation per data source as
`val-core/<data_source>/reward/mean@<n>` (the mean over every response). The actor's and critic's loss metrics
(`actor/pg_loss`, `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/grad_norm`, `critic/vf_loss`, ...) and the critic/
batch statistics already carry verl's names.
"""

from __future__ import annotations

import re

VERL_NAMES = {
    "reward/mean": "critic/score/mean", "reward/max": "critic/score/max", "reward/min": "critic/score/min",
    "response/length_mean": "response_length/mean", "response/length_max": "response_length/max",
    "response/length_min": "response_length/min", "response/clip_frac": "response_length/clip_ratio",
    "prompt/length_mean": "prompt_length/mean", "prompt/length_max": "prompt_length/max",
    "prompt/length_min": "prompt_length/min", "prompt/clip_frac": "prompt_length/clip_ratio",
    "timing/reward_s": "timing_s/reward", "timing/old_log_prob_s": "timing_s/old_log_prob",
    "timing/ref_s": "timing_s/ref", "timing/values_s": "timing_s/values", "timing/adv_s": "timing_s/adv",
    "timing/update_critic_s": "timing_s/update_critic", "timing/update_actor_s": "timing_s/update_actor",
    "timing/update_weights_s": "timing_s/update_weights", "timing/testing_s": "timing_s/testing",
    "timing/save_checkpoint_s": "timing_s/save_checkpoint", "timing/step_s": "timing_s/step",
    "dynamic_sampling/num_gen_batches": "train/num_gen_batches",  # verl's DAPO recipe's
}

_PER_TOKEN = {"gen": "response/num_tokens", "ref": None, "values": None, "adv": None, "update_critic": None,
              "update_actor": None}
"""verl's timing_per_token_ms phases and the token count each is divided by (None: all tokens of the batch)."""

_VAL_MEAN = re.compile(r"^val/(.+)/reward_mean@(\d+)$")


def with_verl_names(metrics: dict[str, float], step: int) -> dict[str, float]:
    """`metrics` (step `step`'s, reduced) with verl's names added; shardrl's own stay."""
    out = dict(metrics)
    for ours, theirs in VERL_NAMES.items():
        if ours in metrics and theirs not in out:
            out[theirs] = metrics[ours]
    if "timing/gen_s" in metrics:
        out["timing_s/gen"] = metrics["timing/gen_s"] - metrics.get("timing/update_weights_s", 0.0)
    if "timing/step_s" in metrics:
        out["perf/time_per_step"] = metrics["timing/step_s"]
    if "perf/tokens_per_s_per_gpu" in metrics:
        out["perf/throughput"] = metrics["perf/tokens_per_s_per_gpu"]
    total = metrics.get("perf/total_num_tokens")
    for phase, count_key in _PER_TOKEN.items():
        seconds = out.get(f"timing_s/{phase}")
        tokens = metrics.get(count_key) if count_key else total
        if seconds is not None and tokens:
            out[f"timing_per_token_ms/{phase}"] = seconds * 1000 / tokens
    for key, value in metrics.items():
        if m := _VAL_MEAN.match(key):
            out[f"val-core/{m[1]}/reward/mean@{m[2]}"] = value
    out["training/global_step"] = step
    return out
