# New streams' first Code2Wav chunks, the chunks a time to first audio waits for, decoded from static
# buffers and replayed as one CUDA graph per batch bucket. Eager, a first chunk of 2-4 frames costs ~2 ms
# of kernels but 15-30 ms of launches (~550 kernels; perf/results/h200-step-streams.json), and in
# the served stage it also queued behind a forward of later chunks. A first chunk has no carried state, so
# its shapes depend only on (streams, frames): a fixed set of graphs covers it.
from __future__ import annotations

import functools

import torch

from .code2wav import ChunkIn, ChunkOut, Code2WavRunner, StreamState
from .cuda_graphs import GraphBank, batch_buckets, bucket_for
from .host_copy import to_device


class FirstChunkDecoder:
    """Decodes batches of first chunks of `frames` frames (up to max_batch streams); other chunks do not
    `fit` and go to Code2WavRunner.decode_groups. Off CUDA, or without graphs, the same code runs eagerly."""

    def __init__(self, runner: Code2WavRunner, frames: int, max_batch: int, cuda_graphs: bool):
        self.runner, self.frames, self.max_batch = runner, frames, max_batch
        self.buckets = batch_buckets(max_batch)
        self.codes = torch.zeros(max_batch, frames, runner.num_quantizers, dtype=torch.long, device=runner.device)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bucket -> wav, kv, hidden
        self.graphs = GraphBank(f"code2wav-first{frames}", runner.device, cuda_graphs)

    def fits(self, chunks: list[ChunkIn]) -> bool:
        return 0 < len(chunks) <= self.max_batch and all(
            state is None and codes.shape[0] == self.frames for codes, state in chunks)  # fmt: skip

    @torch.inference_mode()
    def capture_all(self) -> None:
        self.graphs.capture_all(self.buckets, lambda b: functools.partial(self._forward, b))

    def _forward(self, bucket: int) -> None:
        self.outputs[bucket] = self.runner.forward_first(self.codes[:bucket])

    @torch.inference_mode()
    def decode(self, chunks: list[ChunkIn]) -> list[ChunkOut]:
        """As Code2WavRunner.decode for chunks that fit (range-checked by the caller). Results own their
        memory: the next replay overwrites the graph's outputs."""
        n = len(chunks)
        bucket = bucket_for(n, self.buckets)
        self.codes[:n].copy_(to_device(torch.stack([codes for codes, _ in chunks]), self.codes.device))
        # rows n..bucket keep earlier codes: valid ids, and their outputs are never read
        self.graphs.run(bucket, functools.partial(self._forward, bucket))
        self.runner.forwards += 1
        wav, kv, hidden = self.outputs[bucket]
        return [(wav[i].to(torch.float32, copy=True), StreamState(kv[i].clone(), hidden[i].clone(), self.frames))
                for i in range(n)]
