# Prefix cache of a stage's paged KV cache: blocks of block-aligned prompt prefixes kept by reference, so a
# prompt that starts like earlier ones (a shared system prompt: W1's TTS instructions are ~115 of its ~150
# tokens; a conversation's earlier turns) starts its slot's block table with those very blocks and
# prefills only the rest (stages/chunk_prefill.py). Nothing is copied either way: keeping a block makes the
# cache one more holder of it (core/block_pool.py), taking a kept prefix makes the sequence one. Kept blocks
# are full and lie before the first position their sequences write, so they are never written again.
# Which blocks are kept is core/prefix_index.py's business.
from __future__ import annotations

import torch

from ..core.prefix_index import PrefixIndex, PrefixMatch
from .paged_kv import PagedKVCache


class PrefixCache:
    def __init__(self, cache: PagedKVCache, budget_bytes: int):
        """budget_bytes: at most this much of the pool holds kept prefixes."""
        self.cache = cache
        self.index = PrefixIndex(int(budget_bytes // cache.block_bytes))
        # pool block -> the accept layer's hidden rows [n, D] of the media rows in that block (prompts with
        # media that feed a talker need them for its conditioning; K/V alone do not give them back)
        self.media_rows: dict[int, torch.Tensor] = {}
        self.hit_tokens = 0  # prompt tokens served from the pool, over all prefills
        self.prompt_tokens = 0  # prompt tokens of the prompts looked up
        cache.pool.reclaimer = self  # kept blocks no sequence holds go back when the pool runs short

    def reclaimable(self) -> int:
        refs = self.cache.pool.refs
        return sum(1 for b in self.index.blocks() if refs[b] == 1)

    def reclaim(self, blocks: int) -> None:
        pool = self.cache.pool
        alone = [b for b in self.index.blocks() if pool.refs[b] == 1][:blocks]  # least recently used first
        self.index.forget(set(alone))
        for block in alone:
            self.media_rows.pop(block, None)
            pool.drop(block)

    @property
    def blocks(self) -> int:
        """Pool blocks the cache keeps."""
        return len(self.index)

    def match(self, ids: list[int], salts: dict[int, bytes] | None = None) -> PrefixMatch:
        found = self.index.match(ids, salts)
        self.prompt_tokens += len(ids)
        return found

    def peek(self, ids: list[int]) -> PrefixMatch:
        """The kept prefix a prompt would take now (PrefixIndex.peek), counting nothing."""
        return self.index.peek(ids)

    def load(self, slot: int, found: PrefixMatch) -> None:
        """The slot's table starts with the kept prefix's blocks (positions [0, found.tokens)); found is cut
        to the blocks still kept (a prompt of the same step may have evicted some since the match)."""
        del found.entries[self.index.kept_run(found):]
        if not found.entries:
            return
        self.hit_tokens += found.tokens
        self.cache.release(slot)
        self.cache.pool.share(slot, found.entries)

    def store(self, slot: int, found: PrefixMatch, media_rows: dict[int, torch.Tensor] | None = None,
              first_sighting: bool = False) -> None:  # fmt: skip
        """After the prompt's prefill: keeps the blocks of the slot that the index admits.
        media_rows: block number -> its media rows' accept-layer hidden states, kept with the block;
        first_sighting: keep the blocks from their first prompt on, on probation (PrefixIndex.admit)."""
        pool = self.cache.pool
        admitted, evicted = self.index.admit(found, pool.tables[slot], first_sighting)
        for block in evicted:
            self.media_rows.pop(block, None)
            pool.drop(block)
        for number, block in admitted:
            pool.hold(block)
            rows = media_rows.get(number) if media_rows else None
            if rows is not None:
                self.media_rows[block] = rows
