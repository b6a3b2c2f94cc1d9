"""Sign-in sessions that outlive a server restart: signed, expiring, revocable.

A sign-in gets a cookie ``<token>.<signature>``: 32 random bytes and their HMAC-SHA256 under the
session key (a file in the data directory, made on first start). The store keeps only the token's
SHA-256 with its user and expiry, so every request is checked against the database: logging out
deletes the row and the cookie stops working at once, in every tab and after a restart. The
signature turns away forged or garbled cookies before any database work, and a copy of the
database alone (hashes) signs no one in.

The key is the app's own, not the engine's cache secret: replacing it logs everyone out and leaves
the KV cache valid.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from chatengine.app.datadir import create_private_file
from chatengine.app.store import ChatStore

COOKIE = "chatengine-session"
KEY_FILE = "session.key"
TTL_S = 14 * 24 * 3600.0  # a sign-in lasts two weeks, then the password is asked again
MAX_COOKIE_CHARS = 200  # a real cookie is 87 characters: anything longer is not ours


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def load_or_create_key(data_dir: str | os.PathLike) -> bytes:
    """The session key of this data directory (32 random bytes, a private file, made once)."""
    path = Path(data_dir) / KEY_FILE
    if not path.exists():
        create_private_file(path)
        path.write_bytes(secrets.token_bytes(32))
    key = path.read_bytes()
    if len(key) < 32:
        raise ValueError(f"the session key {path} is damaged (under 32 bytes): delete it (everyone signs in again)")
    return key


class LoginSessions:
    def __init__(
        self, store: ChatStore, key: bytes, ttl_s: float = TTL_S, is_active: Callable[[str], bool] | None = None
    ):
        """is_active(user): False for an account disabled since it signed in (its cookies sign in no one)."""
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.is_active = is_active or (lambda user: True)

    def _sign(self, token: str) -> str:
        return _b64(hmac.new(self.key, token.encode(), hashlib.sha256).digest())

    def _token(self, cookie: str | None) -> str | None:
        """The token of a cookie whose signature holds, else None."""
        if not isinstance(cookie, str) or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        token, signature = cookie.split(".")
        return token if hmac.compare_digest(self._sign(token), signature) else None

    def create(self, user: str) -> str:
        """A new signed-in session for ``user``: the cookie value to give the browser."""
        token = _b64(secrets.token_bytes(32))
        self.store.add_session(_hash(token), user, time.time() + self.ttl_s)
        return f"{token}.{self._sign(token)}"

    def user_of(self, cookie: str | None) -> str | None:
        """The user signed in with this cookie, or None (forged, expired, logged out, unknown)."""
        token = self._token(cookie)
        user = self.store.session_user(_hash(token)) if token else None
        return user if user is not None and self.is_active(user) else None

    def revoke(self, cookie: str | None) -> None:
        """Log out: this cookie signs no one in from now on."""
        token = self._token(cookie)
        if token:
            self.store.delete_session(_hash(token))

    def revoke_user(self, user: str) -> None:
        """Sign ``user`` out of every browser (their account was disabled)."""
        self.store.delete_sessions_of(user)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
