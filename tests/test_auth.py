"""chatengine.app.auth: the users file, password checks (plain and pbkdf2), API key lookup."""

import json
import sys

import pytest

from chatengine.app.auth import admins, hash_password, load_users, user_for_api_key, validate_users, verify_password

FAST = 1000  # PBKDF2 iterations for tests (the default, 600k, is slow on purpose)


def write(tmp_path, data, name="users.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def users():
    return validate_users(
        {
            "alice": {"password": "plain-secret", "api_key": "sk-alice-1234"},
            "bob": {"password": hash_password("bob's pw", iterations=FAST), "api_key": "sk-bob-5678"},
            "carol": {"api_key": "sk-carol"},
            "dave": {"password": "only-ui"},
        }
    )


def test_load_users_plain_and_hashed(tmp_path):
    hashed = hash_password("s3cret", iterations=FAST)
    path = write(
        tmp_path,
        {
            "alice": {"password": "pw", "api_key": "k1"},
            "bob": {"password": hashed, "api_key": "k2", "display_name": "Bob"},
        },
    )
    users = load_users(path)
    assert set(users) == {"alice", "bob"} and users["bob"]["display_name"] == "Bob"
    assert verify_password(users, "alice", "pw") and verify_password(users, "bob", "s3cret")
    assert user_for_api_key(users, "k2") == "bob"


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{not json", "not valid JSON"),
        ("[]", "top level"),
        (json.dumps({"alice": "pw"}), "must map to an object"),
        (json.dumps({"": {"password": "x"}}), "non-empty string"),
        (json.dumps({" alice": {"password": "x"}}), "spaces"),
        (json.dumps({"alice": {}}), "neither"),
        (json.dumps({"alice": {"password": ""}}), "password"),
        (json.dumps({"alice": {"password": 5}}), "password"),
        (json.dumps({"alice": {"api_key": ""}}), "api_key"),
        (json.dumps({"alice": {"api_key": 123}}), "api_key"),
        (json.dumps({"alice": {"api_key": "same"}, "bob": {"api_key": "same"}}), "same api_key"),
        ('{"alice": {"password": "a"}, "alice": {"password": "b"}}', "duplicate"),
        (json.dumps({"alice": {"password": "a", "admin": "yes"}}), "'admin' must be true or false"),
        (json.dumps({"alice": {"password": "pbkdf2_sha256$abc$c2FsdA==$aGFzaA=="}}), "iteration"),
        (json.dumps({"alice": {"password": "pbkdf2_sha256$0$c2FsdA==$" + "A" * 44}}), "iteration"),
        (json.dumps({"alice": {"password": "pbkdf2_sha256$1000$!!!$" + "A" * 44}}), "base64"),
        (json.dumps({"alice": {"password": "pbkdf2_sha256$1000$c2FsdA=="}}), "pbkdf2_sha256$"),
    ],
)
def test_load_users_rejects_bad_files(tmp_path, content, needle):
    with pytest.raises(ValueError) as e:
        load_users(write(tmp_path, content))
    assert needle in str(e.value) and "users.json" in str(e.value)


def test_admins_are_those_marked_true(tmp_path):
    users = load_users(
        write(
            tmp_path, json.dumps({"root": {"password": "a", "admin": True}, "eve": {"password": "b", "admin": False}})
        )
    )
    assert admins(users) == {"root"} and admins(None) == frozenset()


def test_load_users_missing_or_binary(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_users(tmp_path / "nope.json")
    bad = tmp_path / "bin.json"
    bad.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ValueError, match="UTF-8"):
        load_users(bad)


def test_verify_password(users):
    assert verify_password(users, "alice", "plain-secret")
    assert not verify_password(users, "alice", "plain-secreT")
    assert not verify_password(users, "alice", "plain-secret ")
    assert not verify_password(users, "alice", "")
    assert verify_password(users, "bob", "bob's pw")
    assert not verify_password(users, "bob", "bob's pw!")
    assert not verify_password(users, "bob", users["bob"]["password"])  # the hash is not the password
    assert not verify_password(users, "carol", "")  # API-only user: no UI login
    assert not verify_password(users, "mallory", "plain-secret")
    for bad in (None, 5, b"plain-secret", "\ud800"):
        assert not verify_password(users, "alice", bad)
    assert not verify_password(users, None, "x") and not verify_password(None, "alice", "plain-secret")


def test_user_for_api_key(users):
    assert user_for_api_key(users, "sk-alice-1234") == "alice"
    assert user_for_api_key(users, "sk-carol") == "carol"
    for bad in ("sk-alice-123", "sk-alice-12345", "", None, 7, "SK-ALICE-1234", "\ud800"):
        assert user_for_api_key(users, bad) is None
    assert user_for_api_key(None, "sk-alice-1234") is None


def test_hash_password_format_and_salt():
    a = hash_password("pw", iterations=FAST)
    b = hash_password("pw", iterations=FAST)
    assert a != b and a.startswith(f"pbkdf2_sha256${FAST}$") and a.count("$") == 3
    default = hash_password("pw")
    assert int(default.split("$")[1]) >= 100_000
    assert verify_password({"u": {"password": default}}, "u", "pw")
    with pytest.raises(ValueError):
        hash_password("")


def test_auth_command_line(tmp_path, monkeypatch, capsys):
    import io

    from chatengine.app.auth import _main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hunter2\n"))
    assert _main(["hash", "--iterations", str(FAST)]) == 0
    hashed = capsys.readouterr().out.strip()
    path = write(tmp_path, {"eve": {"password": hashed, "api_key": "sk-eve"}})
    assert verify_password(load_users(path), "eve", "hunter2")
    assert _main(["check", str(path)]) == 0 and "eve: password, api_key" in capsys.readouterr().out
    assert _main(["check", str(write(tmp_path, "[]", "b.json"))]) == 1
    assert "top level" in capsys.readouterr().err
    assert _main(["key"]) == 0 and capsys.readouterr().out.startswith("sk-")
