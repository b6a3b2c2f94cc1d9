"""RouterChains: the router's hash chains of requests, each user's started from their recent ones.

The router compares block hashes of its own (a secret of its own, a root no replica uses), salted
per user like the replicas' so that one user's blocks never count as another's. A chat resends its
whole history every turn: the last prompt, its answer and a new message. Hashing a 2.5k-token
conversation from scratch took ~0.27 ms of the API process's one core a turn (16-token blocks); a
user's recent chains (a running prompt's, and each finished prompt with its answer) hold all but the
new message's blocks, found by a few list comparisons (kv.hashing.ChainMemo).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from chatengine.engine.kv.hashing import ChainMemo, extend_chain, salt_extra, user_salt

ROOT = b"chatengine/router"  # never compared with a replica's hashes
USERS = 1024  # users whose recent chains are kept (least recently seen dropped first)
# token ids the memos keep alive, over all users (~36 bytes each as Python ints in lists: ~75 MB)
TOKENS = 1 << 21
PER_USER = 4  # chains kept per user: a finished turn's replaces its prompt's, so a few conversations


@dataclass
class Chain:
    """A request's chain of the router's block hashes, and what it was made from."""

    hashes: list[bytes]
    extra: bytes  # the salt field of its private blocks
    user: str | None
    first: int  # the first private block (those before lie inside a public persona)
    token_ids: list[int]  # the memo's own copy of the prompt (a caller may change theirs)
    memo: ChainMemo  # the user's memo it came from: gone once the user is forgotten


class RouterChains:
    def __init__(self, secret: bytes, block_size: int, users: int = USERS, tokens: int = TOKENS):
        self.secret, self.block_size, self.users, self.tokens = secret, block_size, users, tokens
        self._lock = threading.Lock()  # event loops start chains, listener threads finish them
        # user -> (salt field, recent chains, token ids they hold), least recently seen first
        self._memos: OrderedDict[str | None, tuple[bytes, ChainMemo, int]] = OrderedDict()
        self._held = 0  # token ids held over all users

    def of_prompt(self, token_ids: list[int], user: str | None, first: int) -> Chain:
        """The hashes of the prompt's full blocks (the keys the router matches: those from `first`)."""
        ids = list(token_ids)
        with self._lock:
            extra, memo = self._memo(user)
            chain = Chain([], extra, user, first, ids, memo)
            memo.extend(chain.hashes, ROOT, ids, self.block_size, len(ids) // self.block_size, first, extra)
            self._count(user)
        return chain

    def of_answer(self, chain: Chain, token_ids: list[int]) -> list[bytes]:
        """The prompt and its answer (`token_ids`) finished: the hashes of the blocks the answer
        completed, which the replica now holds; the whole chain replaces the prompt's in the memo
        (unless the user was forgotten meanwhile: then nothing of theirs is kept)."""
        bs = self.block_size
        hashes = list(chain.hashes)  # the prompt's chain stays as it was: it covers its tokens only
        known = len(hashes)
        ids = list(token_ids)
        extend_chain(hashes, ROOT, ids, bs, len(ids) // bs, chain.first, chain.extra)
        with self._lock:
            entry = self._memos.get(chain.user)
            if entry is not None and entry[1] is chain.memo:
                chain.memo.remember(ids, hashes, chain.first, chain.extra, replacing=chain.token_ids)
                self._memos.move_to_end(chain.user)
                self._count(chain.user)
        return hashes[max(known, chain.first) :]

    def forget(self, user: str) -> None:
        with self._lock:
            entry = self._memos.pop(user, None)
            if entry is not None:
                self._held -= entry[2]

    def _memo(self, user: str | None) -> tuple[bytes, ChainMemo]:
        """The user's salt field and recent chains (made on first sight; held under the lock)."""
        entry = self._memos.get(user)
        if entry is None:
            salt = user_salt(self.secret, user)
            entry = self._memos[user] = (salt_extra(salt) if salt else b"", ChainMemo(size=PER_USER), 0)
        else:
            self._memos.move_to_end(user)
        return entry[0], entry[1]

    def _count(self, user: str | None) -> None:
        """Re-count the user's token ids; drop the least recently seen users beyond the bounds."""
        extra, memo, before = self._memos[user]
        now = memo.num_tokens()
        self._memos[user] = (extra, memo, now)
        self._held += now - before
        while len(self._memos) > 1 and (len(self._memos) > self.users or self._held > self.tokens):
            _, (_, _, held) = self._memos.popitem(last=False)
            self._held -= held
