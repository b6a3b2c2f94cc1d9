"""RouterChains: the router's hash chains of requests, each user's started from their recent ones.

The router compares block hashes of its own (a secret of its own, a root no replica uses), salted
per user like the replicas' so that one user's blocks never count as another's. A chat resends its
whole history every turn: the last prompt, its answer and a new message. Hashing a 2.5k-token
conversation from scratch took ~0.27 ms of the API process's one core a turn (16-token blocks); a
user's recent chains (the last prompt, and the last prompt with its answer) hold all but the new
message's blocks, found by a few list comparisons (kv.hashing.ChainMemo).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from chatengine.engine.kv.hashing import ChainMemo, extend_chain, salt_extra, user_salt

ROOT = b"chatengine/router"  # never compared with a replica's hashes
USERS = 1024  # users whose recent chains are kept (least recently seen dropped first)
PER_USER = 4  # chains kept per user: a prompt and its answered form, for two conversations


@dataclass
class Chain:
    """A request's chain of the router's block hashes, and the salt field of its private blocks."""

    hashes: list[bytes]
    extra: bytes
    user: str | None
    first: int  # the first private block (those before lie inside a public persona)


class RouterChains:
    def __init__(self, secret: bytes, block_size: int, users: int = USERS):
        self.secret, self.block_size, self.users = secret, block_size, users
        self._lock = threading.Lock()  # event loops start chains, listener threads finish them
        self._memos: OrderedDict[str | None, tuple[bytes, ChainMemo]] = OrderedDict()

    def of_prompt(self, token_ids: list[int], user: str | None, first: int) -> Chain:
        """The hashes of the prompt's full blocks (the keys the router matches: those from `first`)."""
        with self._lock:
            extra, memo = self._memo(user)
            chain = Chain([], extra, user, first)
            memo.extend(chain.hashes, ROOT, token_ids, self.block_size, len(token_ids) // self.block_size, first, extra)
        return chain

    def of_answer(self, chain: Chain, token_ids: list[int]) -> list[bytes]:
        """The prompt and its answer (`token_ids`) finished: the hashes of the blocks the answer
        completed, which the replica now holds; the whole chain is remembered for the next turn."""
        bs = self.block_size
        hashes = list(chain.hashes)  # the prompt's chain stays as remembered: it covers its tokens only
        known = len(hashes)
        extend_chain(hashes, ROOT, token_ids, bs, len(token_ids) // bs, chain.first, chain.extra)
        with self._lock:
            _, memo = self._memo(chain.user)
            memo.remember(token_ids, hashes, chain.first, chain.extra)
        return hashes[max(known, chain.first) :]

    def forget(self, user: str) -> None:
        with self._lock:
            self._memos.pop(user, None)

    def _memo(self, user: str | None) -> tuple[bytes, ChainMemo]:
        """The user's salt field and recent chains (made on first sight; held under the lock)."""
        entry = self._memos.get(user)
        if entry is None:
            salt = user_salt(self.secret, user)
            entry = self._memos[user] = (salt_extra(salt) if salt else b"", ChainMemo(size=PER_USER))
            if len(self._memos) > self.users:
                self._memos.popitem(last=False)
        else:
            self._memos.move_to_end(user)
        return entry
