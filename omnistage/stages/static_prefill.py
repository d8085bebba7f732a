# Prefill of fresh slots from static buffers, replayed as a CUDA graph per (rows, tokens) bucket. An eager
# prefill is host-bound on the GPU: the talker's ran ~1400 kernels in 5 ms of GPU time but took 74 ms
# to launch them, one prompt or sixteen (perf/results/h200-static-prefill.json), and at 64 concurrent W1
# requests the talker spent a third of its time there. A slot's prompt always starts at position 0 (no
# prefix cache), so attention is causal self-attention over the new tokens alone: each layer writes its
# K/V into the slots' blocks and attends to the tokens it was given. Rows are right-padded to the bucket's
# tokens (causal attention never looks right; positions past a prompt land in its last block, overwritten
# by its decode steps before anything reads them, or in the null block); padding rows repeat row 0,
# writing the same values to the same blocks.
# Text-only prompts only: their MRoPE positions are 0..L-1 in every section.
from __future__ import annotations

import torch

from ..models.layer_stack import run_layers
from .cuda_graphs import GraphBank, batch_buckets, bucket_for
from .host_copy import to_device
from .paged_kv import PagedKVCache, PagedWriter


def token_buckets(max_tokens: int, step: int = 64) -> list[int]:
    return list(range(step, max_tokens, step)) + [max_tokens]


def load_padded(buffer: torch.Tensor, embeds: list[torch.Tensor], rows: int, tokens: int) -> int:
    """Copies each prompt's rows [L_i, D] into buffer[i] and fills rows len(embeds)..rows-1 (the bucket's
    padding) with a repeat of row 0 over `tokens`; returns how many padding rows there are."""
    n = len(embeds)
    for i, e in enumerate(embeds):
        buffer[i, : e.shape[0]].copy_(e)
    if rows > n:
        buffer[n:rows, :tokens].copy_(buffer[:1, :tokens].expand(rows - n, -1, -1))
    return rows - n


class StaticPrefill:
    def __init__(self, name: str, text_model, cache: PagedKVCache, *, max_rows: int, max_tokens: int,
                 cuda_graphs: bool):  # fmt: skip
        self.text_model, self.cache = text_model, cache
        device, dtype = cache.device, cache.dtype
        hidden = text_model.norm.weight.shape[0]
        self.max_rows, self.max_tokens = max_rows, min(max_tokens, cache.max_len)
        self.bank = GraphBank(f"{name}_prefill", device, cuda_graphs)
        # without graphs, exact sizes (no padding to pay for); the CPU tests drive this same code
        self.row_buckets = batch_buckets(max_rows) if self.bank.enabled else None
        # every 64 tokens: a 150-token prompt padded to 256 cost the thinker 130 ms for 16 prompts, 84 unpadded
        self.token_buckets = token_buckets(self.max_tokens) if self.bank.enabled else None
        self.embeds = torch.zeros(max_rows, self.max_tokens, hidden, dtype=dtype, device=device)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.last = torch.zeros(max_rows, dtype=torch.long, device=device)  # each row's last prompt position
        self.hidden_out = torch.zeros(max_rows, hidden, dtype=dtype, device=device)

    def fits(self, rows: int, tokens: int) -> bool:
        return rows <= self.max_rows and tokens <= self.max_tokens

    def shape_for(self, rows: int, tokens: int) -> tuple[int, int]:
        if self.row_buckets is None:
            return rows, tokens
        return bucket_for(rows, self.row_buckets), bucket_for(tokens, self.token_buckets)

    def run(self, embeds: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
        """embeds: per prompt [L_i, D] on the device; slots: where each prompt's K/V goes. Returns the normed
        hidden state at each prompt's last position, [n, D] (a view of a static buffer: copy to keep)."""
        n, lengths = len(embeds), [e.shape[0] for e in embeds]
        for slot, length in zip(slots, lengths):
            self.cache.grow(slot, length)
        self.cache.sync()
        rows, tokens = self.shape_for(n, max(lengths))
        pad = load_padded(self.embeds, embeds, rows, tokens)
        index = to_device([slots + slots[:1] * pad, [x - 1 for x in lengths + lengths[:1] * pad]], self.slots.device)
        self.slots[:rows].copy_(index[0])
        self.last[:rows].copy_(index[1])
        self.bank.run((rows, tokens), lambda: self._run(rows, tokens))
        return self.hidden_out[:n]

    def capture_all(self) -> None:
        """Captures every (rows, tokens) bucket while no slot is in use (they write into the null block)."""
        if not self.bank.enabled:
            return
        self.cache.sync()
        self.slots.zero_()
        self.last.zero_()
        keys = [(r, t) for r in self.row_buckets for t in self.token_buckets]
        self.bank.capture_all(keys, lambda key: lambda: self._run(*key))

    def _positions(self, rows: int, tokens: int) -> torch.Tensor:
        """MRoPE positions [3, rows, tokens]: 0..tokens-1 in every section (text-only prompts)."""
        return torch.arange(tokens, device=self.embeds.device).view(1, 1, tokens).expand(3, rows, tokens)

    def _run(self, rows: int, tokens: int) -> None:
        embeds = self.embeds[:rows, :tokens]
        position_embeddings = self.text_model.rotary_emb(embeds, self._positions(rows, tokens))
        steps = torch.arange(tokens, device=embeds.device)[None].expand(rows, tokens)
        writer = PagedWriter(self.cache, self.slots[:rows], steps, None)
        # no mask: sdpa runs causal over the new tokens
        hidden = run_layers(self.text_model.layers, embeds, attention_mask=None, position_embeddings=position_embeddings,
                            past_key_values=writer)  # fmt: skip
        last = hidden[torch.arange(rows, device=hidden.device), self.last[:rows]]  # [rows, D]
        self.hidden_out[:rows].copy_(self.text_model.norm(last))
