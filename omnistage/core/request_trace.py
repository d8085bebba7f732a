# Optional per-request timestamps across processes, for finding where a request waits between the client,
# the frontend and omni_ensemble (their own metrics each start their clock at their own arrival, so the hops
# between processes are visible in none of them). Off unless OMNI_TRACE_DIR is set; each process then appends
# one JSON line per finished request to OMNI_TRACE_DIR/<component>-<pid>.jsonl. Times are time.perf_counter()
# values: on Linux that is CLOCK_MONOTONIC, one clock for every process of the host, so stamps from different
# processes compare directly (not across hosts). perf/trace_join.py lines them up by request id.
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

TRACE_DIR_ENV = "OMNI_TRACE_DIR"


class RequestTrace:
    def __init__(self, component: str, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{component}-{os.getpid()}.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # several threads of a process finish requests

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()  # read while the server runs (after each benchmark level)


def request_trace(component: str) -> RequestTrace | None:
    """The process's trace for `component` when OMNI_TRACE_DIR is set, else None."""
    directory = os.environ.get(TRACE_DIR_ENV)
    return RequestTrace(component, Path(directory)) if directory else None
