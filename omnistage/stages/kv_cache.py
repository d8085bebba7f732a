# Static per-slot KV cache (gpt-fast style fixed buffers, but with a position per slot) and the small
# adapter that lets transformers' own decoder layers read and write it during a batched decode step.
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVTarget:
    """Where a step's new K/V go, for attention that writes them into the cache itself (fused_projections'
    qkv_into_cache): batch row b, position t of the step -> k[b, :, start + t (+ positions[b])]."""

    k: torch.Tensor  # [B', kv_heads, max_len, head_dim]; v alike, same strides
    v: torch.Tensor
    start: int
    positions: torch.Tensor | None  # [B] long, or None: every row writes from `start`


class SlotKVCache:
    """Per layer: k, v [slots, kv_heads, max_len, head_dim]. Row r of a decode batch is slot r.
    The layers are views of one tensor each for K and V ([layers, slots, ...]), so that a prompt's prefix
    moves between a slot and the prefix cache in one copy for all layers (stages/prefix_cache.py)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.slots, self.max_len = slots, max_len

    def load_prefill(self, slot: int, past_key_values, row: int = 0, length: int | None = None) -> int:
        """Copies row `row` of a transformers DynamicCache (from an eager prefill; right-padded when batched,
        so its first `length` positions) into `slot`; returns the length."""
        for i, layer in enumerate(past_key_values.layers):
            length = layer.keys.shape[2] if length is None else length
            self.k[i][slot, :, :length] = layer.keys[row, :, :length]
            self.v[i][slot, :, :length] = layer.values[row, :, :length]
        return length

    def step_view(self, rows: int, positions: torch.Tensor, kv_len: int) -> DecodeStepCache:
        return DecodeStepCache(self, rows, positions, kv_len)


class DecodeStepCache:
    """Duck-types transformers' Cache.update() for one decode step of rows [0, rows): each row's new K/V
    lands at its own position, and attention reads the first kv_len positions of every row (the caller
    masks positions beyond each row's length). Rows that are not decoding this step write at their next
    free position, which their next real step overwrites."""

    def __init__(self, cache: SlotKVCache, rows: int, positions: torch.Tensor, kv_len: int):
        self.cache, self.rows, self.kv_len = cache, rows, kv_len
        self.positions = positions  # [rows] long, on the cache device
        self.row_index = torch.arange(rows, device=positions.device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k[self.row_index, :, self.positions] = key_states[:, :, 0]  # [rows, kv_heads, head_dim]
        v[self.row_index, :, self.positions] = value_states[:, :, 0]
        return self.attended(layer_idx, 1)

    def kv_target(self, layer_idx: int, tokens: int) -> KVTarget:
        assert tokens == 1
        return KVTarget(self.cache.k[layer_idx], self.cache.v[layer_idx], 0, self.positions)

    def attended(self, layer_idx: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attention reads once this step's are in (update() or kv_target())."""
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        return k[: self.rows, :, : self.kv_len], v[: self.rows, :, : self.kv_len]


class LockstepCache:
    """Tiny cache for a batch that advances in lock-step from position 0 (the code predictor's 16-position
    loop): every row shares the same length, so no mask is needed beyond causality at prefill."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        t = key_states.shape[2]
        end = self.length + t
        self.k[layer_idx][:, :, self.length : end] = key_states
        self.v[layer_idx][:, :, self.length : end] = value_states
        return self.attended(layer_idx, t)

    def kv_target(self, layer_idx: int, tokens: int) -> KVTarget:
        return KVTarget(self.k[layer_idx], self.v[layer_idx], self.length, None)

    def attended(self, layer_idx: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + tokens
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t
