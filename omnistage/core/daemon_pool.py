# Calls run on reused daemon threads. omni_ensemble serves each request on threads of its own (reading a
# stage stream blocks), three per request. Thread.start() waits until the new thread has
# run, which under a busy GIL (~190 request threads in one orchestrator at 64 W1 streams on the H200) is a
# wait for its turn: execute() paid it per request while the requests behind it queued in Triton. Here a
# call goes to an idle thread through a queue, and a thread is started only when none is idle. The threads
# are daemons, unlike concurrent.futures.ThreadPoolExecutor's, so a call that never returns (a stage stream
# that hangs) cannot hold up the process's exit when Triton unloads the model. A thread idle for longer than
# idle_timeout_s ends, so the pool follows the load down again instead of keeping its highest count.
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class DaemonPool:
    def __init__(self, name: str, idle_timeout_s: float = 1.0) -> None:
        self.name, self.idle_timeout_s = name, idle_timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call, or about to, that no submit() has counted on yet
        self.threads = 0  # alive

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs fn(*args) on an idle thread (a new one if none is idle); the Future holds its result."""
        future: Future = Future()
        with self._lock:
            start = self._idle == 0
            if start:
                self.threads += 1
            else:
                self._idle -= 1  # that thread takes this call (or an earlier one, whose thread takes this)
        self._calls.put((future, fn, args))
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{self.threads}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn, args = self._calls.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    # idle counts the waiting threads no call has been promised to; with none, a submit()
                    # has just counted on this one: it stays for that call
                    if self._idle > 0:
                        self._idle -= 1
                        self.threads -= 1
                        return
                continue
            result = error = None
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as e:  # the caller's to see, through the Future
                    error = e
            with self._lock:  # idle before the caller hears back: a call it makes next finds this thread
                self._idle += 1
            if error is not None:
                future.set_exception(error)
            elif not future.cancelled():
                future.set_result(result)
            del future, fn, args, result, error  # nothing of the call outlives it while the thread waits
