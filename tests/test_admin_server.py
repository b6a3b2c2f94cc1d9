"""A real server (uvicorn on loopback): users come from the file into the database, sign in against
it, and a user disabled on the admin page loses their browser session and their API key at once."""

import json
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar

import pytest

pytest.importorskip("gradio")

from chatengine.app.server import ServerThread, close_app, create_app  # noqa: E402

USERS = {"alice": {"password": "pw-alice", "admin": True}, "bob": {"password": "pw-bob", "api_key": "sk-bob"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("admin-data")
    users_file = data / "users.json"
    users_file.write_text(json.dumps(USERS))
    users_file.chmod(0o600)
    app = create_app(
        data_dir=data / "d", users_file=users_file, engine_options=dict(kv_cache_gib=0.25, max_num_batched_tokens=512)
    )
    with ServerThread(app) as srv:
        yield srv, app.state.chat
    close_app(app)


def browser(url, user, password):
    """An opener holding the session cookie of `user`, signed in through Gradio's /login."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    form = urllib.parse.urlencode(dict(username=user, password=password)).encode()
    opener.open(url + "/login", form, timeout=30)
    return opener


def signed_in(opener, url) -> bool:
    """Whether / serves the app (signed in) rather than the sign-in page."""
    page = opener.open(url + "/", timeout=30).read().decode()
    return 'id="signin"' not in page


def api_status(url, key) -> int:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_file_is_imported_hashed(server):
    _, chat = server
    rows = list(chat.store.db.query("SELECT * FROM users")) + list(chat.store.db.query("SELECT * FROM api_keys"))
    text = repr(rows)
    assert "pw-bob" not in text and "sk-bob" not in text


def test_a_disabled_user_loses_session_and_key_at_once(server):
    srv, chat = server
    bob = browser(srv.url, "bob", "pw-bob")
    assert signed_in(bob, srv.url) and api_status(srv.url, "sk-bob") == 200
    chat.accounts.set_disabled("bob", True)
    assert not signed_in(bob, srv.url)  # the session he had stops working
    assert api_status(srv.url, "sk-bob") == 401
    with pytest.raises(urllib.error.HTTPError):
        browser(srv.url, "bob", "pw-bob")  # and he cannot sign in again
    chat.accounts.set_disabled("bob", False)
    assert signed_in(browser(srv.url, "bob", "pw-bob"), srv.url)
