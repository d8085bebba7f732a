from omnistage.core.prefix_index import BLOCK, PrefixIndex


def ids(*parts):
    out = []
    for start, n in parts:
        out += list(range(start, start + n))
    return out


def test_names_cover_the_full_blocks_before_the_last_token():
    assert len(PrefixIndex.names(ids((0, BLOCK)))) == 0  # its last token is always computed
    assert len(PrefixIndex.names(ids((0, BLOCK + 1)))) == 1
    assert len(PrefixIndex.names(ids((0, 3 * BLOCK + 5)))) == 3
    a, b = PrefixIndex.names(ids((0, 40))), PrefixIndex.names(ids((0, 16), (100, 24)))
    assert a[0] == b[0] and a[1] != b[1]  # a name stands for the whole prefix up to its block's end


BLOCKS = [11, 12, 13, 14]  # the prompt's pool blocks


def test_blocks_are_kept_on_their_second_sighting_and_matched_after():
    index = PrefixIndex(capacity=8)
    prompt = ids((0, 3 * BLOCK + 2))
    found = index.match(prompt)
    assert found.entries == [] and index.admit(found, BLOCKS) == ([], [])
    found = index.match(prompt)
    assert found.entries == []
    admitted, evicted = index.admit(found, BLOCKS)
    assert admitted == [(0, 11), (1, 12), (2, 13)] and evicted == []
    found = index.match(prompt)
    assert found.entries == [11, 12, 13] and found.tokens == 3 * BLOCK
    assert index.admit(found, BLOCKS) == ([], [])
    assert index.kept_run(found) == 3


def test_a_shared_prefix_matches_up_to_where_prompts_part():
    index = PrefixIndex(capacity=8)
    for tail in (100, 200):  # two prompts share their first two blocks
        index.admit(index.match(ids((0, 2 * BLOCK), (tail, BLOCK + 3))), BLOCKS)
    found = index.match(ids((0, 2 * BLOCK), (300, BLOCK + 3)))
    assert found.tokens == 2 * BLOCK and len(found.names) == 3


def test_a_zero_capacity_keeps_nothing():
    index = PrefixIndex(capacity=0)
    prompt = ids((0, 2 * BLOCK + 1))
    for _ in range(3):
        assert index.admit(index.match(prompt), BLOCKS) == ([], [])


def test_least_recently_used_blocks_are_evicted():
    index = PrefixIndex(capacity=2)
    a, b = ids((0, BLOCK + 1)), ids((500, BLOCK + 1))
    for prompt, block in ((a, 1), (a, 1), (b, 2), (b, 2)):
        index.admit(index.match(prompt), [block])
    assert len(index) == 2
    index.match(a)  # a used: b is now the oldest
    c = ids((900, BLOCK + 1))
    index.admit(index.match(c), [3])
    assert index.admit(index.match(c), [3]) == ([(0, 3)], [2])  # b's block goes back to the pool
    assert index.match(a).tokens == BLOCK and index.match(b).tokens == 0 and index.match(c).tokens == BLOCK


def test_first_sightings_go_on_probation_and_never_evict_protected_blocks():
    index = PrefixIndex(capacity=4)  # at most 3 protected
    shared = ids((0, BLOCK + 1))
    for _ in range(2):  # seen twice: protected
        index.admit(index.match(shared), [1])
    for n in range(5):  # a burst of unrelated long prompts, kept on their first sighting
        prompt = ids((1000 * (n + 1), 2 * BLOCK + 1))
        index.admit(index.match(prompt), [10 + 2 * n, 11 + 2 * n], first_sighting=True)
    assert len(index) == 4 and index.match(shared).tokens == BLOCK
    assert index.blocks() == [17, 18, 19, 1]  # the burst's last three, then the protected block
    assert index.match(ids((5000, 2 * BLOCK + 1))).tokens == 2 * BLOCK  # matched: protected from now on
    index.admit(index.match(ids((9000, 3 * BLOCK + 1))), [30, 31, 32], first_sighting=True)
    # room for one block of it: it evicts the oldest on probation, not its own; the matched prefix's first
    # block is the most recently used
    assert index.blocks() == [30, 1, 19, 18]


def test_protected_blocks_beyond_their_share_go_back_on_probation():
    index = PrefixIndex(capacity=4)
    prompts = [ids((1000 * n, BLOCK + 1)) for n in range(4)]
    for n, prompt in enumerate(prompts):
        for _ in range(2):
            index.admit(index.match(prompt), [n + 1])
    assert index.blocks() == [1, 2, 3, 4]  # the oldest protected one is on probation, first to go
    index.match(prompts[0])
    assert index.blocks() == [2, 3, 4, 1]
