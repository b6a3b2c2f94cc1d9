"""Block-hash chain, model fingerprint and per-user salt. Run: python -m pytest tests/test_hashing.py -q"""

import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatengine.engine.kv.hashing import (
    DIGEST_SIZE,
    SECRET_FILE,
    SECRET_SIZE,
    file_digest,
    hash_block,
    hash_blocks,
    load_or_create_secret,
    model_fingerprint,
    salt_extra,
    salt_start_block,
    user_salt,
)

REPO = Path(__file__).resolve().parent.parent
FP_ARGS = ("HuggingFaceTB/SmolLM2-135M-Instruct", "0" * 64, "float32", "page-first/v1", 16)
SECRET = bytes(range(32))

# hashing.py needs only the standard library: the subprocesses load that file alone (as `m`), not
# the chatengine package, whose import of torch would cost each of them seconds
STANDALONE = (
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('hashing', {str(REPO / 'chatengine/engine/kv/hashing.py')!r})\n"
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
)


@pytest.fixture
def root():
    return model_fingerprint(*FP_ARGS)


# ---- determinism and pinned values


def test_pinned_digests(root):
    # Regression values: if these change, every persisted KV block becomes unreachable.
    # Change them only together with hashing.VERSION.
    assert root.hex() == "a3fd5283365a46e5a1807ab2c3ce8361"
    assert hash_block(root, [1, 2, 3]).hex() == "fc95da0c532575c731241551515f9baf"
    salted = hash_blocks(root, list(range(40)), 16, 1, user_salt(SECRET, "alice"))
    assert [h.hex() for h in salted] == ["04f117a67060e5834d48648199598bde", "08533e5f3405b8be4d88183a756ddd2d"]


def test_deterministic_across_calls(root):
    assert model_fingerprint(*FP_ARGS) == root
    assert len(root) == DIGEST_SIZE
    ids = list(range(100))
    assert hash_blocks(root, ids, 16, 2, b"s") == hash_blocks(root, tuple(ids), 16, 2, b"s")


def test_deterministic_across_processes(root):
    code = (
        STANDALONE
        + f"r = m.model_fingerprint(*{FP_ARGS!r})\n"
        + f"h = m.hash_blocks(r, list(range(50)), 16, 1, m.user_salt({SECRET!r}, 'bob'))\n"
        + "print(r.hex(), *[x.hex() for x in h])\n"
    )
    expected = " ".join(x.hex() for x in [root, *hash_blocks(root, list(range(50)), 16, 1, user_salt(SECRET, "bob"))])
    for seed in ("0", "12345"):  # Python's own hash() must play no part
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == expected


# ---- framing


def test_framing_token_split_is_distinct(root):
    assert hash_block(hash_block(root, [1, 2]), [3]) != hash_block(hash_block(root, [1]), [2, 3])
    assert hash_block(root, [1, 2]) != hash_block(root, [1, 2, 0])
    assert hash_block(root, []) != hash_block(root, [0])


def test_framing_extra_vs_tokens_is_distinct(root):
    # token 1 as u32le is b"\x01\x00\x00\x00": moving it into extra must change the hash
    assert hash_block(root, [1]) != hash_block(root, [], b"\x01\x00\x00\x00")
    assert hash_block(root, [1, 2], b"") != hash_block(root, [1], (2).to_bytes(4, "little"))
    assert hash_block(root, [1], b"x") != hash_block(root, [1])
    # the salt is a typed extra: a raw extra equal to the salt bytes is a different key
    assert hash_block(root, [1], salt_extra(b"abc")) != hash_block(root, [1], b"abc")


def test_fingerprint_fields_are_framed_and_typed():
    base = model_fingerprint("ab", "c", "float32", "v1", 16)
    assert model_fingerprint("a", "bc", "float32", "v1", 16) != base
    assert model_fingerprint("ab", "c", "bfloat16", "v1", 16) != base
    assert model_fingerprint("ab", "c", "float32", "v2", 16) != base
    assert model_fingerprint("ab", "c", "float32", "v1", 32) != base
    assert model_fingerprint("ab", "c", "float32", "v1", 16, ("lora:x",)) != base
    assert model_fingerprint("ab", "c", "float32", "v1", 16, ("1",)) != model_fingerprint(
        "ab", "c", "float32", "v1", 16, (1,)
    )
    with pytest.raises(ValueError):
        model_fingerprint("ab", "c", "float32", "v1", 0)
    with pytest.raises(TypeError):
        model_fingerprint("ab", "c", "float32", "v1", 16, (1.5,))


def test_token_id_range(root):
    hash_block(root, [0, 2**32 - 1])
    for bad in ([-1], [2**32], [1.0]):
        with pytest.raises(ValueError):
            hash_block(root, bad)


# ---- chains, salt, full blocks


def test_different_roots_give_different_chains(root):
    other = model_fingerprint(*FP_ARGS[:1], "f" * 64, *FP_ARGS[2:])
    a, b = hash_blocks(root, list(range(48)), 16), hash_blocks(other, list(range(48)), 16)
    assert not set(a) & set(b)


def test_only_full_blocks_hashed(root):
    assert hash_blocks(root, list(range(15)), 16) == []
    assert len(hash_blocks(root, list(range(16)), 16)) == 1
    assert len(hash_blocks(root, list(range(47)), 16)) == 2
    # the partial tail does not influence the full blocks' hashes
    assert hash_blocks(root, list(range(40)), 16) == hash_blocks(root, list(range(32)), 16)


def test_chain_matches_hash_block(root):
    ids = list(range(32))
    h0 = hash_block(root, ids[:16])
    assert hash_blocks(root, ids, 16) == [h0, hash_block(h0, ids[16:])]


def test_earlier_token_change_changes_every_later_hash(root):
    ids = list(range(64))
    a = hash_blocks(root, ids, 16)
    ids[20] = 999
    b = hash_blocks(root, ids, 16)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("prefix_len, expected", [(0, 0), (15, 0), (16, 1), (17, 1), (31, 1), (32, 2), (33, 2)])
def test_salt_start_block(prefix_len, expected):
    assert salt_start_block(prefix_len, 16) == expected


@settings(max_examples=60, deadline=None)
@given(n_tokens=st.integers(0, 100), prefix_len=st.integers(0, 100))
def test_salt_changes_exactly_blocks_from_start(n_tokens, prefix_len):
    root = model_fingerprint(*FP_ARGS)
    ids = list(range(1000, 1000 + n_tokens))
    start = salt_start_block(prefix_len, 16)
    plain = hash_blocks(root, ids, 16)
    alice = hash_blocks(root, ids, 16, start, user_salt(SECRET, "alice"))
    bob = hash_blocks(root, ids, 16, start, user_salt(SECRET, "bob"))
    for i, (p, a, b) in enumerate(zip(plain, alice, bob)):
        if i < start:  # fully inside the public prefix: shared by everyone
            assert p == a == b
        else:  # any private token: no two users (nor the unsalted space) share it
            assert len({p, a, b}) == 3
            assert (i + 1) * 16 > prefix_len  # the block holds a token past the prefix
    assert hash_blocks(root, ids, 16, start, user_salt(SECRET, "alice")) == alice  # same user hits


def test_salt_none_start_salts_everything(root):
    ids = list(range(32))
    salted = hash_blocks(root, ids, 16, None, b"s")
    assert not set(salted) & set(hash_blocks(root, ids, 16))
    assert hash_blocks(root, ids, 16, None, b"") == hash_blocks(root, ids, 16)  # single-tenant


def test_user_salt():
    a = user_salt(SECRET, "alice")
    assert a == user_salt(SECRET, "alice") and len(a) == 32
    assert a != user_salt(SECRET, "bob")
    assert a != user_salt(bytes(32), "alice")
    assert user_salt(SECRET, None) == b""
    with pytest.raises(ValueError):
        user_salt(SECRET, "")
    with pytest.raises(ValueError):
        user_salt(b"short", "alice")


# ---- server secret and weights digest


def test_secret_created_0600_and_stable(tmp_path):
    data_dir = tmp_path / "data"
    s1 = load_or_create_secret(data_dir)
    path = data_dir / SECRET_FILE
    assert len(s1) == SECRET_SIZE and path.read_bytes() == s1
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(data_dir) == s1
    assert load_or_create_secret(str(data_dir)) == s1
    assert [p.name for p in data_dir.iterdir()] == [SECRET_FILE]  # no temp file left behind
    assert load_or_create_secret(tmp_path / "other") != s1


def test_secret_race_between_processes(tmp_path):
    code = STANDALONE + "import sys; print(m.load_or_create_secret(sys.argv[1]).hex())\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = {p.communicate()[0].strip() for p in procs}
    assert outs == {(tmp_path / SECRET_FILE).read_bytes().hex()}


@pytest.mark.parametrize("content", [b"", b"x" * 31, b"x" * 33])
def test_damaged_secret_raises(tmp_path, content):
    (tmp_path / SECRET_FILE).write_bytes(content)
    with pytest.raises(ValueError, match="damaged"):
        load_or_create_secret(tmp_path)
    assert (tmp_path / SECRET_FILE).read_bytes() == content  # not silently regenerated


def test_file_digest(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(b"abc")
    assert file_digest(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    p.write_bytes(os.urandom(3 * 1024 + 7))
    import hashlib

    assert file_digest(p, chunk_size=1024) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_chain_memo_gives_the_fresh_chain_and_reuses_only_alike_blocks():
    """Chains started from a remembered one equal chains hashed from scratch, for sequences that
    share prefixes of any length, with equal or different salts and public prefixes; a block is
    reused (the same bytes object) only where both hash it alike."""
    from chatengine.engine.kv.hashing import ChainMemo, extend_chain, salt_extra

    rng = random.Random(3)
    memo, bs, root = ChainMemo(size=4), 4, b"r" * 16
    base = [rng.randrange(50) for _ in range(40)]
    made = []
    for _ in range(60):
        cut = rng.randrange(0, 41)
        toks = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        extra_from = rng.choice([0, 2, 5])
        extra = rng.choice([b"", salt_extra(b"u1"), salt_extra(b"u2")])
        n = len(toks) // bs
        fresh, got = [], []
        extend_chain(fresh, root, toks, bs, n, extra_from, extra)
        memo.extend(got, root, toks, bs, n, extra_from, extra)
        assert got == fresh
        made.append((toks, got, extra_from, extra))
    a = base + [1] * 8
    b = base[:20] + [2] * 8  # 5 shared blocks
    ha, hb, hc = [], [], []
    memo.extend(ha, root, a, bs, len(a) // bs, 3, salt_extra(b"u1"))
    memo.extend(hb, root, b, bs, len(b) // bs, 3, salt_extra(b"u1"))
    assert [x is y for x, y in zip(ha, hb)] == [True] * 5 + [False] * 2
    memo.extend(hc, root, b, bs, len(b) // bs, 3, salt_extra(b"u2"))  # another user: the 3 public blocks
    assert [x is y for x, y in zip(hb, hc)] == [True] * 3 + [False] * 4


def test_chain_memo_starts_from_the_longest_shared_prefix_of_any_entry():
    """The newest entry shares 3 blocks, an older one 8, and one in between agrees on the block after
    the first entry's 3 but not before it: the chain reuses the older entry's 8 blocks."""
    from chatengine.engine.kv.hashing import ChainMemo

    memo, bs, root = ChainMemo(size=8), 4, b"r" * 16
    new = list(range(100, 140))  # 10 blocks
    older = new[:32] + [1] * 8  # 8 blocks alike
    middle = new[:4] + [2] * 8 + new[12:16] + [3] * 20  # block 0 and block 3 alike, 1-2 not
    newest = new[:12] + [4] * 28  # 3 blocks alike
    chains = {}
    for name, toks in (("older", older), ("middle", middle), ("newest", newest)):
        chains[name] = []
        memo.extend(chains[name], root, toks, bs, len(toks) // bs)
    got: list[bytes] = []
    memo.extend(got, root, new, bs, len(new) // bs)
    assert [x is y for x, y in zip(got, chains["older"])] == [True] * 8 + [False] * 2
