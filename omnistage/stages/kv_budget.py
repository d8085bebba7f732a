# How many blocks a stage's paged KV pool gets (stages/paged_kv.py): the profile's kv_cache_bytes over the
# bytes of one block, plus the null block. Without a budget, as many as max_batch_size sequences of
# max_seq_len tokens take. The pool has room for at least one sequence of max_seq_len.
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.block_pool import BLOCK, blocks_for


def kv_bytes_per_token(text_config, dtype: torch.dtype) -> int:
    """K and V of every layer for one position."""
    t = text_config
    return 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVPlan:
    slots: int  # sequences decoded together (max_batch_size)
    blocks: int  # pool blocks, the null block included
    block_bytes: int
    budget_bytes: int | None  # None: no budget given

    @property
    def cache_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        """Positions the pool holds for sequences (the null block is nobody's)."""
        return (self.blocks - 1) * BLOCK


def plan_pool(text_config, dtype: torch.dtype, slots: int, max_seq_len: int, budget_bytes: int | None) -> KVPlan:
    block_bytes = kv_bytes_per_token(text_config, dtype) * BLOCK
    # one sequence of max_seq_len and the position its last step writes must fit, or it would wait forever
    least = blocks_for(max_seq_len + 1)
    usable = budget_bytes // block_bytes if budget_bytes is not None else max(least, slots * blocks_for(max_seq_len))
    if usable < least:
        raise ValueError(f"the KV cache budget of {budget_bytes / 2**20:.1f} MiB holds {usable * BLOCK} tokens, "
                         f"less than one sequence of max_seq_len {max_seq_len}: raise the budget or lower "
                         "max_seq_len")  # fmt: skip
    return KVPlan(slots, usable + 1, block_bytes, budget_bytes)


def kv_budget_bytes(params: dict[str, str]) -> int | None:
    """The stage parameters' KV budget in bytes, or None without one."""
    return int(params["kv_cache_bytes"]) if params.get("kv_cache_bytes") else None
