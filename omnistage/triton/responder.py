# The response thread of a decoupled model. The engine thread hands outputs over without blocking; this
# thread sends them, because response_sender.send() blocks for an IPC round trip (~0.3 ms idle, 0.7-2 ms
# per response on the H200 at 64 streams). Whatever piled up for one request while it was sending is merged
# into a single response, so under load the number of responses per request falls instead of the backlog
# growing (adaptive coalescing). It also asks Triton which clients have left. (Four such threads per stage
# sent in parallel but each send took 3-5x longer: 25.1 against 27.0 req/s at 64 W1 streams on the H200.)
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import triton_python_backend_utils as pb_utils

from ..core.errors import EngineError, OmniError, to_wire
from ..core.poll_ring import PollRing
from .iterator_reaper import IteratorReaper
from .tensors import output_tensors
from .workarounds import CANCEL_GRACE_SECONDS, SEND_STALL_SECONDS, UNDELIVERABLE_MARK

log = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.05
# is_cancelled() queries per poll stop after this long; the next poll goes on from there (core/poll_ring.py)
POLL_BUDGET_SECONDS = 0.002


def error_response(error: Exception):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(error)))


def cancelled_response():
    """The final answer to a request Triton cancelled (its client left): the CANCELLED error the Python
    backend documents for it, with no tensors."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError("[499] cancelled by the client",
                                                                 pb_utils.TritonError.CANCELLED))  # fmt: skip


def answer_probe(sender, responder: "Responder | None") -> None:
    """A health probe's answer: an error while the responder's current send() has been blocked too long,
    which a send toward a dead caller does (workarounds.py, 3): the stage must be reloaded."""
    stalled = responder.stalled_seconds() if responder is not None else 0.0
    if stalled < SEND_STALL_SECONDS:
        send_final(sender)
    else:
        send_final(sender, error_response(EngineError(f"[{responder.name}] {UNDELIVERABLE_MARK}: a response "
                                                      f"send has been blocked for {stalled:.0f}s")))  # fmt: skip


def send_final(sender, response=None) -> None:
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as e:  # the client may be gone (cancelled); nothing else to do for it
        # a warning, not a debug line: when the caller is omni_ensemble, a lost final leaves its stream open
        log.warning("final send failed: %s", e)


class Responder:
    def __init__(self, name: str, encode: Callable[[Any, "str | None"], dict], on_cancel: Callable[[str], None],
                 reaper: IteratorReaper | None = None):  # fmt: skip
        self.name = name
        self.encode = encode  # (output or None, finish_reason or None) -> {name: torch.Tensor or str}
        self.on_cancel = on_cancel
        # A model that makes BLS calls (omni_ensemble) passes its reaper: this thread's cancellation queries
        # are the barriers after which it drops finished stream iterators. Every is_cancelled() call of this
        # model's requests is made here, on this one thread, which the reaper requires.
        self.reaper = reaper
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (sender, bf16_bytes): bf16_bytes for omni_ensemble's BLS calls (tensors.wants_bf16_bytes)
        self._senders: dict[str, tuple[Any, bool]] = {}
        self._cancelled: dict[str, float] = {}  # request id -> when its client was seen gone
        # request id -> (when its caller last sent something for it, how long it may be silent): requests fed
        # by later requests of their caller (a talker's appends), which end when it falls silent
        # (workarounds.py, 12)
        self._expected: dict[str, tuple[float, float]] = {}
        self._send_started = 0.0  # monotonic start of the send() in progress, 0 between sends
        self._poll_ring = PollRing()  # who is asked next whether its client left
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-responder", daemon=True)
        self._running = True
        self.responses_sent = 0
        # where the response thread's time goes: making the tensors, Triton's send() (an IPC round trip, plus a
        # device copy per CUDA tensor) and is_cancelled() queries (a round trip each)
        self.encode_seconds = 0.0
        self.send_seconds = 0.0
        self.poll_seconds = 0.0
        # requests answered with data, and their summed seconds from register() to that first response sent:
        # the model's own part of a request's first output (queue, first step, this thread)
        self._registered_at: dict[str, float] = {}
        self.first_responses = 0
        self.first_response_seconds = 0.0
        # summed seconds from an output's emit() to its response sent (the oldest of those merged into it), and
        # the first part of that: until this thread took it off its queue (the rest is its round: the sends
        # before its own, and its own)
        self.delay_seconds = 0.0
        self.pickup_seconds = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._queue.put(None)
        self._thread.join(5)

    def register(self, request_id: str, sender, bf16_bytes: bool = False) -> None:
        with self._lock:
            self._senders[request_id] = (sender, bf16_bytes)
            self._registered_at[request_id] = time.perf_counter()
        self._poll_ring.add(request_id)

    def unregister(self, request_id: str, sender) -> None:
        with self._lock:
            if self._senders.get(request_id, (None,))[0] is sender:
                del self._senders[request_id]
                self._registered_at.pop(request_id, None)
                self._expected.pop(request_id, None)
                self._poll_ring.discard(request_id)

    def expect_caller(self, request_id: str, silent_s: float) -> None:
        """The request's caller feeds it through later requests: if it sends nothing for silent_s (heard_from),
        the caller is taken to be gone and the request is cancelled."""
        with self._lock:
            self._expected[request_id] = (time.monotonic(), silent_s)

    def heard_from(self, request_id: str, last: bool = False) -> None:
        """The caller sent something for the request; last: nothing more will come (it stops being expected)."""
        with self._lock:
            if last:
                self._expected.pop(request_id, None)
            elif request_id in self._expected:
                self._expected[request_id] = (time.monotonic(), self._expected[request_id][1])

    def emit(self, request_id: str, output, finish_reason: str | None, error: OmniError | None) -> None:
        """Engine callback: must not block."""
        self._queue.put((request_id, output, finish_reason, error, time.perf_counter()))

    @property
    def active(self) -> int:
        return len(self._senders)

    def stalled_seconds(self) -> float:
        """How long the send() in progress has been blocked (0 when none is)."""
        started = self._send_started
        return time.monotonic() - started if started else 0.0

    def _loop(self) -> None:
        last_poll = 0.0
        while self._running:
            try:
                items = [self._queue.get(timeout=CANCEL_POLL_SECONDS)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            picked = time.perf_counter()
            for request_id, (output, finish_reason, error, emitted) in self._coalesce(items).items():
                self._send(request_id, output, finish_reason, error, emitted, picked)
            if time.monotonic() - last_poll >= CANCEL_POLL_SECONDS:
                last_poll = time.monotonic()
                t0 = time.perf_counter()
                self._poll_cancellation()
                self.poll_seconds += time.perf_counter() - t0
                self._cancel_silent()
                self._answer_abandoned()

    @staticmethod
    def _coalesce(items) -> "OrderedDict[str, list]":
        merged: OrderedDict[str, list] = OrderedDict()
        for item in items:
            if item is None:
                continue
            request_id, output, finish_reason, error, emitted = item
            entry = merged.get(request_id)
            if entry is None:
                merged[request_id] = [output, finish_reason, error, emitted]  # the oldest emit's time is kept
                continue
            if output is not None:
                entry[0] = output if entry[0] is None else entry[0].merge(output)
            entry[1] = entry[1] or finish_reason
            entry[2] = entry[2] or error
        return merged

    def _send(self, request_id: str, output, finish_reason: str | None, error: OmniError | None,
              emitted: float | None = None, picked: float | None = None) -> None:  # fmt: skip
        final = finish_reason is not None or error is not None
        with self._lock:
            entry = self._senders.pop(request_id, None) if final else self._senders.get(request_id)
            registered_at = self._registered_at.pop(request_id, None) if output is not None or final else None
            if final:
                self._expected.pop(request_id, None)
        if final:
            self._poll_ring.discard(request_id)
        if entry is None:
            return
        sender, bf16_bytes = entry
        if request_id in self._cancelled:  # the client is gone: nothing more for it but the final
            if final:
                send_final(sender, cancelled_response())
                self._cancelled.pop(request_id, None)
            return

        def response(reason):
            return pb_utils.InferenceResponse(output_tensors=output_tensors(self.encode(output, reason), bf16_bytes))

        t0 = time.perf_counter()
        try:  # our part first: a failure here is a bug, and the stream still ends with an error
            if error is not None:  # what was produced before the failure still goes out, then the error
                data, last = (None if output is None else response(None)), error_response(error)
            elif final:
                data, last = None, response(finish_reason)
            else:
                data, last = response(None), None
        except Exception as e:
            log.exception("[%s] encoding a response for %s failed", self.name, request_id)
            self._end(request_id, sender, final, error_response(EngineError(f"[{self.name}] bad response: {e}")))
            return
        t1 = time.perf_counter()
        self.encode_seconds += t1 - t0
        self._send_started = time.monotonic()
        try:
            if data is not None:
                sender.send(data)
            if final and self.reaper is not None and self.reaper.held:
                # the request's own streams have ended: let their iterators go before it does
                self.reaper.barrier(lambda: not sender.is_cancelled())
            if last is not None:
                sender.send(last, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.responses_sent += 1
            if emitted is not None:
                self.delay_seconds += time.perf_counter() - emitted
                self.pickup_seconds += (picked or emitted) - emitted
            if registered_at is not None and output is not None:
                self.first_responses += 1
                self.first_response_seconds += time.perf_counter() - registered_at
        except Exception as e:  # Triton refused it (the client is gone...): this sender is never used again
            log.warning("[%s] send for %s failed: %s", self.name, request_id, e)
            if not final:
                self._end(request_id, sender, final, None)
        finally:
            self._send_started = 0.0
            self.send_seconds += time.perf_counter() - t1
            if final:
                self._cancelled.pop(request_id, None)

    def _end(self, request_id: str, sender, final: bool, response) -> None:
        """Stops a stream early: frees the request's engine slot and, with a response, ends it with that."""
        if not final:
            with self._lock:
                self._senders.pop(request_id, None)
                self._registered_at.pop(request_id, None)
            self._poll_ring.discard(request_id)
            self.on_cancel(request_id)
        if response is not None:
            send_final(sender, response)

    def _poll_cancellation(self) -> None:
        if self.reaper is None:
            self._ask_cancelled()
        else:
            self.reaper.barrier(self._ask_cancelled)

    def _ask_cancelled(self) -> bool:
        """Asks open requests not yet known cancelled, for about POLL_BUDGET_SECONDS (at least one), whether
        their client left, and cancels those whose client did; returns whether one answered False (made the
        round trip: what the reaper's barrier needs)."""
        answered = False
        deadline = time.perf_counter() + POLL_BUDGET_SECONDS
        for request_id in self._poll_ring.lap(lambda: time.perf_counter() < deadline):
            with self._lock:
                entry = self._senders.get(request_id)
            if entry is None or request_id in self._cancelled:
                continue
            if entry[0].is_cancelled():
                self._cancelled[request_id] = time.monotonic()
                self.on_cancel(request_id)
            else:
                answered = True
        return answered

    def _cancel_silent(self) -> None:
        """Cancels the expected requests whose caller has been silent too long, as if their client had left."""
        now = time.monotonic()
        with self._lock:
            silent = [(i, now - heard) for i, (heard, silent_s) in self._expected.items() if now - heard >= silent_s]
            for request_id, _ in silent:
                del self._expected[request_id]
            silent = [(i, quiet) for i, quiet in silent if i in self._senders and i not in self._cancelled]
        for request_id, quiet in silent:
            log.warning("[%s] %s: its caller sent nothing for %.0fs: cancelled", self.name, request_id, quiet)
            self._cancelled[request_id] = now
            self.on_cancel(request_id)

    def _answer_abandoned(self) -> None:
        """Ends the requests whose client left CANCEL_GRACE_SECONDS ago and which are still open: their
        thread is stuck (in omni_ensemble, on a stream of a stage that died; workarounds.py, 4). Triton
        then releases them, and the model instance can be unloaded."""
        now = time.monotonic()
        for request_id, since in list(self._cancelled.items()):
            if now - since < CANCEL_GRACE_SECONDS:
                continue
            with self._lock:
                entry = self._senders.pop(request_id, None)
                self._registered_at.pop(request_id, None)
            self._poll_ring.discard(request_id)
            del self._cancelled[request_id]
            if entry is not None:
                log.warning("[%s] %s still open %.0fs after its client left: ended here", self.name, request_id,
                            now - since)  # fmt: skip
                send_final(entry[0], cancelled_response())
