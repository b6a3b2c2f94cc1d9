"""The disk store never fails on a damaged file: every byte of a block file flipped, and the file cut
at every length, is a miss at start-up and at read (the file then deleted), never an exception; an
intact file reads back bit for bit. The checksum covers the header as well as the page."""

import json

import pytest
import torch

from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.disk_store import PREFIX, DiskStore

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
    assert got is not None and got[0] == META and torch.equal(got[1], page)
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
    """A flip that leaves valid JSON (a token id changed) is caught by the checksum over the header."""
    data, _ = block_file
    magic, version, n, crc = PREFIX.unpack(data[: PREFIX.size])
    header = json.loads(data[PREFIX.size : PREFIX.size + n])
    header["tokens"] = [11, 13]
    raw = json.dumps(header).encode()
    forged = PREFIX.pack(magic, version, len(raw), crc) + raw + data[PREFIX.size + n :]
    got, disk, path = reopen_and_read(tmp_path, forged)
    assert got is None and not path.exists() and disk.num_damaged == 1
