# Prefix cache of a stage's KV cache: K/V of block-aligned prompt prefixes kept in a device pool, so a prompt
# that starts like earlier ones (a shared system prompt: W1's TTS instructions are ~115 of its ~150 tokens)
# gets those positions copied into its slot and prefills only the rest (stages/chunk_prefill.py). Which
# blocks are kept is core/prefix_index.py's business; this file moves the tensors, one copy for all layers
# each way (SlotKVCache keeps its layers in one tensor for that).
from __future__ import annotations

import torch

from ..core.prefix_index import BLOCK, PrefixIndex, PrefixMatch
from .host_copy import to_device
from .kv_cache import SlotKVCache


class PrefixCache:
    def __init__(self, cache: SlotKVCache, budget_bytes: int):
        self.cache = cache
        layers, _, heads, _, head_dim = cache.k_all.shape
        block_bytes = 2 * layers * heads * BLOCK * head_dim * cache.k_all.element_size()
        capacity = int(budget_bytes // block_bytes)
        shape = (layers, capacity, heads, BLOCK, head_dim)
        self.k = torch.zeros(shape, dtype=cache.k_all.dtype, device=cache.k_all.device)
        self.v = torch.zeros_like(self.k)
        self.index = PrefixIndex(capacity)
        # pool entry -> the accept layer's hidden rows [n, D] of the media rows in that block (prompts with
        # media that feed a talker need them for its conditioning; K/V alone do not give them back)
        self.media_rows: dict[int, torch.Tensor] = {}
        self.hit_tokens = 0  # prompt tokens served from the pool, over all prefills
        self.prompt_tokens = 0  # prompt tokens of the prompts looked up

    def match(self, ids: list[int], salts: dict[int, bytes] | None = None) -> PrefixMatch:
        found = self.index.match(ids, salts)
        self.prompt_tokens += len(ids)
        return found

    def load(self, slot: int, found: PrefixMatch) -> None:
        """Copies the kept prefix into positions [0, found.tokens) of the slot."""
        if not found.entries:
            return
        self.hit_tokens += found.tokens
        entries = to_device(found.entries, self.k.device)
        for pool, slots in ((self.k, self.cache.k_all), (self.v, self.cache.v_all)):
            blocks = pool.index_select(1, entries)  # [layers, n, heads, BLOCK, head_dim]
            layers, n, heads, _, head_dim = blocks.shape
            slots[:, slot, :, : n * BLOCK] = blocks.transpose(1, 2).reshape(layers, heads, n * BLOCK, head_dim)

    def store(self, slot: int, found: PrefixMatch, media_rows: dict[int, torch.Tensor] | None = None,
              first_sighting: bool = False) -> None:  # fmt: skip
        """After the prompt's prefill: copies the blocks the index admits from the slot into the pool.
        media_rows: block number -> its media rows' accept-layer hidden states, kept with the block;
        first_sighting: keep the blocks from their first prompt on (PrefixIndex.admit)."""
        admitted = self.index.admit(found, first_sighting)
        if not admitted:
            return
        for number, entry in admitted:  # an entry taken over from an evicted block drops that block's rows
            rows = media_rows.get(number) if media_rows else None
            if rows is None:
                self.media_rows.pop(entry, None)
            else:
                self.media_rows[entry] = rows
        numbers, entries = to_device([[n for n, _ in admitted], [e for _, e in admitted]], self.k.device)
        end = (max(n for n, _ in admitted) + 1) * BLOCK
        for pool, slots in ((self.k, self.cache.k_all), (self.v, self.cache.v_all)):
            layers, _, heads, _, head_dim = slots.shape
            blocks = slots[:, slot, :, :end].reshape(layers, heads, end // BLOCK, BLOCK, head_dim).transpose(1, 2)
            pool.index_copy_(1, entries, blocks.index_select(1, numbers))
