# The paged KV cache's host side (core/block_pool.py): blocks handed out lowest first, shared blocks with
# holder counts, the null block never handed out, the device table's pending changes, and blocks that a
# reclaimer (a prefix cache) gives back when the pool runs short.
import pytest

from omnistage.core.block_pool import BLOCK, NULL_BLOCK, BlockPool, OutOfBlocks


def test_grow_hands_out_blocks_as_positions_need_them():
    pool = BlockPool(num_blocks=8, slots=2, max_blocks_per_slot=4)
    pool.grow(0, 1)
    pool.grow(0, BLOCK)  # still one block
    pool.grow(1, BLOCK + 1)
    assert pool.tables == [[1], [2, 3]] and pool.free_blocks == 4 and NULL_BLOCK not in pool._free
    assert pool.take_dirty() == [(0, 0, 1), (1, 0, 2), (1, 1, 3)] and pool.take_dirty() == []
    assert pool.needed(0, 3 * BLOCK) == 2


def test_a_pool_or_table_too_small_takes_nothing():
    pool = BlockPool(num_blocks=4, slots=2, max_blocks_per_slot=2)
    pool.grow(0, BLOCK)
    with pytest.raises(OutOfBlocks):
        pool.grow(1, 3 * BLOCK)  # beyond a sequence's table
    pool.grow(1, BLOCK)
    with pytest.raises(OutOfBlocks):
        pool.grow(0, 2 * BLOCK + 1)
    assert pool.tables == [[1], [2]] and pool.free_blocks == 1


def test_shared_blocks_go_back_with_their_last_holder():
    pool = BlockPool(num_blocks=8, slots=3, max_blocks_per_slot=4)
    pool.grow(0, 2 * BLOCK + 5)  # blocks 1, 2, 3
    for block in (1, 2):  # a prefix cache keeps the first two
        pool.hold(block)
    pool.release(0)
    assert pool.refs[1:4] == [1, 1, 0] and pool.free_blocks == 5
    pool.share(1, [1, 2])
    pool.share(2, [1, 2])
    pool.grow(2, 2 * BLOCK + 1)  # its own third block
    assert pool.tables[1] == [1, 2] and pool.tables[2] == [1, 2, 3] and pool.refs[1] == 3
    pool.release(1)
    pool.release(2)
    for block in (1, 2):
        pool.drop(block)
    assert pool.free_blocks == 7 and pool.used_blocks == 0
    assert pool.take_dirty()[-1] == (2, -1, NULL_BLOCK)  # its row goes back to the null block


class _Kept:
    def __init__(self, pool, blocks):
        self.pool, self.blocks = pool, blocks

    def reclaimable(self):
        return len(self.blocks)

    def reclaim(self, n):
        for block in self.blocks[:n]:
            self.pool.drop(block)
        del self.blocks[:n]


def test_a_short_pool_takes_back_what_the_reclaimer_keeps():
    pool = BlockPool(num_blocks=4, slots=2, max_blocks_per_slot=3)
    pool.grow(0, 3 * BLOCK)
    for block in pool.tables[0]:
        pool.hold(block)
    pool.release(0)
    pool.reclaimer = _Kept(pool, [1, 2, 3])
    assert pool.free_blocks == 0 and pool.available_blocks == 3
    pool.grow(1, 2 * BLOCK)
    assert pool.reclaimer.blocks == [3] and len(pool.tables[1]) == 2
