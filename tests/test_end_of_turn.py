"""Generation stops at the chat template's end-of-turn token as well as at EOS, in both rollout backends.

A base model's tokenizer often keeps `<|endoftext|>` as EOS while its chat template ends each turn with
another special token (`<|im_end|>`); a chat-prompted policy ends its reply with the latter, and a
rollout that stops only at EOS runs every reply to max_new_tokens. Here a tiny random model stands in:
a character its greedy replies emit at different steps becomes the template's end-of-turn token.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardrl.rollout import SamplingParams
from shardrl.tokenizer import build_char_tokenizer, end_of_turn_token_id, stop_token_ids
from test_rollout_fast import encode, make_rollout, reference_model, with_eos_at_different_steps


def with_end_of_turn(tok, char: str):
    """A copy of `tok` whose chat template ends every message with `char`, made a special token."""
    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"additional_special_tokens": [char]})
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + char + "\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def test_stop_ids_are_eos_and_the_templates_end_of_turn():
    tok = build_char_tokenizer()
    assert end_of_turn_token_id(tok) is None and stop_token_ids(tok) == [tok.eos_token_id]  # turns end with "\n"
    turn = with_end_of_turn(tok, "#")
    assert stop_token_ids(turn) == [tok.eos_token_id, tok.convert_tokens_to_ids("#")]
    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    assert stop_token_ids(no_template) == [tok.eos_token_id]


def test_both_backends_stop_at_the_end_of_turn_token():
    tok = build_char_tokenizer()
    model = reference_model(tok, seed=1)
    char = with_eos_at_different_steps(tok, model).eos_token  # emitted by some greedy replies, at different steps
    turn = with_end_of_turn(tok, char)
    turn_id = turn.convert_tokens_to_ids(char)
    assert turn.eos_token_id != turn_id
    ids, mask = encode(turn)
    greedy = SamplingParams(greedy=True, max_new_tokens=16)
    outs = {name: make_rollout(name, turn, model, **kw).generate(ids, mask, greedy)
            for name, kw in (("hf", {}), ("fast", dict(max_batch=3, sync_every=2)))}
    assert torch.equal(outs["hf"].response_ids, outs["fast"].response_ids)
    assert torch.equal(outs["hf"].response_mask, outs["fast"].response_mask)
    out = outs["fast"]
    lengths = out.response_mask.sum(1).tolist()
    ended = 0
    for r, length in enumerate(lengths):
        row = out.response_ids[r, :length].tolist()
        if turn_id in row:  # the reply ends at its first end-of-turn token, which is trained on (masked in)
            ended += 1
            assert row.index(turn_id) == length - 1
            assert char not in out.response_text[r]
        else:  # or at EOS, or at the limit
            assert row[-1] == turn.eos_token_id or length == greedy.max_new_tokens
    assert 0 < ended < len(lengths)
