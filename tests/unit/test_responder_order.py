# The response thread (omnistage/triton/responder.py): its send order (within a round, emit order), its
# wait counters, and the requests it cancels when their caller falls silent. Runs the real thread against a
# stand-in for the stub's module and response senders (they exist only in a stub).
import sys
import threading
import time
import types

import pytest


class Sender:
    def __init__(self, name, log, gate=None):
        self.name, self.log, self.gate = name, log, gate

    def send(self, response, flags=0):
        if self.gate is not None:
            self.gate.wait(5)  # holds the thread in its round while the next round piles up
        self.log.append(self.name)
        self.last = (response, flags)

    def is_cancelled(self):
        return False


@pytest.fixture
def responder_module(monkeypatch):
    pb = types.ModuleType("triton_python_backend_utils")
    pb.InferenceResponse = lambda output_tensors=None, error=None: ("response", output_tensors, error)
    pb.TritonError = type("TritonError", (), {"__new__": lambda cls, message, code=None: message, "CANCELLED": 1})
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "omnistage.triton.responder", raising=False)
    monkeypatch.delitem(sys.modules, "omnistage.triton.tensors", raising=False)
    import omnistage.triton.responder as responder

    monkeypatch.setattr(responder, "output_tensors", lambda tensors, bf16_bytes=False: [])
    return responder


class Output:
    def merge(self, later):
        return self


def test_a_round_sends_in_emit_order(responder_module):
    log, gate = [], threading.Event()
    r = responder_module.Responder("stage", lambda output, reason: {}, lambda request_id: None)
    r.register("blocker", Sender("blocker", log, gate))
    for name in ("old1", "old2", "new1", "new2"):
        r.register(name, Sender(name, log))
    r.start()
    try:
        # old1 and old2 have had their first response already (sent before the blocker's round)
        r.emit("old1", Output(), None, None)
        r.emit("old2", Output(), None, None)
        _wait(lambda: log == ["old1", "old2"] or log == ["old2", "old1"])
        log.clear()
        r.emit("blocker", Output(), None, None)  # the thread is now stuck in this round's send
        _wait(lambda: r._queue.qsize() == 0)
        for name in ("old1", "new1", "old2", "new2"):  # the next round, in emit order
            r.emit(name, Output(), None, None)
        gate.set()
        _wait(lambda: len(log) == 5)
        assert log == ["blocker", "old1", "new1", "old2", "new2"]
    finally:
        gate.set()
        r.stop()


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_the_wait_for_pickup_is_counted_apart_from_the_round(responder_module):
    log, gate = [], threading.Event()
    r = responder_module.Responder("stage", lambda output, reason: {}, lambda request_id: None)
    r.register("blocker", Sender("blocker", log, gate))
    r.register("late", Sender("late", log))
    r.start()
    try:
        r.emit("blocker", Output(), None, None)  # taken at once; its send then holds the thread
        _wait(lambda: r._queue.qsize() == 0)
        r.emit("late", Output(), None, None)  # waits on the queue until the blocker's send returns
        time.sleep(0.2)
        gate.set()
        _wait(lambda: len(log) == 2)
        # the blocker was picked up at once but waited in its own send; late waited ~0.2 s for the pickup
        assert 0.2 <= r.pickup_seconds < r.delay_seconds
        assert r.delay_seconds >= 0.4
    finally:
        gate.set()
        r.stop()


def test_a_request_whose_caller_falls_silent_is_cancelled(responder_module):
    """A talker stream waits for appends from its caller; a caller that died sends none (workarounds.py, 12)."""
    log, cancelled = [], []
    r = responder_module.Responder("talker", lambda output, reason: {}, cancelled.append)
    r.on_cancel = lambda request_id: (cancelled.append(request_id), r.emit(request_id, None, "abort", None))
    for name in ("fed", "silent", "ended"):
        r.register(name, Sender(name, log))
        r.expect_caller(name, 0.3)
    r.heard_from("ended", last=True)  # its text is complete: nothing more is expected from the caller
    r.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # appends keep coming for "fed"
            r.heard_from("fed")
            time.sleep(0.05)
        assert cancelled == ["silent"]
        _wait(lambda: log == ["silent"])  # its final answer: cancelled, the engine having aborted it
        assert r.active == 2  # fed and ended stay open
        r.emit("fed", None, "stop", None)
        _wait(lambda: log == ["silent", "fed"])
        assert cancelled == ["silent"]
    finally:
        r.stop()
