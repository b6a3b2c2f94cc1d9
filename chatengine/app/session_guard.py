"""A Gradio session belongs to the user who opened it.

Gradio keys a tab's queue, its streamed replies and its server-side state by a `session_hash` the
browser makes up. Its routes check only that *some* user is signed in (cancel and heartbeat not
even that), so user B who learns A's hash could read A's stream or act on A's state. This
middleware binds each hash to the first signed-in user that uses it and refuses it (403) under any
other name, and refuses it (401) with no sign-in at all. The `call` routes (Gradio's REST-style
API, which looks events up by id alone) are closed: the app's API is /v1.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

PREFIX = "/gradio_api/"
CLOSED = ("call/", "call/v2/")
MAX_BODY_BYTES = 8 << 20  # a UI event's JSON (the server passes a cap fitted to the model's context)
MAX_SESSIONS = 200_000  # oldest bindings go first (Gradio drops a closed session's state within the hour)


class SessionOwners:
    """session hash -> the username that first used it (bounded, oldest dropped first)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.owner: OrderedDict[str, str] = OrderedDict()
        self.max_sessions = max_sessions

    def admit(self, session_hash: str, user: str) -> bool:
        owner = self.owner.setdefault(session_hash, user)
        self.owner.move_to_end(session_hash)
        while len(self.owner) > self.max_sessions:
            self.owner.popitem(last=False)
        return owner == user


def session_in_path(path: str) -> str | None:
    """The hash that a route carries in its path: heartbeat/<hash>, stream/<hash>/<run>/..."""
    parts = path.removeprefix(PREFIX).split("/")
    if parts[0] == "heartbeat" and len(parts) >= 2:
        return parts[1]
    if parts[0] == "stream" and len(parts) >= 4:
        return parts[1]
    return None


def session_in_body(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None  # Gradio answers a malformed body itself
    found = value.get("session_hash") if isinstance(value, dict) else None
    return found if isinstance(found, str) else None


def cookies_of(scope) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    for name, value in scope.get("headers", ()):
        if name == b"cookie":
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # a malformed cookie header is no sign-in
                return {}
    return {k: m.value for k, m in jar.items()}


class SessionOwnerMiddleware:
    """`user_of(cookies)` names the signed-in user (None: nobody)."""

    def __init__(
        self,
        app,
        user_of: Callable[[dict[str, str]], str | None],
        owners: SessionOwners | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        too_large: str = "request too large",
    ):
        """Bodies past `max_body_bytes` get 413 with `too_large` (Gradio's page shows that text) as
        soon as that many bytes came: a 4 MB message is neither read whole nor parsed."""
        self.app, self.user_of = app, user_of
        self.owners = owners or SessionOwners()
        self.max_body_bytes, self.too_large = max_body_bytes, too_large

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(PREFIX):
            return await self.app(scope, receive, send)
        if path.removeprefix(PREFIX).startswith(CLOSED):
            return await _answer(send, 404, "not here: the API is at /v1")
        hashes = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [])
        hashes += [h for h in [session_in_path(path)] if h]
        if scope["method"] == "POST":
            body, receive = await _buffer(receive, self.max_body_bytes)
            if body is None:
                return await _answer(send, 413, self.too_large)
            hashes += [h for h in [session_in_body(body)] if h]
        if hashes:
            user = self.user_of(cookies_of(scope))
            if user is None:
                return await _answer(send, 401, "sign in first")
            if not all(self.owners.admit(h, user) for h in hashes):
                return await _answer(send, 403, "this session belongs to another sign-in; reload the page")
        await self.app(scope, receive, send)


async def _buffer(receive, limit: int):
    """(the whole body, a receive that replays it and then waits as the original does), or (None, _)
    past `limit` bytes."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if size > limit:
            return None, receive
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    replay = iter(messages)

    async def receive_again():
        message = next(replay, None)
        return message if message is not None else await receive()

    return b"".join(m.get("body", b"") for m in messages), receive_again


async def _answer(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
