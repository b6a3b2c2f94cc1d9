"""Lower KV tiers: a host (pinned on CUDA) pool of blocks and a disk store, keyed by block hash.

A block evicted from the device LRU is written back here (same hash, so the same user salt); when
the host pool is full its LRU spills to disk. On CUDA the engine's write-backs are queued on the
device behind the step in flight, into claimed slots (`claim`, `landing`): the host reads or
overwrites a slot only after its copy has landed. With a disk store, published blocks are also written
behind in the background and `flush()` writes everything, so a restart finds them.

Disk layout: `<kv_store_dir>/<root hex>/<hash[:2]>/<hash hex>.kv`, one file per block: a fixed
prefix (magic, version, header length), a JSON header (root, hash, parent, owner, token ids, dtype,
shape, crc32 of the payload) and the raw page bytes. Files are written to a temp name and renamed,
so a crash leaves either the whole file or none. Anything that fails to verify is a miss and is
deleted. The index is rebuilt by scanning the directory at start.

Lookups go host -> disk; a disk hit is read and verified into a host slot on a reader thread,
without stalling the engine (the request waits, the others run), so a restore copies from host
memory only. Entries a pending restore needs are pinned: never
evicted until the copy is done.
"""
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("chatengine.offload")
MAGIC, VERSION = b"CEKV", 1
READERS = 4                              # disk reads in parallel (file reads and crc32 release the GIL)
PREFIX = struct.Struct("<4sHI")          # magic, format version, header length


@dataclass
class BlockMeta:
    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    owner: bytes = b""                    # a tag of the salting user (b"": public / single-tenant)


class DiskStore:
    def __init__(self, directory: str | Path, root: bytes, budget_bytes: int, block_shape, dtype: torch.dtype,
                 queue_size: int = 256):
        self.dir = Path(directory) / root.hex()
        self.root, self.budget, self.block_shape, self.dtype = root, budget_bytes, tuple(block_shape), dtype
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.index: OrderedDict[bytes, tuple[Path, int, BlockMeta]] = OrderedDict()   # LRU: head evicted first
        self.lock = threading.Lock()
        self.num_dropped = self.num_write_errors = self.num_damaged = 0
        self._scan()
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self.writer.start()

    def path(self, h: bytes) -> Path:
        return self.dir / h.hex()[:2] / f"{h.hex()}.kv"

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob("*/*.kv"):
            try:
                with open(path, "rb") as f:
                    meta, _ = self._read_header(f, path)
                found.append((path.stat().st_mtime, meta, path))
            except (OSError, ValueError):
                self._delete(path)
        for _, meta, path in sorted(found, key=lambda x: x[0]):
            self.index[meta.hash] = (path, path.stat().st_size, meta)
        for tmp in self.dir.glob("*/.*.tmp"):   # a crash mid-write leaves only temp files behind
            self._delete(tmp)

    @property
    def num_bytes(self) -> int:
        # list() first: stats() reads this on other threads while the writer thread adds entries
        return sum(size for _, size, _ in list(self.index.values()))

    def __contains__(self, h: bytes) -> bool:
        return h in self.index

    def meta(self, h: bytes) -> BlockMeta | None:
        entry = self.index.get(h)
        return entry[2] if entry else None

    # ---- writing ----------------------------------------------------------------------------------
    def write_behind(self, meta: BlockMeta, page: torch.Tensor, block: bool = False, ready=None) -> bool:
        """Queue a write; when the queue is full, drop it (block=False) rather than stall the engine.
        `ready`: a CUDA event that marks the (non-blocking) copy into `page` done; the writer waits on it."""
        if meta.hash in self.index:
            return True
        try:
            self.queue.put((meta, page, ready), block=block)
            return True
        except queue.Full:
            self.num_dropped += 1
            return False

    def reserve(self, n: int) -> int:
        """How many of n writes to queue now (the queue's free room); the rest count as dropped, so
        the caller skips copying their pages off the device. Only the engine's thread queues writes."""
        take = max(0, min(n, self.queue.maxsize - self.queue.qsize()))
        self.num_dropped += n - take
        return take

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self.queue.task_done()

    def _write(self, meta: BlockMeta, page: torch.Tensor, ready=None) -> None:
        if meta.hash in self.index:
            return
        if ready is not None:
            ready.synchronize()
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"root": self.root.hex(), "hash": meta.hash.hex(), "parent": meta.parent.hex(),
                             "owner": meta.owner.hex(), "tokens": list(meta.token_ids),
                             "dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.block_shape),
                             "crc32": zlib.crc32(payload)}).encode()
        path = self.path(meta.hash)
        tmp = path.parent / f".{path.name}.{threading.get_ident()}.tmp"
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload)
            os.replace(tmp, path)
        except OSError as e:        # e.g. a full disk: the block stays recomputable, nothing breaks
            self.num_write_errors += 1
            if self.num_write_errors == 1 or self.num_write_errors % 100 == 0:
                log.warning("KV disk store write failed (%s); falling back to recompute", e)
            self._delete(tmp)
            return
        with self.lock:
            self.index[meta.hash] = (path, path.stat().st_size, meta)
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        total = self.num_bytes
        while total > self.budget and len(self.index) > 1:
            _, (path, size, _) = self.index.popitem(last=False)
            self._delete(path)
            total -= size

    # ---- reading ----------------------------------------------------------------------------------
    def _read_header(self, f, path: Path) -> tuple[BlockMeta, int]:
        """(meta, payload crc32) of the block file `f` (opened at `path`), left at its payload."""
        head = f.read(PREFIX.size)
        if len(head) != PREFIX.size:
            raise ValueError("truncated header")
        magic, version, n = PREFIX.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise ValueError("bad magic or version")
        h = json.loads(f.read(n))
        if h["root"] != self.root.hex() or h["dtype"] != str(self.dtype).removeprefix("torch.") \
                or tuple(h["shape"]) != self.block_shape:
            raise ValueError("block of another model, dtype or layout")
        meta = BlockMeta(bytes.fromhex(h["hash"]), bytes.fromhex(h["parent"]), tuple(h["tokens"]),
                         bytes.fromhex(h["owner"]))
        if path.name != f"{meta.hash.hex()}.kv":
            raise ValueError("file name does not match its hash")
        return meta, h["crc32"]

    def read(self, h: bytes) -> tuple[BlockMeta, torch.Tensor] | None:
        """The block's meta and page, verified; None (and the file deleted) when anything is off."""
        page = torch.empty(self.block_shape, dtype=self.dtype)
        meta = self.read_into(h, page)
        return None if meta is None else (meta, page)

    def read_into(self, h: bytes, out: torch.Tensor) -> BlockMeta | None:
        """Read the block's page straight into `out` (contiguous, the block's shape and dtype: e.g. a
        host pool slot) and verify it: its meta, or None (the file deleted) when anything is off.
        Safe on a reader thread."""
        entry = self.index.get(h)
        if entry is None:
            return None
        path = entry[0]
        buf = out.view(torch.uint8).numpy().reshape(-1)          # out's bytes, written in place
        try:
            with open(path, "rb") as f:
                meta, crc = self._read_header(f, path)
                n = f.readinto(buf)
                trailing = f.read(1)
            if meta.hash != h or n != buf.size or trailing or zlib.crc32(buf) != crc:
                raise ValueError("checksum or size mismatch")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            log.warning("KV block file %s is damaged (%s): dropped", path.name, e)
            self.num_damaged += 1
            self.drop(h)
            return None
        with self.lock:
            if h in self.index:
                self.index.move_to_end(h)
        try:
            os.utime(path)       # the mtime is the LRU order across restarts
        except OSError:          # evicted by the writer's budget meanwhile: the page is read already
            pass
        return meta

    def drop(self, h: bytes) -> None:
        with self.lock:
            entry = self.index.pop(h, None)
        self._delete(entry[0] if entry else self.path(h))

    @staticmethod
    def _delete(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def flush(self) -> None:
        self.queue.join()

    def close(self) -> None:
        self.flush()
        self.queue.put(None)
        self.writer.join(timeout=10)


class HostPool:
    """A fixed pool of block-sized host buffers, LRU by hash."""

    def __init__(self, num_blocks: int, block_shape, dtype: torch.dtype, pin: bool):
        self.data = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.free_slots = list(range(num_blocks - 1, -1, -1))
        self.index: OrderedDict[bytes, tuple[int, BlockMeta]] = OrderedDict()   # head = LRU
        self.pinned: dict[bytes, int] = {}
        self.landing: dict[int, object] = {}     # slot -> event of a device copy into it, maybe unfinished
        self.loading: dict[int, tuple[bytes, Future]] = {}   # slot -> (hash, its read from disk)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def __contains__(self, h: bytes) -> bool:
        return h in self.index


class TieredCache:
    """The host pool and the optional disk store behind the device pool."""

    def __init__(self, root: bytes, block_shape, dtype: torch.dtype, cpu_blocks: int, pin: bool,
                 disk_dir: str | None = None, disk_budget_bytes: int = 0):
        self.host = HostPool(cpu_blocks, block_shape, dtype, pin) if cpu_blocks > 0 else None
        self.disk = DiskStore(disk_dir, root, disk_budget_bytes, block_shape, dtype) if disk_dir else None
        self.num_restored = self.num_promoted = 0
        self.inflight = None                    # event of the last restore's host -> device copies
        self.reader = ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-reader") if self.host and self.disk else None

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
                if meta.token_ids != tuple(tokens):
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
            if meta is None or meta.token_ids != tuple(tokens) or h in self.host.index:
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
        except Exception:                      # never take the engine down over a disk read
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
    def put(self, meta: BlockMeta, page: torch.Tensor) -> bool:
        """Store one page in host memory (LRU spills to disk). False if every slot is pinned."""
        if self.host is None:
            if self.disk is not None:
                self.disk.write_behind(meta, page.clone(), block=True)
            return False
        stored, slot = self.claim(meta)
        if slot is not None:
            self._settle(slot)                     # a device copy may still be landing in this reused slot
            if self.inflight is not None:          # a restore may still be reading this slot: wait for it
                self.inflight.synchronize()
                self.inflight = None
            self.host.data[slot].copy_(page)
        return stored

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

    def _spill_one(self) -> bool:
        host = self.host
        for h, (slot, _) in host.index.items():         # oldest first, skipping pinned entries and reads
            if h not in host.pinned and slot not in host.loading:
                slot, meta = host.index.pop(h)
                if self.disk is not None:
                    self._settle(slot)
                    self.disk.write_behind(meta, host.data[slot].clone(), block=True)
                host.free_slots.append(slot)
                return True
        return False

    def drop_owner(self, owner: bytes) -> int:
        """Forget every block salted for one user (host and disk). Returns how many."""
        n = 0
        if self.host is not None:
            for h, (slot, meta) in list(self.host.index.items()):
                if meta.owner == owner and h not in self.host.pinned:
                    self._settle(slot)                  # nothing may land in the slot once it is free
                    if self.host.index.pop(h, None) is not None:
                        self.host.free_slots.append(slot)
                        n += 1
        if self.disk is not None:
            self.disk.flush()
            for h, (_, _, meta) in list(self.disk.index.items()):
                if meta.owner == owner:
                    self.disk.drop(h)
                    n += 1
        return n

    def flush(self) -> None:
        """Write every host block to disk and wait for the writer."""
        if self.disk is None:
            return
        if self.host is not None:
            for h, (slot, meta) in list(self.host.index.items()):
                self._settle(slot)
                if h in self.host.index:                # (a failed read is gone)
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
