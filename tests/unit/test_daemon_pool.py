# omnistage/core/daemon_pool.py: calls on reused daemon threads, a new thread only when none is idle.
import threading
import time

import pytest

from omnistage.core.daemon_pool import DaemonPool


def test_an_idle_thread_takes_the_next_call():
    pool = DaemonPool("t")
    names = [pool.submit(lambda: threading.current_thread().name).result(timeout=5) for _ in range(20)]
    assert pool.threads == 1 and set(names) == {"t-1"}


def test_calls_that_block_each_get_a_thread_and_results_come_back():
    pool, gate = DaemonPool("t"), threading.Event()
    blocked = [pool.submit(lambda i=i: (gate.wait(5), i)[1]) for i in range(5)]
    assert pool.threads == 5  # none was idle when each came
    gate.set()
    assert [f.result(timeout=5) for f in blocked] == list(range(5))
    later = [pool.submit(lambda: threading.current_thread()) for _ in range(5)]
    assert pool.threads == 5 and all(f.result(timeout=5).daemon for f in later)


def test_an_exception_reaches_the_future_and_the_thread_serves_on():
    pool = DaemonPool("t")

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pool.submit(fail).result(timeout=5)
    assert pool.submit(lambda: 7).result(timeout=5) == 7 and pool.threads == 1


def test_threads_idle_for_the_timeout_end():
    pool, gate = DaemonPool("t", idle_timeout_s=0.1), threading.Event()
    blocked = [pool.submit(gate.wait, 5) for _ in range(4)]
    gate.set()
    assert all(f.result(timeout=5) for f in blocked) and pool.threads == 4
    deadline = time.monotonic() + 5
    while pool.threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.threads == 0
    assert pool.submit(lambda: 3).result(timeout=5) == 3 and pool.threads == 1  # a new one comes up for more
