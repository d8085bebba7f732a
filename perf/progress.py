# A progress line on stderr: tqdm on a terminal where it is installed, else a plain line every few seconds
# (logs stay readable: no carriage-return redraws).
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, every_s: float = 5.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done = self.ok = self.failed = 0
        self._t0 = self._last = time.monotonic()
        try:
            if not sys.stderr.isatty():
                raise ImportError
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=label, file=sys.stderr, leave=True, dynamic_ncols=True)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.ok += ok
        self.failed += not ok
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(ok=self.ok, failed=self.failed, refresh=False)
        elif time.monotonic() - self._last >= self.every_s or self.done == self.total:
            self._last = time.monotonic()
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._t0
        print(
            f"[{self.label}] {self.done}/{self.total} ok={self.ok} failed={self.failed} ({elapsed:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    def close(self, note: str = "") -> None:
        if self._bar is not None:
            self._bar.close()
        elif note or self.done != self.total:  # update() already printed the final count
            self._line()
        if note:
            print(f"[{self.label}] {note}", file=sys.stderr, flush=True)
