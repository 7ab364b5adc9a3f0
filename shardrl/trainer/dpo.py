"""Offline preference training: `shardrl dpo CONFIG [key=value ...]` (DPO's sigmoid loss, IPO, SimPO and TRL's
other pairwise losses, `algos.preference`), a loop of `trainer.offline`.

A batch is `data.batch_size` prompt/chosen/rejected pairs, two rows each (chosen, rejected), which the engine
keeps in one micro-batch (`group_size=2`); a pair's loss is `algos.preference`'s on the completions' summed
log-probs and token counts, and the step's loss is the mean over the global batch's pairs. The
reference's log-probs come from a forward-only engine of `dpo.ref_model_path` (default: the starting policy) on
the same layout, before each update; simpo needs none. Metrics are TRL's: rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (per-token means for simpo, as TRL's CPO trainer).
With `dpo.rpo_alpha` (RPO) the step adds rpo_alpha times the token mean NLL of the global batch's chosen completion
tokens (TRL takes that mean per device and micro-batch, then averages: the same on one device without gradient
accumulation), logged as nll_loss. Left out: the reference's log-probs precomputed once, and the base model with
adapters off as the reference (LoRA).
"""

from __future__ import annotations

from shardrl.algos.preference import PREFERENCE_LOSSES, PreferenceParams, chosen_nll, sequence_log_probs
from shardrl.distributed import all_reduce_sum
from shardrl.config.names import SMOOTHED_LOSSES
from shardrl.config.schema import DPOConfig
from shardrl.metrics import SumCount, row_means
from shardrl.trainer.offline import PairTrainer
from shardrl.trainer.roles import ModelPath


def pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    """TRL's DPO metrics over these pairs, as (sum, count) pairs."""
    return row_means({"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                      "rewards/accuracies": (chosen_rewards > rejected_rewards).double(),
                      "rewards/margins": chosen_rewards - rejected_rewards,
                      "logps/chosen": chosen_logps, "logps/rejected": rejected_logps})


def preference_step(log_probs, loss_mask, ref_log_probs, loss_type: str, params: PreferenceParams):
    """Per-pair losses and metrics of rows laid out chosen, rejected, chosen, ... (`log_probs`, `loss_mask`
    (2P, T); `ref_log_probs` (2P,), each row's summed reference log-prob, or None)."""
    mode = PREFERENCE_LOSSES[loss_type]
    logps = sequence_log_probs(log_probs, loss_mask)  # (2P,)
    counts = loss_mask.sum(-1).to(logps.dtype)
    rc, rr = (ref_log_probs[0::2], ref_log_probs[1::2]) if mode.uses_ref else (None, None)
    losses, *metrics = mode.fn(logps[0::2], logps[1::2], rc, rr, counts[0::2], counts[1::2], params)
    return losses, pair_metrics(*metrics)


def dpo_loss_fn(loss_type: str, params: PreferenceParams, rpo_alpha: float = 0.0, num_chosen_tokens=None):
    """The engine's loss: a micro-batch's share of the mean loss over the global batch's pairs, plus, with
    `rpo_alpha`, its share of rpo_alpha times the token mean NLL of the global batch's `num_chosen_tokens` chosen
    completion tokens (logged as nll_loss)."""
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        ref = mb["ref_log_probs"] if "ref_log_probs" in mb else None
        losses, metrics = preference_step(outputs["log_probs"], mb["loss_mask"], ref, loss_type, params)
        loss = losses.sum() / (num_seqs / 2)
        if rpo_alpha:
            chosen_mask = mb["loss_mask"][0::2]
            nll = chosen_nll(outputs["log_probs"], mb["loss_mask"], 1)
            loss = loss + rpo_alpha * nll / num_chosen_tokens
            metrics["nll_loss"] = SumCount(nll.detach(), chosen_mask.sum().to(nll.dtype))
        return loss, metrics
    return loss_fn


class DPOTrainer(PairTrainer):
    name, config_cls = "dpo", DPOConfig
    # (dpo.ref_model_path is left out: the same reference moved to another folder is no change)
    resume_settings = ("dpo.loss_type", "dpo.beta", "dpo.label_smoothing", "dpo.simpo_gamma", "dpo.rpo_alpha")

    def reads_setting(self, key: str) -> bool:
        loss = self.cfg.dpo.loss_type
        return {"dpo.simpo_gamma": loss == "simpo", "dpo.label_smoothing": loss in SMOOTHED_LOSSES}.get(key, True)

    def build_more(self):
        s = self.cfg.dpo
        self.params = PreferenceParams(s.beta, s.label_smoothing, s.simpo_gamma)
        self.mode = PREFERENCE_LOSSES[s.loss_type]
        self.ref = self.build_reference(s.ref_model_path) if self.mode.uses_ref else None

    def model_paths(self):
        s = self.cfg.dpo
        ref = [ModelPath("dpo.ref_model_path", s.ref_model_path)]
        return super().model_paths() + (ref if PREFERENCE_LOSSES[s.loss_type].uses_ref and s.ref_model_path else [])

    def before_update(self, batch):
        if self.ref is not None:
            out = self.ref.infer_batch(batch)
            batch["ref_log_probs"] = sequence_log_probs(out["log_probs"].cpu(), batch["loss_mask"])
        if self.cfg.dpo.rpo_alpha:  # the NLL term's denominator: the chosen tokens of every rank's share
            self.num_chosen_tokens = all_reduce_sum(batch["loss_mask"][0::2].sum().double().to(self.device),
                                                    self.mesh.dp_group)
        return batch

    def loss_fn(self):
        s = self.cfg.dpo
        return dpo_loss_fn(s.loss_type, self.params, s.rpo_alpha, getattr(self, "num_chosen_tokens", None))

    def evaluate(self, batch, real_rows):
        out = self.engine.infer_batch(batch)
        ref = batch["ref_log_probs"][:real_rows] if self.ref is not None else None
        losses, metrics = preference_step(out["log_probs"][:real_rows].cpu(), batch["loss_mask"][:real_rows], ref,
                                          self.cfg.dpo.loss_type, self.params)
        if self.cfg.dpo.rpo_alpha:  # (val/loss is the preference loss alone)
            mask = batch["loss_mask"][:real_rows]
            metrics["nll_loss"] = SumCount(float(chosen_nll(out["log_probs"][:real_rows].cpu(), mask, 1)),
                                           float(mask[0::2].sum()))
        return {"loss": SumCount(float(losses.sum()), float(len(losses)))} | metrics


if __name__ == "__main__":  # `torchrun ... -m shardrl.trainer.dpo CONFIG`, the entry of earlier releases
    import runpy
    import sys

    sys.argv[1:1] = ["--trainer", "dpo"]
    runpy.run_module("shardrl.launch", run_name="__main__", alter_sys=True)
