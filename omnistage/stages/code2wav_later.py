# Streams' later Code2Wav chunks (those with carried state) decoded from static buffers and replayed as one
# CUDA graph per (batch size, frames bucket). Eager, a chunk's forward is ~550 launch-bound kernels: on
# the H200 a lone stream's 25-frame chunk took 28 ms where its kernels take a few
# (perf/results/h200-router-later-chunks.json), and its last chunk is on the way to the end of
# every reply. Eager chunks also run one forward per distinct
# (W, n, C') shape; here any later chunks share a forward. The shapes are made static by padding, exactly:
# - K/V: right-aligned in W = window - 1 rows; a stream with fewer (position < W) has its rows before frame
#   0 masked out (Code2WavRunner.transformer), so the attention sees the same keys.
# - new frames: appended after the chunk's n up to the frames bucket. Everything is causal (attention, convs,
#   the transposed convs' crops), so the padded rows change no real output; their samples are cut off.
# - conv context: the stream's C' carried rows, then its new rows, then padding, gathered into C + bucket rows.
#   A stream with C' < C (position < C) starts at its own frame 0, as the module's forward does.
from __future__ import annotations

import functools

import torch

from .code2wav import ChunkIn, ChunkOut, Code2WavRunner, StreamState, _last
from .cuda_graphs import GraphBank, bucket_for
from .host_copy import to_device


def frames_buckets(chunk_frames: int) -> list[int]:
    """Fifths of a chunk: a stream's last chunk pads by less than a fifth of a chunk."""
    return sorted({max(1, -(-chunk_frames * i // 5)) for i in range(1, 6)})


class LaterChunkDecoder:
    """Decodes chunks with carried state of at most chunk_frames frames, max_batch streams per replay (more
    run as several). Every batch size has its graph: at large batches the conv stack's work, not its
    launches, bounds a forward, and padded rows would be paid in full. Off CUDA, or without graphs, the same
    code runs eagerly."""

    def __init__(self, runner: Code2WavRunner, chunk_frames: int, max_batch: int, cuda_graphs: bool):
        self.runner, self.max_batch = runner, max_batch
        self.batch_buckets = list(range(1, max_batch + 1))
        self.frames_buckets = frames_buckets(chunk_frames)
        r, b, n = runner, max_batch, self.frames_buckets[-1]
        self.kv_rows, self.context = r.kv_frames, r.context_frames  # W, C
        self.codes = torch.zeros(b, n, r.num_quantizers, dtype=torch.long, device=r.device)
        self.past_kv = torch.zeros(b, len(r.layers), 2, r.kv_heads, self.kv_rows, r.head_dim, dtype=r.dtype,
                                   device=r.device)  # fmt: skip
        self.past_hidden = torch.zeros(b, self.context, r.hidden_size, dtype=r.dtype, device=r.device)
        self.position = torch.ones(b, 1, dtype=torch.long, device=r.device)
        self.row_sources = torch.zeros(b, self.context + n, dtype=torch.long, device=r.device)  # of the conv stack's rows
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # key -> wav, kv, hidden
        self.graphs = GraphBank("code2wav-later", r.device, cuda_graphs)
        self.chunks = 0  # chunks decoded

    def fits(self, chunks: list[ChunkIn]) -> bool:
        return len(chunks) > 0 and all(state is not None and state.position > 0
                                       and codes.shape[0] <= self.frames_buckets[-1] for codes, state in chunks)  # fmt: skip

    @torch.inference_mode()
    def capture_all(self) -> None:
        keys = [(b, n) for b in self.batch_buckets for n in self.frames_buckets]
        self.graphs.capture_all(keys, lambda key: functools.partial(self._forward, *key))

    def _forward(self, batch: int, frames: int) -> None:
        r = self.runner
        hidden, kv = r.transformer(self.codes[:batch, :frames], self.past_kv[:batch], self.position[:batch])
        rows = torch.cat([self.past_hidden[:batch], hidden], dim=1)  # [B, C + frames, D]
        index = self.row_sources[:batch, : self.context + frames, None].expand(-1, -1, rows.shape[2])
        rows = torch.gather(rows, 1, index)
        self.outputs[batch, frames] = (r.conv_stack(rows), kv, rows)

    @torch.inference_mode()
    def decode(self, chunks: list[ChunkIn]) -> list[ChunkOut]:
        """As Code2WavRunner.decode for chunks that fit (checked and range-checked by the caller). Results own
        their memory: the next replay overwrites the graph's outputs."""
        out: list[ChunkOut] = []
        for start in range(0, len(chunks), self.max_batch):
            out += self._decode(chunks[start : start + self.max_batch])
            self.runner.forwards += 1
        self.chunks += len(chunks)
        return out

    def _decode(self, chunks: list[ChunkIn]) -> list[ChunkOut]:
        r, batch = self.runner, len(chunks)
        frames = bucket_for(max(codes.shape[0] for codes, _ in chunks), self.frames_buckets)
        sources = []
        for i, (codes, state) in enumerate(chunks):
            n, w, c = codes.shape[0], state.kv.shape[3], state.hidden.shape[0]
            self.codes[i, :n].copy_(codes)  # rows n..frames keep earlier codes: valid ids, outputs never read
            self.past_kv[i, :, :, :, self.kv_rows - w :].copy_(state.kv)  # rows before are masked
            self.past_hidden[i, :c].copy_(state.hidden)
            # conv-stack row j reads the carried row j (j < C'), then the new frames, then repeats the last one
            source = list(range(c)) + [self.context + j for j in range(frames)]
            source += [source[-1]] * (self.context - c)
            sources.append(source)
        # host values through pinned memory: a pageable copy would wait for the device (host_copy.py)
        self.row_sources[:batch, : self.context + frames].copy_(to_device(sources, r.device))
        self.position[:batch, 0].copy_(to_device([state.position for _, state in chunks], r.device))
        self.graphs.run((batch, frames), functools.partial(self._forward, batch, frames))
        wav, kv, rows = self.outputs[batch, frames]
        results = []
        for i, (codes, state) in enumerate(chunks):
            n, c = codes.shape[0], state.hidden.shape[0]
            first = r.new_samples_start(c)
            audio = wav[i, first : first + n * r.samples_per_frame].to(torch.float32, copy=True)
            new_kv = _last(kv[i, :, :, :, : self.kv_rows + n], 3, min(state.position + n, self.kv_rows))
            new_hidden = _last(rows[i, : c + n], 0, min(c + n, self.context))
            results.append((audio, StreamState(new_kv.clone(), new_hidden.clone(), state.position + n)))
        return results
