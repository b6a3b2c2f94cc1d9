"""Session hashes bound to their first user; nothing secret in the access log."""

import logging

from chatengine.app import access_log
from chatengine.app.session_guard import SessionOwners, cookies_of, session_in_body, session_in_path


def test_a_session_is_bound_to_its_first_user():
    owners = SessionOwners()
    assert owners.admit("h1", "alice") and owners.admit("h1", "alice")
    assert not owners.admit("h1", "bob")
    assert owners.admit("h2", "bob")


def test_bindings_are_bounded_oldest_first():
    owners = SessionOwners(max_sessions=2)
    owners.admit("a", "u1"), owners.admit("b", "u2"), owners.admit("a", "u1"), owners.admit("c", "u3")
    assert list(owners.owner) == ["a", "c"]  # "b" was the least recently used


def test_where_a_session_hash_rides():
    assert session_in_path("/gradio_api/heartbeat/abc") == "abc"
    assert session_in_path("/gradio_api/stream/abc/run/3/playlist.m3u8") == "abc"
    assert session_in_path("/gradio_api/stream/event-id") is None
    assert session_in_path("/gradio_api/queue/join") is None
    assert session_in_body(b'{"session_hash": "abc", "data": []}') == "abc"
    assert session_in_body(b'{"session_hash": 5}') is None
    assert session_in_body(b"not json") is None
    assert session_in_body(b"[1, 2]") is None


def test_cookies_are_parsed_and_junk_is_no_sign_in():
    scope = {"headers": [(b"cookie", b"access-token-x=tok; other=1")]}
    assert cookies_of(scope) == {"access-token-x": "tok", "other": "1"}
    assert cookies_of({"headers": [(b"cookie", b'bad="')]}) == {}
    assert cookies_of({"headers": []}) == {}


def test_access_log_has_no_session_hash_or_query_string():
    access_log.install()
    access_log.install()
    logger = logging.getLogger("uvicorn.access")
    assert sum(isinstance(f, access_log.RedactedAccessLog) for f in logger.filters) == 1
    lines = []
    for path in ("/gradio_api/queue/data?session_hash=SECRET", "/gradio_api/heartbeat/SECRET", "/v1/models?x=1"):
        record = logging.LogRecord(
            "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
            ("1.2.3.4:5", "GET", path, "1.1", 200), None,
        )  # fmt: skip
        assert logger.filter(record)
        lines.append(record.getMessage())
    assert not any("SECRET" in line or "?" in line for line in lines), lines
    assert lines[1] == '1.2.3.4:5 - "GET /gradio_api/heartbeat/… HTTP/1.1" 200'
