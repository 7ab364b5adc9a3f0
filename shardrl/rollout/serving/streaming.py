"""Streamed replies (`stream=true`, server-sent events) of the OpenAI-compatible server, in vLLM's shapes: the chunks
of a chat reply (the role first, then content deltas) or of a completion (text deltas), each with its tokens' ids
and, where asked, their log-probs; the last chunk of a choice carries its finish_reason and stop_reason; then, with
`stream_options.include_usage`, a chunk of usage alone; then `data: [DONE]`. A chat reply with tool calls streams
its content's tokens, then its calls (`delta.tool_calls`), then its finish_reason.

A reply's chunks go out as the engine makes its tokens (`LiveReply`): on the fast backend's stream, the engine hands
each streamed request's new tokens over at every host sync (every `sync_every` decode steps), and they go out at once
as one chunk (their ids, their text joined), as vLLM's stream merges the tokens its front end has not sent yet; the
reply's last tokens come with the answer, in the chunk that ends it. (A chunk a token took the front end 30.7 us a
hand-over of 16 tokens against 18.4 us for one chunk; at 256 streams one front end has 256 hand-overs a sync.)
A reply whose client sees something other than its tokens' text as they come (tool calls parsed out of it,
log-probs asked for) or one made in a batch (a seeded request, the HF backend) goes out once it is whole: the role
chunk, then its tokens in one chunk (its tool calls after them). Either way the text of the chunks is the reply's,
token by token (`IncrementalText`), and joined is exactly the non-streamed reply's text."""

from __future__ import annotations

import json
import logging
import time
import uuid
import weakref

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # (tokenizers before 0.21)
    Tokenizer = DecodeStream = None

from shardrl.rollout.serving.logprobs import completion_logprobs, token_logprobs
from shardrl.rollout.serving.schema import ChatRequest, Common, stop_list, usage, versions

log = logging.getLogger(__name__)


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
    decoder = IncrementalText(tok)
    return spelled((decoder.add(token) for token in token_ids), text, 0)


def spelled(pieces, text: str, sent: int) -> list[str]:
    """`pieces` (a token's decoded text each) as the tokens' shares of `text[sent:]`: each piece while they spell
    it; from where one stops doing so (a stop string cut the text there), the rest of the text goes with the last
    token and nothing more before it. Joined, they are `text[sent:]`."""
    deltas, spelling = [], True
    for piece in pieces:
        piece = piece if spelling else ""
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
        self.middles: dict[int, tuple[str, str, str]] = {}  # choice index -> its `middle_template`

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
        return self.token_chunks(index, ids, deltas, logprobs, end=o,
                                 prompt_ids=None if self.chat else o["prompt_token_ids"])

    def token_chunks(self, index: int, ids: list[int], deltas: list[str], logprobs=None, end: dict | None = None,
                     prompt_ids: list[int] | None = None, merged: bool = False) -> list:
        """A chunk per token `ids[k]`, its text `deltas[k]` (and its log-probs, where asked); with `end` (the finished
        choice) the last chunk ends the choice (finish_reason, stop_reason, versions); with `prompt_ids` (a
        completion choice's first chunk) the first carries them. `merged` (no log-probs): one chunk of all the tokens,
        their ids and their text joined (`LiveReply`'s, a hand-over's tokens)."""
        if merged:
            groups = [(ids, "".join(deltas))] if ids or deltas else []
        else:
            groups = [(ids[k:k + 1], delta) for k, delta in enumerate(deltas)]
        chunks = []
        middle = self.middle_template(index) if logprobs is None else None
        for k, (group, delta) in enumerate(groups):
            last = end is not None and k == len(groups) - 1
            first = k == 0 and prompt_ids is not None
            if middle is not None and not last and not first:  # (a chunk as the dict below, as text)
                chunks.append(f"{middle[0]}{', '.join(map(str, group))}{middle[1]}{json.dumps(delta)}{middle[2]}")
                continue
            choice = {"index": index, "logprobs": None, "finish_reason": end["finish_reason"] if last else None,
                      "stop_reason": end.get("stop_reason") if last else None, "token_ids": list(group)}
            if self.chat:
                choice["delta"] = {"content": delta}
                if logprobs is not None:
                    choice["logprobs"] = {"content": logprobs[k:k + 1]}
            else:
                choice["text"] = delta
                if first:
                    choice["prompt_token_ids"] = prompt_ids
                if logprobs is not None:  # (the token's own: each list of the choice's cut to it)
                    choice["logprobs"] = {key: None if v is None else v[k:k + 1] for key, v in logprobs.items()}
            if last:
                choice.update(versions(end))
            chunks.append(self.chunk([choice]))
        return chunks

    def middle_template(self, index: int) -> tuple[str, str, str]:
        """A choice's chunk between its first and last, with no log-probs, as the three pieces around its token's
        id and its text (as JSON): the JSON `chunk` makes of the dict `choice` builds, built once a choice rather than
        a dict and a json.dumps a token (half the front end's time on a streamed reply)."""
        if index not in self.middles:
            self.middles[index] = self._middle_template(index)
        return self.middles[index]

    def _middle_template(self, index: int) -> tuple[str, str, str]:
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
        # where the content is in the text: not always at its start (llama3_json's strips the text's leading space)
        start = max(0, o["text"].find(content))
        for k, delta in enumerate(deltas):
            if sent >= start + len(content):
                break
            piece = delta[max(0, start - sent):start + len(content) - sent]
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


def live(req: Common, tok) -> bool:
    """Whether a streamed request's chunks go out as its tokens are made (`LiveReply`): not where its client sees
    something other than each token's text (tool calls parsed out of the reply, log-probs: made of the whole reply),
    nor with a tokenizer whose whole decoding cleans up spaces a token at a time cannot (the text could then differ
    from the non-streamed reply's)."""
    if getattr(tok, "clean_up_tokenization_spaces", False):
        return False
    if isinstance(req, ChatRequest):
        return not req.logprobs and not (req.tools and req.tool_choice != "none")
    return req.logprobs is None


class LiveReply:
    """A streamed reply's events as the engine makes its tokens: `add(k, tokens)` (choice k's new tokens, not its
    last: `Batcher.submit`'s on_tokens) gives a chunk of them at once, `end(outs)` (the whole reply, cut) the chunk
    of the tokens not sent yet that ends each choice (then usage and [DONE]).

    What is sent is always what the whole reply holds: a token is not sent from the first of the request's
    stop_token_ids on (the reply is cut after it: generated past it, as `cut_at_stop_ids` says), and with stop
    strings the last (longest stop string - 1) characters of the text wait, so that text a stop string will cut
    is never sent (a stop string found ends the row at that sync, before its tokens would be handed over). `stop`: the
    stop strings the reply is sampled with (an RL run's endpoint samples with its policy's where the request names
    none: `sampling_of`); the request's where not given. With a byte-fallback tokenizer, the text of a run of byte
    tokens waits until the run ends, and after a run that is not UTF-8 (which its decoder turns whole into one U+FFFD
    a byte, where a token at a time gave the characters in it) all of the choice's text waits for the answer."""

    def __init__(self, writer: ChunkWriter, head_ids: list[int], prompt_of, stop: list[str] | None = None):
        self.writer, self.head_ids, self.prompt_of = writer, head_ids, prompt_of
        req = writer.req
        self.hold = max((len(x) for x in (stop_list(req.stop) if stop is None else stop)), default=1) - 1
        self.stop_ids = set(req.stop_token_ids or ())
        self.bytes = fallback_bytes(writer.tok)
        self.special = set(getattr(writer.tok, "all_special_ids", None) or ()) if self.bytes else set()
        self.choices: dict[int, _LiveChoice] = {}

    def _choice(self, k: int) -> tuple["_LiveChoice", list[str]]:
        """Choice k's state, and its role event where the choice starts here (a chat's choices after the first: the
        first one's went out at once, `ChunkWriter.role`)."""
        if k in self.choices:
            return self.choices[k], []
        c = self.choices[k] = _LiveChoice(IncrementalText(self.writer.tok))
        if self.writer.chat and k:
            return c, [event(self.writer.role(k, self.head_ids))]
        return c, []

    def add(self, k: int, tokens: list[int]) -> list[str]:
        """Choice k's events for `tokens` handed over: one chunk of the tokens sent (their ids, their text joined),
        after its role chunk where the choice starts here."""
        c, events = self._choice(k)
        if c.halted:
            return events
        if self.stop_ids:
            at = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
            if at is not None:
                tokens, c.halted = tokens[:at], True
        if not tokens:
            return events
        if self.bytes:
            text = self._bytewise(c, tokens)
        else:  # (all the tokens' text at once: what a token at a time would send, joined)
            c.held += "".join(map(c.decoder.add, tokens))
            cut = max(0, len(c.held) - self.hold)
            text, c.held = c.held[:cut], c.held[cut:]
        first = not c.ids and not self.writer.chat
        chunks = self.writer.token_chunks(k, tokens, [text], prompt_ids=self.prompt_of(k) if first else None,
                                          merged=True)
        c.ids += tokens
        c.text += text
        return events + [event(x) for x in chunks]

    def _bytewise(self, c: "_LiveChoice", tokens: list[int]) -> str:
        """The text of `tokens` that may go out now, a token at a time: a run of byte tokens waits until it ends,
        and after a run that is not UTF-8 all of the choice's text waits."""
        sent = []
        for token in tokens:
            c.held += c.decoder.add(token)
            if token in self.bytes:
                c.run.append(self.bytes[token])
            elif c.run and token not in self.special:  # (a special token is left out: the run goes on past it)
                c.garbled = c.garbled or not is_utf8(c.run)
                c.run = bytearray()
            cut = 0 if c.run or c.garbled else max(0, len(c.held) - self.hold)
            sent.append(c.held[:cut])
            c.held = c.held[cut:]
        return "".join(sent)

    def end(self, outs: list[dict], prompts: list[list[int]]) -> list[str]:
        events = []
        for k, o in enumerate(outs):
            c, role = self._choice(k)
            events += role
            ids, text = o["token_ids"], o["text"]
            if ids[:len(c.ids)] != c.ids or not text.startswith(c.text):
                log.warning("a streamed reply's sent tokens are not its answer's start")  # (never: see the class)
            rest, sent = ids[len(c.ids):], len(c.text)
            pieces = [c.decoder.add(t) for t in rest]
            if pieces:
                pieces[0] = c.held + pieces[0]
            deltas = spelled(pieces, text, sent) if rest else [text[sent:]]
            first = not c.ids and not self.writer.chat
            chunks = self.writer.token_chunks(k, rest, deltas, end=o, prompt_ids=self.prompt_of(k) if first else None,
                                              merged=True)
            events += [event(x) for x in chunks]
        if self.writer.usage:
            events.append(event(self.writer.final_usage(prompts, outs)))
        events.append(DONE)
        return events


class _LiveChoice:
    def __init__(self, decoder: IncrementalText):
        self.decoder, self.ids, self.held, self.text, self.halted = decoder, [], "", "", False
        self.run, self.garbled = bytearray(), False  # (`LiveReply`: a byte-fallback tokenizer's byte tokens)


_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its `fallback_bytes`


def fallback_bytes(tok) -> dict[int, int]:
    """A byte-fallback tokenizer's byte tokens (`<0xE4>`: Llama 2's, Mistral's, Gemma's), id -> byte; none for
    others. Kept a tokenizer."""
    try:
        if tok in _BYTES:
            return _BYTES[tok]
    except TypeError:  # (a tokenizer that takes no weak reference: read each time)
        pass
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    found = {i: int(name[3:5], 16) for name, i in vocab.items()
             if len(name) == 6 and name.startswith("<0x") and name.endswith(">")
             and all(c in "0123456789ABCDEFabcdef" for c in name[3:5])}
    try:
        _BYTES[tok] = found
    except TypeError:
        pass
    return found


def is_utf8(data: bytearray) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
