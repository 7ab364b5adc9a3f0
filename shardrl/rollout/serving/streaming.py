"""Streamed replies (`stream=true`, server-sent events) of the OpenAI-compatible server, in vLLM's shapes: the chunks
of a chat reply (the role first, then content deltas) or of a completion (text deltas), one chunk per sampled token
with its token id and, where asked, its log-prob; the last chunk of a choice carries its finish_reason and
stop_reason; then, with `stream_options.include_usage`, a chunk of usage alone; then `data: [DONE]`. A chat reply
with tool calls streams its content's tokens so, then its calls (`delta.tool_calls`), then its finish_reason.

The batcher answers a request when its reply is whole (its rows end inside the engine), so a reply's chunks go out
once it is done: the role chunk at once, the rest together. The text of the chunks is the reply's, token by token
(`IncrementalText`), and joined is exactly the non-streamed reply's text."""

from __future__ import annotations

import json
import time
import uuid

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # (tokenizers before 0.21)
    Tokenizer = DecodeStream = None

from shardrl.rollout.serving.logprobs import completion_logprobs, token_logprobs
from shardrl.rollout.serving.schema import ChatRequest, Common, usage, versions


class IncrementalText:
    """A reply's text token by token, as vLLM's incremental detokenizer gives it: each token's new text is the
    decoding of a short window of the last tokens (the window's start keeps a BPE merge or a leading space right) less
    that of the window without the new token; text that ends in an incomplete character (a multi-byte character
    split across tokens decodes to U+FFFD) is held back until the token that completes it. A fast tokenizer's own
    streaming decoder (`tokenizers.decoders.DecodeStream`, the same rule in Rust) does it where there is one: two
    Python decodes a token were about 40% of a streamed reply's cost in the front end."""

    def __init__(self, tok):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0
        self.rust, self.stream = getattr(tok, "_tokenizer", None), None
        if DecodeStream is not None and isinstance(self.rust, Tokenizer):
            self.stream = DecodeStream(skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.stream is not None:
            try:
                return self.stream.step(self.rust, token) or ""
            except Exception:  # (an id the Rust decoder refuses: the Python window from here on)
                self.stream, self.prefix, self.read = None, len(self.ids) - 1, len(self.ids) - 1
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def text_deltas(tok, token_ids: list[int], text: str) -> list[str]:
    """Each token's share of `text` (the reply's final text: cut at a stop string, special tokens left out): the
    incremental decoding's pieces while they spell `text`, the rest with the last token. Joined, they are `text`."""
    decoder, sent, spelling, deltas = IncrementalText(tok), 0, True, []
    for token in token_ids:
        piece = decoder.add(token) if spelling else ""
        # (while the decoding spells the final text its pieces go out; from where it stops doing so (a stop string
        # cut the text there), nothing more does: the rest goes with the last token)
        if piece and not text.startswith(piece, sent):
            spelling = False
            piece = piece[:next(i for i, c in enumerate(piece) if sent + i >= len(text) or text[sent + i] != c)]
        sent += len(piece)
        deltas.append(piece)
    if deltas:
        deltas[-1] += text[sent:]
    return deltas


def event(body) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body) if not isinstance(body, str) else body}\n\n"


DONE = "data: [DONE]\n\n"
ID_MARK, TEXT_MARK = -123456789, "\x00shardrl-text\x00"  # (`ChunkWriter.middle_template`'s places)


def include_usage(req: Common) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


class ChunkWriter:
    """The chunks of one streamed request (`chat`: chat.completion.chunk, else text_completion), all with one id."""

    def __init__(self, req: Common, model_name: str, tok, chat: bool):
        self.req, self.model_name, self.tok, self.chat = req, model_name, tok, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = include_usage(req)

    def chunk(self, choices: list[dict], **more) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices, **more}
        if self.usage and "usage" not in more:  # (OpenAI's: every chunk but the last has usage null)
            body["usage"] = None
        return body

    def role(self, index: int, prompt_ids: list[int]) -> dict:
        """A chat choice's first chunk: its role (and the prompt's token ids, as the non-streamed reply has them)."""
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}], prompt_token_ids=prompt_ids)

    def choice(self, index: int, o: dict) -> list[dict]:
        """A finished choice `o` (the batcher's, cut) as its chunks: one per token, the last with its finish_reason;
        a chat choice with tool calls (`tool_calls.parse_replies`): its content's tokens so, then `tool_call_chunks`."""
        ids = o["token_ids"]
        deltas = text_deltas(self.tok, ids, o["text"]) or [o["text"]]
        logprobs = None
        if self.wants_logprobs():
            logprobs = token_logprobs(self.tok, o) if self.chat else completion_logprobs(self.tok, o)
        if self.chat and o.get("tool_calls"):
            return self.tool_call_chunks(index, o, deltas, logprobs)
        chunks = []
        middle = self.middle_template(index) if logprobs is None else None
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            if middle is not None and not last and (self.chat or k):  # (a token's chunk as the dict below, as text)
                chunks.append(f"{middle[0]}{ids[k]}{middle[1]}{json.dumps(delta)}{middle[2]}")
                continue
            step = ids[k:k + 1]
            choice = {"index": index, "logprobs": None, "finish_reason": o["finish_reason"] if last else None,
                      "stop_reason": o.get("stop_reason") if last else None, "token_ids": step}
            if self.chat:
                choice["delta"] = {"content": delta}
                if logprobs is not None:
                    choice["logprobs"] = {"content": logprobs[k:k + 1]}
            else:
                choice["text"] = delta
                if k == 0:
                    choice["prompt_token_ids"] = o["prompt_token_ids"]
                if logprobs is not None:  # (the token's own: each list of the choice's cut to it)
                    choice["logprobs"] = {key: None if v is None else v[k:k + 1] for key, v in logprobs.items()}
            if last:
                choice.update(versions(o))
            chunks.append(self.chunk([choice]))
        return chunks

    def middle_template(self, index: int) -> tuple[str, str, str]:
        """A choice's chunk between its first and last, with no log-probs, as the three pieces around its token's
        id and its text (as JSON): the JSON `chunk` makes of the dict `choice` builds, built once a choice rather than
        a dict and a json.dumps a token (half the front end's time on a streamed reply)."""
        text = {"content": TEXT_MARK} if self.chat else TEXT_MARK
        body = json.dumps(self.chunk([{"index": index, "logprobs": None, "finish_reason": None, "stop_reason": None,
                                       "token_ids": [ID_MARK], ("delta" if self.chat else "text"): text}]))
        head, rest = body.rsplit(str(ID_MARK), 1)
        between, tail = rest.rsplit(json.dumps(TEXT_MARK), 1)
        return head, between, tail

    def tool_call_chunks(self, index: int, o: dict, deltas: list[str], logprobs: list[dict] | None) -> list[dict]:
        """A chat choice with tool calls, as vLLM's and OpenAI's streams give it: a chunk per token of its content
        (the text before the calls), then a chunk per call (`delta.tool_calls`: its index, id, type, function name
        and whole arguments; the first carries the tokens of the calls), then one of finish_reason "tool_calls"."""
        ids, content, sent, chunks = o["token_ids"], o.get("content") or "", 0, []
        for k, delta in enumerate(deltas):
            if sent >= len(content):
                break
            piece = delta[:len(content) - sent]
            sent += len(delta)
            chunks.append(self.chunk([{"index": index, "delta": {"content": piece}, "token_ids": ids[k:k + 1],
                                       "logprobs": None if logprobs is None else {"content": logprobs[k:k + 1]},
                                       "finish_reason": None}]))
        rest = len(chunks)
        for j, call in enumerate(o["tool_calls"]):
            step = {"index": index, "delta": {"tool_calls": [{"index": j, **call}]}, "finish_reason": None,
                    "token_ids": ids[rest:] if j == 0 else [], "logprobs": None}
            if j == 0 and logprobs is not None:
                step["logprobs"] = {"content": logprobs[rest:]}
            chunks.append(self.chunk([step]))
        chunks.append(self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": "tool_calls",
                                   "stop_reason": o.get("stop_reason"), "token_ids": [], **versions(o)}]))
        return chunks

    def wants_logprobs(self) -> bool:
        return bool(self.req.logprobs) if isinstance(self.req, ChatRequest) else self.req.logprobs is not None

    def final_usage(self, prompts: list[list[int]], outs: list[dict]) -> dict:
        return self.chunk([], usage=usage(prompts, outs))


def chat_events(writer: ChunkWriter, ids: list[int], outs: list[dict]):
    """A chat reply's events after its role chunk (`ChunkWriter.role`, sent before the reply is done)."""
    for i, o in enumerate(outs):
        if i:
            yield event(writer.role(i, ids))
        for chunk in writer.choice(i, o):
            yield event(chunk)
    if writer.usage:
        yield event(writer.final_usage([ids], outs))
    yield DONE


def completion_events(writer: ChunkWriter, prompts: list[list[int]], flat: list[dict]):
    for i, o in enumerate(flat):  # (prompt-major, n a prompt: as the non-streamed reply's choices)
        for chunk in writer.choice(i, o):
            yield event(chunk)
    if writer.usage:
        yield event(writer.final_usage(prompts, flat))
    yield DONE
