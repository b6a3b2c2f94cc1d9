"""Content addresses for KV blocks: model fingerprint, framed block-hash chain, per-user salt.

Every hash here is deterministic (no os.urandom, no Python hash()), so a block computed before a
restart, or on the CPU or disk tier, has the same key afterwards. Every variable-length field is
length-prefixed, so two different inputs can never serialise to the same bytes (with plain
concatenation, one tenant's tokens plus salt could spell another tenant's key).
"""

import hashlib
import hmac
import os
import struct
import tempfile
from collections import deque
from pathlib import Path

VERSION = b"chatengine/kv/v1"  # bump when the recipe or the KV layout meaning changes
DIGEST_SIZE = 16  # 128 bits: collisions are negligible, and a hit also compares token ids
SECRET_FILE = "server_secret"
SECRET_SIZE = 32

# blake2b "person" separates the two kinds of hash, so a root can never equal a block hash.
_ROOT_PERSON = b"chatengine/root"
_BLOCK_PERSON = b"chatengine/block"


def _frame(*fields: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in fields)


def _typed(value) -> bytes:
    # A type tag keeps the str "16", the int 16 and the bytes b"16" apart.
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
        raise TypeError(f"fingerprint fields must be str, bytes or int, got {type(value).__name__}")
    if isinstance(value, str):
        return b"s" + value.encode("utf-8")
    if isinstance(value, int):
        return b"i" + str(value).encode("ascii")
    return b"b" + value


def model_fingerprint(
    model_id: str, weights_digest: str, dtype: str, kv_layout: str, block_size: int, extra: tuple = ()
) -> bytes:
    """Root of every hash chain. Changed weights, dtype, layout or block size give a new root,
    so KV computed under the old model can never be hit."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    fields = (model_id, weights_digest, dtype, kv_layout, block_size, *extra)
    data = _frame(VERSION, struct.pack("<I", len(fields)), *(_typed(f) for f in fields))
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=_ROOT_PERSON).digest()


_U32 = struct.Struct("<I")
_TOKENS: dict[int, struct.Struct] = {}  # block length -> "<I{n}I" (count, then the ids)


def hash_block(parent: bytes, token_ids: list[int] | tuple, extra: bytes = b"") -> bytes:
    """h_i = H(parent ‖ u32 count ‖ u32le tokens ‖ extra), each part framed (the bytes of
    `_frame(parent) + tokens + _frame(extra)`, written out: it runs for every block of every
    prompt, ~1 us instead of ~2)."""
    n = len(token_ids)
    packer = _TOKENS.get(n)
    if packer is None:
        packer = _TOKENS[n] = struct.Struct(f"<I{n}I")
    try:
        tokens = packer.pack(n, *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in 0..2**32-1 ({e})") from None
    data = _U32.pack(len(parent)) + parent + tokens + _U32.pack(len(extra)) + extra
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=_BLOCK_PERSON).digest()


def tokens_digest(block_hash: bytes, token_ids) -> bytes:
    """A digest of a block's token ids keyed by its hash: verifies a hit on a block file without the
    file spelling out the conversation's tokens."""
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=block_hash[:64], person=b"chatengine/toks").digest()


def extend_chain(
    hashes: list[bytes],
    root: bytes,
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    extra_from: int = 0,
    extra: bytes = b"",
) -> None:
    """Append to `hashes` (the chain of token_ids' first blocks) up to num_blocks blocks: each
    `hash_block(parent, block, extra if i >= extra_from else b"")`, with the tokens packed once for
    the whole range (a 2k-token prompt: 135 blocks in ~0.12 ms instead of ~0.17)."""
    first = len(hashes)
    if first >= num_blocks:
        return
    bs = block_size
    try:
        raw = struct.pack(f"<{(num_blocks - first) * bs}I", *token_ids[first * bs : num_blocks * bs])
    except struct.error as e:
        raise ValueError(f"token ids must be ints in 0..2**32-1 ({e})") from None
    count, width = _U32.pack(bs), 4 * bs
    tails = (_U32.pack(0), _U32.pack(len(extra)) + extra)
    parent = hashes[-1] if hashes else root
    for i in range(first, num_blocks):
        j = (i - first) * width
        data = _U32.pack(len(parent)) + parent + count + raw[j : j + width] + tails[i >= extra_from]
        parent = hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=_BLOCK_PERSON).digest()
        hashes.append(parent)


class ChainMemo:
    """The hash chains of the last few sequences, to start a new chain from.

    A chat's prompts share long prefixes (a persona, the conversation so far), and hashing a
    2k-token prefix block by block cost ~0.2 ms of the time to first token on an H200 host, while
    finding the prefix shared with a recent sequence takes a few list comparisons. Only blocks hashed
    alike are reused: the public (unsalted) ones, or every block when both sequences have the same
    salt. A reused hash is one the new sequence would compute itself from the same tokens.

    NOTE: entries keep references to sequences' token and hash lists; both only ever grow at the
    end, and hashes cover known tokens only, so an entry's hashed prefix never changes."""

    def __init__(self, size: int = 16):
        self.entries: deque = deque(maxlen=size)  # (token_ids, hashes, extra_from, extra)

    def extend(
        self,
        hashes: list[bytes],
        root: bytes,
        token_ids: list[int],
        block_size: int,
        num_blocks: int,
        extra_from: int = 0,
        extra: bytes = b"",
    ) -> None:
        """extend_chain, starting from the longest shared prefix of a remembered chain."""
        if not hashes and num_blocks > 1:
            best, best_n = None, 0
            first = token_ids[:block_size]
            for toks, hs, ef, ex in reversed(self.entries):  # the newest first
                limit = min(len(hs), num_blocks)
                if (ef, ex) != (extra_from, extra):
                    limit = min(limit, ef, extra_from)  # the unsalted blocks only
                # it can beat the best so far only if it shares the block after the best's (a chat's
                # recent prompts share a persona: without this each was searched block by block)
                at = best_n * block_size
                if (
                    limit > best_n
                    and toks[:block_size] == first
                    and (not best_n or toks[at : at + block_size] == token_ids[at : at + block_size])
                ):
                    n = _shared_blocks(toks, token_ids, block_size, limit)
                    if n > best_n:
                        best, best_n = hs, n
                        if n == num_blocks:
                            break
            if best_n and best is not None:
                hashes.extend(best[:best_n])
            self.entries.append((token_ids, hashes, extra_from, extra))
        extend_chain(hashes, root, token_ids, block_size, num_blocks, extra_from, extra)

    def remember(
        self,
        token_ids: list[int],
        hashes: list[bytes],
        extra_from: int = 0,
        extra: bytes = b"",
        replacing: list[int] | None = None,
    ) -> None:
        """Keep a chain made elsewhere (hashes of token_ids' first blocks, neither list changed after),
        in place of the entry of the token list `replacing` (the same list object) if there is one."""
        if replacing is not None:
            kept = [e for e in self.entries if e[0] is not replacing]
            if len(kept) < len(self.entries):
                self.entries = deque(kept, maxlen=self.entries.maxlen)
        self.entries.append((token_ids, hashes, extra_from, extra))

    def num_tokens(self) -> int:
        """Token ids the entries hold (what the memo keeps alive)."""
        return sum(len(e[0]) for e in self.entries)


def _shared_blocks(a: list[int], b: list[int], block_size: int, limit: int) -> int:
    """The most whole blocks (<= limit) that a and b begin with alike (they share the first): all
    of them, or a binary search (~8 slice comparisons for a 2k-token prompt, each of the blocks
    not yet known alike)."""
    if a[: limit * block_size] == b[: limit * block_size]:
        return limit
    lo, hi = 1, limit - 1  # a and b agree on lo blocks; they differ within the first hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def salt_extra(salt: bytes) -> bytes:
    """The salt as a typed extra field, so it cannot collide with another kind of extra."""
    return _frame(b"salt", salt)


def salt_start_block(public_prefix_len: int, block_size: int) -> int:
    """Index of the first block that holds any token at or past `public_prefix_len`.

    Blocks before it lie fully inside the public prefix; the straddling block is private."""
    return public_prefix_len // block_size


def hash_blocks(
    root: bytes, token_ids, block_size: int, salt_from_block: int | None = None, salt: bytes = b""
) -> list[bytes]:
    """Chain hashes of the FULL blocks of `token_ids` (a partial tail is never hashed).

    Blocks `0 .. salt_from_block-1` are public: they lie fully inside a registered persona
    system prompt (`salt_from_block = salt_start_block(len(persona_prompt_ids), block_size)`)
    and every user who picks that persona produces the same hashes, so they are shared.
    Block `salt_from_block` (the first one holding any token past the public prefix) and every
    later block get the salt in their extra. The salt also reaches later blocks through the
    chain; mixing it into each one keeps each key private on its own. So a user's conversation
    never produces a hash another user can produce. The caller must only claim a public prefix
    whose token ids equal a registered persona prompt; `salt_from_block=None` means no public
    prefix at all, i.e. salt from block 0. An empty salt (single-tenant) salts nothing.
    """
    hashes: list[bytes] = []
    extend_chain(
        hashes,
        root,
        token_ids,
        block_size,
        len(token_ids) // block_size,
        0 if salt_from_block is None else salt_from_block,
        salt_extra(salt) if salt else b"",
    )
    return hashes


def user_salt(secret: bytes, user: str | None) -> bytes:
    """HMAC-SHA256(server secret, user id), derived on the server from the authenticated user.

    None means single-tenant (no salt). An empty id is refused: it would silently put every
    anonymous caller in one shared namespace."""
    if user is None:
        return b""
    if not user:
        raise ValueError("user id must be a non-empty string, or None for single-tenant use")
    if len(secret) < 16:
        raise ValueError("server secret is too short (need at least 16 bytes)")
    return hmac.new(secret, _frame(b"user", user.encode("utf-8")), hashlib.sha256).digest()


def load_or_create_secret(data_dir) -> bytes:
    """The server secret in `<data_dir>/server_secret`: 32 random bytes, created once (0600)."""
    path = Path(data_dir) / SECRET_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".server_secret.")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(SECRET_SIZE))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic create-if-absent: the first process of a race wins
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links: replace, then re-read below
                os.replace(tmp, path)
            _fsync_dir(path.parent)  # a secret lost to a power cut would orphan every cache
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    secret = path.read_bytes()  # re-read, so racing processes all use the winner's bytes
    if len(secret) != SECRET_SIZE:
        # Never regenerate silently: a new secret changes every user's salt, which orphans all
        # of their cached KV on every tier (GPU, CPU, disk), and a damaged file points at a disk
        # or operator fault that someone should see.
        raise ValueError(
            f"{path} is damaged: {len(secret)} bytes, expected {SECRET_SIZE}. "
            "Restore it from a backup, or delete it to start a new secret "
            "(existing cached KV of every user then becomes unreachable)."
        )
    return secret


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path, chunk_size: int = 1 << 20) -> str:
    """SHA-256 hex of a file, read in chunks (weights files are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()
