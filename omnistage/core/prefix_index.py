# Which block-aligned prompt prefixes have their K/V kept by a stage's prefix cache, and in which block of
# the stage's paged KV pool (torch-free; stages/prefix_cache.py holds the blocks). A block is BLOCK consecutive prompt
# tokens; it is named by a digest of its tokens chained to its predecessor's name, so a name stands for the
# whole prefix up to the block's end. Blocks are admitted on their second sighting: a prompt's unique tail
# (W1's user sentence) costs a digest on the host, never a device copy, while a shared system prompt is
# kept from its second request on. Entries are evicted least recently used first.
# Media placeholder ids say only how many rows an image or clip takes, not what it shows: a prompt with media
# passes `salts`, a digest of each item's decoded content folded into the block where the item starts, so
# two clips of one length name different blocks from there on (and, by the chain, every block after).
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .block_pool import BLOCK


@dataclass
class PrefixMatch:
    names: list[bytes]  # the prompt's cacheable blocks (at most (L - 1) // BLOCK: one token is always computed)
    entries: list[int]  # pool blocks of its longest kept prefix: blocks 0 .. len(entries) - 1

    @property
    def tokens(self) -> int:
        return len(self.entries) * BLOCK


class PrefixIndex:
    """capacity: how many pool blocks the index keeps at most."""

    def __init__(self, capacity: int, admit_after: int = 2):
        self.capacity = capacity
        self.admit_after = admit_after
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # name -> pool block, least recently used first
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # sightings of blocks not kept (bounded)
        self._max_seen = max(1024, 8 * capacity)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def names(ids: list[int], salts: dict[int, bytes] | None = None) -> list[bytes]:
        """salts: block number -> digest of the media items starting in that block."""
        out, previous = [], b""
        for start in range(0, len(ids) - 1 - (len(ids) - 1) % BLOCK, BLOCK):
            block = array("q", ids[start : start + BLOCK]).tobytes()
            salt = salts.get(start // BLOCK, b"") if salts else b""
            previous = hashlib.blake2b(previous + block + salt, digest_size=16).digest()
            out.append(previous)
        return out

    def match(self, ids: list[int], salts: dict[int, bytes] | None = None) -> PrefixMatch:
        names = self.names(ids, salts)
        entries = []
        for name in names:
            entry = self._entries.get(name)
            if entry is None:
                break
            self._entries.move_to_end(name)
            entries.append(entry)
        return PrefixMatch(names, entries)

    def blocks(self) -> list[int]:
        """The kept pool blocks, least recently used first."""
        return list(self._entries.values())

    def forget(self, blocks: set[int]) -> None:
        """Stops keeping these pool blocks."""
        for name in [n for n, b in self._entries.items() if b in blocks]:
            del self._entries[name]

    def kept_run(self, match: PrefixMatch) -> int:
        """How many of the match's leading blocks are still kept as matched."""
        n = 0
        while n < len(match.entries) and self._entries.get(match.names[n]) == match.entries[n]:
            n += 1
        return n

    def admit(self, match: PrefixMatch, blocks: list[int], first_sighting: bool = False
              ) -> tuple[list[tuple[int, int]], list[int]]:  # fmt: skip
        """Counts a sighting of each of the prompt's blocks past its kept prefix; those seen admit_after times
        (once with first_sighting: prompts with media, whose encoders and prefill cost too much to run twice)
        are kept (evicting the least recently used beyond capacity) as long as every block before them is
        kept too (a block is no use without its predecessors). blocks: the prompt's pool blocks, in order.
        Returns the (block number, pool block) pairs kept now and the pool blocks evicted: the caller holds
        the first and lets go of the second."""
        admit_after = 1 if first_sighting else self.admit_after
        admitted, evicted, chained = [], [], self.capacity > 0
        for number in range(len(match.entries), len(match.names)):
            name = match.names[number]
            if name in self._entries:
                continue  # kept meanwhile, by an earlier prompt of the same step
            seen = self._seen.pop(name, 0) + 1
            if not chained or seen < admit_after:
                chained = False
                self._seen[name] = seen
                continue
            if len(self._entries) >= self.capacity:
                evicted.append(self._entries.popitem(last=False)[1])
            self._entries[name] = blocks[number]
            admitted.append((number, blocks[number]))
        while len(self._seen) > self._max_seen:
            self._seen.popitem(last=False)
        return admitted, evicted
