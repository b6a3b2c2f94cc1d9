"""UserDirectory: accounts in SQLite with hashed passwords and keys, disabled users, the file import,
and the API's bearer-key check against the hashed keys."""

import pytest
from starlette.requests import Request

from chatengine.app import auth
from chatengine.app.api.access import Access
from chatengine.app.api.protocol import APIError
from chatengine.app.store import ChatStore, NotFound
from chatengine.app.users import AdminSet, UserDirectory, key_digest

FAST = 1000  # PBKDF2 iterations: the real work factor would take seconds per test here


@pytest.fixture
def accounts(store):
    return UserDirectory(store, iterations=FAST)


def db_text(store) -> str:
    """Every value of the users and api_keys tables, as one string."""
    rows = list(store.db.query("SELECT * FROM users")) + list(store.db.query("SELECT * FROM api_keys"))
    return repr(rows)


def test_add_hashes_the_password_with_a_salt_per_user(accounts, store):
    accounts.add("carol", "correct horse")
    accounts.add("dave", "correct horse")
    hashes = [r["password_hash"] for r in store.db.query("SELECT password_hash FROM users ORDER BY id")]
    assert all(h.startswith("pbkdf2_sha256$") for h in hashes) and hashes[0] != hashes[1]  # salted
    assert "correct horse" not in db_text(store)
    assert accounts.verify_password("carol", "correct horse")
    assert not accounts.verify_password("carol", "correct hors")
    assert not accounts.verify_password("nobody", "correct horse")
    assert not accounts.verify_password("carol", None)


@pytest.mark.parametrize("name", ["", " carol", "a b", "<b>x</b>", "x" * 65, "-lead", None, "é"])
def test_add_refuses_bad_names(accounts, name):
    with pytest.raises(ValueError, match="user name"):
        accounts.add(name, "long enough")


def test_add_refuses_short_passwords_and_duplicates(accounts):
    with pytest.raises(ValueError, match="password"):
        accounts.add("carol", "short")
    accounts.add("carol", "long enough")
    with pytest.raises(ValueError, match="already"):
        accounts.add("carol", "another one")
    assert accounts.verify_password("carol", "long enough")  # the refused add changed nothing


def test_api_keys_are_stored_hashed_and_shown_once(accounts, store):
    accounts.add("carol", "long enough")
    key = accounts.create_key("carol")
    assert key.startswith("sk-") and len(key) > 30
    assert key not in db_text(store) and key_digest(key) in db_text(store)
    assert accounts.user_for_api_key(key) == "carol"
    assert accounts.user_for_api_key(key + "x") is None and accounts.user_for_api_key("") is None
    (key_id,) = accounts.all_users()[0]["keys"]
    accounts.revoke_key("carol", key_id)
    assert accounts.user_for_api_key(key) is None
    with pytest.raises(NotFound):
        accounts.revoke_key("carol", key_id)
    with pytest.raises(NotFound):
        accounts.create_key("nobody")


def test_a_disabled_user_can_neither_sign_in_nor_use_a_key(accounts):
    accounts.add("carol", "long enough", admin=True)
    key = accounts.create_key("carol")
    ended = []
    accounts.on_disable.append(ended.append)
    accounts.set_disabled("carol", True)
    assert ended == ["carol"]  # the server ends their sessions here
    assert not accounts.verify_password("carol", "long enough")
    assert accounts.user_for_api_key(key) is None
    assert not accounts.is_active("carol") and not accounts.is_admin("carol")
    assert "carol" not in AdminSet(accounts)
    accounts.set_disabled("carol", False)
    assert accounts.verify_password("carol", "long enough") and accounts.user_for_api_key(key) == "carol"
    accounts.set_password("carol", "another long one")  # a reset signs her out everywhere too
    assert ended == ["carol", "carol"] and accounts.verify_password("carol", "another long one")
    assert "carol" in AdminSet(accounts)


def test_reset_password(accounts):
    accounts.add("carol", "long enough")
    accounts.set_password("carol", "a new secret")
    assert accounts.verify_password("carol", "a new secret") and not accounts.verify_password("carol", "long enough")
    with pytest.raises(NotFound):
        accounts.set_password("nobody", "a new secret")


def test_the_users_file_is_imported_once_and_hashed(accounts, store):
    hashed = auth.hash_password("bob's pw", iterations=FAST)
    users = auth.validate_users(
        {
            "alice": {"password": "plain-pw", "api_key": "sk-alice", "admin": True},
            "bob": {"password": hashed},
            "api-only": {"api_key": "sk-api"},
        }
    )
    assert accounts.import_users(users) == 3
    assert "plain-pw" not in db_text(store) and "sk-alice" not in db_text(store)
    assert accounts.verify_password("alice", "plain-pw") and accounts.verify_password("bob", "bob's pw")
    assert accounts.user_for_api_key("sk-alice") == "alice" and accounts.user_for_api_key("sk-api") == "api-only"
    assert accounts.is_admin("alice") and not accounts.is_admin("bob")
    assert not accounts.verify_password("api-only", "")
    # the admin page's changes survive the next start's import
    accounts.set_password("alice", "changed on the page")
    accounts.revoke_key("alice", accounts.all_users()[0]["keys"][0])
    accounts.set_disabled("bob", True)
    assert accounts.import_users(users) == 0
    assert accounts.verify_password("alice", "changed on the page")
    assert accounts.user_for_api_key("sk-alice") is None and not accounts.is_active("bob")


def test_an_old_database_gains_the_new_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id TEXT PRIMARY KEY, created_at REAL NOT NULL)")
    con.execute("INSERT INTO users VALUES ('old', 1.0)")
    con.commit()
    con.close()
    store = ChatStore(path)
    accounts = UserDirectory(store, iterations=FAST)
    assert accounts.all_users()[0]["name"] == "old" and accounts.is_active("old")
    accounts.set_password("old", "long enough")
    assert accounts.verify_password("old", "long enough")
    store.close()


def bearer(key: str) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    return Request({"type": "http", "headers": headers, "client": ("127.0.0.1", 1)})


def test_the_api_checks_keys_against_the_hashes(accounts):
    accounts.add("carol", "long enough")
    key = accounts.create_key("carol")
    access = Access(accounts)
    assert access.authenticate(bearer(key)) == "carol"
    with pytest.raises(APIError) as e:
        access.authenticate(bearer(key_digest(key)))  # the stored digest is not a key
    assert e.value.status == 401
    accounts.set_disabled("carol", True)
    with pytest.raises(APIError):
        access.authenticate(bearer(key))
