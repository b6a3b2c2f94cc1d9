"""The disk store: one file per KV block under a directory named by the model's root fingerprint.

Layout: `<kv_store_dir>/<root hex>/<hash[:2]>/<hash hex>.kv`, one file per block: a fixed
prefix (magic, version, header length, crc32 of header and payload), a JSON header (root, hash,
parent, owner tag, a keyed digest of the token ids, dtype, shape) and the raw page bytes. The file
never spells out the tokens: the digest verifies a hit, and the text cannot be read back from it.
Files are written to a temp name and renamed, so a crash leaves either the whole file or none.
Anything that fails to verify is a miss and is deleted. The index is rebuilt by scanning the
directory at start; a size budget evicts the LRU, and the files of other roots (other weights, an
older format) go first, since this model can never hit them.
"""

import contextlib
import ctypes
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from chatengine.engine.kv.block_meta import BlockMeta

log = logging.getLogger("chatengine.kv.disk")
# 2: the checksum covers the header too; 3: a digest of the token ids instead of the ids (older files are misses)
MAGIC, VERSION = b"CEKV", 3
PREFIX = struct.Struct("<4sHII")  # magic, format version, header length, crc32 of header + payload


class DiskStore:
    def __init__(
        self,
        directory: str | Path,
        root: bytes,
        budget_bytes: int,
        block_shape,
        dtype: torch.dtype,
        queue_size: int = 256,
    ):
        self.dir = Path(directory) / root.hex()
        self.root, self.budget, self.block_shape, self.dtype = root, budget_bytes, tuple(block_shape), dtype
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.index: OrderedDict[bytes, tuple[Path, int, BlockMeta]] = OrderedDict()  # LRU: head evicted first
        self._bytes = 0  # the index's file sizes, kept as entries come and go (under self.lock)
        self.pending: dict[bytes, BlockMeta] = {}  # queued for the writer, not indexed yet
        self.cancelled: set[bytes] = set()  # pending ones forgotten meanwhile: never to be indexed
        self._made: set[Path] = set()  # fan-out directories the writers made (or found)
        self.lock = threading.Lock()
        self.closed = False  # the writer has stopped: a later write is dropped, never left waiting
        self.num_dropped = self.num_write_errors = self.num_damaged = self.num_stale = 0
        self._scan()
        self._clean_other_roots()
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
                    meta, _, _ = self._read_header(f, path)
                found.append((path.stat().st_mtime, meta, path))
            except Exception:  # any unreadable file is a miss, never a failed start
                self.num_damaged += 1
                self._delete(path)
        for _, meta, path in sorted(found, key=lambda x: x[0]):
            self._add(meta, path)
        for tmp in self.dir.glob("*/.*.tmp"):  # a crash mid-write leaves only temp files behind
            self._delete(tmp)

    def _clean_other_roots(self) -> None:
        """Delete other roots' block files, oldest first, until everything fits the budget: blocks of
        weights no longer served would otherwise fill the disk for good."""
        room = self.budget - self.num_bytes
        others = [(p.stat().st_mtime, p) for p in _block_files(self.dir.parent) if p.parent.parent != self.dir]
        total = sum(p.stat().st_size for _, p in others)
        for _, path in sorted(others, key=lambda x: x[0]):
            if total <= room:
                break
            total -= path.stat().st_size
            self._delete(path)
            self.num_stale += 1
        for d in self.dir.parent.glob("*/*"):  # emptied fan-out and root directories go too
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        for d in self.dir.parent.iterdir():
            if d != self.dir and d.is_dir() and not any(d.iterdir()):
                d.rmdir()

    @property
    def num_bytes(self) -> int:
        # a running total: summing the index per write made a flush of n blocks O(n^2), its writer
        # thread holding the GIL against the engine's
        return self._bytes

    def _add(self, meta: BlockMeta, path: Path, size: int | None = None) -> None:
        self._pop(meta.hash)
        if size is None:
            try:
                size = path.stat().st_size
            except OSError:  # gone meanwhile: not indexed, a miss
                return
        self.index[meta.hash] = (path, size, meta)
        self._bytes += size

    def _pop(self, h: bytes) -> tuple[Path, int, BlockMeta] | None:
        entry = self.index.pop(h, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry

    def __contains__(self, h: bytes) -> bool:
        return h in self.index

    def queued(self, h: bytes) -> bool:
        """On disk, or on its way there: nothing to write (a lookup finds only what is on disk)."""
        return h in self.pending or h in self.index  # (this order: the writer indexes, then un-pends)

    def meta(self, h: bytes) -> BlockMeta | None:
        entry = self.index.get(h)
        return entry[2] if entry else None

    # ---- writing ----------------------------------------------------------------------------------
    def write_behind(self, meta: BlockMeta, page: torch.Tensor, block: bool = False, ready=None) -> bool:
        """Queue a write; when the queue is full, drop it (block=False) rather than stall the engine.
        `ready`: a CUDA event that marks the (non-blocking) copy into `page` done; the writer waits on it.
        A page on disk or queued already is not queued again."""
        # (a page forgotten while queued counts as queued until the writer has passed it: one queue
        # item a hash at most, so the writer's bookkeeping of it is never another item's; meanwhile
        # the page is recomputed if wanted, never written after its forget)
        if self.queued(meta.hash):  # (only the engine's thread queues)
            return True
        if self.closed:  # no writer would take it, and a flush would wait for it forever
            self.num_dropped += 1
            return False
        self.pending[meta.hash] = meta  # before the writer can take it: it discards it once indexed
        try:
            self.queue.put((meta, page, ready), block=block)
            return True
        except queue.Full:
            self.pending.pop(meta.hash, None)
            self.num_dropped += 1
            return False

    def reserve(self, n: int) -> int:
        """How many of n writes to queue now (the queue's free room); the rest count as dropped, so
        the caller skips copying their pages off the device. Only the engine's thread queues writes."""
        take = 0 if self.closed else max(0, min(n, self.queue.maxsize - self.queue.qsize()))
        self.num_dropped += n - take
        return take

    def _write_loop(self) -> None:
        while self._take(self.queue.get()):
            pass

    def _take(self, item) -> bool:
        """Write one queued item; False for the stop (None)."""
        try:
            if item is None:
                return False
            self._write(*item)
        except Exception:  # the thread must live on: flush() and close() wait for its queue
            with self.lock:
                self.num_write_errors += 1
            log.exception("KV disk store write failed; the block stays recomputable")
        finally:
            if item is not None:  # indexed first (or failed): never neither for a reader
                self.pending.pop(item[0].hash, None)
                self.cancelled.discard(item[0].hash)
            self.queue.task_done()
        return True

    @contextlib.contextmanager
    def helpers(self, n: int):
        """n more writer threads while the block runs: for a flush, which queues every page at once
        while nothing else runs. A write spends most of its time in syscalls and waiting for the
        GIL (see _write), so several overlap. They leave when the block ends."""
        done = threading.Event()
        threads = [
            threading.Thread(target=self._help, args=(done,), name="kv-disk-helper", daemon=True)
            for _ in range(0 if self.closed else n)
        ]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            done.set()
            for t in threads:
                t.join()

    def _help(self, done: threading.Event) -> None:
        while not done.is_set():
            try:
                item = self.queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is None:  # the writer's stop, not ours: back for it
                self.queue.put(None)
                self.queue.task_done()
                return
            self._take(item)

    def _write(self, meta: BlockMeta, page: torch.Tensor, ready=None) -> None:
        # Every call that lets go of the GIL (a syscall, a torch op, crc32 of a page) can wait a
        # switch interval (5 ms) to get it back while another thread computes: the engine's, when it
        # serves. So a write makes five: crc32, open, one writev, close, rename.
        if meta.hash in self.index or meta.hash in self.cancelled:
            return
        if ready is not None:
            ready.synchronize()
        if page.device.type != "cpu":  # its bytes are read through a host pointer below
            raise TypeError(f"a page to write must be in host memory, not on {page.device}")
        if not page.is_contiguous():
            page = page.contiguous()
        # the page's bytes, not copied (no torch op: `page` stays referenced while they are read)
        payload = (ctypes.c_char * page.nbytes).from_address(page.data_ptr())
        header = json.dumps(
            {
                "root": self.root.hex(),
                "hash": meta.hash.hex(),
                "parent": meta.parent.hex(),
                "owner": meta.owner.hex(),
                "digest": meta.tokens_digest().hex(),
                "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.block_shape),
            }
        ).encode()
        head = PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(payload, zlib.crc32(header))) + header
        path = self.path(meta.hash)
        tmp = path.parent / f".{path.name}.{threading.get_ident()}.tmp"
        try:
            self._write_file(tmp, head, payload)
            os.replace(tmp, path)  # (a stale drop() of the hash leaves it be: it is pending)
        except OSError as e:  # e.g. a full disk: the block stays recomputable, nothing breaks
            with self.lock:
                self.num_write_errors += 1
            if self.num_write_errors == 1 or self.num_write_errors % 100 == 0:
                log.warning("KV disk store write failed (%s); falling back to recompute", e)
            self._delete(tmp)
            return
        with self.lock:
            if meta.hash in self.cancelled:  # forgotten while it was written
                self._delete(path)
                return
            self._add(meta, path, len(head) + len(payload))
            self._enforce_budget()

    def _write_file(self, tmp: Path, head: bytes, payload) -> None:
        if tmp.parent not in self._made:  # a fan-out directory: made once, not asked again per write
            tmp.parent.mkdir(exist_ok=True, mode=0o700)
            self._made.add(tmp.parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # its directory was removed meanwhile (e.g. by a store beside)
            tmp.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(tmp, flags, 0o600)
        try:
            data = [head, payload]
            while data:  # (a short write is possible in principle)
                n = os.writev(fd, data)
                data = _rest(data, n)
        finally:
            os.close(fd)

    def _enforce_budget(self) -> None:
        while self._bytes > self.budget and len(self.index) > 1:
            path = self._pop(next(iter(self.index)))[0]  # type: ignore[index]
            self._delete(path)

    # ---- reading ----------------------------------------------------------------------------------
    def _read_header(self, f, path: Path) -> tuple[BlockMeta, int, int]:
        """(meta, the file's crc32, the crc32 of its header) of the block file `f` (opened at `path`),
        left at its payload. Raises ValueError for anything malformed."""
        head = f.read(PREFIX.size)
        if len(head) != PREFIX.size:
            raise ValueError("truncated header")
        magic, version, n, crc = PREFIX.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise ValueError("bad magic or version")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("truncated header")
        try:
            meta = self._parse_header(json.loads(raw), path)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a flipped byte can break any field
            raise ValueError(f"unreadable header ({type(e).__name__})") from None
        return meta, crc, zlib.crc32(raw)

    def _parse_header(self, h: dict, path: Path) -> BlockMeta:
        if (
            h["root"] != self.root.hex()
            or h["dtype"] != str(self.dtype).removeprefix("torch.")
            or tuple(h["shape"]) != self.block_shape
        ):
            raise ValueError("block of another model, dtype or layout")
        meta = BlockMeta(
            bytes.fromhex(h["hash"]),
            bytes.fromhex(h["parent"]),
            None,
            bytes.fromhex(h["owner"]),
            bytes.fromhex(h["digest"]),
        )
        if path.name != f"{meta.hash.hex()}.kv":
            raise ValueError("file name does not match its hash")
        return meta

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
        buf = out.view(torch.uint8).numpy().reshape(-1)  # out's bytes, written in place
        try:
            with open(path, "rb") as f:
                meta, crc, header_crc = self._read_header(f, path)
                n = f.readinto(buf.data)
                trailing = f.read(1)
            if meta.hash != h or n != buf.size or trailing or zlib.crc32(buf.data, header_crc) != crc:
                raise ValueError("checksum or size mismatch")
        except Exception as e:  # any unreadable file is a miss, never a failed read
            log.warning("KV block file %s is damaged (%s): dropped", path.name, e)
            self.num_damaged += 1
            self.drop(h)
            return None
        with self.lock:
            if h in self.index:
                self.index.move_to_end(h)
        try:
            os.utime(path)  # the mtime is the LRU order across restarts
        except OSError:  # evicted by the writer's budget meanwhile: the page is read already
            pass
        return meta

    def drop(self, h: bytes) -> None:
        with self.lock:  # pop and delete at once: a writer indexes under it, never between the two
            entry = self._pop(h)
            if entry is None and h in self.pending:  # a stale drop (e.g. a reader's of an evicted copy):
                return  # the file is being written anew, and is indexed once written
            self._delete(entry[0] if entry else self.path(h))

    def forget(self, match: Callable[[bytes, BlockMeta], bool]) -> int:
        """Delete the stored blocks that match(hash, meta) selects (a deleted user's, a deleted
        conversation's), and never write the queued ones it selects: without waiting for the
        writer, whose backlog the engine's thread would otherwise sit out. Returns how many were
        stored."""
        n = 0
        with self.lock:  # the writer indexes under it: each queued page is either indexed by now
            for h, meta in list(self.pending.items()):  # (or cancelled here, before it is)
                if h not in self.index and match(h, meta):
                    self.cancelled.add(h)
            for h, (path, _, meta) in list(self.index.items()):
                if match(h, meta):
                    self._pop(h)
                    self._delete(path)
                    n += 1
        return n

    @staticmethod
    def _delete(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def flush(self) -> None:
        self.queue.join()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True  # first: a write racing the close is dropped, not left behind the None
        self.flush()
        self.queue.put(None)
        self.writer.join(timeout=10)


def _rest(data: list, n: int) -> list:
    """What of the buffers `data` is left after a write of n bytes."""
    while data and n >= len(data[0]):
        n -= len(data[0])
        data = data[1:]
    if data and n:
        data = [memoryview(data[0])[n:], *data[1:]]
    return data


def _block_files(kv_dir: Path) -> list[Path]:
    """Every block file under every root of a KV store directory."""
    return [p for p in kv_dir.glob("*/*/*.kv") if p.is_file()]


def drop_owner_files(kv_dir: str | Path, owner: bytes) -> int:
    """Delete every block file salted for one user, under every root and every data-parallel
    replica's directory (for a server that is not running: a running one keeps its own index).
    Unreadable files are left to the next start's scan."""
    n = 0
    dirs = [Path(kv_dir), *Path(kv_dir).glob("replica*")]  # and its data-parallel replicas' stores
    for path in (p for d in dirs for p in _block_files(d)):
        try:
            with open(path, "rb") as f:
                magic, version, size, _ = PREFIX.unpack(f.read(PREFIX.size))
                header = json.loads(f.read(size)) if magic == MAGIC and version == VERSION else {}
            if header.get("owner") == owner.hex():
                path.unlink()
                n += 1
        except (OSError, ValueError, AttributeError, struct.error):
            continue
    return n
