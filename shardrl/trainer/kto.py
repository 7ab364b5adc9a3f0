"""KTO on unpaired rows: `shardrl kto CONFIG [key=value ...]`, a loop of `trainer.offline`.

A batch is `data.batch_size` rows of prompt, completion and label (TRL's unpaired preference format: true for a
desirable completion). A row's loss is `algos.preference.kto_loss` on its completion's summed log-prob against the
reference's (`kto.ref_model_path`, by default the starting policy), and the step's loss is the mean over the global
batch's rows (weighted by kto.desirable_weight / undesirable_weight), as TRL's KTOTrainer computes it.

The KL estimate, as TRL's: each row's prompt followed by the previous row's completion in its rank's batch (a
mismatched pair; `data.chat.collate_unpaired`), the mean over the global batch of policy minus reference summed
log-probs of those completions, clamped at 0 and detached. It is computed before the update with forward-only
passes (TRL computes it in the training forward under no_grad: the same number, since it carries no gradient), so
the trained rows' micro-batches hold no KL rows. A rank needs at least 2 rows for mismatched pairs (TRL refuses
fewer); with one, its row pairs with itself.

Logged, with TRL's names: kto/loss, kto/kl, rewards/chosen and logps/chosen (the desirable rows' means),
rewards/rejected and logps/rejected (the undesirable rows'), and the same on val_files (val/loss the KTO loss).
Left out: TRL's apo_zero_unpaired loss type, and the reference's log-probs precomputed once.
"""

from __future__ import annotations

import logging

import torch

from shardrl.algos.preference import kto_loss, sequence_log_probs
from shardrl.batch import Batch
from shardrl.config.schema import KTOConfig
from shardrl.data.chat import collate_unpaired, load_unpaired_dataset
from shardrl.distributed import all_reduce_sum
from shardrl.metrics import SumCount
from shardrl.trainer.offline import OfflineTrainer
from shardrl.trainer.roles import ModelPath

log = logging.getLogger(__name__)

KL_KEYS = ("input_ids", "attention_mask", "loss_mask")


def kto_step(log_probs, loss_mask, ref_log_probs, label, kl, beta, desirable_weight, undesirable_weight):
    """Per-row losses `(B,)` and metrics of rows (`log_probs`, `loss_mask` (B, T); `ref_log_probs`, `label`, `kl`
    (B,): the reference's summed log-probs, 1.0 for a desirable row, the batch's KL estimate)."""
    logps = sequence_log_probs(log_probs, loss_mask)
    losses, rewards = kto_loss(logps, ref_log_probs.to(logps.dtype), label, kl.to(logps.dtype), beta,
                               desirable_weight, undesirable_weight)
    good = label.to(logps.dtype)
    bad = 1 - good

    def mean_over(values, rows):  # (sum, count) over the rows picked by the 0/1 tensor `rows`
        return SumCount((values.detach() * rows).double().sum(), rows.double().sum())

    return losses, {"kl": mean_over(kl, torch.ones_like(good)),
                    "rewards/chosen": mean_over(rewards, good), "rewards/rejected": mean_over(rewards, bad),
                    "logps/chosen": mean_over(logps, good), "logps/rejected": mean_over(logps, bad)}


def kto_loss_fn(beta: float, desirable_weight: float, undesirable_weight: float):
    """The engine's loss: a micro-batch's share of the mean loss over the global batch's rows."""
    def loss_fn(outputs, mb, num_tokens, num_seqs):
        losses, metrics = kto_step(outputs["log_probs"], mb["loss_mask"], mb["ref_log_probs"], mb["label"], mb["kl"],
                                   beta, desirable_weight, undesirable_weight)
        return losses.sum() / num_seqs, metrics
    return loss_fn


class KTOTrainer(OfflineTrainer):
    name, config_cls = "kto", KTOConfig
    resume_settings = ("kto.beta", "kto.desirable_weight", "kto.undesirable_weight")

    def load_rows(self, files):
        d = self.cfg.data
        return load_unpaired_dataset(files, self.tokenizer, d.max_length, d.truncation, d.skip_bad_rows,
                                     d.prompt_key, d.completion_key, d.label_key)

    def collate(self, items):
        return collate_unpaired(items, self.pad_id, self.cfg.data.max_length)

    def build_more(self):
        self.ref = self.build_reference(self.cfg.kto.ref_model_path)
        if self.cfg.data.batch_size // self.mesh.dp_size < 2 and self.rank == 0:
            log.warning("data.batch_size=%d over %d data-parallel ranks leaves a rank one row: KTO's KL estimate pairs "
                        "a prompt with another row's completion of the same rank, so with one it is the row's own "
                        "log-ratio (TRL refuses this); give each rank at least 2 rows", self.cfg.data.batch_size,
                        self.mesh.dp_size)

    def model_paths(self):
        path = self.cfg.kto.ref_model_path
        return super().model_paths() + ([ModelPath("kto.ref_model_path", path)] if path else [])

    def before_update(self, batch):
        """The reference's log-probs of the rows, and the KL estimate over the global batch (every dp rank)."""
        kl_rows = Batch({key: batch[f"kl_{key}"] for key in KL_KEYS})
        batch = batch.select([*KL_KEYS, "label"])
        batch["ref_log_probs"] = sequence_log_probs(self.ref.infer_batch(batch)["log_probs"].cpu(), batch["loss_mask"])
        policy = sequence_log_probs(self.engine.infer_batch(kl_rows)["log_probs"].cpu(), kl_rows["loss_mask"])
        ref = sequence_log_probs(self.ref.infer_batch(kl_rows)["log_probs"].cpu(), kl_rows["loss_mask"])
        total = torch.stack([(policy - ref).double().sum(), torch.tensor(float(len(batch)), dtype=torch.float64)])
        total = all_reduce_sum(total.to(self.device), self.mesh.dp_group).cpu()
        batch["kl"] = torch.full((len(batch),), float(total[0] / total[1]), dtype=torch.float64).clamp(min=0)
        return batch

    def loss_fn(self):
        s = self.cfg.kto
        return kto_loss_fn(s.beta, s.desirable_weight, s.undesirable_weight)

    def evaluate(self, batch, real_rows):
        s, rows = self.cfg.kto, slice(0, real_rows)
        out = self.engine.infer_batch(batch)
        losses, metrics = kto_step(out["log_probs"][rows].cpu(), batch["loss_mask"][rows], batch["ref_log_probs"][rows],
                                   batch["label"][rows], batch["kl"][rows], s.beta, s.desirable_weight,
                                   s.undesirable_weight)
        return {"loss": SumCount(float(losses.sum()), float(len(losses)))} | metrics


if __name__ == "__main__":  # `torchrun ... -m shardrl.trainer.kto CONFIG`, as the other trainers
    import runpy
    import sys

    sys.argv[1:1] = ["--trainer", "kto"]
    runpy.run_module("shardrl.launch", run_name="__main__", alter_sys=True)
