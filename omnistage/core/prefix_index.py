# Which block-aligned prompt prefixes have their K/V kept by a stage's prefix cache, and in which block of
# the stage's paged KV pool (torch-free; stages/prefix_cache.py holds the blocks). A block is BLOCK consecutive prompt
# tokens; it is named by a digest of its tokens chained to its predecessor's name, so a name stands for the
# whole prefix up to the block's end.
# Keep policy, a segmented LRU over one capacity: blocks that proved their reuse (matched by a later prompt,
# or seen in two prompts) are protected; blocks kept on their first sighting (long prompts, so that a
# conversation's next turn finds its earlier turns; prompts with media, whose encoders cost too much to run
# twice) wait on probation until a prompt matches them. A probationary block only ever evicts probationary
# ones, so a burst of unrelated long prompts (W2's 2500 tokens) churns the probation and leaves the shared
# prefixes alone; the protected segment holds at most PROTECTED_SHARE of the capacity (its least recently
# used beyond that go back on probation), so new conversations always find room. Short prompts keep their
# blocks on their second sighting only: a W1 prompt's unique tail (its user sentence) costs a digest on the
# host and never a pool block.
# Media placeholder ids say only how many rows an image or clip takes, not what it shows: a prompt with media
# passes `salts`, a digest of each item's decoded content folded into the block where the item starts, so
# two clips of one length name different blocks from there on (and, by the chain, every block after).
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .block_pool import BLOCK

# The protected segment's most of the capacity: the rest always takes first sightings, so that a
# conversation's turn is found by its next one however many shared prefixes proved their worth.
PROTECTED_SHARE = 0.75


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
        self._protected_max = int(capacity * PROTECTED_SHARE)
        # name -> pool block, least recently used first
        self._protected: OrderedDict[bytes, int] = OrderedDict()
        self._probation: OrderedDict[bytes, int] = OrderedDict()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # sightings of blocks not kept (bounded)
        self._max_seen = max(1024, 8 * capacity)

    def __len__(self) -> int:
        return len(self._protected) + len(self._probation)

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

    def _get(self, name: bytes) -> int | None:
        block = self._protected.get(name)
        return self._probation.get(name) if block is None else block

    def peek(self, ids: list[int], salts: dict[int, bytes] | None = None) -> PrefixMatch:
        """The longest kept prefix, as match() finds it, changing nothing (a prompt still waiting)."""
        names, entries = self.names(ids, salts), []
        for name in names:
            entry = self._get(name)
            if entry is None:
                break
            entries.append(entry)
        return PrefixMatch(names, entries)

    def match(self, ids: list[int], salts: dict[int, bytes] | None = None) -> PrefixMatch:
        """The longest kept prefix of a prompt that takes it: its blocks are protected from now on."""
        found = self.peek(ids, salts)
        # the prefix's first block ends the most recently used: a prefix is cut back from its end
        for name, entry in reversed(list(zip(found.names, found.entries))):
            self._probation.pop(name, None)
            self._protect(name, entry)
        return found

    def blocks(self) -> list[int]:
        """The kept pool blocks, those to let go of first first: probation, then protected, each least
        recently used first."""
        return list(self._probation.values()) + list(self._protected.values())

    def forget(self, blocks: set[int]) -> None:
        """Stops keeping these pool blocks."""
        for segment in (self._probation, self._protected):
            for name in [n for n, b in segment.items() if b in blocks]:
                del segment[name]

    def kept_run(self, match: PrefixMatch) -> int:
        """How many of the match's leading blocks are still kept as matched."""
        n = 0
        while n < len(match.entries) and self._get(match.names[n]) == match.entries[n]:
            n += 1
        return n

    def admit(self, match: PrefixMatch, blocks: list[int], first_sighting: bool = False
              ) -> tuple[list[tuple[int, int]], list[int]]:  # fmt: skip
        """Counts a sighting of each of the prompt's blocks past its kept prefix; those seen admit_after times
        are protected, and with first_sighting every one goes on probation (see the header), as long as every
        block before them is kept too (a block is no use without its predecessors). blocks: the prompt's
        pool blocks, in order. Returns the (block number, pool block) pairs kept now and the pool blocks
        evicted: the caller holds the first and lets go of the second."""
        admitted, evicted, chained = [], [], self.capacity > 0
        mine = set(blocks)
        for number in range(len(match.entries), len(match.names)):
            name = match.names[number]
            if self._get(name) is not None:
                continue  # kept meanwhile, by an earlier prompt of the same step
            if first_sighting:  # evicts neither protected blocks nor the prompt's own, kept just now
                oldest = next(iter(self._probation.values()), None)
                if chained and len(self) >= self.capacity and oldest is not None and oldest not in mine:
                    evicted.append(self._probation.popitem(last=False)[1])
                chained = chained and len(self) < self.capacity
                if chained:
                    self._probation[name] = blocks[number]
                    admitted.append((number, blocks[number]))
                continue
            seen = self._seen.pop(name, 0) + 1
            if not chained or seen < self.admit_after:
                chained = False
                self._seen[name] = seen
                continue
            if len(self) >= self.capacity:
                segment = self._probation or self._protected
                evicted.append(segment.popitem(last=False)[1])
            self._protect(name, blocks[number])
            admitted.append((number, blocks[number]))
        while len(self._seen) > self._max_seen:
            self._seen.popitem(last=False)
        return admitted, evicted

    def _protect(self, name: bytes, block: int) -> None:
        """The block is protected (most recently used); the protected blocks beyond their share go back on
        probation, as its most recently used."""
        self._protected[name] = block
        self._protected.move_to_end(name)
        while len(self._protected) > self._protected_max:
            demoted, entry = self._protected.popitem(last=False)
            self._probation[demoted] = entry
