"""Supervised fine-tuning: `shardrl sft CONFIG [key=value ...]`, a loop of `trainer.offline`.

The loss is the token mean of -log p over the assistant's tokens of the whole global batch (`data.chat`: every
assistant turn of a `messages` chat, tool and user turns masked; a prompt/response row's response only), so the
step equals a plain HF loop's `labels=` loss however the batch is cut into micro-batches or spread over ranks.
Micro-batches are dynamic by default (packed up to engine.max_token_len_per_gpu tokens). Left out: loss weights per
turn, and packing several conversations into one row (the engine packs a micro-batch's rows without padding, which
is what packing buys).

A vision-language model (issue 61) trains on rows with images (`data.image_chat`: verl's `<image>` placeholders or
TRL's image parts, beside `data.image_key`): each row's `multi_modal_inputs` travel with it into its micro-batch,
and the loss is still over the assistant's tokens only (the image placeholders are context).
"""

from __future__ import annotations

from shardrl.algos.aggregate import agg_loss, masked_metric
from shardrl.data.chat import collate_chats, load_chat_dataset
from shardrl.data.image_chat import load_image_chat_dataset
from shardrl.data.images import ImageSettings
from shardrl.config.schema import SFTConfig
from shardrl.metrics import SumCount
from shardrl.trainer.offline import OfflineTrainer


def sft_loss(outputs, mb, num_tokens, num_seqs):
    """The micro-batch's share of the global token mean of -log p over the loss tokens."""
    mask = mb["loss_mask"]
    return agg_loss(-outputs["log_probs"], mask, "token-mean", num_tokens), {}


class SFTTrainer(OfflineTrainer):
    name, config_cls = "sft", SFTConfig
    reads_images = True

    def load_rows(self, files):
        d = self.cfg.data
        if self.processor is not None:  # a vision-language model: rows with images (`data.image_chat`)
            settings = ImageSettings(d.image_key, d.min_pixels, d.max_pixels, d.max_image_pixels)
            return load_image_chat_dataset(files, self.processor, settings, d.max_length, d.truncation,
                                           d.skip_bad_rows, d.messages_key, d.prompt_key, d.response_key)
        return load_chat_dataset(files, self.tokenizer, d.max_length, d.truncation, d.skip_bad_rows,
                                 d.messages_key, d.prompt_key, d.response_key, d.image_key)

    def collate(self, items):
        return collate_chats(items, self.pad_id)

    def loss_fn(self):
        return sft_loss

    def evaluate(self, batch, real_rows):
        """The token mean of -log p over the validation conversations' loss tokens."""
        out = self.engine.infer_batch(batch)
        mask = batch["loss_mask"][:real_rows].float()
        total, count = masked_metric(-out["log_probs"][:real_rows].cpu(), mask.cpu())
        return {"loss": SumCount(float(total), float(count))}


if __name__ == "__main__":  # `torchrun ... -m shardrl.trainer.sft CONFIG`, the entry of earlier releases
    import runpy
    import sys

    sys.argv[1:1] = ["--trainer", "sft"]
    runpy.run_module("shardrl.launch", run_name="__main__", alter_sys=True)
