# A stage's paged KV cache: one pool of fixed-size blocks for all of its sequences (core/block_pool.py
# decides which block holds what), and on the device a block table per slot, [slots, max_blocks] int32, a
# static buffer so that CUDA graphs take it as an input. A slot stays the batch row of a sequence; what it
# holds is as many blocks as its sequence's context needs, up to max_len positions.
# Layout: per layer k, v [num_blocks * BLOCK, kv_heads, head_dim], position-major, so that a position's
# address is block * BLOCK + offset and every writer scatters rows to "physical positions"
# (phys = table[slot, pos // BLOCK] * BLOCK + pos % BLOCK). Readers either gather a row's blocks into
# [rows, kv_heads, L, head_dim] and attend with a mask (the CPU path and the reference), or, for a CUDA
# decode step, run models/paged_attention.py's kernel over each row's own blocks.
from __future__ import annotations

import torch

from ..core.block_pool import BLOCK, NULL_BLOCK, BlockPool, blocks_for
from .host_copy import to_device


def block_bytes(text_config, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of BLOCK positions."""
    t = text_config
    return 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * BLOCK * dtype.itemsize


class PagedKVCache:
    """k, v: per layer [num_blocks * BLOCK, kv_heads, head_dim] views of k_all, v_all
    [layers, num_blocks * BLOCK, kv_heads, head_dim]; table [slots, max_blocks] int32 on the device."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, *, num_blocks: int, max_len: int,
                 dtype, device):  # fmt: skip
        self.max_len = max_len  # positions per sequence (its context), not the pool's size
        self.max_blocks = blocks_for(max_len)
        self.pool = BlockPool(num_blocks, slots, self.max_blocks)
        shape = (layers, num_blocks * BLOCK, kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.table = torch.full((slots, self.max_blocks), NULL_BLOCK, dtype=torch.int32, device=device)
        self.slots, self.kv_heads, self.head_dim = slots, kv_heads, head_dim

    @property
    def device(self) -> torch.device:
        return self.k_all.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_all.dtype

    @property
    def bytes(self) -> int:
        return 2 * self.k_all.numel() * self.k_all.element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes // self.pool.num_blocks

    # ---- blocks ------------------------------------------------------------------------------------------
    def grow(self, slot: int, tokens: int) -> None:
        """The slot holds blocks for its first `tokens` positions (more from the pool where it lacks them)."""
        self.pool.grow(slot, tokens)

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    def sync(self) -> None:
        """Brings the device block tables up to date with the pool's (before a step reads them)."""
        dirty = self.pool.take_dirty()
        if not dirty:
            return
        resets = sorted({s for s, i, _ in dirty if i < 0})
        # a row reset after entries were set drops them; entries set after a reset stay
        last_reset = {s: n for n, (s, i, _) in enumerate(dirty) if i < 0}
        sets = [(s, i, b) for n, (s, i, b) in enumerate(dirty) if i >= 0 and n > last_reset.get(s, -1)]
        if resets:
            self.table[to_device(resets, self.device)] = NULL_BLOCK
        if sets:
            index = to_device([[s for s, _, _ in sets], [i for _, i, _ in sets], [b for _, _, b in sets]], self.device)
            self.table[index[0], index[1]] = index[2].to(torch.int32)

    # ---- addressing --------------------------------------------------------------------------------------
    def physical(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """slots [R] long, positions [R, T] long -> [R, T] long rows of the per-layer k, v. Positions past a
        slot's blocks map into the null block."""
        blocks = self.table[slots[:, None], positions // BLOCK].long()
        return blocks * BLOCK + positions % BLOCK

    def write(self, layer: int, phys: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states/value_states [R, kv_heads, T, head_dim] to the physical positions phys [R, T]."""
        where = phys.reshape(-1)
        heads, dim = self.kv_heads, self.head_dim
        self.k[layer].index_copy_(0, where, key_states.transpose(1, 2).reshape(-1, heads, dim))
        self.v[layer].index_copy_(0, where, value_states.transpose(1, 2).reshape(-1, heads, dim))

    def gather(self, layer: int, slots: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n_blocks blocks of each slot's table as [R, kv_heads, n_blocks * BLOCK, head_dim]."""
        rows = slots.shape[0]
        blocks = self.table[slots, :n_blocks].long()  # [R, n]
        out = []
        for pool in (self.k[layer], self.v[layer]):
            by_block = pool.view(-1, BLOCK, self.kv_heads, self.head_dim)[blocks]  # [R, n, BLOCK, H, D]
            out.append(by_block.reshape(rows, n_blocks * BLOCK, self.kv_heads, self.head_dim).transpose(1, 2))
        return out[0], out[1]

    def read(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slot's first `length` positions, per layer [1, kv_heads, length, head_dim] (K, then V): what
        the tests compare against a reference's cache."""
        self.sync()
        slots = torch.tensor([slot], device=self.device)
        n = blocks_for(length)
        pairs = [self.gather(layer, slots, n) for layer in range(len(self.k))]
        return [k[:, :, :length] for k, _ in pairs], [v[:, :, :length] for _, v in pairs]

    def step_view(self, rows: int, positions: torch.Tensor, kv_len: int, mask: torch.Tensor | None) -> DecodeStepCache:
        return DecodeStepCache(self, rows, positions, kv_len, mask)


class DecodeStepCache:
    """Duck-types transformers' Cache.update() for one decode step of rows [0, rows) (row r is slot r): each
    row's new K/V land at its own position; attention reads each row's blocks through its table, either in
    the paged decode kernel (attend(), CUDA) or gathered up to kv_len positions under `mask`. Rows that are
    not decoding this step write at their next free position, which their next real step overwrites."""

    def __init__(self, cache: PagedKVCache, rows: int, positions: torch.Tensor, kv_len: int,
                 mask: torch.Tensor | None):  # fmt: skip
        self.cache, self.rows, self.kv_len, self.mask = cache, rows, kv_len, mask
        self.positions = positions  # [rows] long, on the cache device
        self.lengths = positions + 1  # what each row attends to: one kernel per step, not one per layer
        self.row_index = torch.arange(rows, device=positions.device)
        self.phys = cache.physical(self.row_index, positions[:, None])  # [rows, 1]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.cache.write(layer_idx, self.phys, key_states, value_states)
        return self.attended(layer_idx, 1)

    def kv_target(self, layer_idx: int, tokens: int):
        from .kv_cache import KVTarget

        assert tokens == 1
        return KVTarget.paged(self.cache.k[layer_idx], self.cache.v[layer_idx], self.phys)

    def attended(self, layer_idx: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.gather(layer_idx, self.row_index, blocks_for(self.kv_len))

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """Attention of the step's queries [rows, heads, 1, head_dim] over each row's own blocks up to its
        position, as [rows, 1, heads, head_dim]; None where the kernel does not run (the caller gathers)."""
        from ..models import paged_attention

        if not paged_attention.runs_on(query):
            return None
        return paged_attention.decode(query, self.cache.k[layer_idx], self.cache.v[layer_idx], self.cache.table,
                                      self.lengths, scaling)  # fmt: skip


class PagedWriter:
    """Duck-types transformers' Cache.update() for a prefill: row r's new K/V go to positions[r] of slot
    slots[r]. kv_len None: attention reads the new tokens only (a prompt from position 0); else each row's
    positions up to each token's own through its table (a suffix after a kept prefix, or a piece of a long
    prompt): in the paged prefill kernel (attend(), CUDA), or gathered up to kv_len under the caller's mask."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, positions: torch.Tensor, kv_len: int | None):
        self.cache, self.slots, self.kv_len = cache, slots, kv_len
        self.starts = positions[:, 0].contiguous()  # [rows]: each row's tokens are consecutive from here
        self.phys = cache.physical(slots, positions)  # [rows, tokens]
        from ..models import paged_attention

        self.paged = kv_len is not None and paged_attention.serves(cache.device)

    def kv_target(self, layer_idx: int, tokens: int):
        """Where the paged kernel's layers write K/V themselves (None: through update())."""
        from .kv_cache import KVTarget

        return KVTarget.paged(self.cache.k[layer_idx], self.cache.v[layer_idx], self.phys) if self.paged else None

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The rows' queries [rows, heads, tokens, head_dim] over their slots, causally -> [rows, tokens, heads,
        head_dim]; asked only where kv_target() gave a target."""
        from ..models import paged_attention

        return paged_attention.prefill(query, self.cache.k[layer_idx], self.cache.v[layer_idx], self.cache.table,
                                       self.slots, self.starts, scaling)  # fmt: skip

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.paged:  # no mask was built: what it would return is read without the rows' causal limit
            raise RuntimeError("a paged prefill attends in the fused attention (models/fused.py install())")
        self.cache.write(layer_idx, self.phys, key_states, value_states)
        if self.kv_len is None:
            return key_states, value_states
        return self.cache.gather(layer_idx, self.slots, blocks_for(self.kv_len))
