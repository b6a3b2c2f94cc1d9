"""Sign-in sessions: a cookie signs in its user until it expires or logs out, across a restart (a
new store and LoginSessions on the same files); forged, altered or foreign cookies sign in no one."""

import os
import stat

import pytest

from chatengine.app.sessions import KEY_FILE, LoginSessions, load_or_create_key
from chatengine.app.store import ChatStore


def test_a_cookie_signs_in_its_user_until_logout(store, tmp_path):
    sessions = LoginSessions(store, load_or_create_key(tmp_path))
    a1, a2, b = sessions.create("alice"), sessions.create("alice"), sessions.create("bob")
    assert (sessions.user_of(a1), sessions.user_of(a2), sessions.user_of(b)) == ("alice", "alice", "bob")
    sessions.revoke(a1)
    assert sessions.user_of(a1) is None
    assert sessions.user_of(a2) == "alice" and sessions.user_of(b) == "bob"  # other sign-ins stay


def test_sign_ins_outlive_a_restart(tmp_path):
    first = ChatStore(tmp_path / "chat.db")
    cookie = LoginSessions(first, load_or_create_key(tmp_path)).create("alice")
    first.close()
    again = ChatStore(tmp_path / "chat.db")
    try:
        assert LoginSessions(again, load_or_create_key(tmp_path)).user_of(cookie) == "alice"
    finally:
        again.close()


def test_the_database_keeps_no_usable_token(store, tmp_path):
    cookie = LoginSessions(store, load_or_create_key(tmp_path)).create("alice")
    token = cookie.split(".")[0]
    [row] = store.db.execute("SELECT token_hash FROM sessions").fetchall()
    assert token not in row[0] and cookie not in row[0]


@pytest.mark.parametrize(
    "forge",
    [
        lambda c: c.split(".")[0],  # no signature
        lambda c: c[:-1] + ("B" if c[-1] == "A" else "A"),  # altered signature
        lambda c: ("B" if c[0] == "A" else "A") + c[1:],  # altered token
        lambda c: c + ".extra",
        lambda c: c * 3,
        lambda c: "",
        lambda c: None,
    ],
)
def test_forged_cookies_sign_in_no_one(store, tmp_path, forge):
    sessions = LoginSessions(store, load_or_create_key(tmp_path))
    cookie = sessions.create("alice")
    assert sessions.user_of(forge(cookie)) is None
    sessions.revoke(forge(cookie))  # a forged logout is ignored
    assert sessions.user_of(cookie) == "alice"


def test_another_servers_key_signs_in_no_one(store, tmp_path):
    cookie = LoginSessions(store, load_or_create_key(tmp_path)).create("alice")
    other = tmp_path / "other"
    other.mkdir()
    assert LoginSessions(store, load_or_create_key(other)).user_of(cookie) is None


def test_sessions_expire(store, tmp_path):
    sessions = LoginSessions(store, load_or_create_key(tmp_path), ttl_s=-1)
    assert sessions.user_of(sessions.create("alice")) is None
    live = LoginSessions(store, load_or_create_key(tmp_path)).create("bob")  # drops the expired row
    assert [r[0] for r in store.db.execute("SELECT user_id FROM sessions").fetchall()] == ["bob"]
    assert LoginSessions(store, load_or_create_key(tmp_path)).user_of(live) == "bob"


def test_deleting_a_user_ends_their_sign_ins(store, tmp_path):
    sessions = LoginSessions(store, load_or_create_key(tmp_path))
    cookie = sessions.create("alice")
    store.delete_user("alice")
    assert sessions.user_of(cookie) is None


def test_the_key_is_private_and_kept(tmp_path):
    key = load_or_create_key(tmp_path)
    assert len(key) == 32 and load_or_create_key(tmp_path) == key
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match="damaged"):
        load_or_create_key(tmp_path)


def test_a_disabled_account_signs_in_no_more(store, tmp_path):
    """A cookie of an account disabled since refuses at once; disabling also deletes its sign-ins,
    so enabling it again does not bring old cookies back."""
    active = {"alice": True, "bob": True}
    sessions = LoginSessions(store, load_or_create_key(tmp_path), is_active=lambda u: active[u])
    alice, bob = sessions.create("alice"), sessions.create("bob")
    active["alice"] = False
    assert sessions.user_of(alice) is None and sessions.user_of(bob) == "bob"
    sessions.revoke_user("alice")
    active["alice"] = True
    assert sessions.user_of(alice) is None and sessions.user_of(bob) == "bob"
