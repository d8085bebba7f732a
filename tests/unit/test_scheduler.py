import pytest

from omnistage.core.errors import BadRequestError, OverloadedError
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Scheduler, Sequence, SeqStatus


def seq(name):
    return Sequence(name, SamplingParams(), payload=None)


def test_admits_up_to_free_slots_lowest_first():
    s = Scheduler(max_slots=3, max_prefills_per_step=8)
    seqs = [seq(f"r{i}") for i in range(5)]
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    assert [q.slot for q in batch.prefills] == [0, 1, 2]
    assert batch.decodes == []
    assert len(s.waiting) == 2 and s.slots_in_use == 3
    # next step: the admitted ones decode, nobody new fits
    batch = s.schedule()
    assert batch.prefills == [] and len(batch.decodes) == 3


def test_finish_frees_slot_and_reuses_lowest():
    s = Scheduler(max_slots=3)
    seqs = [seq(f"r{i}") for i in range(4)]
    for q in seqs:
        s.add(q)
    s.schedule()
    s.finish(seqs[1])
    assert seqs[1].status is SeqStatus.FINISHED and s.slots_in_use == 2
    assert s.active_rows == 3
    batch = s.schedule()
    assert batch.prefills == [seqs[3]] and seqs[3].slot == 1


def test_abort_waiting_sequence_removes_it():
    s = Scheduler(max_slots=1)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)  # still waiting
    assert "b" not in s and len(s.waiting) == 0
    s.finish(a)
    assert s.slots_in_use == 0 and s.active_rows == 0


def test_prefill_budget_per_step():
    s = Scheduler(max_slots=8, max_prefills_per_step=2)
    for i in range(5):
        s.add(seq(f"r{i}"))
    assert len(s.schedule().prefills) == 2
    assert len(s.schedule().prefills) == 2


def test_prefill_token_budget_per_step():
    s = Scheduler(max_slots=8, max_prefills_per_step=8, max_prefill_tokens=100)
    lengths = {"a": 40, "b": 50, "c": 20, "d": 300, "e": 10}
    for name in lengths:
        s.add(seq(name))
    tokens = lambda q: lengths[q.request_id]  # noqa: E731
    assert [q.request_id for q in s.schedule(prompt_tokens=tokens).prefills] == ["a", "b"]  # c would pass 100
    assert [q.request_id for q in s.schedule(prompt_tokens=tokens).prefills] == ["c"]  # d does not fit beside it
    assert [q.request_id for q in s.schedule(prompt_tokens=tokens).prefills] == ["d"]  # too long: alone
    assert [q.request_id for q in s.schedule(prompt_tokens=tokens).prefills] == ["e"]
    unbounded = Scheduler(max_slots=8, max_prefills_per_step=8, max_prefill_tokens=100)
    for name in lengths:
        unbounded.add(seq(name))
    assert len(unbounded.schedule().prefills) == 5  # no lengths given: only the prompt count bounds it


def test_readiness_filters_decodes():
    s = Scheduler(max_slots=4)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.schedule(lambda q: q.request_id == "b").decodes == [b]


def test_queue_limit_and_duplicates():
    s = Scheduler(max_slots=1, max_waiting=1)
    s.add(seq("a"))
    with pytest.raises(BadRequestError):
        s.add(seq("a"))
    with pytest.raises(OverloadedError):
        s.add(seq("b"))


def chunked(lengths, chunk=100):
    """prompt_tokens and chunk_tokens of a runner that prefills prompts longer than `chunk` in chunks."""
    return dict(prompt_tokens=lambda q: lengths[q.request_id],
                chunk_tokens=lambda q: chunk if lengths[q.request_id] > chunk else lengths[q.request_id])  # fmt: skip


def pieces(batch):
    return {q.request_id: (q.prefilled - q.chunk, q.prefilled) for q in batch.prefills}


def test_a_long_prompt_goes_in_whole_chunks_of_the_budget_and_decodes_after_its_last():
    s = Scheduler(max_slots=4, max_prefills_per_step=4, max_prefill_tokens=250)
    hooks = chunked({"long": 530})
    s.add(seq("long"))
    steps = [(pieces(b), [q.request_id for q in b.decodes]) for b in (s.schedule(**hooks) for _ in range(4))]
    assert steps == [({"long": (0, 200)}, []), ({"long": (200, 400)}, []), ({"long": (400, 530)}, []), ({}, ["long"])]


def test_short_prompts_are_not_queued_behind_a_long_ones_pieces():
    s = Scheduler(max_slots=4, max_prefills_per_step=4, max_prefill_tokens=300)
    lengths = {"long": 1000, "old": 800, "a": 60, "b": 90}
    hooks = chunked(lengths)
    s.add(seq("long"))
    assert pieces(s.schedule(**hooks)) == {"long": (0, 300)}
    s.add(seq("old"))  # a second long prompt, then two short ones
    s.add(seq("a"))
    s.add(seq("b"))
    # the oldest prompt part-way goes on first (one chunk at least), then the short ones whole, then the rest
    assert pieces(s.schedule(**hooks)) == {"long": (300, 400), "a": (0, 60), "b": (0, 90)}
    assert pieces(s.schedule(**hooks)) == {"long": (400, 700)}
    assert pieces(s.schedule(**hooks)) == {"long": (700, 1000)}
    assert pieces(s.schedule(**hooks)) == {"old": (0, 300)}


def test_while_others_decode_long_prompts_attend_within_a_bound_per_step():
    # pairs of (new token, attended position): 200 tokens from 0 attend 200 x 200 = 40,000 <= 45,000
    s = Scheduler(max_slots=4, max_prefills_per_step=4, max_prefill_tokens=1000, attended_beside_decodes=45_000)
    lengths = {"run": 50, "long": 1000, "later": 900, "short": 80}
    hooks = chunked(lengths)
    s.add(seq("run"))
    assert pieces(s.schedule(**hooks)) == {"run": (0, 50)}  # alone: nothing decodes yet
    s.add(seq("long"))
    s.add(seq("later"))
    batch = s.schedule(**hooks)
    assert pieces(batch) == {"long": (0, 200)} and [q.request_id for q in batch.decodes] == ["run"]
    s.add(seq("short"))
    # "long" goes on by its chunk (100 x 300 = 30,000); a short prompt goes whole; 100 more of "long" would
    # attend 100 x 400, over what is left, but the first 100 of "later" (100 x 100) fit
    assert pieces(s.schedule(**hooks)) == {"long": (200, 300), "short": (0, 80), "later": (0, 100)}
    s.finish(s.running["run"])
    s.finish(s.running["short"])
    # nothing decodes: the token budget alone, oldest first
    assert pieces(s.schedule(**hooks)) == {"long": (300, 1000), "later": (100, 400)}


def test_beside_decodes_long_prompts_grow_in_units_and_alone_in_chunks():
    # units of 40 while "run" decodes: "long" starts with one (40 x 40 = 1,600 pairs of the bound's 2,000, two
    # would be 80 x 80), "later" gets none; then "long" goes on by the unit a step must give it, over the
    # bound; once nothing decodes, whole chunks of 100 from wherever the units left "long", or all of its rest
    s = Scheduler(max_slots=4, max_prefills_per_step=4, max_prefill_tokens=1000, attended_beside_decodes=2000,
                  piece_tokens=40)  # fmt: skip
    hooks = chunked({"run": 50, "long": 1000, "later": 900})
    s.add(seq("run"))
    s.schedule(**hooks)
    s.add(seq("long"))
    s.add(seq("later"))
    assert pieces(s.schedule(**hooks)) == {"long": (0, 40)}
    assert pieces(s.schedule(**hooks)) == {"long": (40, 80)}
    s.finish(s.running["run"])
    assert pieces(s.schedule(**hooks)) == {"long": (80, 1000)}


def test_a_short_prompt_over_the_budget_lets_no_newer_long_prompt_go_first():
    s = Scheduler(max_slots=4, max_prefills_per_step=4, max_prefill_tokens=200)
    lengths = {"first": 150, "short": 100, "long": 1000}
    hooks = chunked(lengths, chunk=150)
    for name in lengths:
        s.add(seq(name))
    assert pieces(s.schedule(**hooks)) == {"first": (0, 150)}  # 50 left: "short" waits, and "long" behind it
    assert pieces(s.schedule(**hooks)) == {"short": (0, 100)}  # 100 left: less than one chunk of "long"
    assert pieces(s.schedule(**hooks)) == {"long": (0, 150)}


# ---- admission by KV blocks (core/block_pool.py) ----------------------------------------------------------
from omnistage.core.block_pool import BLOCK, BlockPool  # noqa: E402


def blocked(name, prompt, max_tokens=8):
    s = Sequence(name, SamplingParams(max_tokens=max_tokens), payload=prompt)
    return s


def pooled(blocks, slots=4, reserve=16):
    return Scheduler(max_slots=slots, max_prefills_per_step=8, blocks=BlockPool(blocks + 1, slots, 64),
                     reply_reserve=reserve)  # fmt: skip


def test_a_prompt_waits_for_blocks_not_for_a_slot():
    s = pooled(blocks=6)  # 96 positions
    for q in (blocked("a", 40), blocked("b", 40)):  # 40 + 1 + 8 positions: 4 blocks each
        s.add(q)
    batch = s.schedule(prompt_tokens=lambda q: q.payload, kv_tokens=lambda q: q.payload + 1)
    assert [q.request_id for q in batch.prefills] == ["a"]
    assert s.wait_reason == "blocks" and s.waits == {"slots": 0, "blocks": 1} and s.slots_in_use == 1


def test_the_newest_sequence_is_preempted_when_a_decode_lacks_blocks():
    s = pooled(blocks=6, reserve=0)
    length = {"a": 30, "b": 30}
    for name in "ab":
        s.add(blocked(name, 30))
    a, b = s.schedule(prompt_tokens=lambda q: q.payload, kv_tokens=lambda q: length[q.request_id] + 1).prefills
    for q in (a, b):
        s.blocks.grow(q.slot, length[q.request_id] + 1)  # what the runner's prefill and first decode take
        q.num_generated = 1
    assert s.blocks.free_blocks == 2
    length["a"] = length["b"] = 47  # both cross into their third and fourth block: 4 needed, 2 free
    s.blocks.grow(a.slot, 48)
    s.blocks.grow(b.slot, 48)
    batch = s.schedule(prompt_tokens=lambda q: q.payload, kv_tokens=lambda q: length[q.request_id] + 2)
    assert batch.preempted == [b] and batch.decodes == [a] and batch.prefills == []
    assert b.status is SeqStatus.WAITING and s.waiting[0] is b and b.preemptions == 1 and s.preemptions == 1
    assert s.blocks.held(b.slot) == 0 and s.blocks.free_blocks == 3


def test_a_whole_reply_reserve_admits_only_what_can_finish():
    s = pooled(blocks=10, reserve=None)  # talker: sequences are never preempted
    for q in (blocked("a", 20, max_tokens=60), blocked("b", 20, max_tokens=60)):  # 81 positions: 6 blocks
        s.add(q)
    batch = s.schedule(prompt_tokens=lambda q: q.payload, kv_tokens=lambda q: q.payload + 1)
    assert [q.request_id for q in batch.prefills] == ["a"] and s.wait_reason == "blocks"
    s.blocks.grow(batch.prefills[0].slot, 21)  # its reserve stays counted while it holds less
    assert s.schedule(prompt_tokens=lambda q: q.payload, kv_tokens=lambda q: q.payload + 1).prefills == []
    s.finish(batch.prefills[0])
    assert [q.request_id for q in s.schedule(prompt_tokens=lambda q: q.payload).prefills] == ["b"]


def test_a_prompt_preempted_part_way_through_its_prefill_starts_again_from_its_first_chunk():
    s = Scheduler(max_slots=4, max_prefills_per_step=8, max_prefill_tokens=62, blocks=BlockPool(9, 4, 64),
                  reply_reserve=0)  # fmt: skip
    kv = {"a": 31}
    hooks = dict(chunked({"a": 30, "long": 64}, chunk=32), kv_tokens=lambda q: kv[q.request_id])
    a, long = blocked("a", 30), blocked("long", 64)
    s.add(a)
    s.add(long)
    assert pieces(s.schedule(**hooks)) == {"a": (0, 30), "long": (0, 32)}
    s.blocks.grow(a.slot, 31)  # what the runner's prefills take
    s.blocks.grow(long.slot, 32)
    a.num_generated = 1
    kv["a"] = 7 * BLOCK  # its next decode needs 5 more blocks, 4 are free: the newest, mid-prefill, gives way
    batch = s.schedule(**hooks)
    assert batch.preempted == [long] and batch.decodes == [a] and batch.prefills == []
    assert long.status is SeqStatus.WAITING and (long.prefilled, long.chunk) == (0, 0)
    s.finish(a)
    assert pieces(s.schedule(**hooks)) == {"long": (0, 32)}


def test_prompts_with_a_kept_prefix_are_admitted_for_the_blocks_they_add_and_prefill_after_it():
    s = pooled(blocks=10, reserve=0)
    lengths = {"a": 95, "long1": 100, "long2": 100, "long3": 100}
    hooks = dict(chunked(lengths, chunk=32), kv_tokens=lambda q: 96)
    s.add(blocked("a", 95))
    [a] = s.schedule(**hooks).prefills
    s.blocks.grow(a.slot, 96)  # a's prompt and first decode position: 6 blocks, 4 left
    shared = s.blocks.tables[a.slot][:5]  # its first 5 blocks, kept by a prefix cache too
    for block in shared:
        s.blocks.hold(block)
    for name in ("long1", "long2", "long3"):  # 101 positions each: 7 blocks, 5 of them shared, so 2 new
        s.add(blocked(name, 100))
    batch = s.schedule(**hooks, prefix_blocks=lambda q: shared)
    assert pieces(batch) == {"long1": (5 * BLOCK, 100), "long2": (5 * BLOCK, 100)} and s.wait_reason == "blocks"
    for q in batch.prefills:
        assert q.first_piece and q.cached == 5 * BLOCK and q.reserved_blocks == 7


def test_a_kept_prefix_only_the_cache_holds_counts_as_taken_at_admission():
    """Blocks the prefix cache alone holds are spare (it gives them back on demand) until a prompt shares
    them: admitting that prompt takes them as well as the blocks it adds."""
    s = pooled(blocks=8, reserve=0)
    pool = s.blocks
    pool.grow(3, 5 * BLOCK)
    kept = list(pool.tables[3])
    for block in kept:
        pool.hold(block)
    pool.release(3)  # only the "cache" holds the 5 blocks now; 3 are free

    class Cache:
        def reclaimable(self):
            return sum(1 for b in kept if pool.refs[b] == 1)

        def reclaim(self, n):
            raise AssertionError("nothing reclaims here")

    pool.reclaimer = Cache()
    hooks = dict(chunked({"long": 100, "other": 70}, chunk=32), kv_tokens=lambda q: 0)
    s.add(blocked("long", 100))  # 7 blocks, 5 of them the kept prefix: 2 new + the 5 it keeps from reclaim
    s.add(blocked("other", 70))  # 5 blocks of its own: 8 - 7 = 1 left
    batch = s.schedule(**hooks, prefix_blocks=lambda q: kept if q.request_id == "long" else [])
    assert list(pieces(batch)) == ["long"] and s.wait_reason == "blocks"
