"""Reward-model training: `shardrl rm CONFIG [key=value ...]`, a Bradley-Terry model on preference pairs, a loop
of `trainer.offline`.

The model is a sequence classifier with one label: a causal LM's decoder under a new scalar head (or a reward
model to train further), its score read at each sequence's last token. A batch is `data.batch_size` pairs, two
rows each (chosen, rejected) kept in one micro-batch; a pair's loss is -log s(r_chosen - r_rejected - margin), the
margin the row's `margin` column (TRL's; 0 without one), plus TRL's `center_rewards_coefficient` term, the step's
the mean over the global batch's pairs. Logged: rm/accuracy (the share of pairs ranked right), rm/margin (the mean
r_chosen - r_rejected, as TRL's), rewards/chosen, rewards/rejected, and the same on val_files. The HF export
(`trainer.export_hf`) is a *ForSequenceClassification folder that `reward.model_path` loads in an RL run.
"""

from __future__ import annotations

import torch

from shardrl.algos.preference import bradley_terry_loss
from shardrl.config.schema import RMConfig
from shardrl.metrics import SumCount, row_means
from shardrl.trainer.offline import PairTrainer


def reward_pair_step(scores: torch.Tensor, center_coefficient: float, margin: torch.Tensor | None = None):
    """Per-pair losses and metrics of scores `(2P,)` laid out chosen, rejected, chosen, ... (`margin` (2P,): each
    pair's on both its rows, or None)."""
    chosen, rejected = scores[0::2], scores[1::2]
    losses = bradley_terry_loss(chosen, rejected, center_coefficient, None if margin is None else margin[0::2])
    return losses, row_means({"accuracy": (chosen > rejected).double(), "margin": chosen - rejected,
                              "rewards/chosen": chosen, "rewards/rejected": rejected})


def rm_loss_fn(center_coefficient: float):
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        margin = mb["margin"] if "margin" in mb else None
        losses, metrics = reward_pair_step(outputs["scores"], center_coefficient, margin)
        return losses.sum() / (num_seqs / 2), {f"rm/{k}" if "/" not in k else k: v for k, v in metrics.items()}
    return loss_fn


class RMTrainer(PairTrainer):
    name, config_cls, head = "rm", RMConfig, "score"
    resume_settings = ("rm.center_rewards_coefficient",)

    def loss_fn(self):
        return rm_loss_fn(self.cfg.rm.center_rewards_coefficient)

    def evaluate(self, batch, real_rows):
        scores = self.engine.infer_batch(batch)["scores"][:real_rows].cpu()
        losses, metrics = reward_pair_step(scores, self.cfg.rm.center_rewards_coefficient,
                                           batch["margin"][:real_rows].cpu())
        return {"loss": SumCount(float(losses.sum()), float(len(losses)))} | metrics


if __name__ == "__main__":  # `torchrun ... -m shardrl.trainer.rm CONFIG`, the entry of earlier releases
    import runpy
    import sys

    sys.argv[1:1] = ["--trainer", "rm"]
    runpy.run_module("shardrl.launch", run_name="__main__", alter_sys=True)
