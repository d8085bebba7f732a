# Server-side turn detection for one session (`turn_detection: {"type": "server_vad", ...}`): WebRTC's
# voice activity detector (a GMM over sub-band energies, a few microseconds per 20 ms frame, so hundreds
# of sessions cost little CPU) decides voiced or not per frame; speech starts when most of the last
# START_FRAMES frames are voiced and stops after `silence_duration_ms` without a voiced frame. WebRTC's
# detector also calls steady noise speech, so a frame counts as voiced only above a level as well.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import webrtcvad

from openai_frontend.realtime.audio import MODEL_INPUT_RATE

FRAME_MS = 20
FRAME_SAMPLES = MODEL_INPUT_RATE * FRAME_MS // 1000
START_FRAMES = 5  # 100 ms window; speech starts when at least START_VOICED of them are voiced
START_VOICED = 3


def aggressiveness(threshold: float) -> int:
    """OpenAI's threshold (0..1, higher needs clearer speech) as WebRTC's aggressiveness mode (0..3)."""
    return min(3, max(0, int(threshold * 4)))


def level_floor(threshold: float) -> float:
    """The RMS (full scale 1.0) a voiced frame needs: -60 dBFS at threshold 0, -40 at 0.5, -20 at 1."""
    return 10.0 ** ((-60.0 + 40.0 * threshold) / 20.0)


@dataclass
class VadEvent:
    kind: str  # "speech_started" | "speech_stopped"
    audio_ms: int  # session audio position: the start with prefix padding, or where silence ended the turn


class TurnDetector:
    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500):
        self._vad = webrtcvad.Vad(aggressiveness(threshold))
        self._floor = level_floor(threshold) * 32767.0  # on int16 samples
        self.prefix_padding_ms, self.silence_duration_ms = prefix_padding_ms, silence_duration_ms
        self._pending = np.zeros(0, dtype=np.int16)  # samples short of a whole frame
        self._frames = 0  # frames seen since the session started
        self._recent: list[bool] = []  # the last START_FRAMES decisions
        self._speaking = False
        self._silent_ms = 0

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """16 kHz float32 samples in; the turn events they complete, in order."""
        pcm = np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        pcm = np.concatenate([self._pending, pcm]) if self._pending.size else pcm
        whole = pcm.size // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = pcm[whole:]
        events = []
        for frame in pcm[:whole].reshape(-1, FRAME_SAMPLES):
            loud = np.sqrt(np.mean(frame.astype(np.float32) ** 2)) >= self._floor
            voiced = loud and self._vad.is_speech(frame.tobytes(), MODEL_INPUT_RATE)
            self._frames += 1
            event = self._step(voiced)
            if event is not None:
                events.append(event)
        return events

    def _step(self, voiced: bool) -> VadEvent | None:
        self._recent = (self._recent + [voiced])[-START_FRAMES:]
        end_ms = self._frames * FRAME_MS
        if not self._speaking:
            if sum(self._recent) >= START_VOICED:
                self._speaking, self._silent_ms = True, 0
                start = end_ms - len(self._recent) * FRAME_MS
                return VadEvent("speech_started", max(0, start - self.prefix_padding_ms))
            return None
        self._silent_ms = 0 if voiced else self._silent_ms + FRAME_MS
        if self._silent_ms >= self.silence_duration_ms:
            self._speaking, self._recent = False, []
            return VadEvent("speech_stopped", end_ms)
        return None

    @property
    def speaking(self) -> bool:
        return self._speaking
