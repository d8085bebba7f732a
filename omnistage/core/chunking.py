# Chunk schedule of the orchestrator: when a stream of codec frames is cut into Code2Wav windows.
# Torch-free on purpose (the orchestrator and its tests run without a model).
#
# Code2Wav is causal, but the last `tail` samples (555 for Qwen3-Omni) of any window are not final: a window
# that decodes frames [a, e) gives final samples only up to e*spf - tail (spf = 1920 samples per frame). So a
# window that emits frames [start, end) re-decodes at least one frame of left context and returns global
# samples [start*spf - tail, end*spf - tail) (from 0 for the first window); the final window returns up to
# the end of the full decode. Concatenated, the windows have exactly the full decode's length. More left
# context moves the samples closer to the full decode (the pre-transformer sees further back).
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int  # first frame whose samples this window emits
    end: int  # one past the last emitted frame
    context: int  # frames before `start` that are decoded as left context only

    @property
    def decode_start(self) -> int:
        return self.start - self.context

    @property
    def frames(self) -> int:  # frames the decoder runs over
        return self.end - self.decode_start


def _require_positive_int(name: str, value: object, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ChunkSchedule.{name} must be an int >= 1{why}, got {value!r}")


@dataclass(frozen=True)
class ChunkSchedule:
    # vLLM-Omni deploy defaults: first audio after 4 frames (320 ms), then every 25 frames (2 s), each window
    # with up to 25 frames of left context (steady state: decode 50 frames to emit 25).
    first_chunk_frames: int = 4
    chunk_frames: int = 25
    left_context_frames: int = 25

    def __post_init__(self) -> None:
        _require_positive_int("first_chunk_frames", self.first_chunk_frames)
        _require_positive_int("chunk_frames", self.chunk_frames)
        _require_positive_int(
            "left_context_frames",
            self.left_context_frames,
            " (every window after the first re-decodes at least one frame to re-emit the non-final tail"
            " of the previous window)",
        )

    def cutter(self) -> ChunkCutter:
        return ChunkCutter(self)


class ChunkCutter:
    """Cuts one request's frame stream into windows; push() as frames arrive, finish() once at the end."""

    def __init__(self, schedule: ChunkSchedule):
        self.schedule = schedule
        self.total = 0  # frames pushed so far
        self.emitted = 0  # frames covered by windows handed out so far
        self.finished = False

    def push(self, n_new_frames: int) -> list[Window]:
        if self.finished:
            raise RuntimeError("ChunkCutter.push() after finish()")
        if isinstance(n_new_frames, bool) or not isinstance(n_new_frames, int) or n_new_frames < 0:
            raise ValueError(f"n_new_frames must be an int >= 0, got {n_new_frames!r}")
        self.total += n_new_frames
        windows = []
        while True:
            size = self.schedule.first_chunk_frames if self.emitted == 0 else self.schedule.chunk_frames
            if self.total - self.emitted < size:
                return windows
            windows.append(self._cut(self.emitted + size))

    def finish(self) -> list[Window]:
        if self.finished:
            raise RuntimeError("ChunkCutter.finish() called twice")
        self.finished = True
        return [self._cut(self.total)] if self.total > self.emitted else []

    def _cut(self, end: int) -> Window:
        start = self.emitted
        self.emitted = end
        return Window(start, end, min(self.schedule.left_context_frames, start))
