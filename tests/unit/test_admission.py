# omni_ensemble's admission control: max_inflight run, max_queue wait, the next one is refused at once.
import threading
import time

import pytest

from omnistage.core.admission import Admission
from omnistage.core.errors import OverloadedError


def test_runs_queues_then_refuses_and_gives_places_back():
    adm = Admission("stage", max_inflight=2, max_queue=1)
    release = threading.Event()
    started = []

    def serve(i):
        with adm.turn():
            started.append(i)
            release.wait(5)

    threads = []
    for i in range(3):
        adm.admit()
        threads.append(threading.Thread(target=serve, args=(i,)))
        threads[-1].start()
    time.sleep(0.2)
    assert (adm.running, adm.waiting) == (2, 1) and len(started) == 2
    t0 = time.monotonic()
    with pytest.raises(OverloadedError, match="2 requests running, 1 queued"):
        adm.admit()
    assert time.monotonic() - t0 < 0.1 and adm.rejected == 1
    release.set()
    for t in threads:
        t.join(5)
    assert (adm.admitted, adm.running) == (0, 0) and sorted(started) == [0, 1, 2]


def test_a_failing_request_and_one_that_never_ran_give_their_place_back():
    adm = Admission("stage", max_inflight=1, max_queue=0)
    adm.admit()
    with pytest.raises(RuntimeError), adm.turn():
        raise RuntimeError("boom")
    adm.admit()
    adm.leave()
    adm.admit()  # would raise if a place had leaked
    assert adm.admitted == 1


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Admission("stage", max_inflight=0, max_queue=1)


def test_a_request_queued_past_max_wait_is_refused_and_gives_its_place_back():
    adm = Admission("stage", max_inflight=1, max_queue=1, max_wait_s=0.3)
    release = threading.Event()
    adm.admit()

    def hold():
        with adm.turn():
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.1)
    adm.admit()
    with pytest.raises(OverloadedError, match="no turn within 0s in its queue"):
        with adm.turn():
            pass
    assert adm.rejected == 1 and adm.admitted == 1  # the holder's place only
    release.set()
    holder.join(5)
