"""What a reward model reads: the policy's ids as they are, or, for a reward model with its own tokenizer (a Llama-3
reward model scoring a Qwen policy), the conversation re-tokenized by that tokenizer, as verl's
`reward_model.model.input_tokenizer` does (`RewardModelWorker._switch_chat_template`).

Re-tokenizing, per sample: the response's tokens (model and tool tokens, as the attention mask has them) are
decoded with the policy's tokenizer, its end-of-sequence and end-of-turn tokens left out (verl strips the EOS text);
the prompt row's chat messages get the response as one more assistant message; the reward model's tokenizer renders
them with its own chat template and encodes the text (no special tokens added: the template writes them). A plain
string prompt is one user message; a reward model's tokenizer without a chat template reads the prompt's text and
the response's text, with the special tokens it adds itself. Rows are right-padded with its pad id and not cut
(verl cuts at the policy batch's width by default: a longer encoding would lose the response's end).
"""

from __future__ import annotations

import torch

from shardrl.batch import Batch
from shardrl.tokenizer import folder_tokenizer, same_tokenization, stop_token_ids


class Retokenize:
    """`batch` (an RL batch holding `prompt`, each sample's prompt row's own prompt) -> the reward model's
    `input_ids` and `attention_mask` under its own tokenizer."""

    def __init__(self, policy_tokenizer, reward_tokenizer):
        self.policy, self.reward = policy_tokenizer, reward_tokenizer
        self.drop_ids = set(stop_token_ids(policy_tokenizer))
        pad = reward_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (reward_tokenizer.eos_token_id or 0)

    def __call__(self, batch: Batch) -> Batch:
        prompt_width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        responses = batch["input_ids"][:, prompt_width:]  # (N, R)
        kept = batch["attention_mask"][:, prompt_width:].bool()  # (N, R) model and tool tokens
        rows = [self.encode(prompt, self.response_text(ids[mask].tolist()))
                for prompt, ids, mask in zip(batch["prompt"], responses, kept)]
        width = max((len(r) for r in rows), default=0)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (N, T)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (N, T)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        return Batch({"input_ids": input_ids, "attention_mask": attention_mask})

    def response_text(self, ids: list[int]) -> str:
        return self.policy.decode([i for i in ids if i not in self.drop_ids], skip_special_tokens=False)

    def encode(self, prompt, response: str) -> list[int]:
        """The reward model's ids of one conversation (`prompt`: a string or chat messages)."""
        if not getattr(self.reward, "chat_template", None):
            if not isinstance(prompt, str):
                raise ValueError("the reward model's tokenizer (reward.model_path) has no chat template, so it cannot "
                                 "render chat prompts: save one in its folder (tokenizer.chat_template), or use "
                                 "plain-text prompts")
            return self.reward(prompt + response)["input_ids"]
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        text = self.reward.apply_chat_template(chat + [{"role": "assistant", "content": response}],
                                               add_generation_prompt=False, tokenize=False)
        return self.reward(text, add_special_tokens=False)["input_ids"]


def reward_model_inputs(model_path: str, policy_tokenizer, trust_remote_code: bool = False) -> Retokenize | None:
    """A `Retokenize` for a reward model folder whose own tokenizer encodes differently from the policy's; None
    (the policy's ids as they are) for one that encodes the same, or that holds no tokenizer."""
    own = folder_tokenizer(model_path, trust_remote_code)
    if own is None or same_tokenization(own, policy_tokenizer):
        return None
    return Retokenize(policy_tokenizer, own)
