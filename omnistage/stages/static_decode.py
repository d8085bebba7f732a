# One batched decode step of a transformers decoder stack over rows [0, rows) of a PagedKVCache, driven
# from static buffers so that it can be replayed as a CUDA graph per rows bucket: the paged decode kernel
# (models/paged_attention.py) reads each row's blocks to its own length from the block tables, so the graph
# does not depend on the rows' lengths. Where that kernel does not run (no fused attention), attention gathers the
# rows' blocks up to a kv bucket and the graphs are per (rows bucket, kv bucket). Shared by the thinker
# (token ids in, LM logits out) and the talker (input embeddings in, codec logits out).
from __future__ import annotations

from collections.abc import Callable

import torch

from .cuda_graphs import GraphBank, batch_buckets, bucket_for, length_buckets
from .decoder_step import decode_kwargs, decode_step
from .host_copy import to_device
from ..models import fused_ops
from .paged_kv import PagedKVCache


class StaticDecoder:
    def __init__(
        self,
        name: str,
        text_model,  # .layers, .norm, .rotary_emb
        cache: PagedKVCache,
        head: Callable[[torch.Tensor], torch.Tensor],  # [rows, D] -> [rows, V]
        head_dim: int,  # V
        embed: Callable[[torch.Tensor], torch.Tensor] | None,  # ids [rows] -> [rows, D]; None: embeddings in
        *,
        cuda_graphs: bool,
    ):
        self.text_model, self.cache, self.head, self.embed = (text_model, cache, head, embed)
        rows, device = cache.slots, cache.device
        hidden = text_model.norm.weight.shape[0]
        dtype = cache.dtype
        self.bank = GraphBank(name, device, cuda_graphs)
        # padding rows only pay off when a graph replays; eager steps run at the exact size
        self.row_buckets = batch_buckets(rows) if self.bank.enabled else None
        # the paged decode kernel runs from the fused attention (models/fused_projections.py installs it)
        paged_kernel = fused_ops.available() and hasattr(text_model.layers[0].self_attn, "qkv_weight")
        kv_buckets = [cache.max_len] if paged_kernel else length_buckets(cache.max_len)
        self.kv_buckets = kv_buckets if self.bank.enabled else None
        self.index = torch.zeros(2, rows, dtype=torch.long, device=device)  # positions, rope deltas
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.embeds = torch.zeros(rows, 1, hidden, dtype=dtype, device=device)
        self.hidden_out = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.logits_out = torch.zeros(rows, head_dim, dtype=dtype, device=device)

    def shape_for(self, rows: int, kv_len: int) -> tuple[int, int]:
        if self.row_buckets is None:
            return rows, kv_len
        return bucket_for(rows, self.row_buckets), bucket_for(kv_len, self.kv_buckets)

    def step(self, positions: list[int], deltas: list[int], ids: list[int] | None = None) -> tuple[int, int]:
        """Loads rows [0, len(positions)) (ids, or self.embeds filled by the caller) and runs one step;
        returns the (rows, kv_len) shape it ran at. Results: hidden_out[:rows], logits_out[:rows].
        positions/deltas cover every occupied slot up to the highest one (a row that is not stepping writes
        at its next free position, which its next real step overwrites); padding rows up to the bucket
        are free slots and write at position 0."""
        rows, kv_len = self.load(positions, deltas, ids)
        self.bank.run((rows, kv_len), lambda: self._run(rows, kv_len))
        return rows, kv_len

    def load(self, positions: list[int], deltas: list[int], ids: list[int] | None = None) -> tuple[int, int]:
        """step()'s rows into the static buffers, for a forward that another batch runs them in (a long
        prompt's piece: ChunkPrefill.run_beside, which calls inputs() and finish()); returns the (rows,
        kv_len) shape."""
        rows, kv_len = self.shape_for(len(positions), max(positions) + 1)
        pad = rows - len(positions)
        self.index[:, :rows].copy_(to_device([positions + [0] * pad, deltas + [0] * pad], self.index.device))
        if ids is not None:
            self.ids[:rows].copy_(to_device(ids + [0] * pad, self.ids.device))
        self.cache.sync()
        return rows, kv_len

    def inputs(self, rows: int, kv_len: int) -> tuple[torch.Tensor, dict]:
        """The loaded rows as a batch of that forward: input rows [rows, 1, D] and attention kwargs."""
        embeds, positions, deltas = self._inputs(rows)
        return embeds, decode_kwargs(self.text_model, self.cache, embeds, positions, deltas, kv_len)

    def finish(self, out: torch.Tensor) -> None:
        """That forward's output [rows, 1, D] (not normed) for the loaded rows into hidden_out and logits_out,
        as step() leaves them."""
        self._head(self.text_model.norm(out[:, 0]), out.shape[0])

    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, kv_len) shapes of captured steps ([] without graphs)."""
        return [(r, k) for r in self.row_buckets for k in self.kv_buckets] if self.bank.enabled else []

    def capture_all(self) -> None:
        """Captures every (rows, kv) bucket while no slot is in use (padding rows write position 0)."""
        if not self.bank.enabled:
            return
        self.index.zero_()
        self.cache.sync()
        self.bank.capture_all(self.shapes(), lambda key: lambda: self._run(*key))

    def _run(self, rows: int, kv_len: int) -> None:
        self._head(decode_step(self.text_model, self.cache, *self._inputs(rows), kv_len), rows)

    def _inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The loaded rows' input embeddings [rows, 1, D], positions and rope deltas [rows]."""
        embeds = self.embed(self.ids[:rows])[:, None] if self.embed is not None else self.embeds[:rows]
        return embeds, self.index[0, :rows], self.index[1, :rows]

    def _head(self, hidden: torch.Tensor, rows: int) -> None:
        """The step's normed output [rows, D] into hidden_out and its head's logits into logits_out."""
        self.hidden_out[:rows].copy_(hidden)
        self.logits_out[:rows].copy_(self.head(hidden))
