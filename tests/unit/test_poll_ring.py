from omnistage.core.poll_ring import PollRing


def _lap(ring, budget=None):
    asked = []

    def more():
        return budget is None or len(asked) < budget

    for request_id in ring.lap(more):
        asked.append(request_id)
    return asked


def test_a_lap_asks_each_member_once_in_order():
    ring = PollRing()
    for r in "abc":
        ring.add(r)
    ring.add("a")  # already in: no second entry
    assert _lap(ring) == ["a", "b", "c"]
    assert _lap(ring) == ["a", "b", "c"]


def test_a_bounded_lap_goes_on_where_the_last_one_stopped():
    ring = PollRing()
    for r in "abcde":
        ring.add(r)
    assert _lap(ring, budget=2) == ["a", "b"]
    assert _lap(ring, budget=2) == ["c", "d"]
    assert _lap(ring, budget=2) == ["e", "a"]
    assert _lap(ring, budget=0) == ["b"]  # at least one is asked, whatever the budget


def test_discarded_members_are_skipped_and_leave_the_ring():
    ring = PollRing()
    for r in "abc":
        ring.add(r)
    ring.discard("b")
    assert len(ring) == 2
    assert _lap(ring) == ["a", "c"]
    ring.add("b")  # back, at the end
    assert _lap(ring) == ["a", "c", "b"]


def test_members_added_during_a_lap_wait_for_the_next():
    ring = PollRing()
    ring.add("a")
    ring.add("b")
    asked = []
    for r in ring.lap():
        asked.append(r)
        ring.add(r + "2")
    assert asked == ["a", "b"]
    assert _lap(ring) == ["a", "a2", "b", "b2"]  # each joined the ring's end when it was added


def test_an_empty_ring_yields_nothing():
    assert _lap(PollRing()) == []
