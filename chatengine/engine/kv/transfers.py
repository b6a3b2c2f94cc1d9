"""KVTransfers: the copies between the device pool and the host and disk tiers.

The block manager decides what moves (evictions, restores, publishes) and lists it; the runner
owns the device tensors and queues the copies; this class moves the lists to the right copies:
- before a step's forward: evicted pages to host memory (or to disk without a host tier), then
  restores from host memory into their device blocks;
- after a step: newly published pages behind it to the disk store (write-behind);
- on demand: idle cached pages to host memory, everything to disk at shutdown.
Device copies queue behind the step in flight; the host never waits for them here.
"""

import time

from chatengine.engine.kv.block_manager import BlockManager
from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.tiers import TieredCache

GATHER_CHUNK = 64  # pages per device -> host gather
FLUSH_HELPERS = 3  # writer threads a flush adds to the store's one (~10x faster beside a busy thread)


class KVTransfers:
    def __init__(self, runner, block_manager: BlockManager, tiers: TieredCache):
        """runner: the model runner's copy functions (restore_blocks, queue_save_blocks,
        queue_gather_blocks, gather_blocks) over its device pool."""
        self.runner, self.bm, self.tiers = runner, block_manager, tiers

    def before_forward(self) -> None:
        """Copies the schedule asked for, before the forward: evicted pages to host memory first
        (their device blocks may be restore targets), then restores into the device pool."""
        restores = self.bm.take_restores()
        hashes = [h for _, h in restores]
        try:
            self.copy_evictions()
            if restores:
                done = self.runner.restore_blocks(
                    [b for b, _ in restores], self.tiers.host.data, self.tiers.host_slots(hashes)
                )
                self.tiers.copies_in_flight(done)
        except BaseException:  # never leave a published block without its data
            for block_id, _ in restores:
                self.bm.unpublish(block_id)
            raise
        finally:
            if hashes:
                self.tiers.unpin(hashes)

    def copy_evictions(self) -> None:
        """Write evicted pages back to host memory, or to disk without a host tier: queued on the device
        before anything can overwrite their blocks, behind the step in flight, without a host wait."""
        evicted = self.bm.take_evictions()
        if not evicted:
            return
        if self.tiers.host is not None:
            self.save_to_host(evicted)
        else:  # tiers exist with a disk store when they have no host pool
            disk = self.tiers.disk
            assert disk is not None
            todo = [(b, meta) for b, meta in evicted if not disk.queued(meta.hash)]
            self.queue_to_disk(todo[: disk.reserve(len(todo))], block=False)  # the writer behind: dropped

    def save_to_host(self, blocks: list[tuple[int, BlockMeta]]) -> list[bool]:
        """Queue device -> host-memory copies of these (block id, meta) pages into claimed host slots;
        returns whether each page will be in host memory (False: every slot pinned)."""
        stored, ids, slots, claimed = [], [], [], []
        for block_id, meta in blocks:
            ok, slot = self.tiers.claim(meta)
            stored.append(ok)
            if slot is not None:
                ids.append(block_id)
                slots.append(slot)
                claimed.append(meta.hash)
        if ids:
            try:
                copied = self.runner.queue_save_blocks(ids, self.tiers.host.data, slots)
            except BaseException:  # never leave a host entry whose page did not arrive
                self.tiers.unclaim(claimed)
                raise
            self.tiers.landing(slots, copied)
        return stored

    def queue_to_disk(self, blocks: list[tuple[int, BlockMeta]], block: bool) -> None:
        """Queue these (block id, meta) pages for the disk writer, copied off the device behind the
        step in flight (the writer waits for the copy); block=False drops what a full queue cannot take."""
        for i in range(0, len(blocks), GATHER_CHUNK):
            chunk = blocks[i : i + GATHER_CHUNK]
            pages, copied = self.runner.queue_gather_blocks([block_id for block_id, _ in chunk])
            for (_, meta), page in zip(chunk, pages):
                self.tiers.disk.write_behind(meta, page, block=block, ready=copied)

    def write_behind(self) -> None:
        """Queue newly published pages for the disk store. Their last slots may be written by the step
        in flight (async scheduling): the copies queue behind it and the disk writer waits for them."""
        published = self.bm.take_publishes()
        disk = self.tiers.disk
        if disk is None or not published:
            return
        todo = [(block_id, meta) for block_id, meta in published if not disk.queued(meta.hash)]
        self.queue_to_disk(todo[: disk.reserve(len(todo))], block=False)  # a full queue: dropped before any copy

    def flush(self) -> None:
        """Write every cached block of every tier to the disk store and wait for it."""
        disk = self.tiers.disk
        if disk is None:
            return
        hashed = [(b, meta) for b, meta in self.bm.hashed_blocks() if not disk.queued(meta.hash)]  # gather the rest
        with disk.helpers(FLUSH_HELPERS):
            for i in range(0, len(hashed), GATHER_CHUNK):
                chunk = hashed[i : i + GATHER_CHUNK]
                for (_, meta), page in zip(chunk, self.runner.gather_blocks([b for b, _ in chunk])):
                    disk.write_behind(meta, page, block=True)
            self.tiers.flush()

    def offload_idle(self, max_blocks: int | None = None, idle_for_s: float = 0.0) -> int:
        """Move idle cached pages (free on the device for at least idle_for_s, oldest first) to host
        memory now, freeing the device for active users. Returns how many moved."""
        if self.tiers.host is None:
            return 0
        idle = self.bm.idle_cached_blocks(time.monotonic() - idle_for_s)[:max_blocks]
        for block_id, stored in zip(idle, self.save_to_host([(b, self.bm.block_meta(b)) for b in idle])):
            if stored:  # its copy is queued before any step that could reuse the block
                self.bm.demote(block_id)
        return len(idle)
