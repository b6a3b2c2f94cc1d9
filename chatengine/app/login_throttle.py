"""Password guessing costs time: failed sign-ins are counted per username and client address
together, per address, and per username from every address, and past a limit the sign-in route
answers 429 with Retry-After before any password is checked.

Failing someone's sign-ins on purpose stops the guesser, not her: the tight limit is per name and
address. The per-username limit, against guessers with many addresses, is loose, and exempts the
addresses the user has signed in from since the server started (the newest 16). An IPv6 address
counts as its /64, which one host holds whole.

A pure ASGI middleware in front of Gradio's POST /login: it reads the form's username (replaying the
body to Gradio unchanged), refuses a throttled username or address, and records the outcome from
the response status (200: signed in, which clears that username's failures; 400: a failure). An
address gets one check at a time (429 while its previous attempt is being checked).
"""

import ipaddress
import math
import time
from collections import deque

PER_PAIR = (5, 300.0)  # failures allowed per window (s) for one username from one client address
PER_ADDRESS = (20, 300.0)  # ... from one client address, whatever names it tries
PER_USERNAME = (50, 300.0)  # ... for one username from every address but those it signed in from
KNOWN_PER_USER = 16  # addresses remembered per username (the newest), in memory
MAX_FORM_BYTES = 16 * 1024  # a sign-in form is a name and a password


class LoginThrottle:
    def __init__(self, per_username=PER_USERNAME, per_address=PER_ADDRESS, per_pair=PER_PAIR, clock=time.monotonic):
        self.limits = {"user": per_username, "addr": per_address, "pair": per_pair}
        self.clock = clock
        self.failures: dict[tuple[str, str], deque] = {}
        self.known: dict[str, list[str]] = {}  # username -> addresses it signed in from
        self._pruned_at = 0  # the failure table's size after its last pruning
        # addresses whose sign-in is being checked now: password hashing runs one at a time, so
        # without this one address could queue guesses ahead of everyone else's sign-in
        self.checking: set[str] = set()

    def _window(self, kind: str, key: str) -> deque:
        limit, window = self.limits[kind]
        q = self.failures.setdefault((kind, key), deque())
        now = self.clock()
        while q and now - q[0] >= window:
            q.popleft()
        return q

    def _keys(self, username: str, address: str) -> list[tuple[str, str]]:
        address = _network(address)
        keys = [("pair", f"{username}\0{address}"), ("addr", address)]
        if address not in self.known.get(username, ()):
            keys.append(("user", username))
        return keys

    def retry_after(self, username: str, address: str) -> int:
        """Seconds until a sign-in may be tried again (0: now)."""
        wait = 0.0
        for kind, key in self._keys(username, address):
            limit, window = self.limits[kind]
            q = self._window(kind, key)
            if len(q) >= limit:
                wait = max(wait, window - (self.clock() - q[-limit]))
        return math.ceil(wait)

    def failed(self, username: str, address: str) -> None:
        address = _network(address)
        for kind, key in (("pair", f"{username}\0{address}"), ("addr", address), ("user", username)):
            self._window(kind, key).append(self.clock())
        if len(self.failures) > max(100_000, 2 * self._pruned_at):  # a flood of names: forget old ones
            oldest = self.clock() - max(window for _, window in self.limits.values())
            self.failures = {k: q for k, q in self.failures.items() if q and q[-1] > oldest}
            self._pruned_at = len(self.failures)

    def succeeded(self, username: str, address: str) -> None:
        """Her address is known from now on. The username's own count stays: a guesser with many
        addresses must not get a fresh allowance each time she signs in."""
        address = _network(address)
        self.failures.pop(("pair", f"{username}\0{address}"), None)
        known = [a for a in self.known.pop(username, []) if a != address] + [address]
        self.known[username] = known[-KNOWN_PER_USER:]
        if len(self.known) > 100_000:  # bounded: the oldest sign-ins' users go first
            del self.known[next(iter(self.known))]


class LoginThrottleMiddleware:
    def __init__(self, app, throttle: LoginThrottle, path: str = "/login"):
        self.app, self.throttle, self.path = app, throttle, path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != self.path:
            return await self.app(scope, receive, send)
        body, messages = b"", []
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if len(body) > MAX_FORM_BYTES:
                return await _answer(send, 413, b'{"detail": "sign-in form too large"}')
            if not message.get("more_body"):
                break
        username = await _username_of(scope, messages)
        address = (scope.get("client") or ("?", 0))[0]
        wait = self.throttle.retry_after(username, address)
        if wait > 0:
            detail = f'{{"detail": "Too many failed sign-ins: try again in {wait} s."}}'.encode()
            return await _answer(send, 429, detail, [(b"retry-after", str(wait).encode())])
        if address in self.throttle.checking:  # one check per address at a time: no queue of guesses
            detail = b'{"detail": "A sign-in from this address is still being checked: try again in a moment."}'
            return await _answer(send, 429, detail, [(b"retry-after", b"1")])
        replay = iter(messages)

        async def receive_again():
            return next(replay, {"type": "http.disconnect"})

        async def watch(message):
            if message["type"] == "http.response.start":
                if message["status"] == 200:
                    self.throttle.succeeded(username, address)
                elif message["status"] == 400:
                    self.throttle.failed(username, address)
            await send(message)

        self.throttle.checking.add(address)
        try:
            await self.app(scope, receive_again, watch)
        finally:
            self.throttle.checking.discard(address)


def _network(address: str) -> str:
    """What one client holds: an IPv4 address, or an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


async def _username_of(scope, messages: list[dict]) -> str:
    """The form's username, urlencoded or multipart (Gradio's own sign-in page sends multipart):
    the same name must count the same failures whichever way it is sent."""
    from starlette.requests import Request

    replay = iter(messages)

    async def receive():
        return next(replay, {"type": "http.request", "body": b"", "more_body": False})

    try:
        form = await Request(scope, receive).form(max_files=0, max_fields=16)
        name = form.get("username")
    except Exception:  # a malformed form: Gradio refuses it; count it under the address only
        return ""
    return name.strip() if isinstance(name, str) else ""


async def _answer(send, status: int, body: bytes, headers=()) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]}
    )
    await send({"type": "http.response.body", "body": body})
