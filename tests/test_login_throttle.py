"""Password guessing is throttled per username and address, per address and per username (429 +
Retry-After before any password is checked), nobody can lock a user out from her own addresses, and
an unknown username costs the same hashing work as a known one."""

import hashlib

from fastapi import FastAPI, Form
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from chatengine.app import auth
from chatengine.app.login_throttle import LoginThrottle, LoginThrottleMiddleware


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_failures_per_username_and_address_per_address_and_per_username():
    clock = Clock()
    t = LoginThrottle(per_username=(6, 60.0), per_address=(5, 60.0), per_pair=(3, 60.0), clock=clock)
    for _ in range(3):
        assert t.retry_after("alice", "1.1.1.1") == 0
        t.failed("alice", "1.1.1.1")
    assert t.retry_after("alice", "1.1.1.1") == 60  # this name from this address
    assert t.retry_after("alice", "2.2.2.2") == 0  # the guesser's failures do not lock her out
    assert t.retry_after("bob", "3.3.3.3") == 0
    t.failed("bob", "1.1.1.1")
    t.failed("carol", "1.1.1.1")
    assert t.retry_after("dave", "1.1.1.1") == 60  # this address tried 5 times, whatever the names
    for address in ("5.5.5.5", "6.6.6.6", "7.7.7.7"):  # a guesser with many addresses
        t.failed("alice", address)
    assert t.retry_after("alice", "8.8.8.8") == 60  # 6 failures for the name from every address
    clock.now += 30
    assert t.retry_after("alice", "8.8.8.8") == 30
    clock.now += 31
    assert t.retry_after("alice", "8.8.8.8") == 0 and t.retry_after("dave", "1.1.1.1") == 0
    t.failed("erin", "4.4.4.4")
    t.succeeded("erin", "4.4.4.4")
    assert ("pair", "erin\0" + "4.4.4.4") not in t.failures


def test_no_one_locks_a_user_out_of_an_address_she_signed_in_from():
    clock = Clock()
    t = LoginThrottle(per_username=(6, 60.0), per_address=(50, 60.0), per_pair=(3, 60.0), clock=clock)
    t.succeeded("alice", "9.9.9.9")
    for i in range(20):  # failures for her name from 10 addresses
        t.failed("alice", f"1.1.1.{i % 10}")
    assert t.retry_after("alice", "9.9.9.9") == 0  # her address
    assert t.retry_after("alice", "2.2.2.2") == 60  # a new one waits
    for _ in range(3):  # her own address still has its own tight limit
        t.failed("alice", "9.9.9.9")
    assert t.retry_after("alice", "9.9.9.9") == 60


def test_an_ipv6_host_counts_as_its_64_and_old_failures_are_forgotten():
    clock = Clock()
    t = LoginThrottle(per_username=(50, 60.0), per_address=(5, 60.0), per_pair=(3, 60.0), clock=clock)
    for i in range(3):  # one host, a new address of its /64 each time
        t.failed("alice", f"2001:db8::{i + 1}")
    assert t.retry_after("alice", "2001:db8::99") == 60
    assert t.retry_after("alice", "2001:db8:0:1::1") == 0  # another /64
    t.failures = {("user", f"name{i}"): type(t.failures[("user", "alice")])([clock.now]) for i in range(100_001)}
    clock.now += 61
    t.failed("bob", "1.1.1.1")  # past 100,000 keys: those without a failure in the window go
    assert sorted(t.failures) == [("addr", "1.1.1.1"), ("pair", "bob\0" + "1.1.1.1"), ("user", "bob")]


def login_app(throttle):
    """Gradio's sign-in route in miniature: a form; 200 for the right password, 400 otherwise."""
    app = FastAPI()
    seen = []

    @app.post("/login")
    async def login(username: str = Form(...), password: str = Form(...)):
        seen.append(username)
        if password == "right":
            return JSONResponse({"success": True})
        return JSONResponse({"detail": "Incorrect credentials."}, status_code=400)

    app.add_middleware(LoginThrottleMiddleware, throttle=throttle)
    return app, seen


def test_the_sign_in_route_answers_429_with_retry_after():
    app, seen = login_app(LoginThrottle(per_pair=(3, 300.0), per_address=(50, 300.0)))
    with TestClient(app) as client:
        for _ in range(3):
            assert client.post("/login", data={"username": "alice", "password": "guess"}).status_code == 400
        r = client.post("/login", data={"username": "alice", "password": "right"})
        assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 300
        assert "try again in" in r.json()["detail"]
        assert seen == ["alice"] * 3  # the throttled attempt never reached the password check
        assert client.post("/login", data={"username": "bob", "password": "right"}).status_code == 200
        assert seen[-1] == "bob"  # the form reaches the route unchanged


def test_a_multipart_form_counts_against_the_same_username():
    """Gradio's own sign-in page posts multipart/form-data: its failures count per name too, so
    switching encodings cannot dodge the per-username limit."""
    app, seen = login_app(LoginThrottle(per_pair=(2, 300.0), per_address=(50, 300.0)))
    multipart = lambda name, pw: {"username": (None, name), "password": (None, pw)}  # noqa: E731
    with TestClient(app) as client:
        assert client.post("/login", files=multipart("alice", "guess")).status_code == 400
        assert client.post("/login", data={"username": "alice", "password": "guess"}).status_code == 400
        assert client.post("/login", files=multipart("alice", "right")).status_code == 429
        assert client.post("/login", files=multipart("bob", "right")).status_code == 200
        assert seen == ["alice", "alice", "bob"]


def test_an_unknown_user_costs_a_known_users_hashing(monkeypatch):
    users = {"alice": {"password": auth.hash_password("pw", iterations=1234)}}
    calls = []
    real = hashlib.pbkdf2_hmac

    def spy(name, password, salt, iterations, *args, **kwargs):
        calls.append(iterations)
        return real(name, password, salt, iterations, *args, **kwargs)

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", spy)
    assert not auth.verify_password(users, "alice", "wrong")
    assert not auth.verify_password(users, "nobody", "wrong")
    assert calls == [1234, 1234]


def test_password_hashing_runs_at_low_cpu_priority(monkeypatch):
    """Guesses that pass the throttle still cost PBKDF2; it runs one at a time on a nice-10 thread,
    so it takes CPU only when the engine leaves some."""
    import asyncio
    import os
    import threading

    from chatengine.app import server

    seen = []

    class Accounts:  # the user directory's check, recording where it runs
        def verify_password(self, name, password):
            seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.get_ident()))
            return name == "alice"

    check = server._login_check(Accounts())

    async def go():
        return await asyncio.gather(*(check(n, "pw") for n in ("alice", "eve", "bob")))

    assert asyncio.run(go()) == [True, False, False]
    assert {nice for nice, _ in seen} == {10} and len({t for _, t in seen}) == 1  # one thread, nice 10


def test_one_check_at_a_time_per_address():
    """A second attempt from an address whose first is still being checked gets 429 at once, so one
    address cannot queue guesses ahead of other people's sign-ins; another address goes through."""
    import asyncio

    import httpx
    from fastapi import FastAPI, Form
    from fastapi.responses import JSONResponse

    app = FastAPI()
    release = asyncio.Event()

    @app.post("/login")
    async def login(username: str = Form(...), password: str = Form(...)):
        if username == "slow":
            await release.wait()
        return JSONResponse({"detail": "Incorrect credentials."}, status_code=400)

    app.add_middleware(LoginThrottleMiddleware, throttle=LoginThrottle())

    async def go():
        def client(address):
            transport = httpx.ASGITransport(app=app, client=(address, 1234))
            return httpx.AsyncClient(transport=transport, base_url="http://test")

        async with client("10.0.0.1") as a, client("10.0.0.2") as b:
            first = asyncio.create_task(a.post("/login", data={"username": "slow", "password": "x"}))
            await asyncio.sleep(0.05)
            again = await a.post("/login", data={"username": "x", "password": "y"})
            other = await b.post("/login", data={"username": "x", "password": "y"})
            release.set()
            return again, other, await first

    again, other, first = asyncio.run(go())
    assert again.status_code == 429 and "still being checked" in again.json()["detail"]
    assert again.headers["retry-after"] == "1"
    assert other.status_code == 400 and first.status_code == 400
