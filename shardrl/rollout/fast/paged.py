"""The fast rollout's KV blocks: which rows hold which, and which token prefixes they already hold.

The cache is `num_blocks` blocks of `block_size` positions (`FastCausalLM.kv_shape`); a row's cache is the list of
blocks in its slot's row of the block table. Block 0 is scratch: table entries past a row's blocks point at it, and
so do the rows of empty slots, whose decode steps still run and write somewhere.

Prefix index: a block whose positions are all written (a full block of a prompt once prefilled, of a finished row's
prompt and response once retired) is indexed by the tokens from the sequence's start through its end. A later row
whose prompt starts with those tokens reads the block instead of prefilling them again: the n samples of a prompt,
a conversation's next turn (its prompt is the last turn's context, the sampled tokens and what the tool added), an
agent's next request. Blocks are shared read-only; a row writes only into its own blocks (the last, partly filled
block of a shared prompt is copied for each row). A block nobody holds stays indexed until its space is needed
(least recently used first) or the weights change (`clear_index`: the K/V came from the old weights).

Sessions (`pin`): a conversation's blocks can be held between its requests under a session key, so that other
rows' allocations do not evict them while its tool runs. Pins are the first to go when space runs short (the least
recently pinned first), hold at most half the pool, and go with the index when the weights change.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a block pool needs >= 2 blocks of >= 1 position, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is scratch, never handed out
        self.index: dict[bytes, int] = {}  # key of a token prefix -> its last full block
        self.key_of: dict[int, bytes] = {}  # block -> its key, for the blocks in the index
        self.idle: OrderedDict[int, None] = OrderedDict()  # indexed blocks nobody holds, least recently used first
        self.pins: OrderedDict[str, list[int]] = OrderedDict()  # session -> the blocks held for it, oldest first

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def reclaimable(self) -> int:
        """What `allocate` can hand out: the available blocks and those only sessions' pins hold."""
        pinned: dict[int, int] = {}
        for blocks in self.pins.values():
            for block in blocks:
                pinned[block] = pinned.get(block, 0) + 1
        return self.available() + sum(1 for block, holds in pinned.items() if self.refs[block] == holds)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one holder: free ones first, then the least recently used indexed ones (sessions
        unpinned, the oldest first, if that is not enough)."""
        while count > self.available() and self.pins:
            self.release(self.pins.popitem(last=False)[1])
        if count > self.available():
            raise RuntimeError(f"the KV cache has {self.available()} free blocks, {count} asked for")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.idle.popitem(last=False)
                del self.index[self.key_of.pop(block)]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def hold(self, blocks: list[int]) -> None:
        """One more holder of each block (a row sharing them)."""
        for block in blocks:
            if self.refs[block] == 0:
                self.idle.pop(block, None)
            self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer of each block. A row's blocks go deepest first, so that the least recently used end of
        the idle list holds the ends of chains (evicting a chain's first block would strand the rest)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    def keys(self, tokens: list[int], num_blocks: int, known: list[bytes] = ()) -> list[bytes]:
        """The index keys of the first `num_blocks` full blocks of `tokens`: each a 128-bit digest of the previous
        key and the block's tokens, so equal keys mean equal prefixes. `known`: keys already made for a prefix of
        `tokens` (the rest is made from where they end)."""
        keys, size = list(known[:num_blocks]), self.block_size
        previous = keys[-1] if keys else b""
        for i in range(len(keys), num_blocks):
            previous = hashlib.blake2b(previous + array("q", tokens[i * size:(i + 1) * size]).tobytes(),
                                       digest_size=16).digest()
            keys.append(previous)
        return keys

    def lookup(self, tokens: list[int], limit: int, known: list[bytes] = ()) -> list[int]:
        """The indexed blocks that hold the longest prefix of `tokens` of at most `limit` positions (whole
        blocks), held for the caller (`release` them with the rest). `known`: as `keys`."""
        found = self._indexed(tokens, limit, known)
        self.hold(found)  # (out of the idle list; back in it, as the most recently used, on release)
        return found

    def match(self, tokens: list[int], limit: int, known: list[bytes] = ()) -> int:
        """How many blocks `lookup` would find now (nothing held)."""
        return len(self._indexed(tokens, limit, known))

    def _indexed(self, tokens: list[int], limit: int, known: list[bytes] = ()) -> list[int]:
        found = []
        for key in self.keys(tokens, min(limit, len(tokens)) // self.block_size, known):
            block = self.index.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, tokens: list[int], blocks: list[int], written: int, known: list[bytes] = ()) -> None:
        """Indexes the full blocks among the first `written` positions of a row holding `blocks` for `tokens`
        (a prefix already indexed keeps its block). `known`: as `keys`."""
        for key, block in zip(self.keys(tokens, written // self.block_size, known), blocks):
            if key not in self.index and block not in self.key_of:
                self.index[key] = block
                self.key_of[block] = key

    def pin(self, session: str, tokens: list[int]) -> int:
        """Holds the indexed blocks of `tokens`' longest cached prefix for `session` (in place of its last pin);
        returns how many."""
        blocks = self.lookup(tokens, len(tokens))
        self.unpin(session)
        self.pins[session] = blocks
        while sum(map(len, self.pins.values())) > self.num_blocks // 2:
            self.release(self.pins.popitem(last=False)[1])
        return len(self.pins.get(session, []))

    def unpin(self, session: str) -> None:
        self.release(self.pins.pop(session, []))

    def drop_holders(self) -> None:
        """Every block without a holder but the sessions' (a call starts: no row holds any, whatever a failed call
        left behind)."""
        self.refs = [0] * self.num_blocks
        self.free = sorted(set(range(1, self.num_blocks)).difference(self.key_of), reverse=True)
        self.idle = OrderedDict((b, None) for b in self.key_of)
        for blocks in self.pins.values():
            self.hold(blocks)

    def clear_index(self) -> None:
        """Forgets every prefix and session (the weights changed): idle blocks become free, held ones free on
        release."""
        for session in list(self.pins):
            self.unpin(session)
        self.free.extend(self.idle)
        self.idle.clear()
        self.index.clear()
        self.key_of.clear()


class SharedPrefixGroups:
    """Which decode slots read a shared prefix together (`decode_kernel`'s cascade): a group is up to `members`
    slots whose first `shared` cache entries are the same blocks (the n samples of a prompt, admitted together).
    Kept on the host; `push` writes it to the device tensors the decode step reads: `shared` (B,) the entries a
    slot's group reads for it (0: none), `groups` (num_groups, members) each live group's slots, -1 after them, in
    the first rows (the rows after them all -1; a group's row on the device is not its id here). A group
    that drops to one slot is dissolved (its slot reads its whole cache itself)."""

    def __init__(self, num_slots: int, members: int, shared: torch.Tensor, groups: torch.Tensor, block_size: int = 1):
        self.members, self.shared, self.groups, self.block_size = members, shared, groups, block_size
        self.of = [-1] * num_slots  # slot -> its group, -1: none
        self.length = [0] * num_slots  # slot -> shared entries
        self.slots: list[list[int]] = [[] for _ in range(groups.shape[0])]  # group -> its slots
        self.dirty = True

    def active(self) -> bool:
        return any(self.slots)

    def reset(self) -> None:
        self.of = [-1] * len(self.of)
        self.length = [0] * len(self.length)
        self.slots = [[] for _ in self.slots]
        self.dirty = True

    def add(self, slots: list[int], shared: int) -> None:
        """`slots` share their first `shared` entries, whole blocks (the kernel reads them unmasked): groups of up to
        `members` of them (a lone leftover none)."""
        if shared % self.block_size:
            raise ValueError(f"a shared prefix of {shared} entries is not whole blocks of {self.block_size}")
        if shared <= 0:
            return
        for i in range(0, len(slots), self.members):
            part = slots[i: i + self.members]
            if len(part) < 2:
                continue
            gid = self.slots.index([])  # (at most B / 2 groups of >= 2 slots: one is free)
            self.slots[gid] = list(part)
            for s in part:
                self.of[s], self.length[s] = gid, shared
            self.dirty = True

    def remove(self, slot: int) -> None:
        gid = self.of[slot]
        if gid < 0:
            return
        self.slots[gid].remove(slot)
        self.of[slot], self.length[slot] = -1, 0
        if len(self.slots[gid]) == 1:
            last = self.slots[gid].pop()
            self.of[last], self.length[last] = -1, 0
        self.dirty = True

    def move(self, src: int, dst: int) -> None:
        """The row in slot `src` now decodes in the empty slot `dst`."""
        gid = self.of[src]
        if gid < 0:
            return
        members = self.slots[gid]
        members[members.index(src)] = dst
        self.of[dst], self.length[dst] = gid, self.length[src]
        self.of[src], self.length[src] = -1, 0
        self.dirty = True

    def push(self) -> None:
        """The device copies, if anything changed since the last push (in place: graphs read their addresses)."""
        if not self.dirty:
            return
        rows = torch.full(tuple(self.groups.shape), -1, dtype=torch.long)
        for row, members in enumerate(m for m in self.slots if m):  # the live groups first: the kernel stops at the
            rows[row, : len(members)] = torch.tensor(members, dtype=torch.long)  # first empty row
        self.groups.copy_(rows)
        self.shared.copy_(torch.tensor(self.length, dtype=torch.long))
        self.dirty = False
