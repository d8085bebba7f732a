# The order in which a response thread asks Triton whether the clients of its open requests have left
# (torch- and Triton-free). Each is_cancelled() is an IPC round trip through the stub (~0.13 ms measured
# on the CPU machine, more under load), so asking all N open requests at every poll held the response
# thread for N round trips while responses waited: at 48 W1 streams on the CPU, omni_ensemble's thread
# spent 2.0 s of a 16.5 s level polling. A poll now asks for a bounded time and the next poll goes on
# where it stopped, so every request is still asked, one lap spread over several polls.
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator


class PollRing:
    def __init__(self):
        self._lock = threading.Lock()
        self._ring: deque[str] = deque()
        self._members: set[str] = set()

    def add(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._members:
                self._members.add(request_id)
                self._ring.append(request_id)

    def discard(self, request_id: str) -> None:
        """Its entry leaves the ring when a lap reaches it."""
        with self._lock:
            self._members.discard(request_id)

    def __len__(self) -> int:
        return len(self._members)

    def lap(self, more: Callable[[], bool] = lambda: True) -> Iterator[str]:
        """Yields the members, each at most once, from where the previous lap stopped; before each one after
        the first it asks more() whether to go on (a time budget). Requests added meanwhile wait for their
        turn at the end of the ring."""
        with self._lock:
            count = len(self._ring)
        first = True
        for _ in range(count):
            with self._lock:
                if not self._ring:
                    return
                request_id = self._ring.popleft()
                if request_id not in self._members:
                    continue
                self._ring.append(request_id)
            if not first and not more():
                with self._lock:  # not asked: it goes first next time
                    if self._ring and self._ring[-1] == request_id:
                        self._ring.pop()
                        self._ring.appendleft(request_id)
                return
            first = False
            yield request_id
