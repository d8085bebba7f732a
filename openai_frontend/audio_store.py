# Spoken replies kept for OpenAI's multi-turn audio: a reply's `audio.id` names its transcript until
# `expires_at`, and a later request's assistant message {"audio": {"id": ...}} is resolved to it (the thinker
# reads its earlier turns as text, so the reply's samples are never needed again and are not kept: a kept
# reply costs its text, not seconds of pcm16). Bounded by count, bytes and age, all server settings; the
# oldest go first.
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class KeptReply:
    transcript: str
    expires_at: int  # unix seconds


class AudioStore:
    def __init__(self, *, max_items: int, max_bytes: int, ttl_s: int, clock=time.time) -> None:
        self.max_items, self.max_bytes, self.ttl_s, self.clock = max_items, max_bytes, ttl_s, clock
        self._items: OrderedDict[str, KeptReply] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def expires_at(self) -> int:
        """When a reply kept now expires (what its `audio.expires_at` says)."""
        return int(self.clock()) + self.ttl_s

    def keep(self, audio_id: str, transcript: str, expires_at: int) -> None:
        size = _size(transcript)
        if self.max_items < 1 or size > self.max_bytes:
            return  # kept nowhere: a later reference to it gets the same 400 as an expired one
        with self._lock:
            self._items[audio_id] = KeptReply(transcript, expires_at)
            self._bytes += size
            self._evict()

    def get(self, audio_id: str) -> KeptReply | None:
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
            self._bytes -= _size(oldest.transcript)


def _size(transcript: str) -> int:
    return len(transcript.encode("utf-8"))
