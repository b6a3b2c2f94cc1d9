"""BlockManager on tiny pools: exact block ids, ref counts, eviction order, all-or-nothing."""
import pytest

from chatengine.block_manager import BlockManager
from chatengine.sampling_params import SamplingParams
from chatengine.sequence import Sequence

BS = 4


def make_seq(token_ids, salt=b"", public=0):
    seq = Sequence(token_ids, SamplingParams(), block_size=BS)
    seq.salt, seq.public_prefix_len = salt, public
    return seq


def compute(bm, seq, n):
    """What a step does: allocate, (the forward writes), advance, publish."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_exact_ids_and_refs():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(10)))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)                      # fills the tail block 2: no new block
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate(a, 1)
    assert a.block_table == [0, 1, 2, 3]


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, BS)
    a, b = make_seq(list(range(8))), make_seq(list(range(100, 112)))
    assert bm.allocate(a, 8)
    before = ([x.ref_count for x in bm.blocks], list(bm.free_lru), b.block_table, b.num_computed_tokens)
    assert not bm.allocate(b, 12)                 # needs 3, only 2 free
    assert before == ([x.ref_count for x in bm.blocks], list(bm.free_lru), b.block_table, b.num_computed_tokens)
    assert bm.allocate(b, 8)
    assert b.block_table == [2, 3]
    assert bm.num_free_blocks == 0


def test_free_drains_and_unhashed_blocks_are_reused_first():
    bm = BlockManager(6, BS)
    a = make_seq(list(range(10)))                 # blocks 0,1 full, 2 partial
    compute(bm, a, 10)
    bm.free(a)
    assert bm.num_free_blocks == 6 and a.block_table == [] and a.num_computed_tokens == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    # the partial block 2 (no hash) goes to the LRU head; the chain 0->1 goes tail first
    assert list(bm.free_lru)[:1] == [2]
    assert list(bm.free_lru)[-2:] == [1, 0]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(10)))
    compute(bm, a, 10)
    b = make_seq(list(range(8)) + [50, 51, 52])
    hits, _ = bm.lookup(b)
    assert hits == a.block_table[:2] == [0, 1]
    assert bm.allocate(b, 3, hits)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_hit_is_capped_below_the_prompt_length():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    again = make_seq(list(range(8)))              # fully cached: the last token must still run
    assert bm.lookup(again) == ([0], 0)
    longer = make_seq(list(range(9)))
    assert bm.lookup(longer) == ([0, 1], 0)


def test_freed_blocks_stay_hittable_until_evicted_tail_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(12)))                 # 3 full blocks
    compute(bm, a, 12)
    bm.free(a)
    assert bm.num_cached_free_blocks == 3
    b = make_seq(list(range(12)) + [99])
    assert bm.lookup(b) == ([0, 1, 2], 0)
    # allocating 2 fresh blocks takes the unhashed block 3, then the chain's tail (block 2)
    c = make_seq(list(range(200, 208)))
    assert bm.allocate(c, 8)
    assert c.block_table == [3, 2]
    assert bm.num_evictions == 1
    assert bm.blocks[2].hash is None                      # the reused block lost its old hash
    assert bm.lookup(b) == ([0, 1], 0)                    # the chain now ends one block earlier


def test_claiming_free_cached_blocks_counts_against_capacity():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free(a)                                            # blocks 0,1 cached and free; 2 free
    b = make_seq(list(range(8)) + list(range(50, 60)))    # hits [0, 1], then needs 3 more blocks
    hits, _ = bm.lookup(b)
    assert hits == [0, 1]
    assert not bm.allocate(b, 10, hits)                   # 2 claimed + 3 new > 3: nothing changes
    assert b.block_table == [] and bm.num_free_blocks == 3 and bm.blocks[0].ref_count == 0
    assert bm.allocate(b, 4, hits)                        # a smaller chunk fits
    assert b.block_table == [0, 1, 2]


def test_salt_isolates_and_public_prefix_is_shared():
    bm = BlockManager(16, BS)
    persona = list(range(8))                              # 2 full public blocks
    alice = make_seq(persona + [20, 21, 22, 23, 24], salt=b"alice", public=8)
    compute(bm, alice, 13)
    bob = make_seq(persona + [20, 21, 22, 23, 24], salt=b"bob", public=8)
    assert bm.lookup(bob) == (alice.block_table[:2], 0)        # the persona blocks, not alice's own
    alice2 = make_seq(persona + [20, 21, 22, 23, 24], salt=b"alice", public=8)
    assert bm.lookup(alice2) == (alice.block_table[:3], 0)
    bm.free(alice)


def test_write_into_shared_block_is_refused():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(6)))
    assert bm.allocate(a, 6)
    bm.blocks[a.block_table[1]].ref_count += 1            # simulate a second owner of the tail
    a.num_computed_tokens = 6
    with pytest.raises(AssertionError, match="shared block"):
        bm.allocate(a, 1)


def test_invariant_checker_names_the_bad_block():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(4)))
    assert bm.allocate(a, 4)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match=r"Block\(0"):
        bm.check_invariants([])                           # block 0 is referenced by nobody: a leak


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    compute(bm, a, 9)
    assert bm.cached == {}
    bm.free(a)
    assert bm.lookup(make_seq(list(range(9)))) == ([], 0)
