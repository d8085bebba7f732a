# Bidirectional attention over packed tokens cut into segments (cu_seqlens): the media encoders' attention
# (audio windows, image frames) for all media of a prefill step in one SDPA call. transformers' sdpa/eager
# path for these encoders loops over the segments in Python, one SDPA call each; here the packed q/k/v
# are scattered into a grid [segments, width] (each segment left-aligned, its padding masked as keys),
# attended in one call, and gathered back. The linear layers around it run on the packed tokens, so the
# padding costs only attention. Where every segment has the same length (a video's frames, a lone image)
# the packed tokens already are that grid: they are attended as views, with no scatter, gather or mask
# (a fifth of the vision encoder's time over W5's videos on an H200, perf/README.md).
from __future__ import annotations

import torch
import torch.nn.functional as F

from .host_copy import to_device


class Segments:
    """Where each of N packed tokens sits in a [count, width] grid, and the grid's key mask (both None where
    every segment fills the grid's width)."""

    def __init__(self, lengths: list[int], device, width: int | None = None):
        self.count, self.width = len(lengths), width or max(lengths)
        self.even = all(n == self.width for n in lengths)  # the packed tokens are the grid itself
        self.index = self.mask = None  # an even grid needs neither
        if self.even:
            return
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        owner = torch.repeat_interleave(torch.arange(self.count), lengths_t)  # [N] segment of each token
        index = owner * self.width + torch.arange(int(lengths_t.sum())) - starts[owner]
        valid = torch.arange(self.width)[None] < lengths_t[:, None]  # [count, width]
        self.index = to_device(index, device)  # [N] row of the flattened grid
        self.mask = to_device(valid[:, None, None], device)  # [count, 1, 1, width]: keys a query may see


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scaling: float) -> torch.Tensor:
    """q, k, v [N, H, hd] packed -> [N, H * hd]: each token attends to its own segment's tokens."""
    n, heads, head_dim = q.shape
    if segments.even:  # [N, H, hd] -> [S, H, W, hd] views (SDPA takes strided inputs)
        q, k, v = (t.view(segments.count, segments.width, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        return out.transpose(1, 2).reshape(n, heads * head_dim)
    grid = q.new_zeros(3, segments.count * segments.width, heads, head_dim)
    grid[:, segments.index] = torch.stack([q, k, v])
    grid = grid.view(3, segments.count, segments.width, heads, head_dim).transpose(2, 3)  # [3, S, H, W, hd]
    out = F.scaled_dot_product_attention(grid[0], grid[1], grid[2], attn_mask=segments.mask, scale=scaling)
    return out.transpose(1, 2).reshape(segments.count * segments.width, heads * head_dim)[segments.index]
