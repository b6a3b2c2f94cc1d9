"""ChatStore: users, conversations and message trees in SQLite (through sqlite-utils).

A conversation is a tree of messages: ``parent_id`` links a turn to the one it answers, the
children of one parent are alternatives (regenerate, edit, n>1 samples; shown as k/N in creation
order) and ``active_leaf_id`` marks the end of the branch on screen. Each message keeps the exact
token ids that went through the model, so the next prompt is ``prompt_token_ids(user, leaf)`` plus
the new templated turn, and a follow-up hits every cached KV block of its history.

Every method takes the authenticated ``user`` first and checks ownership in the SQL statement
itself (``conversations.user_id = ?``). An id that does not exist and an id owned by someone else
raise the same ``NotFound``. Bad input raises ``ValueError`` before anything is written.

    store = ChatStore(path)                     # WAL, synchronous=FULL, foreign keys, busy timeout
    store = open_store(path_or_postgresql_url)  # the same interface on PostgreSQL (store_postgres.py)
    store.ensure_user(user); store.delete_user(user)                      # delete cascades
    cid = store.create_conversation(user, title="New chat", persona=None, settings=None, model=None)
    store.list_conversations(user, query=None) -> list[dict]              # newest update first
    store.get_conversation(user, cid) -> dict
    store.rename_conversation(user, cid, title); store.update_settings(user, cid, settings, touch=True)
    store.set_pinned(user, cid, pinned)         # pinned chats list first; not a change of the chat
    store.delete_conversation(user, cid)
    store.messages(user, cid) -> list[dict]     # every message of the tree, creation order (export)
    store.add_session(token_hash, user, expires_at); store.delete_session(token_hash)
    store.delete_sessions_of(user)              # every sign-in of a (disabled) user
    store.session_user(token_hash) -> str | None # the signed-in user of an unexpired session
    mid = store.add_message(user, cid, role, content, parent_id=None, *, token_ids=None,
                            stats=None, settings=None, status="done", activate=True)
    store.update_message(user, mid, *, content=None, token_ids=None, stats=None, status=None)
    store.get_message(user, mid) -> dict
    store.children(user, mid) / store.siblings(user, mid) -> list[dict]  # creation order
    store.set_active_leaf(user, cid, mid); store.latest_leaf(user, mid) -> str
    store.active_path(user, cid) / store.path_to(user, mid) -> list[dict]  # root first
    store.prompt_token_ids(user, mid) -> list[int] | None
    store.recover_interrupted() -> int          # at server start: 'streaming' -> 'interrupted'
    store.close()

The accounts (the users table's password_hash, admin, disabled and imported_at columns, and the
api_keys table) belong to users.py; the personas table to persona_catalog.py. They share this file
and its connections (``_write`` for their transactions).

A conversation dict has id, user_id, title, persona, settings, active_leaf_id, pinned (bool),
created_at, updated_at and model (the id of the model it talks to; None: the server's default, as
conversations from before several models were served); a message dict has id, conversation_id,
parent_id, role, content, token_ids
(list[int] | None), stats, settings, status, created_at, updated_at. Times are Unix seconds.

Threads: sqlite3 connections belong to the thread that made them, and Gradio runs handlers in a
thread pool, so each thread gets its own connection (``threading.local``). Every write runs in
``BEGIN IMMEDIATE``, which takes the write lock up front and waits on the busy timeout, instead of a
deferred ``BEGIN`` that can fail with "database is locked" when it upgrades a read to a write.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import threading
import time
import uuid
import weakref
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import sqlite_utils

ROLES = ("system", "user", "assistant")
STATUSES = ("streaming", "done", "aborted", "error", "interrupted")
MAX_ID_CHARS = 256  # user ids, persona names
MAX_TITLE_CHARS = 200
MAX_MODEL_CHARS = 4096  # a model id may be a path
MAX_CONTENT_CHARS = 1_000_000
BUSY_TIMEOUT_S = 30.0

# NOTE: a message's parent is in the same conversation (composite foreign key), so a path never
# leaves its conversation and its owner. The parent link has no ON DELETE CASCADE: SQLite runs
# cascades as nested triggers, and a chain deeper than 1000 turns would fail with "too many levels
# of trigger recursion"; deleting a conversation removes all of its messages in one cascade instead.
SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id          TEXT PRIMARY KEY,
    created_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    id              TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    title           TEXT NOT NULL,
    persona         TEXT,
    settings        TEXT NOT NULL,          -- JSON object: default sampling settings
    active_leaf_id  TEXT,
    pinned          INTEGER NOT NULL DEFAULT 0,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL,
    model           TEXT,                   -- the served model's id; NULL: the server's default
    FOREIGN KEY (active_leaf_id, id) REFERENCES messages(id, conversation_id)
);
CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations(user_id, updated_at);
CREATE TABLE IF NOT EXISTS messages (
    id               TEXT PRIMARY KEY,
    conversation_id  TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id        TEXT,
    role             TEXT NOT NULL,
    content          TEXT NOT NULL,
    token_ids        BLOB,                  -- int32 little-endian; NULL = not known
    stats            TEXT NOT NULL,         -- JSON object: ttft_ms, tok_s, cached tokens, ...
    settings         TEXT NOT NULL,         -- JSON object: sampling settings of this turn
    status           TEXT NOT NULL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    UNIQUE (id, conversation_id),
    FOREIGN KEY (parent_id, conversation_id) REFERENCES messages(id, conversation_id)
);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id, conversation_id);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,           -- shown to admins to tell keys apart (not the secret)
    user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    key_hash    TEXT NOT NULL UNIQUE,       -- sha256 hex of the key; the key itself is never stored
    created_at  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS api_keys_by_user ON api_keys(user_id);
CREATE TABLE IF NOT EXISTS personas (
    key            TEXT PRIMARY KEY,        -- a file persona's name, or a random id
    owner          TEXT REFERENCES users(id) ON DELETE CASCADE,   -- who made it (NULL: a file)
    title          TEXT NOT NULL,
    description    TEXT NOT NULL,
    system_prompt  TEXT NOT NULL,
    public         INTEGER NOT NULL,        -- 1: every user may pick it (its prefix is shared)
    from_file      INTEGER NOT NULL,        -- 1: still the text of prompts/<key>.md (refreshed at start)
    deleted        INTEGER NOT NULL DEFAULT 0,   -- a deleted file persona (so the seed does not bring it back)
    created_at     REAL NOT NULL,
    updated_at     REAL NOT NULL
);
-- sign-ins that outlive a restart: keyed by the SHA-256 of the cookie's random token, so a copy of
-- the database signs no one in; a user's deletion ends their sign-ins
CREATE TABLE IF NOT EXISTS sessions (
    token_hash  TEXT PRIMARY KEY,
    user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL
);
"""
SCHEMA_VERSION = 4  # PRAGMA user_version of a database that has every column of MIGRATIONS
# Columns added after version 1, as (table, column, definition): ChatStore._migrate adds each one a
# database lacks (SCHEMA's CREATE TABLE IF NOT EXISTS leaves an existing table as it was). Additive
# only, so old rows read NULL (or the default) and an old server still reads the database.
MIGRATIONS = [
    ("conversations", "model", "TEXT"),  # 2: the served model's id; NULL: the server's default
    ("users", "password_hash", "TEXT"),  # 3: auth.hash_password's format; NULL: cannot sign in
    ("users", "admin", "INTEGER NOT NULL DEFAULT 0"),  # 3
    ("users", "disabled", "INTEGER NOT NULL DEFAULT 0"),  # 3
    ("users", "imported_at", "REAL"),  # 3: when the --users file entry was imported (never twice)
    ("conversations", "pinned", "INTEGER NOT NULL DEFAULT 0"),  # 4: pinned chats list first
]

# "INSERT OR IGNORE" in words both SQLite (3.24+) and PostgreSQL read
_ADD_USER = "INSERT INTO users (id, created_at) VALUES (?, ?) ON CONFLICT (id) DO NOTHING"
_OWNED_MESSAGE = (
    "SELECT m.{cols} FROM messages m JOIN conversations c ON c.id = m.conversation_id"
    " WHERE m.id = :id AND c.user_id = :user"
)
# root-first path: walk parent_id up from the start row(s), then order by depth
_PATH = (
    "WITH RECURSIVE path(id, depth) AS ({start} UNION ALL SELECT m.parent_id, p.depth + 1"
    " FROM messages m JOIN path p ON m.id = p.id WHERE m.parent_id IS NOT NULL)"
    " SELECT m.* FROM path p JOIN messages m ON m.id = p.id ORDER BY p.depth DESC"
)


class NotFound(LookupError):
    """No such conversation or message for this user (whether or not another user has it)."""


class StoreDamaged(RuntimeError):
    """The database file failed SQLite's integrity check."""


class StoreWriteError(RuntimeError):
    """The database could not take a write (disk full, read-only, I/O error); the message says so
    in words a user can act on, and the write left nothing behind (its transaction rolled back)."""


# SQLite's primary result codes (the low byte of an extended code) that mean "cannot write here"
_WRITE_FAILURES = {
    sqlite3.SQLITE_FULL: "the server's disk is full",
    sqlite3.SQLITE_READONLY: "the server's database has become read-only",
    sqlite3.SQLITE_IOERR: "the server's disk failed a write",
    sqlite3.SQLITE_CANTOPEN: "the server cannot open its database files",
}


def write_failure(e: sqlite3.Error) -> StoreWriteError | None:
    """The StoreWriteError that a failed write of SQLite means, or None for other errors (bugs)."""
    reason = _WRITE_FAILURES.get((getattr(e, "sqlite_errorcode", None) or 0) & 0xFF)
    return StoreWriteError(f"{reason}: nothing was saved. Tell whoever runs this server.") if reason else None


POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(target: str | os.PathLike) -> ChatStore:
    """The store at ``target``: a PostgreSQL URL (postgresql://USER@HOST:PORT/DATABASE; see
    store_postgres.py), or else the path of an SQLite file (the default setup)."""
    if isinstance(target, str) and target.startswith(POSTGRES_SCHEMES):
        try:
            from chatengine.app.store_postgres import PostgresChatStore
        except ImportError:
            raise ValueError("a PostgreSQL database needs psycopg: pip install 'chatengine[postgres]'") from None
        return PostgresChatStore(target)
    return ChatStore(target)


class ChatStore:
    # The SQL that differs between SQLite and PostgreSQL (store_postgres.py has the other side):
    # updated_at strictly increases per user, so the sidebar order is the write order even when two
    # writes fall in one clock tick (SQLite's MAX of two arguments is PostgreSQL's GREATEST)
    BUMP = "MAX(:now, COALESCE((SELECT MAX(updated_at) FROM conversations WHERE user_id = :user), 0) + 1e-6)"
    SAME = "IS"  # "=" that holds for two NULLs (root messages are siblings)
    CONTAINS = "instr(casefold({}), :q) > 0"  # column {} holds the casefolded search text :q

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if self.path == ":memory:" or not self.path:
            raise ValueError("ChatStore needs a file path: each thread opens its own connection")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[sqlite_utils.Database] = weakref.WeakSet()
        self.db.enable_wal()
        with self._write() as db:
            db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add every column of MIGRATIONS that a database made by an older version lacks, then mark
        it SCHEMA_VERSION (never lowered: a newer database stays as it is)."""
        with self._write() as db:
            for table, column, definition in MIGRATIONS:
                if column not in {c.name for c in db[table].columns}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @property
    def db(self) -> Any:  # sqlite_utils.Database (PostgresChatStore: a connection that answers the same calls)
        """This thread's connection, opened on first use."""
        db = getattr(self._local, "db", None)
        if db is None:
            # check_same_thread=False only so that close() may close every thread's connection;
            # each connection is still used by one thread only
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
            db = sqlite_utils.Database(conn, execute_plugins=False)
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA synchronous = FULL")  # WAL + FULL: a returned commit survives power loss
            db.register_function(str.casefold, deterministic=True, name="casefold")
            with self._lock:
                self._open.add(db)
            self._local.db = db
        return db

    def close(self) -> None:
        """Close every thread's connection (at shutdown); a later call opens new ones."""
        with self._lock:
            dbs, self._open = list(self._open), weakref.WeakSet()
            self._local = threading.local()
        for db in dbs:
            db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:  # this thread's connection (as db), in a transaction
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.commit()
            except BaseException:
                db.rollback()
                raise
        except sqlite3.Error as e:
            failure = write_failure(e)
            if failure is None:
                raise
            raise failure from e

    def _text_in(self, text: str) -> str:
        """Text as this database stores it (SQLite: every character)."""
        return text

    def _check_integrity(self) -> None:
        result = self.db.execute("PRAGMA quick_check").fetchone()[0]
        if result != "ok":
            raise StoreDamaged(f"SQLite quick_check: {result}")

    def _rows(self, sql: str, params: dict) -> list[dict]:
        return list(self.db.query(sql, params))

    def _one(self, sql: str, params: dict, missing: str) -> dict:
        rows = self._rows(sql, params)
        if not rows:
            raise NotFound(f"{missing} not found")
        return rows[0]

    # users

    def ensure_user(self, user: str) -> None:
        with self._write() as db:
            db.execute(_ADD_USER, [_name(user, "user"), time.time()])

    def delete_user(self, user: str) -> None:
        """Delete the user with all their conversations and messages (no error if absent)."""
        with self._write() as db:
            db.execute("DELETE FROM users WHERE id = ?", [_name(user, "user")])

    # sign-in sessions (sessions.py makes and checks the tokens)

    def add_session(self, token_hash: str, user: str, expires_at: float) -> None:
        """Record a sign-in; expired ones are dropped here, so the table holds only live ones."""
        now = time.time()
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE expires_at <= ?", [now])
            db.execute(_ADD_USER, [_name(user, "user"), now])
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?)", [token_hash, user, now, float(expires_at)])

    def session_user(self, token_hash: str) -> str | None:
        sql = "SELECT user_id FROM sessions WHERE token_hash = :h AND expires_at > :now"
        rows = self._rows(sql, dict(h=token_hash, now=time.time()))
        return rows[0]["user_id"] if rows else None

    def delete_session(self, token_hash: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE token_hash = ?", [token_hash])

    def delete_sessions_of(self, user: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE user_id = ?", [user])

    # conversations

    def create_conversation(
        self,
        user: str,
        title: str = "New chat",
        persona: str | None = None,
        settings: dict | None = None,
        model: str | None = None,
    ) -> str:
        p: dict = dict(
            id=str(uuid.uuid4()),
            user=_name(user, "user"),
            title=self._text_in(_title(title)),
            persona=None if persona is None else _name(persona, "persona"),
            settings=_json(settings, "settings"),
            model=None if model is None else _text(model, "model", MAX_MODEL_CHARS, required=True),
            now=time.time(),
        )
        with self._write() as db:
            db.execute("INSERT INTO users (id, created_at) VALUES (:user, :now) ON CONFLICT (id) DO NOTHING", p)
            db.execute(
                "INSERT INTO conversations (id, user_id, title, persona, settings, model, created_at,"
                f" updated_at) VALUES (:id, :user, :title, :persona, :settings, :model, :now, {self.BUMP})",
                p,
            )
        return p["id"]

    def list_conversations(self, user: str, query: str | None = None) -> list[dict]:
        """The user's conversations, pinned first, then newest update first; ``query`` matches titles and message
        text as a case-insensitive (Unicode casefold) substring."""
        q = self._text_in(_text(query, "query", MAX_TITLE_CHARS).strip().casefold()) or None if query else None
        rows = self._rows(
            "SELECT c.* FROM conversations c WHERE c.user_id = :user AND (CAST(:q AS TEXT) IS NULL"
            f" OR {self.CONTAINS.format('c.title')} OR EXISTS (SELECT 1 FROM messages m"
            f" WHERE m.conversation_id = c.id AND {self.CONTAINS.format('m.content')}))"
            " ORDER BY c.pinned DESC, c.updated_at DESC, c.rowid DESC",
            dict(user=user, q=q),
        )
        return [_conversation(r) for r in rows]

    def get_conversation(self, user: str, conv_id: str) -> dict:
        return _conversation(
            self._one(
                "SELECT * FROM conversations WHERE id = :id AND user_id = :user",
                dict(id=conv_id, user=user),
                f"conversation {conv_id!r}",
            )
        )

    def rename_conversation(self, user: str, conv_id: str, title: str) -> None:
        self._update_conversation(user, conv_id, title=self._text_in(_title(title)))

    def update_settings(self, user: str, conv_id: str, settings: dict, *, touch: bool = True) -> None:
        """touch=False: a change of the settings alone, which does not move the chat up the list."""
        if touch:
            self._update_conversation(user, conv_id, settings=_json(settings, "settings"))
            return
        with self._write() as db:
            sql = "UPDATE conversations SET settings = ? WHERE id = ? AND user_id = ?"
            if db.execute(sql, [_json(settings, "settings"), conv_id, user]).rowcount != 1:
                raise NotFound(f"conversation {conv_id!r} not found")

    def set_pinned(self, user: str, conv_id: str, pinned: bool) -> None:
        """Pin or unpin; updated_at stays (the chat did not change, and its date group neither)."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE conversations SET pinned = ? WHERE id = ? AND user_id = ?", [int(bool(pinned)), conv_id, user]
            )
            if cur.rowcount != 1:
                raise NotFound(f"conversation {conv_id!r} not found")

    def _update_conversation(self, user: str, conv_id: str, **cols) -> None:
        sets = "".join(f"{k} = :{k}, " for k in cols)
        with self._write() as db:
            cur = db.execute(
                f"UPDATE conversations SET {sets}updated_at = {self.BUMP} WHERE id = :id AND user_id = :user",
                dict(cols, id=conv_id, user=user, now=time.time()),
            )
            if cur.rowcount != 1:
                raise NotFound(f"conversation {conv_id!r} not found")

    def delete_conversation(self, user: str, conv_id: str) -> None:
        with self._write() as db:
            cur = db.execute("DELETE FROM conversations WHERE id = ? AND user_id = ?", [conv_id, user])
            if cur.rowcount != 1:
                raise NotFound(f"conversation {conv_id!r} not found")

    # messages

    def add_message(
        self,
        user: str,
        conv_id: str,
        role: str,
        content: str,
        parent_id: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        stats: dict | None = None,
        settings: dict | None = None,
        status: str = "done",
        activate: bool = True,
    ) -> str:
        """Append a message under ``parent_id`` (None: a root); siblings are alternatives.
        ``activate`` makes it the active leaf. Bumps the conversation's updated_at."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        p: dict = dict(
            id=str(uuid.uuid4()),
            conv=conv_id,
            user=user,
            parent=parent_id,
            role=role,
            content=self._text_in(_text(content, "content", MAX_CONTENT_CHARS)),
            token_ids=_pack(token_ids),
            stats=_json(stats, "stats"),
            settings=_json(settings, "settings"),
            status=_status(status),
            now=time.time(),
        )
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO messages (id, conversation_id, parent_id, role, content, token_ids,"
                " stats, settings, status, created_at, updated_at) SELECT :id, c.id, :parent, :role,"
                " :content, :token_ids, :stats, :settings, :status, :now, :now FROM conversations c"
                " WHERE c.id = :conv AND c.user_id = :user AND (CAST(:parent AS TEXT) IS NULL OR EXISTS"
                " (SELECT 1 FROM messages m WHERE m.id = :parent AND m.conversation_id = c.id))",
                p,
            )
            if cur.rowcount != 1:
                missing = f" or its message {parent_id!r}" if parent_id is not None else ""
                raise NotFound(f"conversation {conv_id!r}{missing} not found")
            leaf = ", active_leaf_id = :id" if activate else ""
            db.execute(
                f"UPDATE conversations SET updated_at = {self.BUMP}{leaf} WHERE id = :conv AND user_id = :user", p
            )
        return p["id"]

    def update_message(
        self,
        user: str,
        msg_id: str,
        *,
        content: str | None = None,
        token_ids: Iterable[int] | None = None,
        stats: dict | None = None,
        status: str | None = None,
    ) -> None:
        """Overwrite the given fields (None leaves a field as it is): streaming partial replies,
        Stop, final stats. Bumps the conversation's updated_at."""
        cols: dict = {}
        if content is not None:
            cols["content"] = self._text_in(_text(content, "content", MAX_CONTENT_CHARS))
        if token_ids is not None:
            cols["token_ids"] = _pack(token_ids)
        if stats is not None:
            cols["stats"] = _json(stats, "stats")
        if status is not None:
            cols["status"] = _status(status)
        sets = "".join(f"{k} = :{k}, " for k in cols)
        p = dict(cols, id=msg_id, user=user, now=time.time())
        with self._write() as db:
            rows = db.execute(
                f"UPDATE messages SET {sets}updated_at = :now WHERE id = :id AND"
                " conversation_id IN (SELECT id FROM conversations WHERE user_id = :user)"
                " RETURNING conversation_id",
                p,
            ).fetchall()
            if not rows:
                raise NotFound(f"message {msg_id!r} not found")
            db.execute(
                f"UPDATE conversations SET updated_at = {self.BUMP} WHERE id = :conv AND user_id = :user",
                dict(p, conv=rows[0][0]),
            )

    def get_message(self, user: str, msg_id: str) -> dict:
        return _message(self._one(_OWNED_MESSAGE.format(cols="*"), dict(id=msg_id, user=user), f"message {msg_id!r}"))

    def children(self, user: str, msg_id: str) -> list[dict]:
        """Replies to ``msg_id`` (its alternatives for the next turn), in creation order."""
        rows = self._rows(
            "SELECT m.* FROM messages m JOIN conversations c ON c.id = m.conversation_id"
            " WHERE m.parent_id = :id AND c.user_id = :user ORDER BY m.rowid",
            dict(id=msg_id, user=user),
        )
        if not rows:
            self.get_message(user, msg_id)  # NotFound, or a leaf
        return [_message(r) for r in rows]

    def siblings(self, user: str, msg_id: str) -> list[dict]:
        """``msg_id`` and its alternatives (same parent, same conversation), in creation order:
        the message is number ``k`` of ``N``."""
        # NOTE: rowid order is insertion order (rows are never re-inserted), unlike wall clock time
        rows = self._rows(
            "SELECT s.* FROM messages m JOIN conversations c ON c.id = m.conversation_id"
            " JOIN messages s ON s.conversation_id = m.conversation_id AND s.parent_id"
            f" {self.SAME} m.parent_id WHERE m.id = :id AND c.user_id = :user ORDER BY s.rowid",
            dict(id=msg_id, user=user),
        )
        if not rows:
            raise NotFound(f"message {msg_id!r} not found")
        return [_message(r) for r in rows]

    def set_active_leaf(self, user: str, conv_id: str, msg_id: str) -> None:
        """Show the branch that ends at ``msg_id`` (any message of the conversation: undo moves
        the leaf up, and the branch below survives). Does not bump updated_at."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE conversations SET active_leaf_id = :msg WHERE id = :conv AND"
                " user_id = :user AND EXISTS (SELECT 1 FROM messages WHERE id = :msg"
                " AND conversation_id = :conv)",
                dict(msg=msg_id, conv=conv_id, user=user),
            )
            if cur.rowcount != 1:
                raise NotFound(f"conversation {conv_id!r} or its message {msg_id!r} not found")

    def latest_leaf(self, user: str, msg_id: str) -> str:
        """Follow the newest child down from ``msg_id`` to a leaf (switching to an alternative
        shows its most recent continuation)."""
        return self._one(
            "WITH RECURSIVE down(id, depth) AS ("
            + _OWNED_MESSAGE.format(cols="id, 0")
            + " UNION ALL SELECT (SELECT ch.id FROM messages ch WHERE ch.parent_id = d.id"
            " ORDER BY ch.rowid DESC LIMIT 1), d.depth + 1 FROM down d WHERE d.id IS NOT NULL)"
            " SELECT id FROM down WHERE id IS NOT NULL ORDER BY depth DESC LIMIT 1",
            dict(id=msg_id, user=user),
            f"message {msg_id!r}",
        )["id"]

    def path_to(self, user: str, msg_id: str) -> list[dict]:
        """Messages from the root down to ``msg_id`` (inclusive)."""
        rows = self._rows(_PATH.format(start=_OWNED_MESSAGE.format(cols="id, 0")), dict(id=msg_id, user=user))
        if not rows:
            raise NotFound(f"message {msg_id!r} not found")
        return [_message(r) for r in rows]

    def active_path(self, user: str, conv_id: str) -> list[dict]:
        """The branch on screen: root to the active leaf ([] for an empty conversation)."""
        rows = self._rows(
            _PATH.format(start="SELECT active_leaf_id, 0 FROM conversations WHERE id = :id AND user_id = :user"),
            dict(id=conv_id, user=user),
        )
        if not rows:
            self.get_conversation(user, conv_id)  # NotFound, or empty
        return [_message(r) for r in rows]

    def leaves(self, user: str, conv_id: str) -> list[dict]:
        """The messages of a conversation that nothing replies to: the tips of all its branches."""
        self.get_conversation(user, conv_id)  # NotFound for others' conversations
        rows = self._rows(
            "SELECT m.* FROM messages m JOIN conversations c ON c.id = m.conversation_id"
            " WHERE m.conversation_id = :cid AND c.user_id = :user"
            " AND NOT EXISTS (SELECT 1 FROM messages k WHERE k.parent_id = m.id) ORDER BY m.rowid",
            dict(cid=conv_id, user=user),
        )
        return [_message(r) for r in rows]

    def messages(self, user: str, conv_id: str) -> list[dict]:
        """Every message of the conversation (all branches), in creation order."""
        self.get_conversation(user, conv_id)  # NotFound for others' conversations
        rows = self._rows(
            "SELECT m.* FROM messages m JOIN conversations c ON c.id = m.conversation_id"
            " WHERE m.conversation_id = :cid AND c.user_id = :user ORDER BY m.rowid",
            dict(cid=conv_id, user=user),
        )
        return [_message(r) for r in rows]

    def prompt_token_ids(self, user: str, msg_id: str) -> list[int] | None:
        """The stored token ids from the root to ``msg_id``, concatenated; None if any message on
        the path has none (then the caller re-templates the text)."""
        ids: list[int] = []
        for m in self.path_to(user, msg_id):
            if m["token_ids"] is None:
                return None
            ids += m["token_ids"]
        return ids

    # maintenance (server side, not per user)

    def recover_interrupted(self) -> int:
        """Run at server start: check the database, and mark replies that were streaming when the last
        process died as 'interrupted'. Returns how many were marked."""
        self._check_integrity()
        with self._write() as db:
            return db.execute(
                "UPDATE messages SET status = 'interrupted', updated_at = ? WHERE status = 'streaming'", [time.time()]
            ).rowcount


# validation and encoding at the boundary


def _text(value: object, what: str, max_chars: int, required: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a str, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ValueError(f"{what} is {len(value)} characters long; the limit is {max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogate at index {e.start})") from None
    if required and not value.strip():
        raise ValueError(f"{what} must not be empty")
    return value


def _name(value: object, what: str) -> str:
    return _text(value, what, MAX_ID_CHARS, required=True)


def _title(value: object) -> str:
    return _text(value, "title", MAX_TITLE_CHARS, required=True).strip()


def _status(value: object) -> str:
    if value not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {value!r}")
    return value


def _json(value: dict | None, what: str) -> str:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON data: {e}") from None


def _pack(token_ids: Iterable[int] | None) -> bytes | None:
    if token_ids is None:
        return None
    token_ids = list(token_ids)
    try:
        if any(isinstance(t, bool) for t in token_ids):
            raise TypeError("bool is not a token id")
        packed = array("i", token_ids)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token_ids must be ints in [0, 2**31): {e}") from None
    if packed and min(packed) < 0:
        raise ValueError(f"token_ids must be ints in [0, 2**31), got {min(packed)}")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes | None) -> list[int] | None:
    if blob is None:
        return None
    ids = array("i")
    ids.frombytes(blob)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def _conversation(row: dict) -> dict:
    return dict(row, settings=json.loads(row["settings"]), pinned=bool(row["pinned"]))


def _message(row: dict) -> dict:
    return dict(
        row, token_ids=_unpack(row["token_ids"]), stats=json.loads(row["stats"]), settings=json.loads(row["settings"])
    )


assert array("i").itemsize == 4, "token ids are stored as int32"
