# Chunk schedule of the orchestrator: when a request's stream of codec frames is cut into Code2Wav chunks.
# Torch-free on purpose (the orchestrator and its tests run without a model).
#
# Each chunk carries only its new frames: Code2Wav streams with carried state (stages/code2wav.py), so no
# left context is re-sent and the chunks, concatenated, are exactly the full decode whatever the sizes.
#
# Two schedules. The fixed one (the first chunk, then chunk_frames at a time) makes the fewest Code2Wav calls,
# for clients that want the whole reply soon (text to speech). The playback one is for audio played as it
# arrives (realtime sessions): there chunk k must be back before chunks 1..k-1 finish playing, and a
# session's Code2Wav calls run one after another, each 170-200 ms on the H200 at 32-64 sessions (full-size
# config, dummy weights), so every chunk must play longer than a call takes. Its first chunk is at least
# PLAYBACK_FIRST_FRAMES (480 ms), whatever the profile's first chunk: with the cuda profile's 1-frame first
# chunk every realtime turn at 32 sessions ran dry. Later chunks ramp up, each 3/5 of the frames cut before
# it, at least PLAYBACK_MIN_FRAMES (6, 4, 6, 9, 15, 24, then chunk_frames): the audio already cut stays ahead
# of playback while the talker makes a frame in up to 40 ms (2x real time) and a later call takes up to
# 300 ms (perf/playback_model.py; its --rules view compares neighbouring rules).
from __future__ import annotations

from dataclasses import dataclass, replace

PLAYBACK_FIRST_FRAMES = 6  # 480 ms
PLAYBACK_MIN_FRAMES = 4  # 320 ms


@dataclass(frozen=True)
class Window:
    start: int  # first frame of the chunk
    end: int  # one past its last frame

    @property
    def frames(self) -> int:
        return self.end - self.start


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ChunkSchedule.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ChunkSchedule:
    # vLLM-Omni deploy defaults: first audio after 4 frames (320 ms), then every 25 frames (2 s)
    first_chunk_frames: int = 4
    chunk_frames: int = 25
    playback: bool = False  # later chunks ramp up to chunk_frames (the playback schedule above)

    def __post_init__(self) -> None:
        _require_positive_int("first_chunk_frames", self.first_chunk_frames)
        _require_positive_int("chunk_frames", self.chunk_frames)

    def cutter(self) -> ChunkCutter:
        return ChunkCutter(self)

    def for_playback(self) -> ChunkSchedule:
        return replace(self, playback=True, first_chunk_frames=max(self.first_chunk_frames, PLAYBACK_FIRST_FRAMES))

    def next_frames(self, emitted: int) -> int:
        """Frames of the chunk that starts after `emitted` frames."""
        if emitted == 0:
            return self.first_chunk_frames
        if not self.playback:
            return self.chunk_frames
        return min(self.chunk_frames, max(PLAYBACK_MIN_FRAMES, emitted * 3 // 5))


@dataclass(frozen=True)
class ChunkPolicy:
    """Which schedule a new request gets. `light` (typically a smaller first chunk) while at most
    `light_load_requests` requests are in flight, the new one counted: a lone stream then hears its first
    audio sooner, at a cost (more, smaller Code2Wav forwards) that only matters under load, where
    `schedule` applies. Without `light`, always `schedule`."""

    schedule: ChunkSchedule = ChunkSchedule()
    light: ChunkSchedule | None = None
    light_load_requests: int = 1

    def for_load(self, in_flight: int, playback: bool = False) -> ChunkSchedule:
        """The schedule of a new request; `playback`: its audio is played as it arrives (realtime)."""
        schedule = self.light if self.light is not None and in_flight <= self.light_load_requests else self.schedule
        return schedule.for_playback() if playback else schedule


class ChunkCutter:
    """Cuts one request's frame stream into chunks; push() as frames arrive, finish() once at the end."""

    def __init__(self, schedule: ChunkSchedule):
        self.schedule = schedule
        self.total = 0  # frames pushed so far
        self.emitted = 0  # frames covered by chunks handed out so far
        self.finished = False

    def push(self, n_new_frames: int) -> list[Window]:
        if self.finished:
            raise RuntimeError("ChunkCutter.push() after finish()")
        if isinstance(n_new_frames, bool) or not isinstance(n_new_frames, int) or n_new_frames < 0:
            raise ValueError(f"n_new_frames must be an int >= 0, got {n_new_frames!r}")
        self.total += n_new_frames
        windows = []
        while True:
            size = self.schedule.next_frames(self.emitted)
            if self.total - self.emitted < size:
                return windows
            windows.append(self._cut(self.emitted + size))

    def finish(self) -> list[Window]:
        if self.finished:
            raise RuntimeError("ChunkCutter.finish() called twice")
        self.finished = True
        return [self._cut(self.total)] if self.total > self.emitted else []

    def _cut(self, end: int) -> Window:
        start, self.emitted = self.emitted, end
        return Window(start, end)
