# The host side of a stage's paged KV cache (torch-free): which pool blocks each slot's sequence holds, in
# order (its block table), and how many holders each block has. A block holds BLOCK consecutive positions
# of one sequence. A block has one holder while its sequence writes it; a kept prompt prefix
# (stages/prefix_cache.py) adds the prefix cache and every sequence that starts with it as holders, and the
# block goes back to the free list when its last holder lets go. Shared blocks are always full and lie
# before every position their sequences write, so no write ever lands in one (nothing to copy on write).
# Block 0 is never handed out: table entries past a slot's blocks name it, so the padded positions of a
# bucketed step write there and nowhere that anyone reads unmasked.
from __future__ import annotations

from typing import Protocol

# Positions per block: the prefix index's block (core/prefix_index.py), so a kept prefix is a run of
# whole pool blocks shared by reference. 16 also keeps a sequence's unused tail under 16 positions
# (1.5 MiB of thinker K/V at most) and is the tile the decode kernel reads per block.
BLOCK = 16
NULL_BLOCK = 0


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


class OutOfBlocks(RuntimeError):
    pass


class Reclaimer(Protocol):
    """Holds blocks it can give back on demand (a prefix cache's kept blocks that no sequence holds)."""

    def reclaimable(self) -> int: ...
    def reclaim(self, blocks: int) -> None: ...  # lets go of up to that many of them


class BlockPool:
    def __init__(self, num_blocks: int, slots: int, max_blocks_per_slot: int):
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is the null block)")
        self.num_blocks, self.max_blocks = num_blocks, max_blocks_per_slot
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: lowest first
        # table entries changed since the device copy was last brought up to date: (slot, index, block);
        # index -1: the slot's row is reset to the null block
        self.dirty: list[tuple[int, int, int]] = []
        self.reclaimer: Reclaimer | None = None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def available_blocks(self) -> int:
        """Free blocks and those the reclaimer would give back."""
        return len(self._free) + (self.reclaimer.reclaimable() if self.reclaimer else 0)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def held(self, slot: int) -> int:
        return len(self.tables[slot])

    def needed(self, slot: int, tokens: int) -> int:
        """Blocks the slot still lacks to hold `tokens` positions."""
        return max(0, blocks_for(tokens) - len(self.tables[slot]))

    def grow(self, slot: int, tokens: int) -> None:
        """Gives the slot blocks for its first `tokens` positions; raises OutOfBlocks when the pool (or the
        slot's table) cannot hold them, taking none."""
        want = blocks_for(tokens)
        table = self.tables[slot]
        if want > self.max_blocks:
            raise OutOfBlocks(f"{tokens} positions exceed a sequence's {self.max_blocks * BLOCK}")
        if want - len(table) > len(self._free) and self.reclaimer is not None:
            self.reclaimer.reclaim(want - len(table) - len(self._free))
        if want - len(table) > len(self._free):
            raise OutOfBlocks(f"{want - len(table)} blocks wanted, {len(self._free)} free")
        while len(table) < want:
            block = self._free.pop()
            self.refs[block] = 1
            self.dirty.append((slot, len(table), block))
            table.append(block)

    def share(self, slot: int, blocks: list[int]) -> None:
        """The empty slot starts with these blocks (a kept prefix), as one more holder of each."""
        table = self.tables[slot]
        assert not table, "shared blocks start a sequence"
        for block in blocks:
            self.refs[block] += 1
            self.dirty.append((slot, len(table), block))
            table.append(block)

    def hold(self, block: int) -> None:
        """One more holder of a block a slot holds (the prefix cache keeping it)."""
        assert self.refs[block] > 0
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One holder fewer; the block is free once none is left."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def release(self, slot: int) -> None:
        """The slot's sequence lets go of all its blocks; its table row goes back to the null block."""
        table = self.tables[slot]
        if not table:
            return
        for block in table:
            self.drop(block)
        table.clear()
        self.dirty.append((slot, -1, NULL_BLOCK))

    def take_dirty(self) -> list[tuple[int, int, int]]:
        out, self.dirty = self.dirty, []
        return out
