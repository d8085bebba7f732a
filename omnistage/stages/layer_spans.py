# The thinker's decoder layers as its prefills with media rows run them: cut into spans at the points where
# the residual stream is touched from outside. After each of the first len(deepstack) layers the vision
# encoder's deepstack features are added at image and video rows (a dense add over a static buffer that is
# zero elsewhere, so it is the same work on every replay of a graph), and the stream entering the accept
# layer is kept for the talker's conditioning on media rows. Without deepstack layers or an accept layer
# (the talker, text-only steps) it is one span over all layers. MediaPrefill and ChunkPrefill (and so
# LongPrefill) run their layers through here: one layer loop for every prefill that may carry media rows.
from __future__ import annotations

import torch

from ..models.layer_stack import run_joint, run_layers
from .host_copy import to_device


class LayerSpans:
    def __init__(self, text_model, *, rows: int, tokens: int, deepstack: int = 0, accept_layer: int | None = None):
        """rows x tokens: the largest step; deepstack: how many first layers take deepstack features after
        them; accept_layer: the layer whose input is kept (None: nothing kept)."""
        self.layers = text_model.layers
        count = len(self.layers)
        if accept_layer is not None and accept_layer <= deepstack:
            raise ValueError(f"accept layer {accept_layer} lies among the deepstack layers (first {deepstack})")
        cuts = sorted({*range(1, deepstack + 1), *([accept_layer] if accept_layer is not None else []), count})
        self.spans = list(zip([0] + cuts[:-1], cuts))
        self.deepstack_count, self.accept_layer = deepstack, accept_layer
        weight = text_model.norm.weight
        hidden, device, dtype = weight.shape[0], weight.device, weight.dtype
        # [layers, rows, tokens, D]: zero except at the step's image and video rows
        self.deepstack = torch.zeros(deepstack, rows, tokens, hidden, dtype=dtype, device=device)
        self._dirty = False  # some deepstack row is not zero
        self.accept_out = torch.zeros(rows if accept_layer is not None else 0, tokens, hidden, dtype=dtype, device=device)

    def load_deepstack(self, rows: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Row i's deepstack features (host positions [k] in the row, features [layers, k, D] on the device, or
        None) into the buffer, every other row zero. Padding rows repeat row 0 (pass its entry again)."""
        if not self.deepstack_count:
            return
        if self._dirty:
            self.deepstack.zero_()
        width = self.deepstack.shape[2]
        where, features = [], []
        for i, row in enumerate(rows):
            if row is not None and row[0].numel():
                where.append(row[0] + i * width)
                features.append(row[1])
        self._dirty = bool(where)
        if where:
            flat = self.deepstack.view(self.deepstack_count, -1, self.deepstack.shape[-1])
            index = to_device(torch.cat(where), self.deepstack.device)  # pinned: no wait for the device
            flat.index_copy_(1, index, torch.cat(features, 1).to(self.deepstack.dtype))

    def run(self, hidden: torch.Tensor, **attention_kwargs) -> torch.Tensor:
        """hidden [rows, tokens, D] through every layer, the stream touched as the header says; returns the
        last layer's output, not normed."""
        rows, tokens = hidden.shape[:2]
        for start, end in self.spans:
            if start == self.accept_layer:
                self.accept_out[:rows, :tokens].copy_(hidden)
            hidden = run_layers(self.layers[start:end], hidden, **attention_kwargs)
            if end <= self.deepstack_count:
                hidden = hidden + self.deepstack[end - 1, :rows, :tokens]
        return hidden

    def run_beside(self, hidden: torch.Tensor, beside: tuple[torch.Tensor, dict], **attention_kwargs
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """run() with another batch (its hidden [B, T, D] and attention kwargs) in the same forward
        (layer_stack.run_joint); the stream is touched at these rows only. Returns both outputs, not
        normed: (this batch's [rows, tokens, D], the other's [B, T, D])."""
        rows, tokens = hidden.shape[:2]
        other, other_kwargs = beside
        for start, end in self.spans:
            if start == self.accept_layer:
                self.accept_out[:rows, :tokens].copy_(hidden)
            flat = run_joint(self.layers[start:end], [(other, other_kwargs), (hidden, attention_kwargs)])
            split = other.shape[0] * other.shape[1]
            other, hidden = flat[:split].view(other.shape), flat[split:].view(hidden.shape)
            if end <= self.deepstack_count:
                hidden = hidden + self.deepstack[end - 1, :rows, :tokens]
        return hidden, other
