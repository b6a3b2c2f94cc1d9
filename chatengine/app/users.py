"""Accounts: who may sign in and call the API, kept in the chat database (the `users` table).

A user has a password hash (auth.hash_password: PBKDF2-SHA256 with a per-user salt), an admin flag,
a disabled flag and any number of API keys, stored as SHA-256 digests (a key is 24 random bytes, so
a fast hash is enough; a new key is shown once, when it is made). The `--users` JSON file is an
import: each of its users is copied in once (plain passwords hashed on the way), and from then on
the database is the truth, changed on the admin page.

A disabled user can neither sign in nor use an API key; `on_disable` callbacks (the server's:
end their sign-ins) run when a user is disabled and when their password is reset.

    accounts = UserDirectory(store)
    accounts.import_users(auth.load_users(path))
    accounts.add("carol", "a long password", admin=False)
    key = accounts.create_key("carol")          # the only time the key is seen
    accounts.verify_password("carol", pw); accounts.user_for_api_key(key) -> "carol"
    accounts.set_disabled("carol", True); accounts.set_password("carol", new)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable

from chatengine.app import auth
from chatengine.app.store import ChatStore, NotFound

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # names made on the admin page
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024  # PBKDF2 hashes the whole password: no megabyte ones
KEY_PREFIX = "sk-"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def check_new_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError("a user name is 1 to 64 letters, digits or . _ @ - (starting with a letter or digit)")
    return name


def check_new_password(password: object) -> str:
    if not isinstance(password, str) or not MIN_PASSWORD_CHARS <= len(password) <= MAX_PASSWORD_CHARS:
        raise ValueError(f"a password has {MIN_PASSWORD_CHARS} to {MAX_PASSWORD_CHARS} characters")
    return password


class UserDirectory:
    def __init__(self, store: ChatStore, *, iterations: int = auth.DEFAULT_ITERATIONS):
        """iterations: PBKDF2 work factor of new hashes (tests use a small one)."""
        self.store, self.iterations = store, iterations
        self.on_disable: list[Callable[[str], None]] = []
        self._dummy = auth.hash_password(secrets.token_urlsafe(12), iterations=iterations)

    # ---- reading -------------------------------------------------------------------------------
    def _row(self, name: object) -> dict | None:
        if not isinstance(name, str):
            return None
        rows = list(self.store.db.query("SELECT * FROM users WHERE id = ?", [name]))
        return rows[0] if rows else None

    def exists(self, name: str) -> bool:
        return self._row(name) is not None

    def is_active(self, name: object) -> bool:
        """Known and not disabled (people who only chatted in local mode count as known)."""
        row = self._row(name)
        return row is not None and not row["disabled"]

    def is_admin(self, name: object) -> bool:
        row = self._row(name)
        return row is not None and bool(row["admin"]) and not row["disabled"]

    def all_users(self) -> list[dict]:
        """Every user: name, admin, disabled, can_sign_in, keys (their ids), created_at; by name."""
        keys: dict[str, list[str]] = {}
        for k in self.store.db.query("SELECT user_id, id FROM api_keys ORDER BY created_at, id"):
            keys.setdefault(k["user_id"], []).append(k["id"])
        return [
            dict(
                name=r["id"],
                admin=bool(r["admin"]),
                disabled=bool(r["disabled"]),
                can_sign_in=r["password_hash"] is not None,
                keys=keys.get(r["id"], []),
                created_at=r["created_at"],
            )
            for r in self.store.db.query("SELECT * FROM users ORDER BY id")
        ]

    # ---- checks (constant-time in the secret) ----------------------------------------------------
    def verify_password(self, name: object, password: object) -> bool:
        """True for an active user's right password. An unknown, disabled or password-less user costs
        the same PBKDF2 work, so timing tells nothing about which names exist."""
        row = self._row(name)
        stored = row["password_hash"] if row is not None else None
        users = {"u": {"password": stored or self._dummy}}
        ok = auth.verify_password(users, "u", password)
        return ok and stored is not None and not row["disabled"]  # type: ignore[index]

    def user_for_api_key(self, key: object) -> str | None:
        """The active user owning API key `key`, or None."""
        if not isinstance(key, str) or not key:
            return None
        digest = key_digest(key)
        rows = list(
            self.store.db.query(
                "SELECT k.key_hash, u.id, u.disabled FROM api_keys k JOIN users u ON u.id = k.user_id"
                " WHERE k.key_hash = ?",
                [digest],
            )
        )
        if not rows or not hmac.compare_digest(rows[0]["key_hash"], digest) or rows[0]["disabled"]:
            return None
        return rows[0]["id"]

    # ---- changes -------------------------------------------------------------------------------
    def add(self, name: str, password: str, *, admin: bool = False) -> None:
        check_new_name(name)
        hashed = auth.hash_password(check_new_password(password), iterations=self.iterations)
        with self.store._write() as db:
            if db.execute("SELECT 1 FROM users WHERE id = ?", [name]).fetchone():
                raise ValueError(f"there is already a user {name!r}")
            db.execute(
                "INSERT INTO users (id, created_at, password_hash, admin) VALUES (?, ?, ?, ?)",
                [name, time.time(), hashed, int(bool(admin))],
            )

    def set_password(self, name: str, password: str) -> None:
        """A new password signs the user out everywhere (a stolen cookie ends with the old password)."""
        hashed = auth.hash_password(check_new_password(password), iterations=self.iterations)
        self._update(name, "password_hash = ?", [hashed])
        for callback in self.on_disable:
            callback(name)

    def set_disabled(self, name: str, disabled: bool) -> None:
        self._update(name, "disabled = ?", [int(bool(disabled))])
        if disabled:
            for callback in self.on_disable:
                callback(name)

    def _update(self, name: str, sets: str, params: list) -> None:
        with self.store._write() as db:
            if db.execute(f"UPDATE users SET {sets} WHERE id = ?", [*params, name]).rowcount != 1:
                raise NotFound(f"user {name!r} not found")

    def create_key(self, name: str) -> str:
        """A new API key for `name`: returned here once, only its digest is kept."""
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        with self.store._write() as db:
            if not db.execute("SELECT 1 FROM users WHERE id = ?", [name]).fetchone():
                raise NotFound(f"user {name!r} not found")
            self._insert_key(db, name, key)
        return key

    @staticmethod
    def _insert_key(db, name: str, key: str) -> None:
        db.execute(
            "INSERT INTO api_keys (id, user_id, key_hash, created_at) VALUES (?, ?, ?, ?)",
            [secrets.token_hex(4), name, key_digest(key), time.time()],
        )

    def revoke_key(self, name: str, key_id: str) -> None:
        with self.store._write() as db:
            cur = db.execute("DELETE FROM api_keys WHERE id = ? AND user_id = ?", [key_id, name])
            if cur.rowcount != 1:
                raise NotFound(f"user {name!r} has no key {key_id!r}")

    # ---- the --users file ------------------------------------------------------------------------
    def import_users(self, users: dict[str, dict]) -> int:
        """Copy in the users of a validated users file (auth.load_users) not imported before; returns
        how many came in. Later starts leave them alone: a password reset, a revoked key or a
        disabled flag set on the admin page is not undone by the file."""
        done = 0
        for name, entry in users.items():
            row = self._row(name)
            if row is not None and row["imported_at"] is not None:
                continue
            self._import_one(name, entry)
            done += 1
        return done

    def _import_one(self, name: str, entry: dict) -> None:
        password = entry.get("password")
        if password is not None and not auth.is_hashed(password):
            password = auth.hash_password(password, iterations=self.iterations)  # never stored in plain text
        with self.store._write() as db:
            db.execute(
                "INSERT INTO users (id, created_at) VALUES (?, ?) ON CONFLICT (id) DO NOTHING", [name, time.time()]
            )
            db.execute(
                "UPDATE users SET password_hash = COALESCE(?, password_hash), admin = ?, imported_at = ? WHERE id = ?",
                [password, int(entry.get("admin") is True), time.time(), name],
            )
            key = entry.get("api_key")
            if key is not None:
                owner = db.execute("SELECT user_id FROM api_keys WHERE key_hash = ?", [key_digest(key)]).fetchone()
                if owner is not None and owner[0] != name:
                    raise ValueError(f"the users file gives {name!r} an API key that user {owner[0]!r} already has")
                if owner is None:
                    self._insert_key(db, name, key)


class AdminSet:
    """`user in admins`, asked of the database each time: the admin flag changes at run time."""

    def __init__(self, accounts: UserDirectory):
        self.accounts = accounts

    def __contains__(self, user: object) -> bool:
        return self.accounts.is_admin(user)
