"""A reply's log-probs in the wire shapes: chat's (`token_logprobs`: an entry a token with its `bytes` and
`top_logprobs`), the completions' (`completion_logprobs`: parallel lists, a {token: log-prob} dict a token) and the
Responses API's (`output_logprobs`, chat's entries). A token is named by its text as vLLM gives it (`token_pieces`:
the token decoded alone, special tokens spelled out), never its vocabulary entry: a byte-level BPE's entry spells
a space 'Ġ' and each byte of a character as a character of its own, which no client can read."""

from __future__ import annotations

import itertools
import weakref

LEAST_LOGPROB = -9999.0
"""An alternative's log-prob is at least this (OpenAI's and vLLM's stand-in for -inf, which JSON cannot spell)."""


def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each character a byte-level vocabulary entry spells, the byte it
    stands for (printable bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


BYTE_OF_CHAR = byte_of_char()
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {id: (text, bytes)}


def is_byte_level(tok) -> bool:
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def token_bytes(tok, token_id: int, text: str, byte_level: bool) -> list[int]:
    """The bytes a token stands for: a byte-level entry's own (a piece of a character split across tokens, which
    decodes to U+FFFD alone), a byte-fallback token's (`<0x0A>`), else its text's UTF-8."""
    if token_id not in (getattr(tok, "added_tokens_decoder", None) or {}):
        name = tok.convert_ids_to_tokens(token_id)
        if byte_level and isinstance(name, str) and name and all(c in BYTE_OF_CHAR for c in name):
            return [BYTE_OF_CHAR[c] for c in name]
        if isinstance(name, str) and len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
            try:
                return [int(name[3:5], 16)]
            except ValueError:
                pass
    return list(text.encode("utf-8", errors="replace"))


def token_pieces(tok, ids: list[int]) -> list[tuple[str, list[int]]]:
    """Each token's (text, bytes): its text decoded alone, special tokens spelled out (vLLM's), and its bytes
    (`token_bytes`); kept a tokenizer, so that a token is decoded once a server."""
    try:
        known = _PIECES.setdefault(tok, {})
    except TypeError:  # (a tokenizer that takes no weak reference: decoded each time)
        known = {}
    missing = list(dict.fromkeys(t for t in ids if t not in known))
    if missing:
        byte_level = is_byte_level(tok)
        texts = tok.batch_decode([[t] for t in missing], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
        for t, text in zip(missing, texts):
            known[t] = (text, token_bytes(tok, t, text, byte_level))
    return [known[t] for t in ids]


def alternatives(tok, o: dict) -> list[list[tuple[tuple[str, list[int]], float]]]:
    """Each token's likeliest tokens (the batcher's `top_ids`, `top_log_probs`), best first, as ((text, bytes),
    log-prob) pairs; none a token where none were asked."""
    ids = o.get("top_ids") or [[] for _ in o["token_ids"]]
    pieces = iter(token_pieces(tok, [t for step in ids for t in step]))
    return [[(next(pieces), max(lp, LEAST_LOGPROB)) for lp in lps] for lps in o.get("top_log_probs") or ids]


def token_logprobs(tok, o: dict) -> list[dict]:
    """A choice's log-prob entries, one a token (chat's shape, and the Responses API's), each with its
    `top_logprobs`: the likeliest tokens, best first (OpenAI's; vLLM's put the sampled token first, in place of the
    k-th where it is not among them)."""
    return [{"token": text, "logprob": lp, "bytes": raw,
             "top_logprobs": [{"token": name, "logprob": x, "bytes": b} for (name, b), x in top]}
            for (text, raw), lp, top in zip(token_pieces(tok, o["token_ids"]), o["log_probs"], alternatives(tok, o))]


def completion_logprobs(tok, o: dict) -> dict:
    """A choice's log-probs in the completions' shape: `top_logprobs` a token is {token: log-prob} for the sampled
    token, then the likeliest others, best first: logprobs + 1 entries where the sampled token is not among the
    likeliest (OpenAI's and vLLM's). Tokens of the same text (pieces of characters: U+FFFD) share an entry: the
    sampled token's log-prob, else the likeliest one's."""
    tokens = [text for text, _ in token_pieces(tok, o["token_ids"])]
    tops = []
    for name, lp, top in zip(tokens, o["log_probs"], alternatives(tok, o)):
        entry = {name: lp}
        for (text, _), x in top:  # (the first of a text kept: the sampled token's, else the likeliest's)
            entry.setdefault(text, x)
        tops.append(entry)
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {"tokens": tokens, "token_logprobs": o["log_probs"], "top_logprobs": tops,
            "text_offset": offsets}  # (where each token's text starts: the lengths of those before, as vLLM's)
