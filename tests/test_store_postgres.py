"""PostgresChatStore beyond ChatStore's behaviour (test_store.py runs that on both databases): the
schema kept in step with SQLite's, a URL's password never shown, lost connections, NUL characters,
the accounts and personas in the same database, and `serve` / `delete-user` with --database-url."""

import sqlite3
import threading

import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[postgres]')")

from postgres_server import free_port  # noqa: E402

from chatengine.app.store import ChatStore, NotFound, StoreWriteError, open_store  # noqa: E402

SECRET = "hunter2-Very-Secret"
A = "alice"


@pytest.fixture
def url(postgres):
    return postgres.new_schema()


@pytest.fixture
def store(url):
    s = open_store(url)
    yield s
    s.close()


def test_a_url_that_does_not_connect_names_the_database_but_not_its_password(tmp_path, capsys):
    from chatengine.app import server
    from chatengine.app.cli import main

    port = free_port()  # nothing listens there
    bad = f"postgresql://bob:{SECRET}@127.0.0.1:{port}/chat"
    for opening in (lambda: open_store(bad), lambda: server._open_store(bad)):
        with pytest.raises(ValueError) as e:
            opening()
        message = str(e.value)
        assert f"postgresql://bob@127.0.0.1:{port}/chat" in message and "refused" in message
        assert "check that PostgreSQL runs there" in message and SECRET not in message
    with pytest.raises(ValueError, match="notaport") as e:
        open_store(f"postgresql://bob:{SECRET}@127.0.0.1:notaport/chat")
    assert SECRET not in str(e.value)
    # libpq's own message about these quotes the whole URL, password and all: it is not passed on
    for unreadable in (f"postgresql://bob:{SECRET}@[::1/chat", f"postgresql://bob:{SECRET}@h/chat?nosuch=1"):
        with pytest.raises(ValueError, match="cannot read the --database-url") as e:
            open_store(unreadable)
        assert SECRET not in str(e.value)
    assert main(["delete-user", A, "--data-dir", str(tmp_path / "none"), "--database-url", bad]) == 2
    err = capsys.readouterr().err
    assert "cannot use the chat database postgresql://bob@" in err and SECRET not in err
    assert server.build_parser().parse_args(["--database-url", bad]).database_url == bad


def test_a_wrong_password_says_so_without_either_password(postgres):
    with pytest.raises(ValueError, match="password authentication failed") as e:
        open_store(postgres.url("postgres", password=SECRET))
    assert SECRET not in str(e.value) and postgres.password not in str(e.value)


def test_the_schema_has_every_column_of_sqlites(url, tmp_path):
    """A column added to store.SCHEMA or MIGRATIONS needs its PostgreSQL twin in store_postgres.SCHEMA."""
    pg = open_store(url)
    lite = ChatStore(tmp_path / "chat.db")
    try:
        tables = [r["name"] for r in lite.db.query("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert {"users", "conversations", "messages", "api_keys", "personas", "sessions"} <= set(tables)
        for table in tables:
            sqlite_columns = [c.name for c in lite.db[table].columns]
            rows = pg.db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?"
                " AND table_schema = current_schema() ORDER BY ordinal_position",
                [table],
            ).fetchall()
            assert [c for (c,) in rows if c != "rowid"] == sqlite_columns, table
    finally:
        pg.close(), lite.close()


def test_servers_starting_together_create_the_tables_once(url):
    stores, errors = [], []

    def start():
        try:
            stores.append(open_store(url))
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(stores) == 4
    c = stores[0].create_conversation(A, "seen by all")
    assert all(s.get_conversation(A, c)["title"] == "seen by all" for s in stores)
    for s in stores:
        s.close()


def test_a_lost_connection_fails_one_write_and_reconnects(store, postgres):
    c = store.create_conversation(A, "before")

    def kill_connection():
        pid = store.db.conn.info.backend_pid
        with _admin(postgres) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])

    kill_connection()  # a read goes through on a new connection
    assert store.get_conversation(A, c)["title"] == "before"
    kill_connection()
    with pytest.raises(StoreWriteError, match="cannot reach its database: nothing was saved"):
        store.rename_conversation(A, c, "lost")
    store.rename_conversation(A, c, "after")  # the next write reconnects
    assert store.get_conversation(A, c)["title"] == "after"


def test_a_write_that_loses_a_race_with_a_deletion_is_not_found(store, url):
    """A reply saved while its conversation is being deleted elsewhere: NotFound, as on SQLite."""
    import psycopg

    c = store.create_conversation(A, "going")
    u = store.add_message(A, c, "user", "q")
    results = []

    def add_reply():
        try:
            results.append(store.add_message(A, c, "assistant", "late", u))
        except NotFound as e:
            results.append(e)

    with psycopg.connect(url) as other:  # deletes in a transaction held open until the insert waits on it
        other.execute("DELETE FROM conversations WHERE id = %s", [c])
        writer = threading.Thread(target=add_reply)
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive()  # waiting on the deleted row's lock
    writer.join(timeout=10)
    assert [type(r) for r in results] == [NotFound]
    with pytest.raises(NotFound):
        store.get_conversation(A, c)


def _admin(postgres):
    import psycopg

    return psycopg.connect(postgres.url(), autocommit=True)


def test_nul_characters(store):
    """PostgreSQL text holds no NUL: in a message or title (a model may write one) it becomes U+FFFD;
    in an id or name it is bad input, and nothing is written."""
    c = store.create_conversation(A, "nul\x00title")
    m = store.add_message(A, c, "assistant", "a\x00b")
    store.update_message(A, m, content="a\x00bc")
    assert store.get_conversation(A, c)["title"] == "nul\ufffdtitle"
    assert store.get_message(A, m)["content"] == "a\ufffdbc"
    assert [x["id"] for x in store.list_conversations(A, "a\x00b")] == [c]
    for bad in (lambda: store.ensure_user("eve\x00"), lambda: store.create_conversation(A, "t", persona="p\x00")):
        with pytest.raises(ValueError, match="NUL"):
            bad()
    with pytest.raises(ValueError, match="NUL"):
        store.get_conversation(A, "x\x00")
    assert store.db.execute("SELECT COUNT(*) FROM users").fetchone()[0] == 1
    assert [x["id"] for x in store.list_conversations(A)] == [c]


def test_accounts_and_personas_live_in_the_same_database(store):
    from chatengine.app.persona_catalog import PersonaCatalog
    from chatengine.app.users import UserDirectory
    from chatengine.personas import Persona

    accounts = UserDirectory(store, iterations=1000)
    accounts.add("carol", "long enough", admin=True)
    assert accounts.verify_password("carol", "long enough") and accounts.is_admin("carol")
    key = accounts.create_key("carol")
    assert accounts.user_for_api_key(key) == "carol"
    assert accounts.import_users({"dave": {"password": "also long enough", "api_key": "sk-dave"}}) == 1
    assert accounts.import_users({"dave": {"password": "changed!"}}) == 0  # imported once
    listed = {u["name"]: u for u in accounts.all_users()}
    assert len(listed["carol"]["keys"]) == 1 and len(listed["dave"]["keys"]) == 1
    accounts.revoke_key("carol", listed["carol"]["keys"][0])
    assert accounts.user_for_api_key(key) is None
    accounts.set_disabled("dave", True)
    assert accounts.user_for_api_key("sk-dave") is None and not accounts.is_active("dave")
    with pytest.raises(NotFound):
        accounts.set_disabled("nobody", True)

    class Engine:
        def register_persona(self, name, prompt):
            pass

        def unregister_persona(self, name):
            pass

    seeds = {"assistant": Persona("assistant", "Assistant", "Helpful", "You are helpful.")}
    catalog = PersonaCatalog(store, Engine(), seeds)
    mine = catalog.create("erin", "Mine", "", "Be mine.", admin=False)
    assert set(catalog.visible("erin")) == {"assistant", mine} and set(catalog.visible("carol")) == {"assistant"}
    catalog.update("erin", mine, "Mine, renamed", "", "Be mine.", public=False, admin=False)
    assert catalog.get(mine).title == "Mine, renamed"
    catalog.delete("erin", mine, admin=False)
    PersonaCatalog(store, Engine(), seeds)  # a second start re-seeds
    assert list(catalog.visible("erin")) == ["assistant"]


def test_serve_opens_the_database_and_marks_interrupted_replies(url):
    from chatengine.app import server

    s = open_store(url)
    c = s.create_conversation(A, "t")
    m = s.add_message(A, c, "assistant", "partial", status="streaming")
    s.close()
    store = server._open_store(url)
    try:
        assert type(store).__name__ == "PostgresChatStore"
        assert store.get_message(A, m)["status"] == "interrupted"
    finally:
        store.close()


def test_delete_user_with_a_database_url(url, tmp_path, capsys):
    from chatengine.app.cli import main

    s = open_store(url)
    for user in ("zoe", "yan"):
        s.create_conversation(user, f"{user}'s plans")
    assert main(["delete-user", "zoe", "--data-dir", str(tmp_path / "elsewhere"), "--database-url", url]) == 0
    assert "deleted user 'zoe': 1 conversations, 0 cached KV pages" in capsys.readouterr().out
    assert s.list_conversations("zoe") == [] and len(s.list_conversations("yan")) == 1
    s.close()


def test_sqlite_is_still_the_default(tmp_path):
    s = open_store(tmp_path / "chat.db")
    assert type(s) is ChatStore and isinstance(s.db.conn, sqlite3.Connection)
    s.close()
