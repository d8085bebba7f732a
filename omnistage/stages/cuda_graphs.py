# CUDA graphs for the decode hot paths (nano-vllm / gpt-fast style): a step function that reads static
# input buffers and writes static output buffers is captured once per bucket key and replayed after.
# Padding a batch up to its bucket is the caller's job. Off CUDA (or with graphs disabled) the same
# function runs eagerly, so the CPU tests drive exactly the code the graphs capture.
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable

import torch

log = logging.getLogger(__name__)


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_rows (and max_rows itself)."""
    return [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 8)) + [max_rows]


def length_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """Powers of two from `smallest` up to max_len (and max_len itself): attention reads the bucket's
    positions, so a short-context batch does not pay for the longest slot the cache could hold."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class GraphBank:
    """Captured graphs by key, sharing one memory pool. `run(key, fn)`: fn() must only read and write
    tensors that outlive the call (static buffers), take no host decisions from device values, and do the
    same work for the same key every time."""

    def __init__(self, name: str, device: torch.device, enabled: bool):
        self.name = name
        self.enabled = bool(enabled) and device.type == "cuda"
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.captured_up_front = False  # capture_all ran: a key missing from it is a bucket-set bug

    def run(self, key: Hashable, fn: Callable[[], None]) -> None:
        if not self.enabled:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            if self.captured_up_front:  # a capture while serving stalls the stage and races its other threads
                log.warning("[%s] capturing a CUDA graph for %s while serving: capture_all left it out", self.name, key)
            graph = self.graphs[key] = self._capture(fn)
        graph.replay()

    def capture_all(self, keys: Iterable[Hashable], fn_for: Callable[[Hashable], Callable[[], None]]) -> None:
        """Captures every key up front (largest first, so smaller graphs reuse the pool's blocks)."""
        if not self.enabled:
            return
        started = time.perf_counter()
        keys = sorted(keys, reverse=True)
        for key in keys:
            if key not in self.graphs:
                self.graphs[key] = self._capture(fn_for(key))
        torch.cuda.synchronize()
        self.captured_up_front = True
        log.info("[%s] captured %d CUDA graphs in %.1f s", self.name, len(keys), time.perf_counter() - started)

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        # warm-up on a side stream (cuBLAS workspaces, lazy inits) before capturing, as PyTorch advises
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph
