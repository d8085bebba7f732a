# How many KV-cache slots a stage instance gets: max_batch_size, or fewer where the memory given to the KV
# cache (kv_cache_bytes) cannot hold that many slots of max_seq_len tokens. Without a budget,
# max_batch_size holds as configured.
from __future__ import annotations

from dataclasses import dataclass

import torch


def kv_bytes_per_slot(text_config, max_seq_len: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one slot of max_seq_len positions (SlotKVCache's layout)."""
    per_position = 2 * text_config.num_hidden_layers * text_config.num_key_value_heads * text_config.head_dim
    return per_position * max_seq_len * dtype.itemsize


@dataclass(frozen=True)
class KVPlan:
    slots: int
    per_slot_bytes: int
    budget_bytes: int | None  # None: no budget given, max_batch_size as configured

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.per_slot_bytes


def plan_slots(max_slots: int, per_slot_bytes: int, budget_bytes: int | None) -> KVPlan:
    if budget_bytes is None:
        return KVPlan(max_slots, per_slot_bytes, None)
    fits = budget_bytes // per_slot_bytes
    if fits < 1:
        raise ValueError(f"the KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no slot of "
                         f"{per_slot_bytes / 2**20:.1f} MiB: raise the budget or lower max_seq_len")  # fmt: skip
    return KVPlan(min(max_slots, fits), per_slot_bytes, budget_bytes)


def kv_budget_bytes(params: dict[str, str]) -> int | None:
    """The stage parameters' KV budget in bytes, or None without one."""
    return int(params["kv_cache_bytes"]) if params.get("kv_cache_bytes") else None
