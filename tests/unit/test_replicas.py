# Session-pinned replica routing: least sessions first, ties rotate, a session keeps its replica.
import threading

import pytest

from omnistage.pipeline.replicas import ReplicaRouter


def test_new_sessions_go_to_the_least_loaded_replica_and_stay_there():
    router = ReplicaRouter(["talker", "talker_1", "talker_2"])
    assert [router.pin(s) for s in "abc"] == ["talker", "talker_1", "talker_2"]
    assert router.pin("a") == "talker" and router.get("b") == "talker_1"  # pinned: no re-balancing
    router.release("b")
    assert router.load() == {"talker": 1, "talker_1": 0, "talker_2": 1}
    assert router.pin("d") == "talker_1"
    router.release("a"), router.release("c")
    assert router.pin("e") in ("talker", "talker_2") and router.get("a") is None


def test_ties_rotate_so_one_request_at_a_time_is_spread():
    router = ReplicaRouter(["thinker", "thinker_1"])
    served = []
    for i in range(4):
        served.append(router.pin(str(i)))
        router.release(str(i))
    assert served == ["thinker", "thinker_1", "thinker", "thinker_1"]
    assert router.load() == {"thinker": 0, "thinker_1": 0}


def test_concurrent_pins_balance_exactly():
    router = ReplicaRouter(["a", "b"])
    threads = [threading.Thread(target=router.pin, args=(str(i),)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert router.load() == {"a": 50, "b": 50}


def test_release_of_an_unknown_session_is_harmless():
    router = ReplicaRouter(["a"])
    router.release("nope")
    assert router.load() == {"a": 0}


@pytest.mark.parametrize("names", [[], ["a", "a"]])
def test_replica_names_must_be_distinct(names):
    with pytest.raises(ValueError):
        ReplicaRouter(names)
