"""Sign-in and logout routes as the server wires them: another site's page can neither sign a
browser in (login CSRF) nor out (logout is a POST, same origin only); the cookie is Secure when
the operator says TLS ends at a proxy."""

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from chatengine.app.login_routes import add_login_routes
from chatengine.app.same_origin import SameOriginMiddleware, check_trusted_origins, normalize_origin, refusal
from chatengine.app.server import build_parser, uvicorn_proxy_options
from chatengine.app.sessions import COOKIE, LoginSessions

EVIL = {"origin": "https://evil.example"}
OURS = {"origin": "http://testserver"}  # TestClient's host
FORM = {"username": "alice", "password": "pw"}


def make_app(store, *, secure=False, trusted=()):
    app = FastAPI()
    sessions = LoginSessions(store, b"k" * 32)
    checked = []

    async def check(username, password):
        checked.append(username)
        return (username, password) == ("alice", "pw")

    user_of = add_login_routes(app, sessions, check, secure=secure)

    @app.get("/who")
    async def who(request: Request):
        return {"user": user_of(request)}

    @app.post("/v1/echo")
    async def api():
        return {"ok": True}

    app.add_middleware(SameOriginMiddleware, trusted_origins=trusted)
    return app, checked


def who(client) -> str | None:
    return client.get("/who").json()["user"]


@pytest.mark.parametrize(
    "headers",
    [
        EVIL,
        {"origin": "null"},  # a sandboxed page, or one that hides its address
        {"referer": "https://evil.example/page.html"},  # no Origin: the Referer speaks
        {"sec-fetch-site": "cross-site"},  # a browser that sent neither
        {"sec-fetch-site": "same-site"},  # another port or subdomain of this site
        {"origin": "http://testserver.evil.example"},
        {"origin": "http://testserver:8080"},  # another port of this host is another origin
    ],
)
def test_a_sign_in_from_another_sites_page_is_refused_before_the_password_check(store, headers):
    app, checked = make_app(store)
    with TestClient(app) as client:
        r = client.post("/login", data=FORM, headers=headers)
        assert r.status_code == 403 and "another site" in r.json()["detail"]
        assert COOKIE not in r.cookies and checked == [] and who(client) is None


@pytest.mark.parametrize(
    "headers",
    [
        OURS,
        {"origin": "https://testserver"},  # TLS ended at a proxy: the app sees http
        {"referer": "http://testserver/?c=abc"},
        {"sec-fetch-site": "same-origin"},
        {},  # not a browser (curl, gradio_client): no CSRF, its own credentials
    ],
)
def test_a_sign_in_from_this_servers_page_or_a_program_works(store, headers):
    app, _ = make_app(store)
    with TestClient(app) as client:
        assert client.post("/login", data=FORM, headers=headers).status_code == 200
        assert who(client) == "alice"


def test_a_trusted_origin_signs_in_and_others_do_not(store):
    app, _ = make_app(store, trusted=["https://chat.example.org"])
    with TestClient(app) as client:
        assert client.post("/login", data=FORM, headers={"origin": "https://chat.example.org"}).status_code == 200
        assert client.post("/login", data=FORM, headers={"origin": "http://chat.example.org"}).status_code == 403


def test_logout_is_a_same_origin_post_and_get_only_offers_the_button(store):
    app, _ = make_app(store)
    with TestClient(app) as client:
        client.post("/login", data=FORM, headers=OURS)
        page = client.get("/logout")  # an <img src=/logout> of any page
        assert page.status_code == 200 and '<form method="post" action="logout">' in page.text
        assert who(client) == "alice"
        assert client.post("/logout", headers=EVIL).status_code == 403
        assert who(client) == "alice"
        r = client.post("/logout", headers=OURS, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "./"
        assert who(client) is None


def test_the_api_is_not_the_middlewares_business(store):
    app, _ = make_app(store)
    with TestClient(app) as client:  # API keys in a header, never cookies: CORS decides there
        assert client.post("/v1/echo", headers=EVIL).status_code == 200


def test_a_new_sign_in_ends_the_browsers_previous_one(store):
    app, _ = make_app(store)
    with TestClient(app) as client:
        client.post("/login", data=FORM, headers=OURS)
        old = client.cookies[COOKIE]
        client.post("/login", data=FORM, headers=OURS)
        assert client.cookies[COOKIE] != old and who(client) == "alice"
    with TestClient(app, cookies={COOKIE: old}) as kept:  # the replaced cookie, kept by someone
        assert who(kept) is None


@pytest.mark.parametrize(
    "secure, base, expected", [(False, "http", False), (True, "http", True), (False, "https", True)]
)
def test_the_cookie_is_secure_over_https_or_when_the_operator_says_so(store, secure, base, expected):
    app, _ = make_app(store, secure=secure)
    with TestClient(app, base_url=f"{base}://testserver") as client:
        r = client.post("/login", data=FORM, headers={"origin": f"{base}://testserver"})
        flags = r.headers["set-cookie"].lower()
        assert "httponly" in flags and "samesite=lax" in flags
        assert ("secure" in flags.split("; ")) is expected
        out = client.post("/logout", headers={"origin": f"{base}://testserver"}, follow_redirects=False)
        assert ("secure" in out.headers["set-cookie"].lower().split("; ")) is expected


def test_origins_are_compared_by_scheme_host_and_port():
    assert normalize_origin("HTTPS://Chat.Example.org") == "https://chat.example.org:443"
    assert normalize_origin("http://[::1]:7860/x") == "http://[::1]:7860"
    assert normalize_origin("null") is None and normalize_origin("file:///etc") is None
    assert refusal({"origin": "http://localhost:7860", "host": "localhost:7860"}) is None
    assert refusal({"origin": "http://localhost", "host": "localhost:80"}) is None
    assert refusal({"origin": "http://localhost:7860"}) is not None  # no Host: nothing to match
    with pytest.raises(ValueError, match="trusted origin"):
        check_trusted_origins(["chat.example.org"])
    with pytest.raises(ValueError, match="trusted origin"):
        check_trusted_origins(["https://chat.example.org/app"])


def test_serve_flags_for_a_tls_proxy():
    args = build_parser().parse_args(
        ["--secure-cookies", "--forwarded-allow-ips", "10.0.0.2", "--trusted-origins", "https://chat.example.org"]
    )
    assert args.secure_cookies and args.trusted_origins == ["https://chat.example.org"]
    assert uvicorn_proxy_options(args.forwarded_allow_ips) == {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.2"}
    assert uvicorn_proxy_options(None) == {}  # uvicorn's own default (127.0.0.1)
    assert not build_parser().parse_args([]).secure_cookies
