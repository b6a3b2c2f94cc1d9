"""The data-parallel router: affinity to the replica holding a conversation's blocks, least loaded
for new ones, rebalancing when a replica's queue runs far ahead, dead replicas skipped."""

import pytest

from chatengine.engine.replicas.router import Router


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def test_new_conversations_go_to_the_least_loaded_replica():
    r = Router(3)
    picks = [r.route(chain(f"c{i}", 4)).replica for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert r.load == [2, 2, 2] and r.counts["least_loaded"] == 6


def test_a_next_turn_goes_where_its_blocks_are():
    r = Router(2)
    first = r.route(chain("a", 3))
    r.route(chain("b", 3))  # the other replica is now as loaded
    r.finished(first.replica, chain("a", 5))  # prompt + answer held there
    turn2 = r.route(chain("a", 7))
    assert (turn2.replica, turn2.matched_blocks, turn2.reason) == (first.replica, 5, "affinity")


def test_a_short_match_is_a_new_conversation():
    r = Router(2)
    r.remember(0, chain("a", 2))  # the user's usual opening, held on replica 0
    r.load = [1, 0]
    assert r.route(chain("a", 2) + chain("new", 3)).reason == "least_loaded"  # 2 of 5 blocks
    assert r.route(chain("a", 2) + chain("new", 1)).reason == "affinity"  # 2 of 3 blocks


def test_affinity_follows_the_deepest_block():
    r = Router(2)
    r.remember(0, chain("a", 2))
    r.remember(1, chain("a", 4))  # a longer history of the same conversation lives on 1
    assert r.match(chain("a", 6)) == (1, 4)
    assert r.match(chain("z", 6)) == (None, 0)


def test_a_replica_far_ahead_loses_its_affinity():
    r = Router(2, balance_abs=2, balance_rel=1.5)
    r.remember(0, chain("a", 3))
    r.load = [3, 0]  # 3 - 0 > 2 and 3 > 1.5 * 0: far ahead
    route = r.route(chain("a", 4))
    assert (route.replica, route.reason) == (1, "rebalanced")
    r.load = [2, 1]  # within both thresholds: the cache wins
    assert r.route(chain("a", 4)).reason == "affinity"


def test_a_full_replica_with_a_queue_loses_its_affinity_to_one_with_a_free_slot():
    r = Router(2, balance_abs=8, capacity=100)
    r.remember(0, chain("a", 3))
    r.load = [108, 99]  # 8 would wait ahead of it: a short wait, the cache wins
    assert r.route(chain("a", 4)).reason == "affinity"
    r.load = [109, 99]  # 9 would wait while replica 1 has a free slot
    assert (r.route(chain("a", 4)).replica, r.counts["rebalanced"]) == (1, 1)
    r.load = [120, 100]  # no free slot elsewhere: within the relative threshold, it stays
    assert r.route(chain("a", 4)).reason == "affinity"
    r.capacity = None  # unbounded: only the far-ahead rule
    r.load = [109, 99]
    assert r.route(chain("a", 4)).reason == "affinity"


def test_dead_replicas_get_nothing_and_their_blocks_are_forgotten():
    r = Router(2)
    r.remember(1, chain("a", 3))
    r.mark_dead(1)
    assert r.match(chain("a", 3)) == (None, 0)
    assert {r.route(chain(f"n{i}", 2)).replica for i in range(4)} == {0}
    r.mark_dead(0)
    with pytest.raises(RuntimeError, match="every replica"):
        r.route(chain("x", 1))


def test_tracked_blocks_are_bounded_oldest_first():
    r = Router(2, max_tracked_blocks=4)
    r.remember(0, chain("old", 3))
    r.remember(1, chain("new", 3))
    assert len(r._owner) == 4
    assert r.match(chain("old", 1)) == (None, 0)  # the oldest went first
    assert r.match(chain("new", 3)) == (1, 3)


def test_finished_never_drives_load_negative():
    r = Router(1)
    r.finished(0, [])
    assert r.load == [0]
    with pytest.raises(ValueError):
        Router(0)
