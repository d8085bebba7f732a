# Keeps finished BLS response iterators until Triton 2.51's stub has let go of them, so that their last
# reference, and with it every response, tensor and numpy array they hold, is dropped on one of our
# threads, with the GIL.
#
# Why: the stub keeps a table of response iterators. Its stub-to-parent thread (native, no Python thread
# state) erases an iterator from that table once the stream has ended (pb_stub.cc, SendCleanupId). When
# that erase drops the last reference, the iterator and all its responses are freed in that thread, off
# the GIL. Every tensor of a response owns numpy arrays (two empty ones even for BF16 and GPU tensors: the
# default members of PbTensor), and freeing them there corrupts the heap while our threads run Python.
#
# When: that thread serves one FIFO queue: the cleanup of a finished stream and each is_cancelled() query
# go through it in the order they were made, and is_cancelled() waits for its own answer. So once an
# is_cancelled() call that began after a stream ended has returned with a round trip (False: a request
# already known to be cancelled answers from a cache), the stub has erased that stream's iterator, and ours
# is the last reference. The caller must make every is_cancelled() call of its requests from one thread:
# concurrent calls on one request share a single query, which may have been queued before the cleanup.
from __future__ import annotations

import threading
from typing import Any, Callable


class IteratorReaper:
    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[tuple[int, Any]] = []  # (sequence number, iterator), oldest first
        self._sequence = 0

    def hold(self, iterator: Any) -> None:
        """A stream read to its end: its iterator's cleanup is already queued in the stub."""
        with self._lock:
            self._sequence += 1
            self._held.append((self._sequence, iterator))

    @property
    def held(self) -> int:
        return len(self._held)

    def mark(self) -> int:
        """Call before the barrier query; pass the result to release_through() once it has returned."""
        with self._lock:
            return self._sequence

    def release_through(self, mark: int) -> int:
        """Drops the iterators held up to `mark`, on the calling thread; returns how many."""
        with self._lock:
            n = 0
            while n < len(self._held) and self._held[n][0] <= mark:
                n += 1
            released, self._held = self._held[:n], self._held[n:]
        del released  # the last references go here, outside the lock
        return n

    def barrier(self, queries: Callable[[], bool]) -> bool:
        """Runs `queries` (is_cancelled() calls), which returns whether one of them made the round trip
        (answered False); if one did, releases what was held before they began. Returns that answer."""
        mark = self.mark()
        answered = queries()
        if answered:
            self.release_through(mark)
        return answered
