# How many KV-cache slots a stage instance gets: max_batch_size, or fewer where the memory given to the KV
# cache cannot hold that many slots of max_seq_len tokens. The budget is either explicit (kv_cache_bytes,
# any device) or a fraction of the GPU memory still free once the weights are loaded
# (kv_cache_memory_fraction): the rest of that free memory stays for activations, CUDA graphs and
# Triton's tensor pools. Without either, max_batch_size holds as configured.
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


def kv_bytes_per_slot(text_config, max_seq_len: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one slot of max_seq_len positions (SlotKVCache's layout)."""
    per_position = 2 * text_config.num_hidden_layers * text_config.num_key_value_heads * text_config.head_dim
    return per_position * max_seq_len * dtype.itemsize


def free_device_bytes(device: torch.device, memory_fraction: float | None = None) -> int:
    """What this process can still allocate on its GPU: the device's free memory, within its share of the
    GPU where a deploy profile gave one (memory_fraction)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    # the caching allocator's cached blocks are free to this process but not counted free by the driver
    free += torch.cuda.memory_reserved(device) - allocated
    cap = (memory_fraction or 1.0) * total - allocated
    return int(max(0, min(free, cap)))


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


def kv_budget_bytes(params: dict[str, str], device: torch.device) -> int | None:
    """The stage parameters' KV budget in bytes, or None without one."""
    if params.get("kv_cache_bytes"):
        return int(params["kv_cache_bytes"])
    fraction = params.get("kv_cache_memory_fraction")
    if not fraction:
        return None
    if device.type != "cuda":
        log.warning("kv_cache_memory_fraction applies to GPUs only: ignored on %s", device)
        return None
    share = float(params["memory_fraction"]) if params.get("memory_fraction") else None
    # the thinker's prefix-cache pool is allocated next to the KV cache: the fraction is of what it leaves
    pool = int(params.get("prefix_cache_bytes") or 0)
    return int(float(fraction) * max(0, free_device_bytes(device, share) - pool))
