"""BlockManager on tiny pools: exact block ids, ref counts, eviction order, all-or-nothing."""

import pytest

from chatengine.engine.kv.block_manager import BlockManager
from chatengine.engine.kv.hashing import hash_block
from chatengine.engine.sequence import Sequence
from chatengine.sampling_params import SamplingParams

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
    assert bm.allocate(a, 2)  # fills the tail block 2: no new block
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate(a, 1)
    assert a.block_table == [0, 1, 2, 3]


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, BS)
    a, b = make_seq(list(range(8))), make_seq(list(range(100, 112)))
    assert bm.allocate(a, 8)
    before = ([x.ref_count for x in bm.blocks], list(bm.free_lru), b.block_table, b.num_computed_tokens)
    assert not bm.allocate(b, 12)  # needs 3, only 2 free
    assert before == ([x.ref_count for x in bm.blocks], list(bm.free_lru), b.block_table, b.num_computed_tokens)
    assert bm.allocate(b, 8)
    assert b.block_table == [2, 3]
    assert bm.num_free_blocks == 0


def test_free_drains_and_unhashed_blocks_are_reused_first():
    bm = BlockManager(6, BS)
    a = make_seq(list(range(10)))  # blocks 0,1 full, 2 partial
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
    hits, _, _ = bm.lookup(b)
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
    again = make_seq(list(range(8)))  # fully cached: the last token must still run
    assert bm.lookup(again) == ([0], 0, False)
    longer = make_seq(list(range(9)))
    assert bm.lookup(longer) == ([0, 1], 0, False)


def test_freed_blocks_stay_hittable_until_evicted_tail_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(12)))  # 3 full blocks
    compute(bm, a, 12)
    bm.free(a)
    assert bm.num_cached_free_blocks == 3
    b = make_seq(list(range(12)) + [99])
    assert bm.lookup(b) == ([0, 1, 2], 0, False)
    # allocating 2 fresh blocks takes the unhashed block 3, then the chain's tail (block 2)
    c = make_seq(list(range(200, 208)))
    assert bm.allocate(c, 8)
    assert c.block_table == [3, 2]
    assert bm.num_evictions == 1
    assert bm.blocks[2].hash is None  # the reused block lost its old hash
    assert bm.lookup(b) == ([0, 1], 0, False)  # the chain now ends one block earlier


def test_claiming_free_cached_blocks_counts_against_capacity():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free(a)  # blocks 0,1 cached and free; 2 free
    b = make_seq(list(range(8)) + list(range(50, 60)))  # hits [0, 1], then needs 3 more blocks
    hits, _, _ = bm.lookup(b)
    assert hits == [0, 1]
    assert not bm.allocate(b, 10, hits)  # 2 claimed + 3 new > 3: nothing changes
    assert b.block_table == [] and bm.num_free_blocks == 3 and bm.blocks[0].ref_count == 0
    assert bm.allocate(b, 4, hits)  # a smaller chunk fits
    assert b.block_table == [0, 1, 2]


def test_salt_isolates_and_public_prefix_is_shared():
    bm = BlockManager(16, BS)
    persona = list(range(8))  # 2 full public blocks
    alice = make_seq(persona + [20, 21, 22, 23, 24], salt=b"alice", public=8)
    compute(bm, alice, 13)
    bob = make_seq(persona + [20, 21, 22, 23, 24], salt=b"bob", public=8)
    assert bm.lookup(bob) == (alice.block_table[:2], 0, False)  # the persona blocks, not alice's own
    alice2 = make_seq(persona + [20, 21, 22, 23, 24], salt=b"alice", public=8)
    assert bm.lookup(alice2) == (alice.block_table[:3], 0, False)
    bm.free(alice)


def test_write_into_shared_block_is_refused():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(6)))
    assert bm.allocate(a, 6)
    bm.blocks[a.block_table[1]].ref_count += 1  # simulate a second owner of the tail
    a.num_computed_tokens = 6
    with pytest.raises(AssertionError, match="shared block"):
        bm.allocate(a, 1)


def test_invariant_checker_names_the_bad_block():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(4)))
    assert bm.allocate(a, 4)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match=r"Block\(0"):
        bm.check_invariants([])  # block 0 is referenced by nobody: a leak


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    compute(bm, a, 9)
    assert bm.cached == {}
    bm.free(a)
    assert bm.lookup(make_seq(list(range(9)))) == ([], 0, False)


def decode(bm, seq, token):
    """One decode step: the sampled token joins the sequence, then the step computes it."""
    seq.append_token(token)
    compute(bm, seq, 1)


def published(bm):
    """(block id, hash) of each block published since the last call, in order."""
    return [(block_id, meta.hash) for block_id, meta in bm.take_publishes()]


def test_cache_full_blocks_publishes_exactly_the_newly_full_blocks():
    bm = BlockManager(8, BS, root=b"root")
    bm.write_behind = True  # pending_publishes records every publish
    a = make_seq(list(range(10)))
    compute(bm, a, 10)  # blocks 0, 1 full; block 2 holds 2 tokens
    h0 = hash_block(b"root", [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert published(bm) == [(0, h0), (1, h1)]
    assert bm.cached == {h0: 0, h1: 1} and a.num_published_blocks == 2
    decode(bm, a, 10)  # block 2: 3 of 4 tokens
    assert published(bm) == [] and bm.blocks[2].hash is None
    a.append_token(11)
    assert bm.allocate(a, 1)  # the step that fills block 2 is scheduled...
    assert bm.blocks[2].hash is None  # ...but nothing is published before it ran
    a.num_computed_tokens += 1
    bm.cache_full_blocks(a)
    h2 = hash_block(h1, [8, 9, 10, 11])
    assert published(bm) == [(2, h2)]
    assert bm.blocks[2].token_ids == (8, 9, 10, 11) and bm.blocks[2].parent == h1
    assert a.num_published_blocks == 3
    bm.check_invariants([a])
    # blocks below num_published_blocks are never looked at again (a decode step is O(1) per
    # sequence): an unpublished old block stays unpublished when a later block fills
    bm.unpublish(0)
    for t in (12, 13, 14, 15):
        decode(bm, a, t)
    assert published(bm) == [(3, hash_block(h2, [12, 13, 14, 15]))]
    assert bm.blocks[0].hash is None


def test_published_count_follows_free_hits_and_fork():
    bm = BlockManager(12, BS, root=b"root")
    bm.write_behind = True
    a = make_seq(list(range(10)))
    compute(bm, a, 10)
    published(bm)
    bm.free(a)  # preempted: recomputed from scratch later
    assert a.num_published_blocks == 0
    hits, _, _ = bm.lookup(a)
    assert hits == [0, 1]
    assert bm.allocate(a, 2, hits)  # hits are published already
    assert a.num_published_blocks == 2 and a.num_computed_tokens == 8
    a.num_computed_tokens += 2
    bm.cache_full_blocks(a)
    assert published(bm) == []  # block 2 is still partial
    # fork: the child shares the parent's published blocks and publishes only its own
    child = make_seq(list(range(10)))
    copy = bm.fork(a, child, 9)
    assert child.block_table[:2] == [0, 1] and child.num_published_blocks == 2
    assert copy == (a.block_table[2], child.block_table[2])
    compute(bm, child, 1)  # the last prompt token, then two samples
    decode(bm, child, 50)
    decode(bm, child, 51)
    h1 = bm.blocks[1].hash
    assert published(bm) == [(child.block_table[2], hash_block(h1, [8, 9, 50, 51]))]
    bm.check_invariants([a, child])
    bm.free(child)
    bm.free(a)


def test_a_block_computed_twice_concurrently_is_shared_once_published():
    bm = BlockManager(8, BS, root=b"root")
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # neither is published yet: no hits
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    for seq in (a, b):
        seq.num_computed_tokens += 9
        bm.cache_full_blocks(seq)
    # a's full blocks are indexed; b's duplicates are swapped for them and freed (its tail stays)
    assert b.block_table == [0, 1, 5] and sorted(bm.cached.values()) == [0, 1]
    assert [bm.blocks[i].ref_count for i in range(6)] == [2, 2, 1, 0, 0, 1]
    assert list(bm.free_lru)[:2] == [4, 3] and bm.num_free_blocks == 4  # freed duplicates go first
    assert b.num_published_blocks == 2
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_fork_of_a_block_aligned_prompt_holds_the_prompt_once():
    """n samples of an 8-token prompt (2 full blocks): a child recomputes the last prompt token in
    a copy of block 1; once full it is swapped for the parent's published block 1 and freed."""
    bm = BlockManager(8, BS, root=b"root")
    parent = make_seq(list(range(8)))
    compute(bm, parent, 8)
    assert parent.block_table == [0, 1] and sorted(bm.cached.values()) == [0, 1]
    child = make_seq(list(range(8)))
    assert bm.fork(parent, child, 7) == (1, 2)  # device copy of block 1's first 3 tokens into 2
    assert child.block_table == [0, 2]
    compute(bm, child, 1)  # recompute token 7: block 2 equals block 1
    assert child.block_table == [0, 1] and [bm.blocks[i].ref_count for i in range(3)] == [2, 2, 0]
    bm.check_invariants([parent, child])
    bm.free(child)
    bm.free(parent)
    bm.check_invariants([])
