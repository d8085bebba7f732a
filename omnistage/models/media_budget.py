# A per-process budget of decoded media in flight: what the requests being preprocessed at once may hold,
# counted from their media's headers before anything is decoded (pixels x 3 bytes of an RGB image, 4 bytes
# per 16 kHz sample of a clip). One request over the whole budget can never run: a 400. One that would take
# the total over it waits for nobody: a 503 with Retry-After, as admission's refusals are.
from __future__ import annotations

import contextlib
import threading

from omnistage.core.errors import BadRequestError, OverloadedError


class MediaBudget:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_flight = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reserve(self, cost: int):
        if cost > self.max_bytes:
            raise BadRequestError(f"the request's media decode to {cost / 2**20:.0f} MiB, over this server's "
                                  f"limit of {self.max_bytes / 2**20:.0f} MiB per request")  # fmt: skip
        with self._lock:
            if self.in_flight + cost > self.max_bytes:
                raise OverloadedError("too much media being processed right now; retry shortly")
            self.in_flight += cost
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= cost
