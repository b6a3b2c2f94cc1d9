import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chatengine.app.store as store_module
from chatengine.app.store import MAX_CONTENT_CHARS, MAX_TITLE_CHARS, ChatStore, NotFound, open_store

A, B = "alice", "bob"


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path):
    """Where this test's chat database lives: an SQLite file, then a schema of its own on the session's
    PostgreSQL server (the ChatStore behaviour below holds on both)."""
    if request.param == "sqlite":
        return tmp_path / "chat.db"
    return request.getfixturevalue("postgres").new_schema()


@pytest.fixture
def store(database):
    """An empty chat database of this test's own, on each backend."""
    s = open_store(database)
    yield s
    s.close()


def on_postgres(store) -> bool:
    return type(store).__name__ == "PostgresChatStore"


def ids(messages):
    return [m["id"] for m in messages]


def count(store, table):
    return store.db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_connection_settings(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    db = store.db
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
    store.close()


def test_tree_branches_and_active_leaf(store):
    c = store.create_conversation(A, "Tree", persona="helper", settings={"temperature": 0.7})
    sys_ = store.add_message(A, c, "system", "Be brief.", token_ids=[1, 2])
    u1 = store.add_message(A, c, "user", "hi", sys_, token_ids=[3])
    a1 = store.add_message(A, c, "assistant", "hello", u1, token_ids=[4, 5])
    assert ids(store.active_path(A, c)) == [sys_, u1, a1]
    a2 = store.add_message(A, c, "assistant", "hey", u1, token_ids=[6])  # regenerate
    a3 = store.add_message(A, c, "assistant", "yo", u1, activate=False)
    assert ids(store.siblings(A, a1)) == ids(store.siblings(A, a3)) == [a1, a2, a3]
    assert ids(store.children(A, u1)) == [a1, a2, a3]
    assert store.children(A, a1) == []
    assert store.get_conversation(A, c)["active_leaf_id"] == a2
    assert ids(store.active_path(A, c)) == [sys_, u1, a2]
    u2 = store.add_message(A, c, "user", "more", a2, token_ids=[7])
    a4 = store.add_message(A, c, "assistant", "sure", u2, token_ids=[8])
    store.set_active_leaf(A, c, a1)  # pick alternative 1/3
    assert ids(store.active_path(A, c)) == [sys_, u1, a1]
    assert store.latest_leaf(A, a2) == a4  # switching back shows its continuation
    assert store.latest_leaf(A, u1) == a3  # newest child first
    assert store.latest_leaf(A, a4) == a4
    store.set_active_leaf(A, c, u2)  # undo: the branch below survives
    assert ids(store.active_path(A, c)) == [sys_, u1, a2, u2]
    assert ids(store.children(A, u2)) == [a4]
    assert ids(store.path_to(A, a4)) == [sys_, u1, a2, u2, a4]
    assert [m["parent_id"] for m in store.path_to(A, a4)] == [None, sys_, u1, a2, u2]
    assert store.prompt_token_ids(A, a4) == [1, 2, 3, 6, 7, 8]
    assert store.prompt_token_ids(A, a3) is None  # a3 has no ids
    assert store.prompt_token_ids(A, a1) == [1, 2, 3, 4, 5]


def test_root_alternatives_and_empty_conversation(store):
    c = store.create_conversation(A, "Edit first turn")
    assert store.active_path(A, c) == []
    r1 = store.add_message(A, c, "user", "first")
    r2 = store.add_message(A, c, "user", "first, edited")
    assert store.get_message(A, r2)["parent_id"] is None
    assert ids(store.siblings(A, r1)) == [r1, r2]
    assert ids(store.active_path(A, c)) == [r2]
    other = store.create_conversation(A, "Other")
    store.add_message(A, other, "user", "root elsewhere")
    assert ids(store.siblings(A, r1)) == [r1, r2]  # roots of other conversations are not siblings


def test_message_fields_and_update(store):
    c = store.create_conversation(A, "Fields")
    u = store.add_message(A, c, "user", "q", token_ids=[10, 11])
    m = store.add_message(
        A, c, "assistant", "", u, status="streaming", settings={"temperature": 0.0, "seed": 7, "stop": ["\n\n"]}
    )
    got = store.get_message(A, m)
    assert (got["conversation_id"], got["parent_id"], got["role"], got["content"]) == (c, u, "assistant", "")
    assert (got["token_ids"], got["stats"], got["status"]) == (None, {}, "streaming")
    assert got["settings"] == {"temperature": 0.0, "seed": 7, "stop": ["\n\n"]}
    store.update_message(A, m, content="partial", token_ids=[12])
    store.update_message(
        A,
        m,
        content="partial reply",
        token_ids=[12, 13],
        status="aborted",
        stats={"ttft_ms": 12.5, "tok_s": 80.25, "num_tokens": 2},
    )
    got = store.get_message(A, m)
    assert (got["content"], got["token_ids"], got["status"]) == ("partial reply", [12, 13], "aborted")
    assert got["stats"] == {"ttft_ms": 12.5, "tok_s": 80.25, "num_tokens": 2}
    assert got["settings"] == {"temperature": 0.0, "seed": 7, "stop": ["\n\n"]}
    assert got["updated_at"] >= got["created_at"]
    store.update_message(A, m, status="done")  # other fields untouched
    assert store.get_message(A, m)["content"] == "partial reply"
    assert store.prompt_token_ids(A, m) == [10, 11, 12, 13]


def test_json_and_token_id_round_trips(database):
    s = open_store(database)
    sampling = {
        "temperature": 1.25,
        "top_p": 0.9,
        "max_tokens": 512,
        "seed": None,
        "stop": ["</s>", "ü"],
        "nested": {"a": [1, 2.5, True, None]},
    }
    c = s.create_conversation(A, "JSON ✓", persona="pirate", settings=sampling)
    big = [0, 1, 2**31 - 1, 49151, 7]
    text = "NUL\x00 rtl \u05e9\u05dc\u05d5\u05dd zwj 👩‍👩‍👧 cjk 漢字 \U0001f600"
    m = s.add_message(A, c, "user", text, token_ids=big, stats={"emoji": "🦜", "x": -0.0})
    e = s.add_message(A, c, "assistant", "empty ids", m, token_ids=[])
    s.close()
    s = open_store(database)
    conv = s.get_conversation(A, c)
    assert (conv["title"], conv["persona"], conv["settings"]) == ("JSON ✓", "pirate", sampling)
    got = s.get_message(A, m)
    if on_postgres(s):  # PostgreSQL text holds no NUL: it reads as U+FFFD
        text = text.replace("\x00", "\ufffd")
    assert (got["content"], got["token_ids"], got["stats"]) == (text, big, {"emoji": "🦜", "x": -0.0})
    assert s.get_message(A, e)["token_ids"] == []
    assert s.prompt_token_ids(A, e) == big
    s.update_settings(A, c, {"temperature": 0})
    assert s.get_conversation(A, c)["settings"] == {"temperature": 0}
    s.close()


def test_list_order_and_rename(store, monkeypatch):
    monkeypatch.setattr(store_module.time, "time", lambda: 1_700_000_000.0)  # one clock tick
    c1 = store.create_conversation(A, "one")
    c2 = store.create_conversation(A, "two")
    c3 = store.create_conversation(A, "three")
    assert ids(store.list_conversations(A)) == [c3, c2, c1]
    m = store.add_message(A, c1, "user", "bump")
    assert ids(store.list_conversations(A)) == [c1, c3, c2]
    store.rename_conversation(A, c2, "  two, renamed ")
    assert ids(store.list_conversations(A)) == [c2, c1, c3]
    assert store.get_conversation(A, c2)["title"] == "two, renamed"
    store.update_message(A, m, content="bumped")
    assert ids(store.list_conversations(A)) == [c1, c2, c3]
    store.set_active_leaf(A, c1, m)  # browsing is not an update
    store.update_settings(A, c3, {"top_k": 40})
    assert ids(store.list_conversations(A)) == [c3, c1, c2]
    assert store.list_conversations(B) == []


def test_search_titles_and_contents_per_user(store):
    c1 = store.create_conversation(A, "Trip to Paris")
    c2 = store.create_conversation(A, "Cooking")
    store.add_message(A, c2, "user", "How do I bake ÄPFEL strudel on the Straße?")
    c3 = store.create_conversation(A, "100% _literal_")
    cb = store.create_conversation(B, "Bob's paris notes")
    store.add_message(B, cb, "user", "strudel for bob")
    assert ids(store.list_conversations(A, "paris")) == [c1]
    assert ids(store.list_conversations(A, "STRUDEL")) == [c2]
    assert ids(store.list_conversations(A, "äpfel")) == [c2]
    assert ids(store.list_conversations(A, "STRASSE")) == [c2]  # Unicode casefold
    assert ids(store.list_conversations(A, "0%")) == [c3]  # no LIKE wildcards
    assert ids(store.list_conversations(A, "_l")) == [c3]
    assert ids(store.list_conversations(A, "I")) == [c3, c2, c1]
    assert store.list_conversations(A, "bob") == []
    assert ids(store.list_conversations(B, "strudel")) == [cb]
    assert ids(store.list_conversations(A, "")) == [c3, c2, c1]


# text that means something to SQL, sqlite3 or psycopg, as a value it must be taken for what it says
HOSTILE = ["'; DROP TABLE messages; --", "%s", "%(user)s", ":user", "?", "' OR '1'='1", "\\", '"', "$1", "%"]


def test_values_are_never_sql(store):
    convs = {text: store.create_conversation(A, text) for text in HOSTILE}
    for text, cid in convs.items():
        store.add_message(A, cid, "user", f"body {text}")
        assert store.get_conversation(A, cid)["title"] == text
        assert [m["content"] for m in store.messages(A, cid)] == [f"body {text}"]
        assert cid in ids(store.list_conversations(A, text))
        for op in (lambda: store.get_conversation(B, cid), lambda: store.get_conversation(A, text)):
            with pytest.raises(NotFound):
                op()
    assert ids(store.list_conversations(A, "' OR '1'='1")) == [convs["' OR '1'='1"]]
    assert store.list_conversations("%") == [] and store.list_conversations(B, "%") == []  # users by those names
    store.delete_user("' OR '1'='1")
    assert (count(store, "conversations"), count(store, "messages")) == (len(HOSTILE), len(HOSTILE))


def test_prompt_token_ids_follow_the_branch(store):
    c = store.create_conversation(A, "ids")
    u = store.add_message(A, c, "user", "a", token_ids=range(5))
    x = store.add_message(A, c, "assistant", "b", u, token_ids=[100])
    y = store.add_message(A, c, "assistant", "c", u, token_ids=[200, 201])
    f = store.add_message(A, c, "user", "d", y)
    assert store.prompt_token_ids(A, x) == [0, 1, 2, 3, 4, 100]
    assert store.prompt_token_ids(A, y) == [0, 1, 2, 3, 4, 200, 201]
    assert store.prompt_token_ids(A, f) is None
    store.update_message(A, f, token_ids=[300])
    assert store.prompt_token_ids(A, f) == [0, 1, 2, 3, 4, 200, 201, 300]


def ownership_fixture(store):
    ca = store.create_conversation(A, "secret")
    ma = store.add_message(A, ca, "user", "alice's secret", token_ids=[1])
    cb = store.create_conversation(B, "bob's")
    mb = store.add_message(B, cb, "user", "bob's message")
    return ca, ma, cb, mb


# (name, call as B) — each gets A's id first, then a fresh id that exists nowhere
FOREIGN_OPS = [
    ("get_conversation", lambda s, cid, mid, cb, mb: s.get_conversation(B, cid)),
    ("rename", lambda s, cid, mid, cb, mb: s.rename_conversation(B, cid, "mine")),
    ("settings", lambda s, cid, mid, cb, mb: s.update_settings(B, cid, {"t": 1})),
    ("delete", lambda s, cid, mid, cb, mb: s.delete_conversation(B, cid)),
    ("pin", lambda s, cid, mid, cb, mb: s.set_pinned(B, cid, True)),
    ("messages", lambda s, cid, mid, cb, mb: s.messages(B, cid)),
    ("active_path", lambda s, cid, mid, cb, mb: s.active_path(B, cid)),
    ("add_to_conv", lambda s, cid, mid, cb, mb: s.add_message(B, cid, "user", "x")),
    ("add_under_msg", lambda s, cid, mid, cb, mb: s.add_message(B, cb, "user", "x", mid)),
    ("get_message", lambda s, cid, mid, cb, mb: s.get_message(B, mid)),
    ("update_message", lambda s, cid, mid, cb, mb: s.update_message(B, mid, content="x")),
    ("children", lambda s, cid, mid, cb, mb: s.children(B, mid)),
    ("siblings", lambda s, cid, mid, cb, mb: s.siblings(B, mid)),
    ("path_to", lambda s, cid, mid, cb, mb: s.path_to(B, mid)),
    ("prompt_ids", lambda s, cid, mid, cb, mb: s.prompt_token_ids(B, mid)),
    ("latest_leaf", lambda s, cid, mid, cb, mb: s.latest_leaf(B, mid)),
    ("leaf_in_theirs", lambda s, cid, mid, cb, mb: s.set_active_leaf(B, cid, mid)),
    ("leaf_in_mine", lambda s, cid, mid, cb, mb: s.set_active_leaf(B, cb, mid)),
]


@pytest.mark.parametrize("name,op", FOREIGN_OPS, ids=[n for n, _ in FOREIGN_OPS])
def test_other_users_ids_look_nonexistent(store, name, op):
    ca, ma, cb, mb = ownership_fixture(store)
    before = (store.get_conversation(A, ca), store.active_path(A, ca), store.get_message(B, mb))
    with pytest.raises(NotFound) as foreign:
        op(store, ca, ma, cb, mb)
    missing_c, missing_m = str(uuid.uuid4()), str(uuid.uuid4())
    with pytest.raises(NotFound) as missing:
        op(store, missing_c, missing_m, cb, mb)
    assert str(foreign.value) == str(missing.value).replace(missing_c, ca).replace(missing_m, ma)
    assert "alice" not in str(foreign.value) and "secret" not in str(foreign.value)
    assert (store.get_conversation(A, ca), store.active_path(A, ca), store.get_message(B, mb)) == before
    assert (count(store, "conversations"), count(store, "messages")) == (2, 2)


def test_parent_and_leaf_must_be_in_the_same_conversation(store):
    c1 = store.create_conversation(A, "one")
    c2 = store.create_conversation(A, "two")
    m1 = store.add_message(A, c1, "user", "in one")
    with pytest.raises(NotFound, match="conversation .* or its message .* not found"):
        store.add_message(A, c2, "assistant", "in two", m1)
    with pytest.raises(NotFound):
        store.set_active_leaf(A, c2, m1)
    assert store.active_path(A, c2) == [] and count(store, "messages") == 1


def test_delete_conversation_and_user_cascade(store):
    ca1, ma, cb, mb = ownership_fixture(store)
    ca2 = store.create_conversation(A, "deep")
    # a chain deeper than SQLite's trigger recursion limit (1000), written in one transaction
    chain = [f"deep-{i}" for i in range(1500)]
    with store._write() as db:  # deep-i answers deep-(i-1); one statement that both databases read
        db.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 1499)"
            " INSERT INTO messages (id, conversation_id, parent_id, role, content, stats, settings, status,"
            " created_at, updated_at) SELECT 'deep-' || i, ?, CASE WHEN i > 0 THEN 'deep-' || (i - 1) END,"
            " 'user', CAST(i AS TEXT), '{}', '{}', 'done', 0, 0 FROM n",
            [ca2],
        )
    parent = store.add_message(A, ca2, "assistant", "last", chain[-1])
    assert ids(store.active_path(A, ca2)) == chain + [parent]
    store.delete_conversation(A, ca2)
    assert ids(store.list_conversations(A)) == [ca1]
    assert count(store, "messages") == 2
    with pytest.raises(NotFound):
        store.delete_conversation(A, ca2)
    with pytest.raises(NotFound):
        store.get_message(A, parent)
    store.delete_user(A)
    assert store.list_conversations(A) == []
    assert (count(store, "users"), count(store, "conversations"), count(store, "messages")) == (1, 1, 1)
    with pytest.raises(NotFound):
        store.get_message(A, ma)
    assert store.get_message(B, mb)["content"] == "bob's message"
    store.delete_user(A)  # idempotent
    store.ensure_user(A)
    store.ensure_user(A)
    assert count(store, "users") == 2


BAD_INPUTS = [
    ("role empty", lambda s, c: s.add_message(A, c, "", "x")),
    ("role unknown", lambda s, c: s.add_message(A, c, "tool", "x")),
    ("role None", lambda s, c: s.add_message(A, c, None, "x")),
    ("content int", lambda s, c: s.add_message(A, c, "user", 5)),
    ("content None", lambda s, c: s.add_message(A, c, "user", None)),
    ("content bytes", lambda s, c: s.add_message(A, c, "user", b"x")),
    ("content surrogate", lambda s, c: s.add_message(A, c, "user", "ok \ud800 no")),
    ("content too long", lambda s, c: s.add_message(A, c, "user", "x" * (MAX_CONTENT_CHARS + 1))),
    ("status unknown", lambda s, c: s.add_message(A, c, "user", "x", status="finished")),
    ("ids negative", lambda s, c: s.add_message(A, c, "user", "x", token_ids=[1, -1])),
    ("ids overflow", lambda s, c: s.add_message(A, c, "user", "x", token_ids=[2**31])),
    ("ids float", lambda s, c: s.add_message(A, c, "user", "x", token_ids=[1.5])),
    ("ids str", lambda s, c: s.add_message(A, c, "user", "x", token_ids=["1"])),
    ("ids bool", lambda s, c: s.add_message(A, c, "user", "x", token_ids=[True])),
    ("stats list", lambda s, c: s.add_message(A, c, "user", "x", stats=[1])),
    ("stats nan", lambda s, c: s.add_message(A, c, "user", "x", stats={"t": float("nan")})),
    ("settings object", lambda s, c: s.add_message(A, c, "user", "x", settings={"o": object()})),
    ("title empty", lambda s, c: s.create_conversation(A, "   ")),
    ("title too long", lambda s, c: s.create_conversation(A, "t" * (MAX_TITLE_CHARS + 1))),
    ("title surrogate", lambda s, c: s.create_conversation(A, "\udfff")),
    ("title None", lambda s, c: s.create_conversation(A, None)),
    ("user empty", lambda s, c: s.create_conversation("", "t")),
    ("user None", lambda s, c: s.ensure_user(None)),
    ("persona empty", lambda s, c: s.create_conversation(A, "t", persona="")),
    ("rename empty", lambda s, c: s.rename_conversation(A, c, "")),
    ("settings str", lambda s, c: s.update_settings(A, c, "temperature=1")),
    ("update surrogate", lambda s, c: s.update_message(A, s.active_path(A, c)[0]["id"], content="\ud800")),
    ("update status", lambda s, c: s.update_message(A, s.active_path(A, c)[0]["id"], status="")),
    ("search surrogate", lambda s, c: s.list_conversations(A, "\ud800")),
]


# SQLite only: the checks run in Python before any SQL, the same on both databases (PostgreSQL's own
# refusal, a NUL character, is in test_store_postgres.py)
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
@pytest.mark.parametrize("name,op", BAD_INPUTS, ids=[n for n, _ in BAD_INPUTS])
def test_bad_input_is_rejected_and_nothing_written(store, name, op):
    c = store.create_conversation(A, "t")
    m = store.add_message(A, c, "user", "kept", token_ids=[1])
    before = (store.list_conversations(A), store.get_message(A, m), count(store, "users"))
    with pytest.raises(ValueError):
        op(store, c)
    assert (store.list_conversations(A), store.get_message(A, m), count(store, "users")) == before
    assert count(store, "messages") == 1


def test_persistence_and_recovery(database):
    path = database
    s1 = open_store(path)
    c = s1.create_conversation(A, "persist")
    u = s1.add_message(A, c, "user", "q", token_ids=[1, 2])
    r = s1.add_message(A, c, "assistant", "partial", u, token_ids=[3], status="streaming")
    s2 = open_store(path)  # a second process while the first is alive
    assert ids(s2.active_path(A, c)) == [u, r]
    s1.close()  # no checkpoint needed: WAL is read on open
    s3 = open_store(path)
    assert s3.get_conversation(A, c)["title"] == "persist"
    assert s3.prompt_token_ids(A, r) == [1, 2, 3]
    assert s3.recover_interrupted() == 1
    assert s3.get_message(A, r)["status"] == "interrupted"
    assert s3.get_message(A, u)["status"] == "done"
    assert s3.recover_interrupted() == 0
    s2.close(), s3.close()
    s4 = open_store(path)
    assert (s4.get_message(A, r)["status"], s4.get_message(A, r)["content"]) == ("interrupted", "partial")
    s4.close()
    s4.get_conversation(A, c)  # close() is not final: reopens lazily
    s4.close()


def test_connections_are_per_thread(store):
    c = store.create_conversation(A, "threads")
    seen = {}

    def worker():  # the Gradio case: a thread-pool handler
        seen["db"] = store.db
        seen["mid"] = store.add_message(A, c, "user", "from a worker")

    t = threading.Thread(target=worker)
    t.start(), t.join()
    assert seen["db"] is not store.db
    assert store.get_message(A, seen["mid"])["content"] == "from a worker"


def test_concurrent_writers_lose_nothing(database):
    stores = [open_store(database), open_store(database)]  # two "processes", threads on each
    shared = stores[0].create_conversation("shared", "everyone")
    root = stores[0].add_message("shared", shared, "system", "root")
    num_threads, num_msgs = 8, 25
    own = {i: stores[i % 2].create_conversation(f"user{i}", f"conv {i}") for i in range(num_threads)}
    errors = []
    barrier = threading.Barrier(num_threads)

    def worker(i):
        s, user, c = stores[i % 2], f"user{i}", own[i]
        try:
            barrier.wait(timeout=10)
            parent = None
            for j in range(num_msgs):
                parent = s.add_message(user, c, "user", f"{i}:{j}", parent, token_ids=[i, j])
                m = s.add_message("shared", shared, "assistant", "", root, status="streaming")
                s.update_message("shared", m, content=f"{i}:{j}", token_ids=[j], status="done")
                s.list_conversations(user, "conv")
        except Exception as e:  # e.g. "database is locked"
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [t.is_alive() for t in threads] == [False] * num_threads
    assert errors == []
    s = stores[1]
    for i in range(num_threads):
        path_ = s.active_path(f"user{i}", own[i])
        assert [m["content"] for m in path_] == [f"{i}:{j}" for j in range(num_msgs)]
        assert s.prompt_token_ids(f"user{i}", path_[-1]["id"]) == [x for j in range(num_msgs) for x in (i, j)]
    replies = s.children("shared", root)
    assert sorted(m["content"] for m in replies) == sorted(
        f"{i}:{j}" for i in range(num_threads) for j in range(num_msgs)
    )
    assert {m["status"] for m in replies} == {"done"}
    assert count(s, "messages") == 1 + 2 * num_threads * num_msgs
    for st_ in stores:
        st_.close()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shared_store(request, tmp_path_factory):
    if request.param == "sqlite":
        s = open_store(tmp_path_factory.mktemp("hyp") / "h.db")
    else:
        s = open_store(request.getfixturevalue("postgres").new_schema())
    yield s
    s.close()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.lists(st.integers(0, 2**31 - 1), max_size=4)), min_size=1, max_size=12)
)
def test_random_trees_match_a_model(shared_store, spec):
    # each entry: (index of the parent among earlier messages, or a root if out of range; ids)
    s = shared_store
    c = s.create_conversation(A, "random")
    made, parent_of = [], {}
    for k, (p, tok) in enumerate(spec):
        parent = made[p] if p < k else None
        made.append(s.add_message(A, c, "user", str(k), parent, token_ids=tok))
        parent_of[made[-1]] = parent
    for k, mid in enumerate(made):
        chain, x = [], mid
        while x is not None:
            chain.insert(0, x)
            x = parent_of[x]
        assert ids(s.path_to(A, mid)) == chain
        assert s.prompt_token_ids(A, mid) == [t for x in chain for t in spec[made.index(x)][1]]
        assert ids(s.siblings(A, mid)) == [m for m in made if parent_of[m] == parent_of[mid]]
        assert ids(s.children(A, mid)) == [m for m in made if parent_of[m] == mid]
    assert ids(s.active_path(A, c)) == ids(s.path_to(A, made[-1]))


def test_store_imports_no_engine_code():
    path = Path(__file__).resolve().parents[1] / "chatengine" / "app" / "store.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('store', {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('chatengine')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pinned_chats_list_first_and_pinning_keeps_the_date(store):
    old, mid, new = (store.create_conversation(A, title=t) for t in ("old", "mid", "new"))
    before = store.get_conversation(A, old)["updated_at"]
    store.set_pinned(A, old, True)
    assert store.get_conversation(A, old)["updated_at"] == before and store.get_conversation(A, old)["pinned"] is True
    assert [c["title"] for c in store.list_conversations(A)] == ["old", "new", "mid"]
    assert [c["pinned"] for c in store.list_conversations(A)] == [True, False, False]
    store.set_pinned(A, old, False)
    assert [c["title"] for c in store.list_conversations(A)] == ["new", "mid", "old"]


def test_messages_lists_every_branch_in_creation_order(store):
    cid = store.create_conversation(A)
    u1 = store.add_message(A, cid, "user", "q")
    r1 = store.add_message(A, cid, "assistant", "a1", u1)
    r2 = store.add_message(A, cid, "assistant", "a2", u1)
    got = store.messages(A, cid)
    assert [(m["id"], m["parent_id"], m["content"]) for m in got] == [(u1, None, "q"), (r1, u1, "a1"), (r2, u1, "a2")]


def test_a_version_1_database_gains_the_pinned_column(tmp_path):
    """A database made before pins (schema version 1) opens with every chat unpinned, its data intact."""
    import sqlite3

    path = tmp_path / "old.db"
    v1 = "\n".join(ln for ln in store_module.SCHEMA.splitlines() if not ln.strip().startswith(("pinned ", "model ")))
    assert "pinned" not in v1 and "model " not in v1
    db = sqlite3.connect(path)
    db.executescript(v1 + "PRAGMA user_version = 1;")
    db.execute("INSERT INTO users VALUES ('alice', 1.0)")
    db.execute("INSERT INTO conversations (id, user_id, title, settings, created_at, updated_at)"
               " VALUES ('c1', 'alice', 'kept', '{}', 1.0, 2.0)")  # fmt: skip
    db.commit()
    db.close()
    s = ChatStore(path)
    try:
        [conv] = s.list_conversations(A)
        assert (conv["id"], conv["title"], conv["pinned"], conv["updated_at"]) == ("c1", "kept", False, 2.0)
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION == 4
        assert s.get_conversation(A, "c1")["model"] is None
        s.set_pinned(A, "c1", True)
        assert s.get_conversation(A, "c1")["pinned"] is True
    finally:
        s.close()
    ChatStore(path).close()  # a second start finds the column there


def test_settings_alone_can_change_without_moving_the_chat(store):
    old, new = store.create_conversation(A, title="old"), store.create_conversation(A, title="new")
    before = store.get_conversation(A, old)["updated_at"]
    store.update_settings(A, old, {"temperature": 0.1}, touch=False)
    assert store.get_conversation(A, old)["settings"] == {"temperature": 0.1}
    assert store.get_conversation(A, old)["updated_at"] == before
    assert [c["id"] for c in store.list_conversations(A)] == [new, old]
    with pytest.raises(NotFound):
        store.update_settings(B, old, {"temperature": 9}, touch=False)
    store.update_settings(A, old, {"temperature": 0.2})  # a turn's: the chat moves up
    assert [c["id"] for c in store.list_conversations(A)] == [old, new]


def test_a_conversation_keeps_its_model(store):
    a = store.create_conversation(A, model="tiny-b")
    b = store.create_conversation(A)
    assert store.get_conversation(A, a)["model"] == "tiny-b"
    assert store.get_conversation(A, b)["model"] is None  # the server's default
    assert {c["id"]: c["model"] for c in store.list_conversations(A)} == {a: "tiny-b", b: None}
    for bad in ("", 7):
        with pytest.raises(ValueError, match="model"):
            store.create_conversation(A, model=bad)


def test_a_version_1_database_gains_the_model_column(tmp_path):
    """A database of the one-model days opens as it was, its conversations on the default model."""
    import sqlite3

    path = tmp_path / "v1.db"
    v1 = "\n".join(line for line in store_module.SCHEMA.splitlines() if not line.strip().startswith("model "))
    with sqlite3.connect(path) as db:
        db.executescript(v1 + "PRAGMA user_version = 1;")
        db.execute("INSERT INTO users VALUES ('alice', 0)")
        db.execute(
            "INSERT INTO conversations (id, user_id, title, settings, created_at, updated_at)"
            " VALUES ('c1', 'alice', 'old chat', '{}', 0, 0)"
        )
    db.close()
    for _ in range(2):  # and a second open changes nothing
        s = ChatStore(path)
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION
        assert s.get_conversation(A, "c1")["model"] is None
        assert s.get_conversation(A, s.create_conversation(A, model="m"))["model"] == "m"
        s.close()
