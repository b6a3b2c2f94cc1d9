"""The Gradio UI through gradio_client against a real server on loopback (one per module):
login, streaming, stop, regenerate, two users isolated."""

import json
import time

import pytest

gradio_client = pytest.importorskip("gradio_client")
pytest.importorskip("gradio")
uvicorn = pytest.importorskip("uvicorn")

from gradio_client import Client  # noqa: E402

from chatengine.app.auth import hash_password  # noqa: E402
from chatengine.app.server import ServerThread, close_app, create_app  # noqa: E402

# the passwords stored hashed with few PBKDF2 iterations, as the unit tests do: every sign-in checks
# one, and at the default 600k each cost ~0.35 s of CPU (test_auth.py covers the default)
FAST = 1000
USERS = {
    "alice": {"password": hash_password("pw-alice", iterations=FAST), "api_key": "sk-alice"},
    "bob": {"password": hash_password("pw-bob", iterations=FAST), "api_key": "sk-bob"},
}
# text, persona, temperature, top_p, max_tokens, seed, n
SHORT = ("assistant", 0, 1, 8, -1, 1)
LONG_PROMPT = "Write a very long story about a dragon, at least 1000 words."
LONG = ("assistant", 0, 1, 400, -1, 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("chatengine.app.auth", reason="login needs chatengine.app.auth")
    data = tmp_path_factory.mktemp("ui-data")
    users_file = data / "users.json"
    users_file.write_text(json.dumps(USERS))
    app = create_app(
        data_dir=data, users_file=users_file, engine_options=dict(kv_cache_gib=0.25, max_num_batched_tokens=512)
    )
    # Gradio's heartbeat every 0.25 s (its own end-to-end tests' interval; 15 s by default): a
    # client's close() joins its heartbeat thread for up to 1 s, and that thread only sees the close
    # when the next heartbeat arrives, so every closed client cost a 1 s wait (and left the thread
    # behind); now close() ends the thread, and the server sees the session go, within 0.25 s
    with pytest.MonkeyPatch.context() as env, ServerThread(app) as srv:
        env.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.25")
        yield srv
    close_app(app)


@pytest.fixture
def alice(server):
    c = Client(server.url, auth=("alice", "pw-alice"), verbose=False, analytics_enabled=False)
    yield c
    c.close()


@pytest.fixture
def bob(server):
    c = Client(server.url, auth=("bob", "pw-bob"), verbose=False, analytics_enabled=False)
    yield c
    c.close()


def texts(chat) -> list[str]:
    """The text of every message of a Chatbot value as gradio_client returns it."""
    out = []
    for m in chat or []:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(content)
    return out


def send(client, text, args=SHORT):
    return client.predict(text, *args, api_name="/send")


def wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_login_is_required(server):
    with pytest.raises(Exception):
        Client(server.url, auth=("alice", "wrong"), verbose=False, analytics_enabled=False)
    with pytest.raises(Exception):
        Client(server.url, verbose=False, analytics_enabled=False)


def test_no_upload_route(server):
    """Gradio's upload routes take files from anyone into a shared temp dir; the app has no upload."""
    import httpx

    for path in ("gradio_api/upload", "gradio_api/upload_progress?upload_id=x"):
        r = httpx.post(f"{server.url}/{path}", files={"files": ("a.txt", b"x" * 1000)})
        assert r.status_code == 404 and "no file uploads" in r.text, (path, r.status_code)


def test_internal_endpoints_are_hidden(alice):
    names = set(alice.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/send", "/stop", "/regenerate", "/open"} <= names
    assert not any("tick" in n or "lambda" in n or "busy" in n or "retry" in n for n in names)


def test_streaming_reply(alice, server):
    # 16 tokens: each step (~0.1 s) outlasts the UI's 80 ms repaint throttle, so ~16 streamed updates
    job = alice.submit("Write three short sentences about the sea.", "assistant", 0, 1, 16, -1, 1, api_name="/send")
    seen = []
    for out in job:  # every streamed update
        chat = texts(out[1])
        if len(chat) == 2:
            seen.append(chat[1])
    final = job.result()
    chat = texts(final[1])
    assert chat[0] == "Write three short sentences about the sea."
    assert "tokens" in chat[1] and "TTFT" in chat[1]  # the stats line under the reply
    partial = [s for s in seen if "▍" in s]
    assert len(partial) >= 2, f"expected several streamed updates, got {seen}"
    body = lambda s: s.split("▍")[0].strip()  # noqa: E731
    assert len(body(partial[-1])) >= len(body(partial[0]))
    conv_id = final[3]["value"]
    assert conv_id in [c[1] for c in final[3]["choices"]]
    store = server.app.state.chat.store
    path = store.active_path("alice", conv_id)
    assert [m["role"] for m in path] == ["system", "user", "assistant"]
    assert path[-1]["status"] in ("done",) and path[-1]["token_ids"]


def test_follow_up_turn_reuses_cached_blocks(alice, server):
    out = send(alice, "Name a fruit.")
    out = send(alice, "Name another fruit.")
    conv_id = out[3]["value"]
    reply = server.app.state.chat.store.active_path("alice", conv_id)[-1]
    if not server.app.state.chat.engine.engine.config.enable_prefix_caching:
        pytest.skip("prefix caching is disabled")
    assert reply["stats"]["cached_tokens"] > 0
    assert f"{reply['stats']['cached_tokens']}/" in texts(out[1])[-1]


def test_regenerate_adds_an_alternative(alice, server):
    out = send(alice, "Say something nice.")
    assert "1 / 1" in out[2]["value"]
    out = alice.predict(1.0, 1, 8, -1, 1, api_name="/regenerate")  # -> chatbot, label, list
    assert "2 / 2" in out[1]["value"]
    assert "2/2" in texts(out[0])[-1]
    conv_id = out[2]["value"]
    store = server.app.state.chat.store
    leaf = store.active_path("alice", conv_id)[-1]
    assert len(store.siblings("alice", leaf["id"])) == 2
    # the reply's inline ‹ shows the first alternative again
    alice.predict(f"{leaf['id']}:-1:1", api_name="/switch_version")
    first = store.siblings("alice", leaf["id"])[0]["id"]
    assert store.active_path("alice", conv_id)[-1]["id"] == first


def test_n_alternatives(alice, server):
    out = alice.predict("Pick a number.", "assistant", 1.0, 1, 6, 3, 2, api_name="/send")
    assert "1 / 2" in out[2]["value"]
    conv_id = out[3]["value"]
    store = server.app.state.chat.store
    leaf = store.active_path("alice", conv_id)[-1]
    assert [s["status"] for s in store.siblings("alice", leaf["id"])] == ["done", "done"]


def test_stop_keeps_partial_reply(alice, server):
    job = alice.submit(LONG_PROMPT, *LONG, api_name="/send")
    engine = server.app.state.chat.engine.engine
    wait_for(lambda: any(r.seqs and r.seqs[0].num_output_tokens >= 3 for r in list(engine.requests.values())))
    t = time.monotonic()
    alice.predict(api_name="/stop")
    final = job.result(timeout=30)
    assert time.monotonic() - t < 10
    chat = texts(final[1])
    assert "stopped" in chat[-1]
    conv_id = final[3]["value"]
    reply = server.app.state.chat.store.active_path("alice", conv_id)[-1]
    assert reply["status"] == "aborted" and reply["content"]
    wait_for(lambda: not engine.requests, timeout=5)


def test_versions_do_not_switch_under_a_streaming_reply(alice, server):
    """While a reply streams, the stream owns the view: ‹ is refused (it would move the branch on
    screen out from under the reply being painted)."""
    out = send(alice, LONG_PROMPT)  # 8 tokens
    conv_id = out[3]["value"]
    job = alice.submit(0, 1, 400, -1, 1, api_name="/regenerate")  # alternative 2/2: greedy, runs long
    engine = server.app.state.chat.engine.engine
    wait_for(lambda: any(r.seqs and r.seqs[0].num_output_tokens >= 3 for r in list(engine.requests.values())))
    store = server.app.state.chat.store
    leaf = store.active_path("alice", conv_id)[-1]
    assert [s["id"] for s in store.siblings("alice", leaf["id"])].index(leaf["id"]) == 1
    alice.predict(f"{leaf['id']}:-1:1", api_name="/switch_version")
    assert store.active_path("alice", conv_id)[-1]["id"] == leaf["id"]
    alice.predict(api_name="/stop")
    job.result(timeout=30)
    alice.predict(f"{leaf['id']}:-1:2", api_name="/switch_version")  # and once it is over, it does
    assert store.active_path("alice", conv_id)[-1]["id"] != leaf["id"]
    wait_for(lambda: not engine.requests, timeout=5)


def test_two_users_are_isolated(alice, bob, server):
    out = send(alice, "alice's secret plan")
    a_conv = out[3]["value"]
    assert a_conv
    # bob's list does not show it, search does not find it, and opening it by id shows nothing
    b_list = bob.predict("", api_name="/search")
    assert a_conv not in [c[1] for c in b_list["choices"]]
    assert bob.predict("secret plan", api_name="/search")["choices"] == []
    try:
        opened = bob.predict(a_conv, api_name="/open")
    except gradio_client.exceptions.AppError:
        pass  # Gradio itself refuses a value that is not among bob's choices
    else:
        assert texts(opened[0]) == []
        assert a_conv not in [c[1] for c in opened[4].get("choices", [])]
    # bob's own chat goes to his own conversation, and alice's is untouched
    out_b = send(bob, "bob here")
    b_conv = out_b[3]["value"]
    assert b_conv != a_conv and [c[1] for c in out_b[3]["choices"]] == ["group:Today", b_conv]
    store = server.app.state.chat.store
    assert [m["content"] for m in store.active_path("alice", a_conv) if m["role"] == "user"] == ["alice's secret plan"]
    # alice still sees hers, and opens it
    assert a_conv in [c[1] for c in alice.predict("", api_name="/search")["choices"]]
    opened = alice.predict(a_conv, api_name="/open")
    assert texts(opened[0])[0] == "alice's secret plan"


def test_two_users_stream_at_once(alice, bob, server):
    """No per-event limit: both users' requests are in the engine together (batched)."""
    engine = server.app.state.chat.engine.engine
    args = ("assistant", 0, 1, 24, -1, 1)
    ja = alice.submit(LONG_PROMPT, *args, api_name="/send")
    jb = bob.submit(LONG_PROMPT, *args, api_name="/send")
    most = 0
    deadline = time.monotonic() + 60
    while not (ja.done() and jb.done()):
        most = max(most, len(engine.requests))
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert most == 2
    assert "tokens" in texts(ja.result()[1])[-1] and "tokens" in texts(jb.result()[1])[-1]


def test_rename_and_delete(alice, server):
    out = send(alice, "to be renamed")
    conv = out[3]["value"]
    listed = alice.predict("Renamed chat", api_name="/rename")
    assert ["Renamed chat", conv] in [list(c) for c in listed["choices"]]
    out = alice.predict("assistant", api_name="/delete")  # -> chatbot, label, list, persona, title
    assert texts(out[0]["value"] if isinstance(out[0], dict) else out[0]) == []
    assert conv not in [c[1] for c in out[2]["choices"]]
    with pytest.raises(Exception):
        server.app.state.chat.store.get_conversation("alice", conv)


def test_a_loopback_server_answers_only_its_own_host_names(server, tmp_path):
    """DNS rebinding: a page whose name the attacker points at 127.0.0.1 sends its own name as Host
    (and Origin): a server bound to loopback refuses it; its own names and a trusted origin's pass."""
    import httpx

    from chatengine.app.server import loopback_hosts

    assert loopback_hosts("0.0.0.0", None) is None  # bound elsewhere: the operator names the hosts
    hosts = loopback_hosts("127.0.0.1", ["https://chat.example.org"])
    app = create_app(data_dir=tmp_path, engine=server.app.state.chat.engine, allowed_hosts=hosts)
    with ServerThread(app) as local:
        port = local.url.rsplit(":", 1)[1]
        for host, status in (("evil.example", 400), ("localhost", 200), ("127.0.0.1", 200), ("chat.example.org", 200)):
            r = httpx.get(local.url + "/health", headers={"host": f"{host}:{port}"})
            assert r.status_code == status, host
    close_app(app)


def test_local_mode_without_login(server, tmp_path):
    """Without a users file: one local user and no login page (the engine is shared here)."""
    engine = server.app.state.chat.engine
    app = create_app(data_dir=tmp_path, engine=engine)
    with ServerThread(app) as local:
        c = Client(local.url, verbose=False, analytics_enabled=False)
        try:
            out = send(c, "hello")
            assert "tokens" in texts(out[1])[-1]
            convs = app.state.chat.store.list_conversations("local")
            assert [x["id"] for x in convs] == [out[3]["value"]]
        finally:
            c.close()
    close_app(app)  # closes its store; the shared engine stays up
    assert not engine._stopped


def _signed_in(server, user: str):
    import httpx

    http = httpx.Client(base_url=server.url, timeout=30)
    assert http.post("/login", data={"username": user, "password": f"pw-{user}"}).status_code == 200
    return http


def test_a_session_belongs_to_its_user(alice, server):
    """Bob, signed in, cannot read or steer Alice's tab by its session hash; nobody unsigned can
    cancel or keep it alive; Alice's own routes still work."""
    import httpx

    send(alice, "Hello")  # binds alice's session hash to alice
    h = alice.session_hash
    bob_http, alice_http = _signed_in(server, "bob"), _signed_in(server, "alice")
    try:
        r = bob_http.get("/gradio_api/queue/data", params={"session_hash": h})
        assert r.status_code == 403 and "another sign-in" in r.text
        r = bob_http.post("/gradio_api/queue/join", json={"data": ["hi"], "fn_index": 0, "session_hash": h})
        assert r.status_code == 403
        r = bob_http.post("/gradio_api/cancel", json={"session_hash": h, "fn_index": 0, "event_id": "x"})
        assert r.status_code == 403
        with bob_http.stream("GET", f"/gradio_api/heartbeat/{h}") as r:
            assert r.status_code == 403
        r = bob_http.get("/gradio_api/deep_link", params={"session_hash": h})
        assert r.status_code == 403
        cancel = {"session_hash": h, "fn_index": 0, "event_id": "x"}
        assert httpx.post(f"{server.url}/gradio_api/cancel", json=cancel).status_code == 401
        assert httpx.get(f"{server.url}/gradio_api/heartbeat/{h}").status_code == 401
        assert bob_http.post("/gradio_api/call/send", json={"data": []}).status_code == 404
        with alice_http.stream("GET", f"/gradio_api/heartbeat/{h}") as r:
            assert r.status_code == 200  # the owner's own tab stays alive
    finally:
        bob_http.close()
        alice_http.close()
    assert texts(send(alice, "Hello again")[1])[-2] == "Hello again"  # alice's session still serves alice


def test_a_message_too_large_for_the_model_is_refused_unread(server):
    """A 4 MB UI event is answered 413 after the cap's worth of bytes, in words the page shows;
    nothing reaches Gradio's JSON parser or the tokenizer."""
    http = _signed_in(server, "bob")
    try:
        body = {"data": ["x" * 4_000_000], "fn_index": 0, "session_hash": "bobs-tab"}
        r = http.post("/gradio_api/queue/join", json=body)
        assert r.status_code == 413 and "This message is too long" in r.json()["detail"]
    finally:
        http.close()


def test_the_api_is_rate_limited_per_user_when_users_sign_in(server):
    """One API key cannot flood the server: 120 requests a minute by default (--api-rate-limit)."""
    limiter = server.app.state.api.access.limiter
    assert limiter is not None and limiter.per_minute == 120


def test_a_sign_in_outlives_a_restart_and_logout_ends_it(server, tmp_path):
    """The session cookie works on a new server over the same data dir; after Log out it opens
    nothing (the app, the export route, Gradio's config) on that server or the next. Another
    site's page can neither sign in, nor post UI events, nor log out."""
    import httpx

    engine = server.app.state.chat.engine
    users_file = tmp_path / "users.json"
    users_file.write_text(json.dumps(USERS))

    def serve():
        return ServerThread(create_app(data_dir=tmp_path, users_file=users_file, engine=engine))

    with serve() as first:
        http = httpx.Client(base_url=first.url, timeout=30)
        evil = {"origin": "https://evil.example"}  # another site's page posting the attacker's sign-in
        assert http.post("/login", data={"username": "alice", "password": "pw-alice"}, headers=evil).status_code == 403
        assert "chatengine-session" not in http.cookies
        assert http.post("/login", data={"username": "alice", "password": "wrong"}).status_code == 400
        assert http.post("/login", data={"username": "alice", "password": "pw-alice"}).status_code == 200
        cookie = http.cookies["chatengine-session"]
        conv = first.app.state.chat.store.create_conversation("alice", title="kept")
    close_app(first.app)
    with serve() as second:
        jar = {"chatengine-session": cookie}
        again = httpx.Client(base_url=second.url, timeout=30, cookies=jar)
        assert 'id="signin"' not in again.get("/").text and again.get("/config").status_code == 200
        assert again.get(f"/export/{conv}.md").text.startswith("# kept")
        assert again.get("/logout").status_code == 200  # a page with the button: a GET signs no one out
        assert again.get(f"/export/{conv}.md").status_code == 200
        body = {"data": [], "fn_index": 0, "session_hash": "alices-tab"}
        assert again.post("/gradio_api/queue/join", json=body, headers=evil).status_code == 403
        assert again.post("/logout", headers=evil).status_code == 403
        assert again.post("/logout", follow_redirects=False).status_code == 303
        stale = httpx.Client(base_url=second.url, timeout=30, cookies=jar)  # the old cookie, kept by an attacker
        assert 'id="signin"' in stale.get("/").text
        assert stale.get(f"/export/{conv}.md").status_code == 401
        assert stale.get("/config").status_code == 401
    close_app(second.app)
