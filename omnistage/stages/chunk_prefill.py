# Prefill of prompt suffixes into slots whose first positions already hold the prompt's prefix (blocks of
# the prefix cache, shared by reference: stages/prefix_cache.py), replayed as a CUDA graph per (rows,
# tokens, kv) bucket like StaticPrefill. Row r's tokens sit at positions starts[r] .. starts[r] + tokens - 1
# of slot slots[r]; each layer writes their K/V into the slot's blocks and attends causally over the
# slot's positions read through its block table: the kept prefix and the suffix so far (on CUDA in the
# paged prefill kernel, each row to its own positions, so kv is a single bucket; else gathered up to kv
# under a mask). Rows are
# right-padded to the bucket's tokens (the padded positions lie past the prompt, in its last block or the
# null block, are masked for its real tokens and are overwritten by its decode steps before anything reads
# them); padding rows repeat row 0. A row's MRoPE positions come from a buffer: text rows take their slot
# positions on every section, shifted by their rope offset (a prompt whose kept prefix holds media: its
# rope delta); rows of a prompt with media (its pieces, long_prefill.py) take their own, and the layers run
# through LayerSpans, which adds their deepstack rows and keeps their accept-layer rows.
from __future__ import annotations

import torch

from ..models import paged_attention
from .cuda_graphs import GraphBank, batch_buckets, bucket_for
from .host_copy import to_device
from ..core.block_pool import BLOCK, blocks_for
from .layer_spans import LayerSpans
from .paged_kv import PagedKVCache, PagedWriter
from .static_prefill import load_padded

# longer suffixes prefill in full (StaticPrefill). W1's are ~38 tokens: padded to 64 they made 40% of a
# 16-prompt step's tokens padding
TOKEN_BUCKETS = (32, 48, 64)
KV_BUCKETS = (256, 512)


class ChunkPrefill:
    def __init__(self, name: str, text_model, cache: PagedKVCache, *, max_rows: int, cuda_graphs: bool,
                 token_buckets: tuple[int, ...] = TOKEN_BUCKETS, kv_buckets: tuple[int, ...] = KV_BUCKETS,
                 max_attended: int | None = None, deepstack: int = 0, accept_layer: int | None = None):  # fmt: skip
        """token_buckets / kv_buckets: the suffix lengths and attended lengths graphs are captured for (the
        largest of each bounds what fits); max_attended: the most rows x kv positions of a step (its
        attention's K/V copies grow with it), None: no bound; deepstack / accept_layer: see LayerSpans."""
        self.text_model, self.cache = text_model, cache
        device, dtype = cache.device, cache.dtype
        hidden = text_model.norm.weight.shape[0]
        self.token_buckets, self.max_attended = list(token_buckets), max_attended
        self.max_rows, self.max_tokens = max_rows, self.token_buckets[-1]
        self.max_kv = min(kv_buckets[-1], cache.max_len)
        self.bank = GraphBank(f"{name}_chunk_prefill", device, cuda_graphs)
        self.joint = GraphBank(f"{name}_chunk_prefill_beside_decode", device, cuda_graphs)  # run_beside()'s
        self.joint_keys: set[tuple[tuple[int, int], tuple[int, int, int]]] = set()  # (decode shape, rows shape)
        # without graphs, exact sizes (no padding to pay for); the CPU tests drive this same code
        self.row_buckets = batch_buckets(max_rows) if self.bank.enabled else None
        self.kv_buckets = [b for b in kv_buckets if b < self.max_kv] + [self.max_kv]
        if paged_attention.serves(device):  # each row reads its own positions: no gather to size or bound
            self.kv_buckets, self.max_attended = [self.max_kv], None
        self.embeds = torch.zeros(max_rows, self.max_tokens, hidden, dtype=dtype, device=device)
        # slots, starts, last token
        self.index = torch.zeros(3, max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, max_rows, self.max_tokens, dtype=torch.long, device=device)
        self.hidden_out = torch.zeros(max_rows, hidden, dtype=dtype, device=device)
        self.spans = LayerSpans(text_model, rows=max_rows, tokens=self.max_tokens, deepstack=deepstack,
                                accept_layer=accept_layer)  # fmt: skip

    def shape_for(self, rows: int, tokens: int, furthest_start: int) -> tuple[int, int, int]:
        """(rows, tokens, kv_len) a step runs at: every padded position lies below kv_len."""
        if self.row_buckets is None:
            return rows, tokens, furthest_start + tokens
        tokens = bucket_for(tokens, self.token_buckets)
        return bucket_for(rows, self.row_buckets), tokens, bucket_for(furthest_start + tokens, self.kv_buckets)

    def fits(self, rows: int, tokens: int, furthest_start: int) -> bool:
        """rows suffixes of at most `tokens` tokens, the furthest starting at furthest_start."""
        if rows > self.max_rows or tokens > self.max_tokens:
            return False
        padded = bucket_for(tokens, self.token_buckets) if self.row_buckets else tokens
        if furthest_start + padded > self.max_kv:
            return False
        rows, _, kv_len = self.shape_for(rows, tokens, furthest_start)
        return self.max_attended is None or rows * kv_len <= self.max_attended

    def run(self, embeds: list[torch.Tensor], slots: list[int], starts: list[int],
            rope_offsets: list[int] | None = None, positions: list[torch.Tensor | None] | None = None,
            deepstack: list | None = None) -> torch.Tensor:  # fmt: skip
        """embeds: per prompt its suffix [T_i, D] on the device; starts: where each suffix begins in its slot;
        rope_offsets: what each text row adds to its slot positions for the rotary embedding (default 0);
        positions: a row's own MRoPE positions [3, T_i] (host), None for a text row; deepstack: a row's
        deepstack rows (InputRows.deepstack) or None. Returns the normed hidden state at each suffix's last
        token, [n, D] (a static buffer's view); spans.accept_out[i] holds row i's accept-layer rows."""
        n, shape = self._load(embeds, slots, starts, rope_offsets, positions, deepstack)
        self.bank.run(shape, lambda: self._run(*shape))
        return self.hidden_out[:n]

    def run_beside(self, decoder, step: tuple, embeds: list[torch.Tensor], slots: list[int], starts: list[int],
                   rope_offsets: list[int] | None = None, positions: list[torch.Tensor | None] | None = None,
                   deepstack: list | None = None) -> torch.Tensor:  # fmt: skip
        """run() with a decode step of `decoder` (a StaticDecoder; step: its step()'s arguments) in the same
        forward (LayerSpans.run_beside): one read of each layer's experts for both. Returns run()'s result;
        the step's results are in the decoder's buffers as its step() leaves them. On CUDA a graph per
        (decode shape, rows shape) replays, for the shapes capture_beside() took."""
        n, shape = self._load(embeds, slots, starts, rope_offsets, positions, deepstack)
        decode_shape = decoder.load(*step)
        self.joint.run((decode_shape, shape), lambda: self._run_beside(shape, decoder, decode_shape))
        return self.hidden_out[:n]

    def joins(self, decode_shape: tuple[int, int], rows: int, tokens: int, furthest_start: int) -> bool:
        """Whether run_beside() can take these rows (as fits() counts them) beside a decode step of that
        (rows, kv_len) shape: any that fit where graphs are off; on CUDA the shapes capture_beside() took."""
        if not self.joint.enabled:
            return self.fits(rows, tokens, furthest_start)
        return (decode_shape, self.shape_for(rows, tokens, furthest_start)) in self.joint_keys

    def capture_beside(self, decoder, tokens: tuple[int, ...], rows: tuple[int, ...] = (1,)) -> None:
        """Captures run_beside()'s graphs for each of `rows` (row buckets) x `tokens` (token buckets) beside
        each of the decoder's shapes (on CUDA one per rows bucket: the paged decode kernel reads each row to
        its own length), while no slot is in use."""
        if not self.joint.enabled:
            return
        shapes = [(r, t, self.kv_buckets[-1]) for r in rows for t in tokens]
        self.joint_keys = {(d, shape) for d in decoder.shapes() for shape in shapes}
        self.cache.sync()
        self.index.zero_()
        self.joint.capture_all(self.joint_keys, lambda key: lambda: self._run_beside(key[1], decoder, key[0]))

    def _run_beside(self, shape: tuple[int, int, int], decoder, decode_shape: tuple[int, int]) -> None:
        decoder.finish(self._run(*shape, beside=decoder.inputs(*decode_shape)))

    def _load(self, embeds, slots, starts, rope_offsets, positions, deepstack) -> tuple[int, tuple[int, int, int]]:
        """The rows into the static buffers; returns their number and the (rows, tokens, kv_len) shape."""
        n, lengths = len(embeds), [e.shape[0] for e in embeds]
        for slot, start, length in zip(slots, starts, lengths):
            self.cache.grow(slot, start + length)
        self.cache.sync()
        rows, tokens, kv_len = self.shape_for(n, max(lengths), max(starts))
        pad = load_padded(self.embeds, embeds, rows, tokens)
        offsets = rope_offsets or [0] * n
        host = (torch.tensor(starts + starts[:1] * pad) + torch.tensor(offsets + offsets[:1] * pad))[:, None]
        host = (host + torch.arange(tokens)[None]).expand(3, -1, -1).clone()  # [3, rows, tokens]
        for i, p in enumerate(positions or []):
            if p is not None:
                host[:, i, : p.shape[1]] = p
        host[:, n:] = host[:, :1]
        self.positions[:, :rows, :tokens].copy_(to_device(host, self.positions.device))
        deepstack = deepstack or [None] * n
        self.spans.load_deepstack(deepstack + deepstack[:1] * pad)
        index = [slots + slots[:1] * pad, starts + starts[:1] * pad, [x - 1 for x in lengths + lengths[:1] * pad]]
        self.index[:, :rows].copy_(to_device(index, self.index.device))
        return n, (rows, tokens, kv_len)

    def capture_all(self) -> None:
        """Captures every bucket while no slot is in use (they write into the null block)."""
        if not self.bank.enabled:
            return
        self.cache.sync()
        self.index.zero_()
        keys = [(r, t, k) for r in self.row_buckets for t in self.token_buckets for k in self.kv_buckets
                if t <= k and (self.max_attended is None or r * k <= self.max_attended)]  # fmt: skip
        self.bank.capture_all(keys, lambda key: lambda: self._run(*key))

    def _run(self, rows: int, tokens: int, kv_len: int, beside: tuple[torch.Tensor, dict] | None = None
             ) -> torch.Tensor | None:  # fmt: skip
        embeds = self.embeds[:rows, :tokens]
        slots, starts, last = (self.index[i, :rows] for i in range(3))
        position_embeddings = self.text_model.rotary_emb(embeds, self.positions[:, :rows, :tokens])
        mask, writer = attend_after_prefix(self.cache, slots, starts, tokens, kv_len)
        kwargs = dict(attention_mask=mask, position_embeddings=position_embeddings, past_key_values=writer)
        other = None
        if beside is None:
            hidden = self.spans.run(embeds, **kwargs)
        else:
            hidden, other = self.spans.run_beside(embeds, beside, **kwargs)
        last_hidden = hidden[torch.arange(rows, device=hidden.device), last]  # [rows, D]
        self.hidden_out[:rows].copy_(self.text_model.norm(last_hidden))
        return other


def attend_after_prefix(cache: PagedKVCache, slots: torch.Tensor, starts: torch.Tensor, tokens: int,
                        kv_len: int) -> tuple[torch.Tensor, PagedWriter]:  # fmt: skip
    """The attention mask and K/V writer of rows whose `tokens` new tokens sit at slot positions starts[r]..:
    each layer writes them into the slots' blocks and each token attends to its slot's positions up to its
    own, read through the block table ([rows, 1, tokens, kv_len] mask, kv_len rounded up to whole blocks)."""
    kv_len = blocks_for(kv_len) * BLOCK  # a gather reads whole blocks
    positions = starts[:, None] + torch.arange(tokens, device=starts.device)[None, :]  # [rows, tokens]
    writer = PagedWriter(cache, slots, positions, kv_len)
    if writer.paged:  # the paged prefill kernel reads each row's own positions: no mask to build
        return None, writer
    mask = (torch.arange(kv_len, device=starts.device)[None, None, :] <= positions[:, :, None])[:, None]
    return mask, writer
