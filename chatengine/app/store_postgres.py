"""PostgresChatStore: the ChatStore interface on a PostgreSQL database (through psycopg 3), for
several chatengine servers that share one conversation history.

    store = open_store("postgresql://chat@db.internal:5432/chat")   # store.py's factory picks this class

Every method, its SQL and its checks are ChatStore's: the SQL is written once, for sqlite3, and a
thread's PostgresConnection turns its ``?`` and ``:name`` placeholders into psycopg's (values always
travel as bound parameters, never inside the SQL text). What differs is named here: the schema
(DOUBLE PRECISION for SQLite's 8-byte REAL, BYTEA for BLOB, a ``rowid`` identity column standing in
for SQLite's hidden one, which the queries order by), and ChatStore's three SQL fragments.

Search folds case as SQLite's casefold does for what people type (``STRASSE`` finds ``Straße``):
both sides go through ICU's full upper-case mapping (the ``und-x-icu`` collation, which Debian's and
most other PostgreSQL builds have; the store checks at open).

PostgreSQL text cannot hold the NUL character: in message contents and titles (where a model's
output lands) it becomes U+FFFD; anywhere else (ids, names) it is a ValueError, nothing written.

Threads: each thread has its own connection (autocommit; a write is one transaction), opened on first
use and again after it broke (after a database restart a read retries on a new connection, a write
fails once with StoreWriteError). Writes are not serialized as SQLite serializes them (servers share
the database): each statement checks ownership itself, a write that lost a race with a deletion is
NotFound, a deadlock or lock timeout a StoreWriteError to try again.

The URL's password is never shown: messages name the database by ``describe(url)``. Prefer a URL
without one, and the password in PGPASSWORD or ~/.pgpass: a command line is visible in ``ps``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import weakref
from collections.abc import Iterator

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.string import StrDumper

from chatengine.app.store import BUSY_TIMEOUT_S, ChatStore, NotFound, StoreWriteError

CONNECT_TIMEOUT_S = 10
SCHEMA_LOCK = 0x63686174  # pg_advisory_xact_lock key: one server at a time creates the tables
ICU = '"und-x-icu"'  # ICU's root locale: full Unicode case mapping whatever the database's locale

# ChatStore's SCHEMA (the columns of every MIGRATION included), in PostgreSQL's types
SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id             TEXT PRIMARY KEY,
    created_at     DOUBLE PRECISION NOT NULL,
    password_hash  TEXT,
    admin          INTEGER NOT NULL DEFAULT 0,
    disabled       INTEGER NOT NULL DEFAULT 0,
    imported_at    DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS conversations (
    rowid           BIGINT GENERATED ALWAYS AS IDENTITY,   -- insertion order, as SQLite's rowid
    id              TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    title           TEXT NOT NULL,
    persona         TEXT,
    settings        TEXT NOT NULL,
    active_leaf_id  TEXT,
    pinned          INTEGER NOT NULL DEFAULT 0,
    created_at      DOUBLE PRECISION NOT NULL,
    updated_at      DOUBLE PRECISION NOT NULL,
    model           TEXT
);
CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations(user_id, updated_at);
CREATE TABLE IF NOT EXISTS messages (
    rowid            BIGINT GENERATED ALWAYS AS IDENTITY,
    id               TEXT PRIMARY KEY,
    conversation_id  TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id        TEXT,
    role             TEXT NOT NULL,
    content          TEXT NOT NULL,
    token_ids        BYTEA,
    stats            TEXT NOT NULL,
    settings         TEXT NOT NULL,
    status           TEXT NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    updated_at       DOUBLE PRECISION NOT NULL,
    UNIQUE (id, conversation_id),
    FOREIGN KEY (parent_id, conversation_id) REFERENCES messages(id, conversation_id)
);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id, conversation_id);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, rowid);
-- the active leaf is a message of the same conversation (added here: messages must exist first)
DO $$ BEGIN
    ALTER TABLE conversations ADD CONSTRAINT conversations_active_leaf_fkey
        FOREIGN KEY (active_leaf_id, id) REFERENCES messages(id, conversation_id);
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,
    user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    key_hash    TEXT NOT NULL UNIQUE,
    created_at  DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS api_keys_by_user ON api_keys(user_id);
CREATE TABLE IF NOT EXISTS personas (
    key            TEXT PRIMARY KEY,
    owner          TEXT REFERENCES users(id) ON DELETE CASCADE,
    title          TEXT NOT NULL,
    description    TEXT NOT NULL,
    system_prompt  TEXT NOT NULL,
    public         INTEGER NOT NULL,
    from_file      INTEGER NOT NULL,
    deleted        INTEGER NOT NULL DEFAULT 0,
    created_at     DOUBLE PRECISION NOT NULL,
    updated_at     DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    token_hash  TEXT PRIMARY KEY,
    user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL
);
"""


def describe(url: str) -> str:
    """The database a URL names, fit for logs and error messages: everything but the password."""
    try:
        p = conninfo_to_dict(url)
    except psycopg.Error:
        return "(an unreadable PostgreSQL URL)"
    user = f"{p['user']}@" if p.get("user") else ""
    port = f":{p['port']}" if p.get("port") else ""
    return f"postgresql://{user}{p.get('host', '')}{port}/{p.get('dbname', '')}"


def _without_password(message: str, url: str) -> str:
    """``message`` with the URL's password blotted out, for the case that a library quotes it."""
    with contextlib.suppress(psycopg.Error):
        password = conninfo_to_dict(url).get("password")
        if password:
            message = message.replace(str(password), "***")
    return message


_PLACEHOLDER = re.compile(r"""('[^']*'|"[^"]*"|\$\$.*?\$\$)|(\?)|(?<![:\w]):(\w+)|(%)""", re.S)


@functools.lru_cache(maxsize=512)
def psycopg_sql(sql: str) -> str:
    """sqlite3's placeholders as psycopg's: ``?`` -> ``%s``, ``:name`` -> ``%(name)s``, a literal ``%``
    doubled; quoted strings and names are left alone."""

    def one(m: re.Match) -> str:
        quoted, qmark, name, _ = m.groups()
        return quoted or ("%s" if qmark else f"%({name})s" if name else "%%")

    return _PLACEHOLDER.sub(one, sql)


def _checked(params: list | tuple | dict) -> list | tuple | dict:
    for value in params.values() if isinstance(params, dict) else params:
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("PostgreSQL cannot store text with a NUL character (\\x00)")
    return params


class PostgresConnection:
    """One thread's psycopg connection, answering the calls ChatStore, users.py and
    persona_catalog.py make of a sqlite_utils.Database: ``execute`` (a cursor of tuples) and
    ``query`` (dicts; the rowid column hidden, as SQLite hides its own)."""

    def __init__(self, conn: psycopg.Connection):
        self.conn = conn

    def execute(self, sql: str, params: list | tuple | dict | None = None) -> psycopg.Cursor:
        if params is None:  # no placeholders: sent as it is (several statements allowed)
            return self.conn.execute(sql)
        return self.conn.execute(psycopg_sql(sql), _checked(params))

    def query(self, sql: str, params: list | tuple | dict | None = None) -> list[dict]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(psycopg_sql(sql), _checked(params if params is not None else ()))
            rows = cur.fetchall()
        for row in rows:
            row.pop("rowid", None)
        return rows

    @property
    def usable(self) -> bool:
        return not (self.conn.closed or self.conn.broken)

    def close(self) -> None:
        self.conn.close()


class PostgresChatStore(ChatStore):
    BUMP = "GREATEST(:now, COALESCE((SELECT MAX(updated_at) FROM conversations WHERE user_id = :user), 0) + 1e-6)"
    SAME = "IS NOT DISTINCT FROM"
    CONTAINS = f"strpos(upper({{}} COLLATE {ICU}), upper(:q COLLATE {ICU})) > 0"

    def __init__(self, url: str):
        """Connect, check the server, create the tables a new database lacks. ValueError (naming the
        database without its password) for a URL that cannot be read, connected to or written."""
        self.where = describe(url)
        self._conninfo = _with_defaults(url)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet[PostgresConnection] = weakref.WeakSet()
        try:
            self._check_server()
            with self._write() as db:
                db.execute("SELECT pg_advisory_xact_lock(?)", [SCHEMA_LOCK])
                db.execute("SET LOCAL client_min_messages = warning")  # no "already exists, skipping" notices
                db.execute(SCHEMA)
        except BaseException as e:
            self.close()
            if not isinstance(e, (psycopg.Error, StoreWriteError)):
                raise
            cause = " ".join(_without_password(str(e.__cause__ or e), url).split())
            raise ValueError(
                f"cannot use the chat database {self.where} ({cause}): check that PostgreSQL runs there and "
                "accepts this host, the user, password and database name of --database-url, and that the user "
                "may create tables in that database"
            ) from None

    def _check_server(self) -> None:
        db = self.db
        encoding = db.conn.info.parameter_status("server_encoding") or "an unknown encoding"
        if encoding.upper() != "UTF8":
            raise ValueError(f"the chat database {self.where} is {encoding}-encoded; chatengine needs a UTF8 database")
        try:
            db.execute(f"SELECT upper('x' COLLATE {ICU})")
        except psycopg.errors.UndefinedObject:
            raise ValueError(
                f"the PostgreSQL server of {self.where} has no ICU collations (it was built without ICU), "
                "which search needs"
            ) from None

    @property
    def db(self) -> PostgresConnection:
        """This thread's connection, opened on first use and again when it broke."""
        db = getattr(self._local, "db", None)
        if db is None or not db.usable:
            conn = psycopg.connect(self._conninfo, autocommit=True)
            conn.adapters.register_dumper(str, StrDumper)  # str is text (not "unknown": one meaning for NULL tests)
            conn.execute(f"SET lock_timeout = '{int(BUSY_TIMEOUT_S)}s'")  # as SQLite's busy timeout: no endless wait
            db = PostgresConnection(conn)
            with self._lock:
                self._connections.add(db)
            self._local.db = db
        return db

    def close(self) -> None:
        """Close every thread's connection (at shutdown); a later call opens new ones."""
        with self._lock:
            dbs, self._connections = list(self._connections), weakref.WeakSet()
            self._local = threading.local()
        for db in dbs:
            db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[PostgresConnection]:
        try:
            db = self.db
            with db.conn.transaction():
                yield db
        except psycopg.errors.ForeignKeyViolation:
            # every insert checks what it refers to in its own statement: only a concurrent deletion
            # (another thread or server) gets here
            raise NotFound("the conversation or message was deleted meanwhile: not found") from None
        except (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction) as e:
            raise StoreWriteError(f"{_failure(e)}: nothing was saved. Tell whoever runs this server.") from e

    def _rows(self, sql: str, params: dict) -> list[dict]:
        db = self.db
        try:
            return db.query(sql, params)
        except psycopg.OperationalError:
            if db.usable:
                raise
            return self.db.query(sql, params)  # once more on a new connection: the old one died

    def _text_in(self, text: str) -> str:
        return text.replace("\x00", "\ufffd")

    def _check_integrity(self) -> None:
        """Nothing to do: PostgreSQL checks its own pages (there is no quick_check to run)."""


def _with_defaults(url: str) -> str:
    """The URL as a conninfo string, with our defaults for what it leaves out."""
    try:
        given = conninfo_to_dict(url)
    except psycopg.Error:
        raise ValueError(
            "cannot read the --database-url: expected postgresql://USER@HOST:PORT/DATABASE "
            "(the password in PGPASSWORD or ~/.pgpass, or after USER: in the URL)"
        ) from None
    defaults = {"connect_timeout": str(CONNECT_TIMEOUT_S), "application_name": "chatengine", "client_encoding": "UTF8"}
    return make_conninfo(url, **{k: v for k, v in defaults.items() if k not in given})


def _failure(e: psycopg.Error) -> str:
    """What a failed write of PostgreSQL means, in words for a person."""
    if isinstance(e, psycopg.errors.DiskFull):
        return "the database server's disk is full"
    if isinstance(e, psycopg.errors.ReadOnlySqlTransaction):
        return "the database has become read-only"
    if isinstance(e, (psycopg.errors.TransactionRollback, psycopg.errors.LockNotAvailable)):
        return "the database was too busy (try again)"
    return "the server cannot reach its database"
