# Spoken replies kept for OpenAI's multi-turn audio: a reply's `audio.id` names its kept copy (transcript
# and pcm16) until `expires_at`, and a later request's assistant message {"audio": {"id": ...}} is resolved
# to that copy's transcript (the thinker reads its earlier turns as text). Bounded by count, bytes and
# age, all server settings; the oldest copies go first.
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class KeptAudio:
    transcript: str
    pcm16: bytes  # s16le 24 kHz mono
    expires_at: int  # unix seconds


class AudioStore:
    def __init__(self, *, max_items: int, max_bytes: int, ttl_s: int, clock=time.time) -> None:
        self.max_items, self.max_bytes, self.ttl_s, self.clock = max_items, max_bytes, ttl_s, clock
        self._items: OrderedDict[str, KeptAudio] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def expires_at(self) -> int:
        """When a reply kept now expires (what its `audio.expires_at` says)."""
        return int(self.clock()) + self.ttl_s

    def keep(self, audio_id: str, transcript: str, pcm16: bytes, expires_at: int) -> None:
        size = len(pcm16) + len(transcript.encode("utf-8"))
        if self.max_items < 1 or size > self.max_bytes:
            return  # kept nowhere: a later reference to it gets the same 400 as an expired one
        with self._lock:
            self._items[audio_id] = KeptAudio(transcript, pcm16, expires_at)
            self._bytes += size
            self._evict()

    def get(self, audio_id: str) -> KeptAudio | None:
        with self._lock:
            self._evict()
            return self._items.get(audio_id)

    def _evict(self) -> None:
        now = self.clock()
        while self._items:
            oldest_id, oldest = next(iter(self._items.items()))
            if oldest.expires_at > now and len(self._items) <= self.max_items and self._bytes <= self.max_bytes:
                break
            del self._items[oldest_id]
            self._bytes -= len(oldest.pcm16) + len(oldest.transcript.encode("utf-8"))
