# A session's input audio buffer: appended audio in the session's format, kept at the model's 16 kHz as
# pcm16 until it is committed, with server VAD run over it. Positions are in the session's audio time
# (16 kHz samples since the session started), which is what speech_started / speech_stopped report in ms.
from __future__ import annotations

from typing import Any

import numpy as np

from openai_frontend.realtime.audio import MODEL_INPUT_RATE, InputAudio, float_to_pcm16
from openai_frontend.realtime.events import EventError
from openai_frontend.realtime.vad import FRAME_MS, START_FRAMES, TurnDetector, VadEvent

SAMPLES_PER_MS = MODEL_INPUT_RATE // 1000


class InputBuffer:
    def __init__(self, fmt: str, turn_detection: dict[str, Any] | None, max_seconds: float):
        self.max_seconds = max_seconds
        self.audio = InputAudio(fmt)
        self.turn_detection = turn_detection
        self.vad = _detector(turn_detection)
        self.pcm = bytearray()  # uncommitted: 16 kHz pcm16
        self.start = 0  # session sample of pcm[0]
        self.fed = 0  # samples received in the session

    def reconfigure(self, fmt: str, turn_detection: dict[str, Any] | None) -> None:
        if fmt != self.audio.format:
            self.audio = InputAudio(fmt)
        if turn_detection != self.turn_detection:
            self.turn_detection, self.vad = turn_detection, _detector(turn_detection)

    def append(self, raw: bytes) -> list[VadEvent]:
        """Append client audio; the turns it completes (none without server VAD)."""
        samples = self.audio.feed(raw)
        self._add(samples)
        if len(self.pcm) / 2 / MODEL_INPUT_RATE > self.max_seconds:
            raise EventError(f"more than {self.max_seconds:g} s of uncommitted input audio; commit or clear the "
                             "buffer sooner", code="input_audio_buffer_too_large", param="audio", close=True)  # fmt: skip
        return [] if self.vad is None else self.vad.feed(samples)

    def trim_idle(self) -> None:
        """Between turns only the prefix padding and the detector's start window are worth keeping."""
        if self.vad is not None and not self.vad.speaking:
            keep_ms = self.turn_detection["prefix_padding_ms"] + START_FRAMES * FRAME_MS + 100
            self.drop_before(self.fed - keep_ms * SAMPLES_PER_MS)

    def drop_before(self, sample: int) -> None:
        if sample > self.start:
            del self.pcm[: 2 * (sample - self.start)]
            self.start = sample

    def take_until(self, audio_end_ms: int) -> bytes:
        """The buffered audio up to audio_end_ms (a detected turn); the rest stays."""
        end = min(len(self.pcm) // 2, max(0, audio_end_ms * SAMPLES_PER_MS - self.start))
        taken = bytes(self.pcm[: 2 * end])
        self.drop_before(self.start + end)
        return taken

    def take_all(self) -> bytes:
        """Everything buffered, including what the resampler still held (a client's commit)."""
        self._add(self.audio.flush())
        return self.take_until(self.fed // SAMPLES_PER_MS + 1)

    def clear(self) -> None:
        self.drop_before(self.start + len(self.pcm) // 2)

    def _add(self, samples: np.ndarray) -> None:
        self.fed += samples.size
        self.pcm += float_to_pcm16(samples).tobytes()


def _detector(turn_detection: dict[str, Any] | None) -> TurnDetector | None:
    if turn_detection is None:
        return None
    td = turn_detection
    return TurnDetector(td["threshold"], td["prefix_padding_ms"], td["silence_duration_ms"])
