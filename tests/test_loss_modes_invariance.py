"""Each policy-loss mode (vanilla, gspo, gspo_token, cispo, sapo, geo_mean, dppo_tv, dppo_kl) with and without rollout-mismatch weights gives the same
update and the same loss metrics whatever the cut: one process with the whole mini-batch in one micro-batch,
or two processes with micro-batches of 1 or 3 samples, a token budget, or Ulysses sequence parallelism (sp=2,
where each rank's forward holds half of each row and the loss sees the gathered rows). GSPO's per-sequence
ratio needs whole sequences in a loss call: the engine cuts micro-batches between sequences, so it holds.

fp32 on CPU (gloo); each world is one spawn that runs every variant.
"""

from __future__ import annotations

import pytest
import torch

from shardrl.testing import TINY_MODELS, random_batch, run_distributed

pytestmark = pytest.mark.multiproc

NUM_SEQS, MAX_LEN = 8, 14
OPTIM = dict(lr=1e-30, betas=[0.9, 0.99], eps=1e-6, weight_decay=0.0, clip_grad=0.0)
MODES = {  # name -> (loss_mode, loss_agg_mode, rollout_is (level, mode) or None[, actor settings])
    "vanilla_is_geometric_mask": ("vanilla", "token-mean", ("geometric", "mask")),
    "gspo": ("gspo", "seq-mean-token-mean", None),
    "gspo_token_is_token": ("gspo_token", "token-mean", ("token", "truncate")),
    "gspo_seq_sum_is_sequence": ("gspo", "seq-mean-token-sum", ("sequence", "truncate")),
    "cispo_is_token_mask": ("cispo", "token-mean", ("token", "mask")),
    "sapo": ("sapo", "seq-mean-token-mean", None, dict(tau_pos=1.0, tau_neg=3.0)),
    "geo_mean_is_token": ("geo_mean", "seq-mean-token-mean", ("token", "truncate")),
    # the tiny model's token probabilities are ~1/vocab: divergence bounds at that scale mask some tokens
    "dppo_tv": ("dppo_tv", "token-mean", None, dict(clip_ratio_low=2e-5, clip_ratio_high=2e-5, clip_ratio_c=1.02)),
    "dppo_kl_seq_sum": ("dppo_kl", "seq-mean-token-sum", None,
                        dict(clip_ratio_low=1e-8, clip_ratio_high=1e-8, clip_ratio_c=1.02)),
}
LAYOUTS_2 = {
    "mb1": dict(micro_batch_size_per_gpu=1),
    "mb3": dict(micro_batch_size_per_gpu=3),
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=20),
    "sp2": dict(micro_batch_size_per_gpu=2, ulysses_sequence_parallel_size=2),
}


def make_batch():
    """A batch with old and sampler log-probs off the policy's (so ratios, clips and weights are not trivial),
    each sequence one advantage (GRPO-like), and the rollout-correction weights of each mode."""
    batch = random_batch(NUM_SEQS, MAX_LEN, TINY_MODELS["qwen2"]["vocab_size"], seed=5, min_len=4)
    g = torch.Generator().manual_seed(6)
    mask = batch["loss_mask"].float()
    batch["advantages"] = torch.randn(NUM_SEQS, 1, generator=g) * mask
    return batch, g


def _steps(layouts: dict) -> dict:
    from shardrl.algos.rollout_correction import rollout_is_weights
    from shardrl.config.schema import ActorConfig, EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import record_grads
    from shardrl.trainer.updates import actor_loss_fn

    out = {}
    for lname, engine_kwargs in layouts.items():
        # one engine per layout; its steps (lr ~0) leave the parameters, so every mode's gradient is at the init
        engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                              EngineConfig(param_dtype="float32", logprob_chunk_size=7, **engine_kwargs),
                              OptimConfig(**OPTIM))
        grads = record_grads(engine)
        for mname, (loss_mode, agg, is_cfg, *settings) in MODES.items():
            batch, g = make_batch()
            mask = batch["loss_mask"]
            logp = engine.infer_batch(batch)["log_probs"].cpu()  # the same on every layout (checked elsewhere)
            batch["old_log_probs"] = logp + 0.05 * torch.randn(logp.shape, generator=g) * mask
            batch["sampled_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(logp.shape, generator=g) * mask
            if is_cfg is not None:
                w, new_mask, _ = rollout_is_weights(batch["old_log_probs"], batch["sampled_log_probs"], mask,
                                                    *is_cfg, threshold=1.5)
                batch["rollout_is_weights"], batch["loss_mask"] = w, new_mask
            mine = batch.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
            actor_cfg = ActorConfig(loss_mode=loss_mode, **{"clip_ratio_low": 0.02, "clip_ratio_high": 0.03,
                                                            **(settings[0] if settings else {})})
            metrics = engine.train_batch(mine, actor_loss_fn(actor_cfg, agg, batch_weights=is_cfg is not None))
            # the old_from_forward path's mismatch metrics are (sum, count) pairs through the engine as well
            engine2_metrics = engine.train_batch(mine, actor_loss_fn(actor_cfg, agg, old_from_forward=True),
                                                with_entropy=True)
            out[lname, mname] = {"grads": grads[-2], "metrics": metrics,
                                 "mismatch": {k: v for k, v in engine2_metrics.items() if k.startswith("rollout/")}}
    return out


@pytest.fixture(scope="module")
def results():
    one = run_distributed(_steps, 1, {"whole": dict(micro_batch_size_per_gpu=NUM_SEQS)})
    two = run_distributed(_steps, 2, LAYOUTS_2)
    return one, two


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
@pytest.mark.parametrize("mode", list(MODES))
def test_loss_modes_are_invariant_to_the_cut(results, layout, mode):
    one, two = results
    want, got = one["whole", mode], two[layout, mode]
    # a comparison worth making: the loss moves, some tokens are clipped (SAPO clips none)
    assert (want["metrics"]["actor/pg_clipfrac"] > 0) == (MODES[mode][0] != "sapo")
    assert abs(want["metrics"]["loss"]) > 1e-4, want["metrics"]
    scale = max(float(v.abs().max()) for v in want["grads"].values())
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-5 * scale, msg=f"{layout} {mode} {name}")
    for key in ("loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    assert set(want["mismatch"]) == {"rollout/logprob_abs_diff", "rollout/kl", "rollout/k3_kl"}
    for key, value in want["mismatch"].items():
        assert value != 0 and got["mismatch"][key] == pytest.approx(value, rel=1e-5), key


def test_gspo_differs_from_vanilla_on_the_same_batch(results):
    # the modes are not one loss under several names
    one, _ = results
    a = one["whole", "gspo"]["grads"]
    b = one["whole", "vanilla_is_geometric_mask"]["grads"]
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)
