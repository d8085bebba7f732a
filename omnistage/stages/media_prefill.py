# The thinker's prefill of a step's prompts with media rows (and the text-only prompts of the same step) in
# one forward from static buffers, replayed as a CUDA graph per (rows, tokens) bucket as StaticPrefill does
# for text-only steps. Each prompt comes as InputRows (media_rows.py: the encoders' tokens already in its
# embeddings, its MRoPE positions, its deepstack rows), so every kind of media (audio, images, video, a
# video's audio track) runs the same forward. A prompt may start after a kept prefix already in its slot (a
# system prompt, a conversation's earlier turns: stages/media_prefix_cache.py cuts it between media items):
# then its row holds the prompt from `start` on, and the step attends over the slots' positions as
# ChunkPrefill does, one graph per (rows, tokens, kv) bucket. The layers run through LayerSpans: deepstack
# rows added after the first layers, the stream entering the accept layer kept for the talker's
# conditioning on media rows. Rows are right-padded to the bucket's tokens and padding rows repeat row 0
# (see static_prefill.py). Prompts longer than the buffers go in pieces (long_prefill.py).
from __future__ import annotations

import torch

from ..models import paged_attention
from .chunk_prefill import attend_after_prefix
from .cuda_graphs import bucket_for, length_buckets
from .host_copy import to_device
from .layer_spans import LayerSpans
from .media_rows import InputRows
from .paged_kv import PagedKVCache, PagedWriter
from .positioned_prefill import PositionedPrefill
from .static_prefill import load_padded


class MediaPrefill(PositionedPrefill):
    """StaticPrefill's buffers, buckets and graphs with per-row MRoPE positions (PositionedPrefill), plus
    deepstack rows and the accept layer's rows (LayerSpans)."""

    def __init__(self, name: str, text_model, cache: PagedKVCache, *, max_rows: int, max_tokens: int,
                 deepstack: int, accept_layer: int, cuda_graphs: bool):  # fmt: skip
        super().__init__(f"{name}_media", text_model, cache, max_rows=max_rows, max_tokens=max_tokens,
                         cuda_graphs=cuda_graphs)  # fmt: skip
        rows, tokens, _ = self.embeds.shape
        self.spans = LayerSpans(text_model, rows=rows, tokens=tokens, deepstack=deepstack, accept_layer=accept_layer)
        self.accept_out = self.spans.accept_out  # [rows, tokens, D]: each row's accept-layer input
        self.starts = torch.zeros(rows, dtype=torch.long, device=self.embeds.device)  # where each row begins in its slot
        # attended lengths of steps with a kept prefix: a prompt's prefix and suffix together fit the buffers;
        # one bucket where the paged prefill kernel reads each row's own positions (nothing sized by them)
        self.kv_buckets = None
        if self.bank.enabled:
            paged = paged_attention.serves(self.embeds.device)
            self.kv_buckets = [self.max_tokens] if paged else length_buckets(self.max_tokens)

    def fits(self, starts: list[int], lengths: list[int]) -> bool:
        """Whether rows of these starts and lengths (prompt tokens after the start) can run as one step."""
        rows, tokens, kv_len = self.step_shape(starts, lengths)
        return rows <= self.max_rows and tokens <= self.max_tokens and (kv_len or 0) <= self.max_tokens

    def step_shape(self, starts: list[int], lengths: list[int]) -> tuple[int, int, int | None]:
        """(rows, tokens, kv_len) a step runs at; kv_len None: every row starts at 0 (attention over the new
        tokens alone), else every padded position lies below it."""
        rows, tokens = self.shape_for(len(lengths), max(lengths))
        if not any(starts):
            return rows, tokens, None
        kv_len = max(starts) + tokens
        if self.kv_buckets and kv_len <= self.max_tokens:
            kv_len = bucket_for(kv_len, self.kv_buckets)
        return rows, tokens, kv_len

    def run(self, prompts: list[InputRows], slots: list[int], starts: list[int]) -> torch.Tensor:
        """prompts: each prompt's rows from its start on (MediaInputs.rows); slots: where each one's K/V goes;
        starts: where each prompt's rows begin in its slot (the slot holds the positions before, see fits()).
        Returns the normed hidden state at each prompt's last position [n, D]. After it, accept_out[i] holds
        prompt i's accept-layer rows (a static buffer: read before the next run)."""
        n, lengths = len(prompts), [p.embeds.shape[0] for p in prompts]
        for slot, start, length in zip(slots, starts, lengths):
            self.cache.grow(slot, start + length)
        self.cache.sync()
        rows, tokens, kv_len = self.step_shape(starts, lengths)
        pad = load_padded(self.embeds, [p.embeds for p in prompts], rows, tokens)
        self.load_positions([p.positions for p in prompts], rows, tokens)
        self.spans.load_deepstack([p.deepstack for p in prompts + prompts[:1] * pad])
        index = to_device([slots + slots[:1] * pad, [x - 1 for x in lengths + lengths[:1] * pad],
                           starts + starts[:1] * pad], self.slots.device)  # fmt: skip
        self.slots[:rows].copy_(index[0])
        self.last[:rows].copy_(index[1])
        self.starts[:rows].copy_(index[2])
        key = (rows, tokens) if kv_len is None else (rows, tokens, kv_len)
        self.bank.run(key, lambda: self._run(*key))
        return self.hidden_out[:n]

    def capture_all(self) -> None:
        """StaticPrefill's (rows, tokens) buckets, and (rows, tokens, kv) ones for steps after kept prefixes."""
        if not self.bank.enabled:
            return
        self.starts.zero_()
        super().capture_all()
        keys = [(r, t, k) for r in self.row_buckets for t in self.token_buckets for k in self.kv_buckets if t <= k]
        self.bank.capture_all(keys, lambda key: lambda: self._run(*key))

    def _run(self, rows: int, tokens: int, kv_len: int | None = None) -> None:
        hidden = self.embeds[:rows, :tokens]
        position_embeddings = self.text_model.rotary_emb(hidden, self.positions[:, :rows, :tokens])
        if kv_len is None:  # every row from position 0: sdpa runs causal over the new tokens, no mask
            steps = torch.arange(tokens, device=hidden.device)[None].expand(rows, tokens)
            mask, writer = None, PagedWriter(self.cache, self.slots[:rows], steps, None)
        else:
            mask, writer = attend_after_prefix(self.cache, self.slots[:rows], self.starts[:rows], tokens, kv_len)
        hidden = self.spans.run(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                                past_key_values=writer)  # fmt: skip
        last = hidden[torch.arange(rows, device=hidden.device), self.last[:rows]]  # [rows, D]
        self.hidden_out[:rows].copy_(self.text_model.norm(last))
