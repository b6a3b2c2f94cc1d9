"""BlockManager: the device pool of KV pages — ref counts, block tables, prefix index, LRU.

A block is `ref_count` users' page. Full blocks are immutable and content-addressed: once the step
that filled a block has finished, `cache_full_blocks` publishes it under its chain hash. A block
whose ref count drops to 0 keeps its hash and joins the free LRU; it can be hit again until
allocation takes it from the LRU head, which drops the hash. Sequences free their blocks tail
first, so a chain's tail is evicted before its head. Unhashed free blocks go to the head (they are
worth nothing). Allocation is all-or-nothing: a failed `allocate` changes nothing.

With lower tiers (offload.TieredCache), a hashed block evicted from the LRU is queued for
write-back to host memory, a lookup continues the device hit in host memory and on disk, and a hit
there gets a fresh device block that is published at once and queued for a restore copy. The engine
runs the queued copies (evictions first, then restores) before the step's forward.

The block manager never touches tensors: copies (fork, offload) are requested from the runner.
"""

import hashlib
import time
from collections import OrderedDict
from itertools import chain
from typing import Any

from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.hashing import ChainMemo, salt_extra, salt_start_block
from chatengine.engine.sequence import Sequence


def owner_tag(salt: bytes) -> bytes:
    """Which user a salted block belongs to (lets a user's blocks be dropped); b"" when public."""
    return hashlib.blake2b(salt, digest_size=8, person=b"kv-owner").digest() if salt else b""


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "owner", "freed_at")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent = b""  # the previous block's hash (the root for block 0)
        self.owner = b""  # tag of the user whose salt is in the hash (b"": public)
        self.freed_at = 0.0  # when its ref count last dropped to 0 (idle since)

    def meta(self) -> BlockMeta:
        assert self.hash is not None, "only a published block has a meta"
        return BlockMeta(self.hash, self.parent, self.token_ids, self.owner)

    def set_hash(self, meta: BlockMeta) -> None:
        assert meta.token_ids is not None, "a device block knows its tokens (restores carry the request's)"
        self.hash, self.parent, self.token_ids, self.owner = meta.hash, meta.parent, meta.token_ids, meta.owner

    def clear_hash(self) -> None:
        self.hash, self.parent, self.token_ids, self.owner = None, b"", (), b""

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash.hex()[:8] if self.hash else None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, root: bytes = b""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root  # model fingerprint: the parent of block 0
        self.chains = ChainMemo()  # recent hash chains, to start new ones from
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evicted first
        # kept as blocks change hands (stats() runs every 0.2 s: a scan of a GPU's ~100k blocks took
        # ~30 ms of the engine thread each time): free blocks holding a page, blocks held twice or more
        self._free_cached = 0
        self._shared = 0
        self.cached: dict[bytes, int] = {}  # hash -> block id (in use or free)
        self.tiers: Any = None  # the host and disk tiers (TieredCache), if any; the pool never imports them
        self.write_behind = False  # queue newly published blocks for the disk
        self.pending_evictions: list[tuple[int, BlockMeta]] = []  # device -> host copies to make
        self.pending_restores: list[tuple[int, bytes]] = []  # host -> device copies to make
        self.pending_publishes: list[tuple[int, BlockMeta]] = []  # device -> disk write-behind
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
        return self._free_cached

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ---------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chain hashes of seq's first `num_blocks` full blocks (extended lazily on the sequence)."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            self.chains.extend(
                hashes,
                self.root,
                seq.token_ids,
                self.block_size,
                num_blocks,
                salt_start_block(seq.public_prefix_len, self.block_size),
                salt_extra(seq.salt) if seq.salt else b"",
            )
        return hashes[:num_blocks]

    def lookup(self, seq: Sequence) -> tuple[list[int], int, bool]:
        """The longest cached prefix of seq: ids of the device blocks it starts with, how many blocks
        continue it in host memory, and whether more are on their way from disk (then the caller
        waits for them rather than recompute them). Capped at num_tokens - 1: the last token is
        always computed, to get logits. No side effects on the device pool."""
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return [], 0, False  # (prompt logprobs need every prompt row computed)
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        cached = self.cached
        hits = []
        for h in hashes:
            block_id = cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        # a hit compares tokens too (a hash collision must not serve another prompt's KV): one
        # comparison of the whole run, block by block only where it differs
        blocks, bs = self.blocks, self.block_size
        if hits and list(chain.from_iterable(blocks[b].token_ids for b in hits)) != seq.token_ids[: len(hits) * bs]:
            hits = hits[: next(i for i, b in enumerate(hits) if blocks[b].token_ids != tuple(seq.block_tokens(i)))]
        num_lower, loading = 0, False
        if self.tiers is not None and len(hits) < len(hashes):
            rest = range(len(hits), len(hashes))
            num_lower, loading = self.tiers.lookup(hashes[len(hits) :], [seq.block_tokens(i) for i in rest])
        return hits, num_lower, loading

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that became full and computed since the last call (call after the
        step that wrote them). Blocks below seq.num_published_blocks were looked at already, so a
        decode step costs O(1) per sequence, not O(blocks)."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_published_blocks:
            return
        first_salted = salt_start_block(seq.public_prefix_len, self.block_size)
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_published_blocks, num_full):
            block, h = self.blocks[seq.block_table[i]], hashes[i]
            if block.hash is not None:  # a prefix hit or a restored block: published already
                continue
            if h in self.cached:  # computed twice: share the first copy, free this one
                self._share_cached(seq, i, self.cached[h])
                continue
            block.set_hash(
                BlockMeta(
                    h,
                    hashes[i - 1] if i else self.root,
                    tuple(seq.block_tokens(i)),
                    owner_tag(seq.salt) if i >= first_salted else b"",
                )
            )
            self.cached[h] = block.block_id
            if self.write_behind:
                self.pending_publishes.append((block.block_id, block.meta()))
        seq.num_published_blocks = num_full

    def _share_cached(self, seq: Sequence, i: int, cached_id: int) -> None:
        """seq's block i holds what block `cached_id` holds (same hash and tokens: two requests
        computed one prefix at once, or a fork child recomputed the last token of a block-aligned
        prompt): point seq at the published block and free its duplicate, so n samples of a
        prompt hold its pages once."""
        dup = seq.block_table[i]
        if self.blocks[cached_id].token_ids != tuple(seq.block_tokens(i)):
            return  # a hash collision: keep the private copy
        self._ref(cached_id)
        # a new list, not an edit in place: the runner mirrors tables that only grow or are replaced
        seq.block_table = seq.block_table[:i] + [cached_id] + seq.block_table[i + 1 :]
        self._unref(dup)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: tuple[int, ...] | list[int] = (), num_restore: int = 0
    ) -> bool:
        """Grow seq's table to hold num_new_tokens more tokens, first claiming `cached_blocks` and
        then `num_restore` blocks restored from the lower tiers (a lookup() result, only for a
        sequence with no blocks yet). All or nothing."""
        # NOTE: called for every running sequence every step, so the decode path is kept lean
        bs = self.block_size
        num_hit = len(cached_blocks) + num_restore
        num_computed = seq.num_computed_tokens + num_hit * bs
        num_needed = (num_computed + num_new_tokens + bs - 1) // bs - len(seq.block_table) - len(cached_blocks)
        num_claimed_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0) if cached_blocks else 0
        if num_needed + num_claimed_free > len(self.free_lru):
            return False
        if num_hit:
            assert not seq.block_table and seq.num_computed_tokens == 0
            for block_id in cached_blocks:
                self._ref(block_id)
            seq.block_table = list(cached_blocks)
            hashes = self.block_hashes(seq, num_hit)
            for i in range(len(cached_blocks), num_hit):  # restored: published now, copied before the forward
                block_id = self._take_free()
                meta = self.tiers.host.index[hashes[i]][1]  # (its tokens: seq's, as lookup verified)
                meta = BlockMeta(meta.hash, meta.parent, tuple(seq.block_tokens(i)), meta.owner)
                self.blocks[block_id].set_hash(meta)
                self.cached[meta.hash] = block_id
                seq.block_table.append(block_id)
                self.pending_restores.append((block_id, meta.hash))
            if num_restore:
                self.tiers.pin(hashes[len(cached_blocks) : num_hit])
            seq.num_computed_tokens = seq.num_cached_tokens = num_computed
            seq.num_published_blocks = num_hit  # hits and restores are published already
            num_needed -= num_restore
        if num_new_tokens and seq.num_computed_tokens % bs:
            # NOTE: the partial tail is about to be written; it must be ours alone
            tail = self.blocks[seq.block_table[seq.num_computed_tokens // bs]]
            assert tail.ref_count == 1 and tail.hash is None, f"write into shared block {tail}"
        for _ in range(num_needed):  # (empty when nothing is needed)
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
        child.num_published_blocks = num_full  # the parent has published these
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
        seq.num_computed_tokens = seq.num_published_blocks = 0

    # ---- internals ------------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_lru[block_id]
            self._free_cached -= block.hash is not None
        block.ref_count += 1
        self._shared += block.ref_count == 2

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of {block}"
        self._shared -= block.ref_count == 2
        block.ref_count -= 1
        if block.ref_count == 0:
            block.freed_at = time.monotonic()
            self.free_lru[block_id] = None
            self._free_cached += block.hash is not None
            if block.hash is None:
                self.free_lru.move_to_end(block_id, last=False)

    def _take_free(self) -> int:
        block_id, _ = self.free_lru.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: drop the old hash (stale-entry bug)
            self._free_cached -= 1
            if self.tiers is not None:  # write back to host memory before reuse
                self.pending_evictions.append((block_id, block.meta()))
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.clear_hash()
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def unpublish(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        if block.hash is not None and block.ref_count == 0:
            self._free_cached -= 1
        block.clear_hash()

    # ---- what the KV transfers take and give back ------------------------------------------------
    def take_restores(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of host -> device copies the last allocation asked for; the list empties."""
        restores, self.pending_restores = self.pending_restores, []
        return restores

    def take_evictions(self) -> list[tuple[int, BlockMeta]]:
        """Evicted hashed blocks whose pages must be written back before their blocks are reused."""
        evicted, self.pending_evictions = self.pending_evictions, []
        return evicted

    def take_publishes(self) -> list[tuple[int, BlockMeta]]:
        """Blocks published since the last call (for the disk store's write-behind)."""
        published, self.pending_publishes = self.pending_publishes, []
        return published

    def hashed_blocks(self) -> list[tuple[int, BlockMeta]]:
        """Every block that holds a published page, with its meta."""
        return [(b.block_id, b.meta()) for b in self.blocks if b.hash is not None]

    def idle_cached_blocks(self, freed_before: float) -> list[int]:
        """Free blocks still holding a published page, free since before `freed_before`, oldest first."""
        return [b for b in self.free_lru if self.blocks[b].hash is not None and self.blocks[b].freed_at <= freed_before]

    def block_meta(self, block_id: int) -> BlockMeta:
        return self.blocks[block_id].meta()

    def demote(self, block_id: int) -> None:
        """A free block whose page now lives in a lower tier: unpublished and reused first."""
        self.unpublish(block_id)
        self.free_lru.move_to_end(block_id, last=False)

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_blocks - self.num_free_blocks,
            "kv_blocks_cached": self.num_cached_free_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "prefix_cache_hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0,
            "prefix_cache_hit_tokens": self.num_hit_tokens,
            "prefix_cache_queried_tokens": self.num_queried_tokens,
            "evictions": self.num_evictions,
            "kv_blocks_shared": self._shared,
        }

    def drop_owner(self, owner: bytes) -> int:
        """Unpublish free cached blocks of one user (a deleted user); blocks in use are left alone."""
        return self._drop_free(lambda block: block.owner == owner)

    def drop_hashes(self, hashes: set[bytes]) -> int:
        """Unpublish free cached blocks with these hashes (a deleted conversation's); blocks in use stay."""
        return self._drop_free(lambda block: block.hash in hashes)

    def _drop_free(self, match) -> int:
        n = 0
        for block_id in list(self.free_lru):
            block = self.blocks[block_id]
            if block.hash is not None and match(block):
                del self.cached[block.hash]
                block.clear_hash()
                self._free_cached -= 1
                self.free_lru.move_to_end(block_id, last=False)
                n += 1
        return n

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Conservation, ref counts = table membership, index consistency. Names the bad blocks."""
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        bad = [b for b in self.blocks if b.ref_count != refs[b.block_id]]
        assert not bad, (
            f"ref counts differ from table membership: {bad[:8]} (tables say {[refs[b.block_id] for b in bad[:8]]})"
        )
        free = set(self.free_lru)
        assert len(free) == len(self.free_lru)
        counted = (self._free_cached, self._shared)
        cached_free = sum(1 for b in free if self.blocks[b].hash is not None)
        scanned = (cached_free, sum(1 for b in self.blocks if b.ref_count > 1))
        assert counted == scanned, f"(cached free, shared) blocks counted {counted}, scanned {scanned}"
        wrong = [b for b in self.blocks if (b.ref_count == 0) != (b.block_id in free)]
        assert not wrong, f"free list disagrees with ref counts: {wrong[:8]}"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"index entry {h.hex()[:8]} -> {self.blocks[block_id]}"
        orphans = [b for b in self.blocks if b.hash is not None and self.cached.get(b.hash) != b.block_id]
        assert not orphans, f"hashed blocks missing from the index: {orphans[:8]}"
        # copies in flight: a block waiting for its restore is held by a sequence, never free
        in_flight = [b for b, _ in self.pending_restores if self.blocks[b].ref_count == 0]
        assert not in_flight, f"blocks freed while their restore copy is pending: {in_flight[:8]}"
        # cache_full_blocks never looks below num_published_blocks again: it must not outrun the KV
        stale = [seq for seq in seqs if seq.num_published_blocks > seq.num_computed_tokens // self.block_size]
        assert not stale, f"published-block counts ahead of the computed tokens: {stale[:8]}"
