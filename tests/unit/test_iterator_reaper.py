"""IteratorReaper: finished BLS iterators are dropped only after a barrier query that began after they were
held has made its round trip, and on the thread that ran it (omnistage/triton/iterator_reaper.py)."""

import threading
import weakref

from omnistage.triton.iterator_reaper import IteratorReaper


class Iterator:  # stands in for a 2.51 ResponseIterator: anything weak-referenceable
    pass


def watch(obj, freed: list) -> None:
    weakref.finalize(obj, lambda: freed.append(threading.get_ident()))


def test_release_through_drops_only_what_was_held_up_to_the_mark():
    reaper, freed = IteratorReaper(), []
    for _ in range(3):
        it = Iterator()
        watch(it, freed)
        reaper.hold(it)
    mark = reaper.mark()
    late = Iterator()
    watch(late, freed)
    reaper.hold(late)
    del it, late
    assert freed == []  # held: nothing dropped yet
    assert reaper.release_through(mark) == 3
    assert len(freed) == 3 and reaper.held == 1
    assert reaper.release_through(reaper.mark()) == 1
    assert len(freed) == 4 and reaper.held == 0


def test_barrier_covers_what_was_held_before_the_query_not_during_it():
    reaper, freed = IteratorReaper(), []
    before = Iterator()
    watch(before, freed)
    reaper.hold(before)
    ending = [Iterator()]  # a stream that ends during the query (the list lets it go when held)
    watch(ending[0], freed)

    def query():  # another stream ends while the query is in flight: its cleanup may be queued after it
        reaper.hold(ending.pop())
        return True  # it made the round trip

    del before
    assert reaper.barrier(query) is True
    assert len(freed) == 1 and reaper.held == 1
    assert ending == [] and len(freed) == 1  # only the reaper holds it now, until a later barrier


def test_a_cancelled_answer_is_no_barrier():
    """A request already known to be cancelled answers from the stub's cache, without the round trip."""
    reaper, freed = IteratorReaper(), []
    it = Iterator()
    watch(it, freed)
    reaper.hold(it)
    del it
    assert reaper.barrier(lambda: False) is False  # is_cancelled() was True: no round trip
    assert freed == [] and reaper.held == 1
    assert reaper.barrier(lambda: True) is True
    assert len(freed) == 1


def test_iterators_are_dropped_on_the_thread_that_ran_the_barrier():
    reaper, freed = IteratorReaper(), []

    def stream():  # a reading thread holds its iterator and leaves
        it = Iterator()
        watch(it, freed)
        reaper.hold(it)

    readers = [threading.Thread(target=stream) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert freed == []
    barrier_thread = []

    def barrier():
        barrier_thread.append(threading.get_ident())
        reaper.barrier(lambda: True)

    t = threading.Thread(target=barrier)
    t.start()
    t.join()
    assert freed == barrier_thread * 4
