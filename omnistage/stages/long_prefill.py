# Prefill of prompts longer than the static prefill takes whole (chunked prefill). The engine
# hands such a prompt over in pieces across steps (core/scheduler.py): whole chunks of CHUNK_TOKENS while
# nothing else runs, whole units of PIECE_TOKENS beside decoding streams, and its prompt's last tokens. Here
# a piece is cut into rows of CHUNK_TOKENS, each starting where the previous one ends; a row of at most
# PIECE_TOKENS (a unit, or a prompt's short rest) takes a token bucket of that size instead of a chunk's. A
# step's rows run in ChunkPrefill forwards (stages/chunk_prefill.py) of one bucket each, those of whole
# chunks first, with the slot's positions up to their own. Each layer writes all rows' K/V into their
# slots before any row attends, so a row reads the rows before it of its prompt from the same forward as it
# reads the pieces of earlier steps: the prompt's K/V and last hidden state are those of one causal pass
# over it. A row padded to its bucket ends inside the block table, which spans a chunk past the context on
# graphs (runner.py), and its padded positions past the prompt's blocks write to the null block.
# A prompt with media rows comes as InputRows (media_rows.py, encoded at its first piece and kept until its
# last): its rows carry their MRoPE positions and deepstack rows into the same forward, and the accept
# layer's rows at its media positions come back for the talker's conditioning.
from __future__ import annotations

import torch

from .chunk_prefill import ChunkPrefill
from .cuda_graphs import length_buckets
from .host_copy import to_device
from .media_rows import InputRows
from .paged_kv import PagedKVCache

# Tokens per row, and the longest prompt the static prefill takes whole (runner.py): a text prompt is either
# one static prefill row or rows of this size.
CHUNK_TOKENS = 512
# The unit of a long prompt's pieces beside decoding streams, and the smaller token bucket of its rows: the
# piece a step must give a long prompt costs a quarter of a chunk's attention, wherever in the prompt it lies.
PIECE_TOKENS = 128
# Rows per forward (a step with more runs several, in row order): 8192 tokens at most. On CUDA each row
# attends through its block table in the paged prefill kernel (models/paged_attention.py). Where attention
# is gathered instead (the CPU), each row reads its slot up to the furthest row's end and transformers'
# masked sdpa copies the 4 KV heads out per query head, so a forward also holds at most MAX_ATTENDED rows x
# attended positions.
MAX_ROWS = 16
MAX_ATTENDED = 16 * 4096
# Rows that ride a decode step's forward (run()'s beside) on CUDA: a long prompt's piece, or up to 4 new media
# prompts of the thinker's (a row each).
ROWS_BESIDE = (1, 2, 4)


class LongPrefill:
    def __init__(self, name: str, text_model, cache: PagedKVCache, *, max_rows: int, cuda_graphs: bool,
                 deepstack: int = 0, accept_layer: int | None = None):  # fmt: skip
        """deepstack / accept_layer: the thinker's media rows (LayerSpans); the talker's prompts need neither."""
        kv_buckets = tuple(length_buckets(cache.max_len, CHUNK_TOKENS))
        self.rows = ChunkPrefill(f"{name}_long", text_model, cache, max_rows=min(max_rows, MAX_ROWS),
                                 cuda_graphs=cuda_graphs, token_buckets=(PIECE_TOKENS, CHUNK_TOKENS),
                                 kv_buckets=kv_buckets, max_attended=MAX_ATTENDED, deepstack=deepstack,
                                 accept_layer=accept_layer)  # fmt: skip

    def run(self, pieces: list[tuple[InputRows, int, int]], beside: tuple | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:  # fmt: skip
        """pieces: per prompt (its piece's rows, embeddings on the device; its slot; where the piece starts in
        the slot); beside: (a StaticDecoder, its step()'s arguments), a decode step run in the pieces' first
        forward (ChunkPrefill.run_beside; see joins()). Returns the normed hidden state at each piece's last
        token, [n, D], and each piece's accept-layer rows at its media rows ([m, D], None without media rows
        or an accept layer)."""
        rows = []  # (piece, rows [<= CHUNK_TOKENS], slot, start)
        for i, (piece, slot, start) in enumerate(pieces):
            starts = range(0, piece.embeds.shape[0], CHUNK_TOKENS)
            rows += [(i, piece.cut(t, t + CHUNK_TOKENS), slot, start + t) for t in starts]
        # the short rows after the chunks: at most two buckets a step, and a piece's short row is its last
        rows.sort(key=lambda r: _length(r) <= PIECE_TOKENS)
        last = torch.empty(len(pieces), self.rows.hidden_out.shape[1], dtype=self.rows.hidden_out.dtype,
                           device=self.rows.hidden_out.device)  # fmt: skip
        accepted: list[list[torch.Tensor]] = [[] for _ in pieces]
        keep = self.rows.spans.accept_layer is not None
        for group in self._groups(rows, mixed=beside is not None):  # a prompt's rows stay in order
            args = ([r[1].embeds for r in group], [r[2] for r in group], [r[3] for r in group])
            kwargs = dict(positions=[r[1].positions for r in group], deepstack=[r[1].deepstack for r in group])
            if beside is not None:
                hidden = self.rows.run_beside(*beside, *args, **kwargs)
                beside = None
            else:
                hidden = self.rows.run(*args, **kwargs)
            for j, (i, part, *_) in enumerate(group):
                last[i] = hidden[j]  # a piece's later rows overwrite its earlier ones: its last row stays
                if keep and part.media is not None and part.media.numel():
                    where = to_device(part.media, hidden.device)
                    accepted[i].append(self.rows.spans.accept_out[j].index_select(0, where))
        return last, [torch.cat(a) if a else None for a in accepted]

    def joins(self, pieces: list[tuple[InputRows, int, int]], decode_shape: tuple[int, int]) -> bool:
        """Whether run() can take a decode step of that (rows, kv_len) shape beside these pieces: any where
        graphs are off; on CUDA pieces of one row each in a shape whose graphs are captured beside the
        decoder's (ROWS_BESIDE rows of a unit's or a chunk's bucket: a piece deep in a long prompt, where a
        step's attention budget leaves a unit or a few, or a step's new media prompts)."""
        if not self.rows.joint.enabled:
            return True
        tokens = max(piece.embeds.shape[0] for piece, _, _ in pieces)
        start = max(start for _, _, start in pieces)
        return tokens <= CHUNK_TOKENS and self.rows.joins(decode_shape, len(pieces), tokens, start)

    def _groups(self, rows: list[tuple], mixed: bool = False) -> list[list[tuple]]:
        """Consecutive rows cut into forwards of one token bucket that fit the ChunkPrefill (rows, attended
        positions): a short row in a forward of whole chunks would be padded to a chunk. mixed: the first
        forward, which rides a decode step, takes short rows beside chunks too, since a forward of their own
        would cost more than their padding."""
        groups = [[rows[0]]]
        for row in rows[1:]:
            group = groups[-1]
            tokens = max(_length(r) for r in [row, *group])
            same = (_length(row) > PIECE_TOKENS) == (_length(group[0]) > PIECE_TOKENS) or mixed and len(groups) == 1
            if same and self.rows.fits(len(group) + 1, tokens, max(row[3], *(r[3] for r in group))):
                group.append(row)
            else:
                groups.append([row])
        return groups

    def capture_all(self, pool) -> None:
        """Captures every bucket into the graph memory pool `pool` (shared with the static prefill's)."""
        self.rows.bank.pool = self.rows.joint.pool = pool
        self.rows.capture_all()

    def capture_beside(self, decoder) -> None:
        """Captures ROWS_BESIDE rows of a unit's and of a chunk's bucket beside each of the decoder's steps
        (run()'s beside), into the same pool."""
        self.rows.capture_beside(decoder, (PIECE_TOKENS, CHUNK_TOKENS), ROWS_BESIDE)


def _length(row: tuple) -> int:
    return row[1].embeds.shape[0]
