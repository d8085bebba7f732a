# Admission control of a stage that serves requests on threads of its own (omni_ensemble): at most
# `max_inflight` run at once, at most `max_queue` more wait for a turn, and anything beyond is refused
# at once with OverloadedError (a 503 with Retry-After at the frontend) instead of queueing without
# bound. Refusing early is the point: a queued request holds memory and, in Triton, a response stream.
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from .errors import OverloadedError


class Admission:
    def __init__(self, name: str, max_inflight: int, max_queue: int, max_wait_s: float | None = None):
        if max_inflight < 1 or max_queue < 0:
            raise ValueError(f"{name}: need max_inflight >= 1 and max_queue >= 0")
        self.name, self.max_inflight, self.max_queue = name, max_inflight, max_queue
        self.max_wait_s = max_wait_s  # a request queued longer is refused (OverloadedError); None: no bound
        self._turns = threading.Semaphore(max_inflight)
        self._lock = threading.Lock()
        self.admitted = 0  # running + waiting
        self.running = 0
        self.rejected = 0

    def admit(self) -> None:
        """Reserve a place (running or waiting); raises OverloadedError when both are full."""
        with self._lock:
            if self.admitted >= self.max_inflight + self.max_queue:
                self.rejected += 1
                raise OverloadedError(f"{self.name} is overloaded ({self.running} requests running, "
                                      f"{self.admitted - self.running} queued); retry later")  # fmt: skip
            self.admitted += 1

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for a running slot (at most max_wait_s, then OverloadedError); the place taken by admit() is
        given back on exit, whatever happens."""
        try:
            if not self._turns.acquire(timeout=self.max_wait_s):
                with self._lock:
                    self.rejected += 1
                raise OverloadedError(f"{self.name} is overloaded: no turn within {self.max_wait_s:.0f}s in its "
                                      f"queue; retry later")  # fmt: skip
            try:
                with self._lock:
                    self.running += 1
                try:
                    yield
                finally:
                    with self._lock:
                        self.running -= 1
            finally:
                self._turns.release()
        finally:
            self.leave()

    def leave(self) -> None:
        """Give back a place taken by admit() that never got a turn()."""
        with self._lock:
            self.admitted -= 1

    @property
    def waiting(self) -> int:
        return self.admitted - self.running
