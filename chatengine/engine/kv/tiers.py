"""Lower KV tiers: a host (pinned on CUDA) pool of blocks in front of the disk store, keyed by block hash.

A block evicted from the device LRU is written back here (same hash, so the same user salt); when
the host pool is full its LRU spills to disk, unless the disk writer is behind (then it is dropped:
the engine never waits on the disk but to flush). On CUDA the engine's write-backs are queued on the
device behind the step in flight, into claimed slots (`claim`, `landing`): the host reads or
overwrites a slot only after its copy has landed. With a disk store, published blocks are also written
behind in the background and `flush()` writes everything, so a restart finds them.

Lookups go host -> disk; a disk hit is read and verified into a host slot on a reader thread,
without stalling the engine (the request waits, the others run), so a restore copies from host
memory only. Entries a pending restore needs are pinned: never evicted until the copy is done.
"""

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.disk_store import DiskStore

log = logging.getLogger("chatengine.kv.tiers")
READERS = 4  # disk reads in parallel (file reads and crc32 release the GIL)


class HostPool:
    """A fixed pool of block-sized host buffers, LRU by hash."""

    def __init__(self, num_blocks: int, block_shape, dtype: torch.dtype, pin: bool):
        self.data = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.free_slots = list(range(num_blocks - 1, -1, -1))
        self.index: OrderedDict[bytes, tuple[int, BlockMeta]] = OrderedDict()  # head = LRU
        self.pinned: dict[bytes, int] = {}
        self.landing: dict[int, object] = {}  # slot -> event of a device copy into it, maybe unfinished
        self.loading: dict[int, tuple[bytes, Future]] = {}  # slot -> (hash, its read from disk)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def __contains__(self, h: bytes) -> bool:
        return h in self.index


class TieredCache:
    """The host pool and the optional disk store behind the device pool."""

    def __init__(
        self,
        root: bytes,
        block_shape,
        dtype: torch.dtype,
        cpu_blocks: int,
        pin: bool,
        disk_dir: str | None = None,
        disk_budget_bytes: int = 0,
    ):
        self.host = HostPool(cpu_blocks, block_shape, dtype, pin) if cpu_blocks > 0 else None
        self.disk = DiskStore(disk_dir, root, disk_budget_bytes, block_shape, dtype) if disk_dir else None
        self.num_restored = self.num_promoted = 0
        self.inflight = None  # event of the last restore's host -> device copies
        self.reader = (
            ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-reader") if self.host and self.disk else None
        )

    # ---- lookup (metadata + reads from disk) -------------------------------------------------------
    def lookup(self, hashes: list[bytes], token_lists: list[list[int]]) -> tuple[int, bool]:
        """(How many of `hashes`, a chain continuing a device hit, are in host memory, in order;
        whether the chain goes on with blocks on their way from disk). A disk hit is not waited for:
        its read into a claimed host slot starts on a reader thread, with the disk hits after it,
        and a later lookup finds them in host memory. A damaged file ends the run."""
        host, n = self.host, 0
        if host is None:
            return 0, False
        for i, (h, tokens) in enumerate(zip(hashes, token_lists)):
            entry = host.index.get(h)
            if entry is not None:
                slot, meta = entry
                if not meta.holds(tokens):
                    break
                if slot in host.loading:
                    if not host.loading[slot][1].done():
                        return n, True
                    if not self._finish_load(slot):
                        break
                host.index.move_to_end(h)
            elif self.disk is not None and h in self.disk:
                return n, self._start_loads(hashes[i:], token_lists[i:])
            else:
                break
            n += 1
        return n, False

    def _start_loads(self, hashes: list[bytes], token_lists: list[list[int]]) -> bool:
        """Start reading the run of disk hits at the head of `hashes` into host slots (claimed now,
        so later lookups see them coming); whether any read started."""
        started = False
        for h, tokens in zip(hashes, token_lists):
            meta = self.disk.meta(h)
            if meta is None or not meta.holds(tokens) or h in self.host.index:
                break
            _, slot = self.claim(meta)
            if slot is None:
                break
            # the slot may still be written by a device copy or read by a restore: the reader waits
            waits = [e for e in (self.host.landing.pop(slot, None), self.inflight) if e is not None]
            self.host.loading[slot] = (h, self.reader.submit(self._load, h, slot, waits))
            started = True
        return started

    def _load(self, h: bytes, slot: int, waits: list) -> bool:
        """On the reader thread: the page of `h` into host slot `slot`, verified."""
        try:
            for event in waits:
                event.synchronize()
            return self.disk.read_into(h, self.host.data[slot]) is not None
        except Exception:  # never take the engine down over a disk read
            log.exception("KV block read failed")
            return False

    def _finish_load(self, slot: int) -> bool:
        """Collect the disk read into `slot` (waiting for it if it still runs); a failed one leaves
        nothing behind."""
        h, load = self.host.loading.pop(slot)
        if load.result():
            self.num_promoted += 1
            return True
        self.host.index.pop(h, None)
        self.host.free_slots.append(slot)
        return False

    def loads_in_flight(self) -> bool:
        return bool(self.host is not None and self.host.loading)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a disk read finishes, at most `timeout` s: for an engine with nothing else to run."""
        if self.loads_in_flight():
            wait([load for _, load in self.host.loading.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def pin(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.host.pinned[h] = self.host.pinned.get(h, 0) + 1

    def unpin(self, hashes: list[bytes]) -> None:
        for h in hashes:
            left = self.host.pinned[h] - 1
            if left:
                self.host.pinned[h] = left
            else:
                del self.host.pinned[h]

    def host_slots(self, hashes: list[bytes]) -> list[int]:
        """Host pool slots of pinned hashes, for a restore that copies straight from `host.data`."""
        self.num_restored += len(hashes)
        return [self.host.index[h][0] for h in hashes]

    def copies_in_flight(self, event) -> None:
        """A restore is reading host slots until `event` (anything with .synchronize()) completes."""
        self.inflight = event

    # ---- write-back from the device ---------------------------------------------------------------
    def claim(self, meta: BlockMeta) -> tuple[bool, int | None]:
        """Room in host memory for one page, indexed now: (whether the page will be here, the slot to
        copy it to; None when it is here already or nothing is free). A device copy into the slot
        is then named with `landing`."""
        host = self.host
        if meta.hash in host.index:
            host.index.move_to_end(meta.hash)
            return True, None
        if not host.free_slots and not self._spill_one():
            return False, None
        slot = host.free_slots.pop()
        host.index[meta.hash] = (slot, meta)
        return True, slot

    def unclaim(self, hashes: list[bytes]) -> None:
        """Forget claimed entries whose copy was never queued (it failed): their slots go back."""
        for h in hashes:
            slot, _ = self.host.index.pop(h)
            self.host.free_slots.append(slot)

    def landing(self, slots: list[int], event) -> None:
        """Device copies into these slots finish with `event` (None: finished). Host-side reads and
        writes of a slot wait for it; device-side ones are ordered behind it on the compute stream."""
        if event is not None:
            for slot in slots:
                self.host.landing[slot] = event

    def _settle(self, slot: int) -> None:
        """Wait for whatever still writes host slot `slot`: a device copy, or a read from disk."""
        event = self.host.landing.pop(slot, None)
        if event is not None:
            event.synchronize()
        if slot in self.host.loading:
            self._finish_load(slot)

    def _collect_loads(self) -> None:
        """Collect the disk reads that have finished. A lookup collects its own, but one whose
        request went away (aborted while it waited) is collected here, or its slot stays taken."""
        for slot in [slot for slot, (_, load) in self.host.loading.items() if load.done()]:
            h = self.host.loading[slot][0]
            if self._finish_load(slot):  # spilled last: a waiting request may be about to use it
                self.host.index.move_to_end(h)

    def _spill_one(self) -> bool:
        host = self.host
        self._collect_loads()
        if host.free_slots:  # a failed read gave its slot back
            return True
        for h, (slot, _) in host.index.items():  # oldest first, skipping pinned entries and reads
            if h not in host.pinned and slot not in host.loading:
                slot, meta = host.index.pop(h)
                # to disk unless it is there (written behind) or the writer is behind: then dropped,
                # recomputable, and the engine, serving everyone, never waits on the disk
                if self.disk is not None and not self.disk.queued(h) and self.disk.reserve(1):
                    self._settle(slot)
                    self.disk.write_behind(meta, host.data[slot].clone())
                host.free_slots.append(slot)
                return True
        return False

    def drop_owner(self, owner: bytes) -> int:
        """Forget every block salted for one user (host and disk). Returns how many."""
        return self._drop(lambda h, meta: meta.owner == owner)

    def drop_hashes(self, hashes: set[bytes]) -> int:
        """Forget these blocks (host and disk): a deleted conversation's. Returns how many."""
        return self._drop(lambda h, meta: h in hashes)

    def _drop(self, match) -> int:
        n = 0
        if self.host is not None:
            for h, (slot, meta) in list(self.host.index.items()):
                if match(h, meta) and h not in self.host.pinned:
                    self._settle(slot)  # nothing may land in the slot once it is free
                    if self.host.index.pop(h, None) is not None:
                        self.host.free_slots.append(slot)
                        n += 1
        if self.disk is not None:
            n += self.disk.forget(match)
        return n

    def flush(self) -> None:
        """Write every host block to disk and wait for the writer."""
        if self.disk is None:
            return
        if self.host is not None:
            for h, (slot, meta) in list(self.host.index.items()):
                if self.disk.queued(h):  # written, or queued by the device pool's flush
                    continue
                self._settle(slot)
                if h in self.host.index:  # (a failed read is gone)
                    self.disk.write_behind(meta, self.host.data[slot].clone(), block=True)
        self.disk.flush()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.shutdown(wait=True)
        if self.disk is not None:
            self.flush()
            self.disk.close()

    def stats(self) -> dict:
        return {
            "cpu_blocks_total": self.host.num_blocks if self.host else 0,
            "cpu_blocks_used": len(self.host.index) if self.host else 0,
            "disk_blocks": len(self.disk.index) if self.disk else 0,
            "disk_bytes": self.disk.num_bytes if self.disk else 0,
            "disk_writes_dropped": self.disk.num_dropped if self.disk else 0,
            "disk_write_errors": self.disk.num_write_errors if self.disk else 0,
            "disk_damaged_files": self.disk.num_damaged if self.disk else 0,
            "blocks_restored": self.num_restored,
        }
