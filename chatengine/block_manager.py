"""BlockManager: the device pool of KV pages — ref counts, block tables, prefix index, LRU.

A block is `ref_count` users' page. Full blocks are immutable and content-addressed: once the step
that filled a block has finished, `cache_full_blocks` publishes it under its chain hash. A block
whose ref count drops to 0 keeps its hash and joins the free LRU; it can be hit again until
allocation takes it from the LRU head, which drops the hash. Sequences free their blocks tail
first, so a chain's tail is evicted before its head. Unhashed free blocks go to the head (they are
worth nothing). Allocation is all-or-nothing: a failed `allocate` changes nothing.

The block manager never touches tensors: copies (fork, offload) are requested from the runner.
"""
from collections import OrderedDict

from chatengine.hashing import hash_block, salt_extra, salt_start_block
from chatengine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash.hex()[:8] if self.hash else None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, root: bytes = b""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root                                  # model fingerprint: the parent of block 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evicted first
        self.cached: dict[bytes, int] = {}                # hash -> block id (in use or free)
        self.on_evict = None                              # callback(block) before a hashed block is reused
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_lru)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_lru if self.blocks[b].hash is not None)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ---------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chain hashes of seq's first `num_blocks` full blocks (extended lazily on the sequence)."""
        hashes = seq.block_hashes
        first_salted = salt_start_block(seq.public_prefix_len, self.block_size)
        salted = salt_extra(seq.salt) if seq.salt else b""
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self.root
            hashes.append(hash_block(parent, seq.block_tokens(i), salted if i >= first_salted else b""))
        return hashes[:num_blocks]

    def lookup(self, seq: Sequence) -> list[int]:
        """Ids of the longest run of cached blocks that starts seq's prompt (no side effects).
        Capped at num_tokens - 1: the last token is always computed, to get logits."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits = []
        for i, h in enumerate(self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that are full and computed (call after the step that wrote them)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self.block_hashes(seq, num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            if h in self.cached:          # computed twice concurrently: keep the first, no dedup
                continue
            block.hash, block.token_ids = h, tuple(seq.block_tokens(i))
            self.cached[h] = block.block_id

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow seq's table to hold num_new_tokens more tokens, first claiming `cached_blocks`
        (a lookup() result, only for a sequence with no blocks yet). All or nothing."""
        num_claimed_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        if num_needed + num_claimed_free > len(self.free_lru):
            return False
        if cached_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0
            for block_id in cached_blocks:
                self._ref(block_id)
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = num_computed
        if num_new_tokens and seq.num_computed_tokens % self.block_size:
            # NOTE: the partial tail is about to be written; it must be ours alone
            tail = self.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]]
            assert tail.ref_count == 1 and tail.hash is None, f"write into shared block {tail}"
        for _ in range(max(num_needed, 0)):
            seq.block_table.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give child the KV of parent's first num_tokens tokens: full blocks are shared (ref += 1),
        a partial tail gets a fresh block of its own. Returns the (src, dst) block copy the device
        must make, or None when no copy is needed. Raises MemoryError (changing nothing) when no
        block is free for the tail."""
        assert not child.block_table
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.free_lru:
            raise MemoryError("no free block for the forked tail")
        for block_id in parent.block_table[:num_full]:
            self._ref(block_id)
        child.block_table = parent.block_table[:num_full]
        child.num_computed_tokens = num_tokens
        child.block_hashes = parent.block_hashes[:num_full]
        if not partial:
            return None
        child.block_table.append(self._take_free())
        return parent.block_table[num_full], child.block_table[-1]

    def count_prefix_hit(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first; its computed state is reset."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- internals ------------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_lru[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of {block}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_lru[block_id] = None
            if block.hash is None:
                self.free_lru.move_to_end(block_id, last=False)

    def _take_free(self) -> int:
        block_id, _ = self.free_lru.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:                       # evict: drop the old hash (stale-entry bug)
            if self.on_evict is not None:
                self.on_evict(block)
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Conservation, ref counts = table membership, index consistency. Names the bad blocks."""
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        bad = [b for b in self.blocks if b.ref_count != refs[b.block_id]]
        assert not bad, f"ref counts differ from table membership: {bad[:8]} (tables say {[refs[b.block_id] for b in bad[:8]]})"
        free = set(self.free_lru)
        assert len(free) == len(self.free_lru)
        wrong = [b for b in self.blocks if (b.ref_count == 0) != (b.block_id in free)]
        assert not wrong, f"free list disagrees with ref counts: {wrong[:8]}"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"index entry {h.hex()[:8]} -> {self.blocks[block_id]}"
        orphans = [b for b in self.blocks if b.hash is not None and self.cached.get(b.hash) != b.block_id]
        assert not orphans, f"hashed blocks missing from the index: {orphans[:8]}"
