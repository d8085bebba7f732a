# OpenAI `stop` strings, matched on the streamed reply text. Text that might be the start of a stop
# string is held back until the next delta decides it, so a streamed reply never shows a stop string or
# a part of one; the reply ends just before the first match.
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""  # text not yet released: it ends with a prefix of some stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` (plus what was held) that is safe to emit; sets `stopped` on a match."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = max((_overlap(buffer, s) for s in self.stops), default=0)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the reply: what was held back was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
