# Where attention that writes K/V into a cache itself (fused_projections' qkv_into_cache) puts them, and the
# code predictor's tiny lock-step cache. The thinker's and talker's caches are paged (stages/paged_kv.py).
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVTarget:
    """Where a step's new K/V go: batch row b, position t of the step -> k[b, :, start + t (+ positions[b])]
    of a dense [B', kv_heads, max_len, head_dim] cache, or, for a paged pool [P, kv_heads, head_dim]
    (k, v viewed as [1, kv_heads, P, head_dim]), its row phys[b, t]."""

    k: torch.Tensor  # v alike, same strides
    v: torch.Tensor
    start: int
    positions: torch.Tensor | None  # [B] long, or None: every row writes from `start`
    phys: torch.Tensor | None = None  # [B, T] long: paged pool rows (start and positions unused)

    @classmethod
    def paged(cls, k: torch.Tensor, v: torch.Tensor, phys: torch.Tensor) -> KVTarget:
        """k, v [P, kv_heads, head_dim] pool views of one layer."""
        return cls(k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0, None, phys)


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
