# StaticPrefill for prompts whose MRoPE positions are not 0..L-1 on every section (prompts from media turns:
# image and video rows take 2D/3D positions, and the text after them is shifted by the rope delta): each
# prompt's positions [3, L] go into a static buffer beside its embeddings, so one graph per (rows, tokens)
# bucket serves any mix of text and media prompts. Padding rows repeat row 0 (see static_prefill.py);
# positions past a prompt are 0 (their K/V are overwritten by its decode steps before anything reads them).
from __future__ import annotations

import torch

from .host_copy import to_device
from .paged_kv import PagedKVCache
from .static_prefill import StaticPrefill


class PositionedPrefill(StaticPrefill):
    def __init__(self, name: str, text_model, cache: PagedKVCache, *, max_rows: int, max_tokens: int,
                 cuda_graphs: bool):  # fmt: skip
        super().__init__(name, text_model, cache, max_rows=max_rows, max_tokens=max_tokens, cuda_graphs=cuda_graphs)
        rows, tokens, _ = self.embeds.shape
        self.positions = torch.zeros(3, rows, tokens, dtype=torch.long, device=self.embeds.device)

    def run(self, embeds: list[torch.Tensor], slots: list[int], positions: list[torch.Tensor]) -> torch.Tensor:
        """StaticPrefill.run, each prompt at its own positions ([3, L_i] on the host)."""
        rows, tokens = self.shape_for(len(embeds), max(e.shape[0] for e in embeds))
        self.load_positions(positions, rows, tokens)
        return super().run(embeds, slots)

    def load_positions(self, positions: list[torch.Tensor], rows: int, tokens: int) -> None:
        """Prompt i's positions (host) into row i of the buffer in one copy, padding rows repeating row 0."""
        host = torch.zeros(3, rows, tokens, dtype=torch.long)
        for i, p in enumerate(positions):
            host[:, i, : p.shape[1]] = p
        host[:, len(positions) :] = host[:, :1]
        self.positions[:, :rows, :tokens].copy_(to_device(host, self.positions.device))

    def _positions(self, rows: int, tokens: int) -> torch.Tensor:
        return self.positions[:, :rows, :tokens]
