"""The disk store never fails on a damaged file: every byte of a block file flipped, and the file cut
at every length, is a miss at start-up and at read (the file then deleted), never an exception; an
intact file reads back bit for bit. The checksum covers the header as well as the page."""

import json
import os
import threading
import time

import pytest
import torch

from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.disk_store import PREFIX, DiskStore, _rest

SHAPE = (2, 2, 2, 1, 4)  # layers, K/V, block size, kv heads, head dim: a small page
ROOT = b"r" * 16
META = BlockMeta(b"h" * 16, b"p" * 16, (11, 12), b"o" * 8)


def store(directory) -> DiskStore:
    return DiskStore(directory, ROOT, 1 << 20, SHAPE, torch.float32)


@pytest.fixture(scope="module")
def block_file(tmp_path_factory):
    """The bytes of one written block file, and its page."""
    directory = tmp_path_factory.mktemp("kv")
    page = torch.randn(SHAPE)
    disk = store(directory)
    disk.write_behind(META, page, block=True)
    disk.close()
    return disk.path(META.hash).read_bytes(), page


def reopen_and_read(tmp_path, data: bytes):
    """Write `data` as the block's file, start a store over it, read the block: (read, store)."""
    disk = DiskStore.__new__(DiskStore)  # only for the path: the layout is fixed by root and hash
    disk.dir = tmp_path / ROOT.hex()
    path = disk.path(META.hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    fresh = store(tmp_path)
    try:
        return fresh.read(META.hash), fresh, path
    finally:
        fresh.close()


def test_an_intact_file_reads_back_bit_for_bit(tmp_path, block_file):
    data, page = block_file
    got, disk, _ = reopen_and_read(tmp_path, data)
    assert got is not None and torch.equal(got[1], page)
    meta = got[0]
    assert (meta.hash, meta.parent, meta.owner) == (META.hash, META.parent, META.owner)
    assert meta.token_ids is None and meta.holds((11, 12)) and not meta.holds((11, 13))
    assert disk.num_damaged == 0


def test_every_flipped_byte_is_a_miss(tmp_path, block_file):
    data, _ = block_file
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x5A
        got, disk, path = reopen_and_read(tmp_path / str(i), bytes(damaged))
        assert got is None, f"byte {i} flipped was read as good"
        assert not path.exists() and disk.num_damaged == 1, i


def test_every_cut_is_a_miss(tmp_path, block_file):
    data, _ = block_file
    for n in range(len(data)):
        got, disk, path = reopen_and_read(tmp_path / str(n), data[:n])
        assert got is None and not path.exists() and disk.num_damaged == 1, n


def test_a_header_that_parses_but_lies_is_a_miss(tmp_path, block_file):
    """A flip that leaves valid JSON (the owner changed) is caught by the checksum over the header."""
    data, _ = block_file
    magic, version, n, crc = PREFIX.unpack(data[: PREFIX.size])
    header = json.loads(data[PREFIX.size : PREFIX.size + n])
    header["owner"] = "00" * 8
    raw = json.dumps(header).encode()
    forged = PREFIX.pack(magic, version, len(raw), crc) + raw + data[PREFIX.size + n :]
    got, disk, path = reopen_and_read(tmp_path, forged)
    assert got is None and not path.exists() and disk.num_damaged == 1


def test_a_block_file_keeps_no_token_ids(tmp_path):
    """What verifies a hit (a digest keyed by the block hash), never the conversation's tokens."""
    tokens = (31337, 27182, 16180, 14142)
    meta = BlockMeta(b"s" * 16, b"p" * 16, tokens, b"o" * 8)
    disk = store(tmp_path)
    disk.write_behind(meta, torch.zeros(SHAPE), block=True)
    disk.close()
    data = disk.path(meta.hash).read_bytes()
    header = json.loads(data[PREFIX.size : PREFIX.size + PREFIX.unpack(data[: PREFIX.size])[2]])
    assert "tokens" not in header and set(header) >= {"digest", "hash", "owner"}
    assert not any(str(t).encode() in data for t in tokens)
    assert torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()[:8] not in data
    reread = store(tmp_path).meta(meta.hash)
    assert reread.holds(tokens) and not reread.holds(tokens[::-1])


def test_files_of_version_2_with_plain_token_ids_are_purged(tmp_path, block_file):
    data, _ = block_file
    magic, _, n, crc = PREFIX.unpack(data[: PREFIX.size])
    old = PREFIX.pack(magic, 2, n, crc) + data[PREFIX.size :]
    got, disk, path = reopen_and_read(tmp_path, old)
    assert got is None and not path.exists()


def test_other_roots_are_cleaned_oldest_first_within_the_budget(tmp_path):
    import os

    for k, root in enumerate((b"a" * 16, b"b" * 16)):  # two older models' stores, 3 blocks each
        old = DiskStore(tmp_path, root, 1 << 20, SHAPE, torch.float32)
        for i in range(3):
            old.write_behind(BlockMeta(bytes([k, i]) * 8, b"p" * 16, (i,), b""), torch.zeros(SHAPE), block=True)
        old.close()
        for path in (tmp_path / root.hex()).glob("*/*.kv"):
            os.utime(path, (1000 + k, 1000 + k))  # root "a" is the older one
    size = next(tmp_path.glob("*/*/*.kv")).stat().st_size  # (every file the same size)
    fresh = DiskStore(tmp_path, ROOT, 3 * size + size // 2, SHAPE, torch.float32)  # room for 3 of the 6
    left = sorted(p.parent.parent.name for p in tmp_path.glob("*/*/*.kv"))
    assert fresh.num_stale == 3 and left == [(b"b" * 16).hex()] * 3  # the older root went first, whole
    assert not (tmp_path / (b"a" * 16).hex()).exists()
    big = DiskStore(tmp_path, ROOT, 1 << 30, SHAPE, torch.float32)  # a budget with room keeps the rest
    assert big.num_stale == 0 and len(list(tmp_path.glob("*/*/*.kv"))) == 3


def test_drop_owner_files_reaches_every_root(tmp_path):
    from chatengine.engine.kv.disk_store import drop_owner_files

    for root in (b"a" * 16, b"b" * 16):
        disk = DiskStore(tmp_path, root, 1 << 20, SHAPE, torch.float32)
        for i, owner in enumerate((b"u" * 8, b"v" * 8, b"")):
            disk.write_behind(BlockMeta(root[:8] + bytes([i]) * 8, b"p" * 16, (i,), owner), torch.zeros(SHAPE), True)
        disk.close()
    assert drop_owner_files(tmp_path, b"u" * 8) == 2
    left = [DiskStore(tmp_path, r, 1 << 20, SHAPE, torch.float32) for r in (b"a" * 16, b"b" * 16)]
    assert all(sorted(m[2].owner for m in d.index.values()) == [b"", b"v" * 8] for d in left)


def test_the_byte_count_follows_writes_evictions_drops_and_a_restart(tmp_path):
    """num_bytes is kept as a running total (a sum per write made a flush quadratic): it stays the
    size of the files on disk through the budget's evictions, a drop and a rescan, within budget."""
    scratch = store(tmp_path / "scratch")
    scratch.write_behind(META, torch.zeros(SHAPE), block=True)
    scratch.close()
    one = scratch.num_bytes  # one block file's size
    directory = tmp_path / "store"

    def on_disk():
        return sum(p.stat().st_size for p in (directory / ROOT.hex()).glob("*/*.kv"))

    disk = DiskStore(directory, ROOT, 5 * one, SHAPE, torch.float32)
    metas = [BlockMeta(bytes([i]) * 16, b"p" * 16, (i,), b"o" * 8) for i in range(12)]
    for meta in metas:
        disk.write_behind(meta, torch.randn(SHAPE), block=True)
    disk.flush()
    assert disk.num_bytes == on_disk() == 5 * one  # the 7 oldest evicted
    assert list(disk.index) == [m.hash for m in metas[7:]]
    disk.drop(metas[9].hash)
    assert disk.num_bytes == on_disk() == 4 * one
    disk.close()
    again = DiskStore(directory, ROOT, 5 * one, SHAPE, torch.float32)
    assert again.num_bytes == on_disk() == 4 * one and len(again.index) == 4
    again.close()


def test_the_writer_lives_on_after_a_failed_write(tmp_path, monkeypatch):
    """A file gone between its rename and its index entry (deleted from outside the process) is a
    miss when read, and uncounted; an unexpected error in one write counts as a
    write error; the writer thread keeps serving, so flush() and close() still return."""
    disk = store(tmp_path)
    real_add = disk._add
    calls = []

    def vanishing(meta, path, size=None):  # the first file is deleted between its rename and its index entry
        calls.append(meta.hash)
        if len(calls) == 1:
            path.unlink()
        return real_add(meta, path, size)

    monkeypatch.setattr(disk, "_add", vanishing)
    disk.write_behind(META, torch.randn(SHAPE), block=True)
    disk.flush()
    assert disk.read(META.hash) is None  # a miss
    assert META.hash not in disk and disk.num_bytes == 0 and disk.num_damaged == 1  # nothing counted
    monkeypatch.setattr(disk, "_write", lambda *a: 1 / 0)
    disk.write_behind(BlockMeta(b"x" * 16, b"p" * 16, (1,), b"o" * 8), torch.randn(SHAPE), block=True)
    disk.flush()
    assert disk.num_write_errors == 1
    monkeypatch.undo()
    other = BlockMeta(b"y" * 16, b"p" * 16, (2,), b"o" * 8)
    disk.write_behind(other, torch.randn(SHAPE), block=True)
    disk.close()
    assert other.hash in disk and disk.num_bytes > 0


def test_a_page_is_queued_once_and_a_failed_write_can_be_queued_again(tmp_path, monkeypatch):
    """A page queued for the writer is not queued again (the flush of the host tier after the device
    pool's would write it twice); once written it is on disk; a write that failed leaves nothing
    pending, so the page can be queued again."""
    disk = store(tmp_path)
    gate, writes = threading.Event(), []
    real_write = disk._write
    monkeypatch.setattr(disk, "_write", lambda *a: gate.wait(10) and (writes.append(a[0].hash) or real_write(*a)))
    assert disk.write_behind(META, torch.randn(SHAPE)) and disk.write_behind(META, torch.randn(SHAPE))
    assert disk.queued(META.hash) and META.hash not in disk  # not readable before it is written
    gate.set()
    disk.flush()
    assert writes == [META.hash]
    assert META.hash in disk and disk.queued(META.hash) and not disk.pending
    other = BlockMeta(b"z" * 16, b"p" * 16, (3,), b"o" * 8)
    monkeypatch.setattr(disk, "_write", lambda *a: 1 / 0)
    disk.write_behind(other, torch.randn(SHAPE), block=True)
    disk.flush()
    assert not disk.queued(other.hash) and disk.num_write_errors == 1
    monkeypatch.undo()
    disk.write_behind(other, torch.randn(SHAPE), block=True)
    disk.close()
    assert other.hash in disk


def test_a_write_after_close_is_dropped_and_never_hangs_a_flush(tmp_path):
    """The writer has stopped: a write queued now would wait forever in the next flush. It is dropped
    (counted), reserve() offers no room, and closing twice is harmless."""
    disk = store(tmp_path)
    disk.close()
    assert not disk.writer.is_alive()
    other = BlockMeta(b"z" * 16, b"p" * 16, (3,), b"o" * 8)
    assert disk.write_behind(other, torch.randn(SHAPE), block=True) is False
    assert disk.reserve(4) == 0 and disk.num_dropped == 5
    assert not disk.queued(other.hash)
    done = threading.Thread(target=lambda: (disk.flush(), disk.close()), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()


def test_rest_is_what_a_short_write_left():
    assert _rest([b"abc", b"defg"], 0) == [b"abc", b"defg"]
    assert [bytes(b) for b in _rest([b"abc", b"defg"], 2)] == [b"c", b"defg"]
    assert _rest([b"abc", b"defg"], 3) == [b"defg"]
    assert [bytes(b) for b in _rest([b"abc", b"defg"], 5)] == [b"fg"]
    assert _rest([b"abc", b"defg"], 7) == []


def test_short_writes_and_a_strided_page_read_back_bit_for_bit(tmp_path, monkeypatch):
    """The writer hands the kernel the header and the page in one writev; a write that takes only a
    few bytes at a time goes on from where it stopped. A page that is a strided view is written as
    its values."""
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, [memoryview(bufs[0])[:7]]))
    disk = store(tmp_path)
    page = torch.randn(tuple(reversed(SHAPE))).permute(4, 3, 2, 1, 0)  # SHAPE, not contiguous
    assert not page.is_contiguous()
    disk.write_behind(META, page, block=True)
    disk.flush()
    meta, back = disk.read(META.hash)
    assert meta.hash == META.hash and torch.equal(back, page)
    disk.close()


def test_helpers_write_beside_the_writer_and_leave_with_their_block(tmp_path, monkeypatch):
    """A flush's extra writers take queued pages beside the store's own writer; every page is written
    once, and the helpers are gone when the block ends, a close inside it included."""
    disk = store(tmp_path)
    real_write, writers = disk._write, set()

    def slow(*a):
        writers.add(threading.current_thread().name)
        time.sleep(0.01)
        return real_write(*a)

    monkeypatch.setattr(disk, "_write", slow)
    metas = [BlockMeta(bytes([i]) * 16, b"p" * 16, (i,), b"o" * 8) for i in range(40)]
    pages = [torch.full(SHAPE, float(i)) for i in range(40)]
    with disk.helpers(3):
        for m, p in zip(metas, pages):
            assert disk.write_behind(m, p, block=True)
        disk.flush()
    assert "kv-disk-writer" in writers and "kv-disk-helper" in writers
    assert not [t for t in threading.enumerate() if t.name == "kv-disk-helper"]
    assert all(torch.equal(disk.read(m.hash)[1], p) for m, p in zip(metas, pages))
    assert not disk.pending and disk.num_write_errors == 0 and len(disk.index) == 40
    # the writer's stop, taken by a helper while the writer is busy, goes back to the writer
    gate = threading.Event()
    monkeypatch.setattr(disk, "_write", lambda *a: gate.wait(10) and real_write(*a))
    disk.write_behind(BlockMeta(b"w" * 16, b"p" * 16, (1,), b"o" * 8), torch.zeros(SHAPE))
    deadline = time.monotonic() + 10
    while disk.queue.qsize() and time.monotonic() < deadline:  # the writer holds the page
        time.sleep(0.01)
    with disk.helpers(1):
        disk.queue.put(None)
        while not disk.queue.qsize() == 1 or [t for t in threading.enumerate() if t.name == "kv-disk-helper"]:
            assert time.monotonic() < deadline, "the helper kept the stop"
            time.sleep(0.01)
    gate.set()
    disk.writer.join(10)
    assert not disk.writer.is_alive() and b"w" * 16 in disk


def test_a_fan_out_directory_removed_meanwhile_is_made_again(tmp_path):
    disk = store(tmp_path)
    first, second = (BlockMeta(b"\xab" + bytes([i]) * 15, b"p" * 16, (i,), b"o" * 8) for i in (1, 2))
    disk.write_behind(first, torch.randn(SHAPE), block=True)
    disk.flush()
    disk.drop(first.hash)
    disk.path(first.hash).parent.rmdir()  # e.g. a store beside this one cleaning up
    disk.write_behind(second, torch.randn(SHAPE), block=True)
    disk.close()
    assert second.hash in disk and disk.num_write_errors == 0


def test_a_page_not_in_host_memory_is_a_write_error_not_a_read_of_its_pointer(tmp_path):
    disk = store(tmp_path)
    disk.write_behind(META, torch.empty(SHAPE, device="meta"), block=True)
    disk.close()
    assert META.hash not in disk and disk.num_write_errors == 1


def test_a_stale_drop_leaves_a_page_being_written_anew(tmp_path):
    """A reader's drop of a hash whose old copy was evicted meanwhile, while the writer has renamed
    the new copy into place but not indexed it yet: the new file stays (it is indexed next). A hash
    neither indexed nor pending has its file deleted."""
    disk = store(tmp_path)
    path = disk.path(META.hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the new copy")
    disk.pending[META.hash] = META
    disk.drop(META.hash)
    assert path.exists()
    del disk.pending[META.hash]
    disk.drop(META.hash)
    assert not path.exists()
    disk.close()


def stalled(tmp_path) -> DiskStore:
    """A store whose writer has stopped as if stuck on a slow disk: writes wait in its queue."""
    disk = store(tmp_path)
    disk.queue.put(None)
    disk.writer.join(10)
    return disk


def test_forget_deletes_stored_pages_and_cancels_queued_ones_without_waiting(tmp_path):
    """A deleted user's pages: the stored ones go at once, the queued ones are never written (the
    engine's thread does not sit out the writer's backlog), and every other page is written."""
    disk = stalled(tmp_path)
    zoe = [BlockMeta(bytes([1, i]) * 8, b"p" * 16, (i,), b"z" * 8) for i in range(3)]
    yan = [BlockMeta(bytes([2, i]) * 8, b"p" * 16, (i,), b"y" * 8) for i in range(3)]
    page = torch.ones(SHAPE)
    disk.write_behind(zoe[0], page)
    disk._take(disk.queue.get_nowait())  # stored before the forget
    for meta in zoe[1:] + yan:
        assert disk.write_behind(meta, page)
    assert disk.forget(lambda h, meta: meta.owner == b"z" * 8) == 1
    assert not disk.path(zoe[0].hash).exists() and zoe[0].hash not in disk
    while not disk.queue.empty():  # the writer comes back
        disk._take(disk.queue.get_nowait())
    assert sorted(disk.index) == sorted(m.hash for m in yan)
    assert not any(disk.path(m.hash).exists() for m in zoe)
    assert not disk.pending and not disk.cancelled


def test_a_page_forgotten_while_it_is_written_is_deleted_not_indexed(tmp_path, monkeypatch):
    disk = stalled(tmp_path)
    write_file = disk._write_file

    def forget_meanwhile(tmp, head, payload):  # the engine's thread forgets it mid-write
        write_file(tmp, head, payload)
        assert disk.forget(lambda h, meta: True) == 0

    monkeypatch.setattr(disk, "_write_file", forget_meanwhile)
    disk.write_behind(META, torch.ones(SHAPE))
    disk._take(disk.queue.get_nowait())
    assert META.hash not in disk and not disk.path(META.hash).exists()
    assert not disk.pending and not disk.cancelled and disk.num_write_errors == 0
