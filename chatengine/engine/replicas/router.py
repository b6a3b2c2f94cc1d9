"""Router: which replica runs a request. Cache-aware, load-balanced, no tensors.

Each replica keeps its own prefix cache, so a conversation's next turn is fastest on the replica
that ran its last one. The router remembers, for the private block hashes of every prompt it sent
(and of every answer that came back), which replica got them last (an LRU of hashes: an
approximation of each replica's cache, as cache-aware routers keep one). A request goes to the
replica holding the longest run of its blocks when that run is most of the request (a next turn:
its history) and that replica's queue does not run far ahead of the least loaded one's; anything
else (a new conversation, even one opening like the user's others) goes to the least loaded.

Public persona blocks are left out of the match: every replica holds them (they are warmed on
each), so they say nothing about where a conversation lives.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

# A replica's queue "runs far ahead" when it holds more than BALANCE_ABS requests beyond the least
# loaded one and more than BALANCE_REL times its count: then even a cache match goes elsewhere
# (recomputing a prefix costs less than waiting behind a long queue).
BALANCE_ABS = 8
BALANCE_REL = 1.5
# It runs ahead too when a request would queue behind more than BALANCE_ABS others beyond the
# replica's capacity (the sequences it runs at once) while the least loaded one has a free slot: a
# short wait for a slot costs the other replica's idle slots little, a long one more than the
# recomputed history (a prefill of a few thousand tokens, about one of its steps).
# A match counts when it covers more than this share of the request's private blocks: a next turn
# matches nearly all of them, a new conversation of the same user at most its opening block or two.
CACHE_THRESHOLD = 0.5
MAX_TRACKED_BLOCKS = 1 << 20  # ~100 MB of hashes at most: far more blocks than replicas hold


@dataclass
class Route:
    replica: int
    matched_blocks: int  # private blocks of the prompt the replica holds (as far as the router knows)
    reason: str  # "affinity" | "least_loaded" | "rebalanced"


@dataclass
class Router:
    num_replicas: int
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    cache_threshold: float = CACHE_THRESHOLD
    max_tracked_blocks: int = MAX_TRACKED_BLOCKS
    capacity: int | None = None  # requests a replica runs at once (max_num_seqs); None: unbounded
    load: list[int] = field(init=False)  # requests in flight per replica
    alive: list[bool] = field(init=False)
    counts: dict[str, int] = field(init=False)  # routes by reason
    _owner: OrderedDict = field(init=False)  # block hash -> the replica that got it last, oldest first

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.load = [0] * self.num_replicas
        self.alive = [True] * self.num_replicas
        self.counts = {"affinity": 0, "least_loaded": 0, "rebalanced": 0}
        self._owner = OrderedDict()

    def route(self, block_hashes: list[bytes]) -> Route:
        """Pick a replica for a request whose private blocks hash to `block_hashes` (in order);
        counts it as in flight there and remembers that the replica now holds those blocks."""
        least = self.least_loaded()
        owner, matched = self.match(block_hashes)
        if owner is None or matched <= self.cache_threshold * len(block_hashes):
            route = Route(least, 0, "least_loaded")
        elif self._far_ahead(owner, least):
            route = Route(least, 0, "rebalanced")
        else:
            route = Route(owner, matched, "affinity")
        self.counts[route.reason] += 1
        self.load[route.replica] += 1
        self.remember(route.replica, block_hashes)
        return route

    def finished(self, replica: int, block_hashes: list[bytes]) -> None:
        """A request sent to `replica` is done; it now holds `block_hashes` too (its answer's blocks:
        the prompt's were remembered when it was routed)."""
        self.load[replica] = max(0, self.load[replica] - 1)
        if self.alive[replica]:
            self.remember(replica, block_hashes)

    def least_loaded(self) -> int:
        live = [i for i in range(self.num_replicas) if self.alive[i]]
        if not live:
            raise RuntimeError("every replica has stopped")
        return min(live, key=lambda i: self.load[i])

    def match(self, block_hashes: list[bytes]) -> tuple[int | None, int]:
        """(the live replica that got the deepest of these blocks, how many blocks that covers).
        Hashes are chained, so holding block i means having been sent blocks 0..i."""
        for i in range(len(block_hashes) - 1, -1, -1):
            owner = self._owner.get(block_hashes[i])
            if owner is not None and self.alive[owner]:
                return owner, i + 1
        return None, 0

    def remember(self, replica: int, block_hashes: list[bytes]) -> None:
        owners = self._owner
        for h in block_hashes:
            owners[h] = replica
            owners.move_to_end(h)
        while len(owners) > self.max_tracked_blocks:
            owners.popitem(last=False)

    def mark_dead(self, replica: int) -> None:
        """A replica that stopped gets nothing more; what it held is forgotten."""
        self.alive[replica] = False
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def _far_ahead(self, replica: int, least: int) -> bool:
        mine, lowest = self.load[replica], self.load[least]
        if mine - lowest > self.balance_abs and mine > self.balance_rel * lowest:
            return True
        cap = self.capacity
        return cap is not None and mine - cap > self.balance_abs and lowest < cap
