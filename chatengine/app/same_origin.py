"""Requests that change something come from this server's own pages, not from another site's.

A page of another site can make the browser send a form POST here: to /login with the attacker's
name and password (login CSRF: the victim then chats, and types, inside the attacker's account), to
/logout, or to Gradio's event routes. SameSite=Lax keeps the session cookie off cross-site POSTs,
but login needs no cookie, and a page of another port of the same host is "same-site". So every
request of an unsafe method (POST, PUT, ...) outside the API is refused (403) unless it says it
comes from this server:

- ``Origin``, or ``Referer`` when there is no Origin, names the host the request was sent to (its
  Host header), or one of the operator's ``trusted_origins`` (a proxy that rewrites Host);
  ``Origin: null`` (a sandboxed or no-referrer page) is foreign;
- with neither header, a browser's ``Sec-Fetch-Site`` (which pages cannot set) must not say
  cross-site or same-site; a client that is no browser (curl, gradio_client) sends none of the three
  and passes: it is no CSRF vector, it holds its own credentials.

The API (/v1, /health) is left alone: it takes API keys in a header, never cookies, and CORS
(cors.py) decides which pages may call it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from chatengine.app.api.cors import API_PREFIXES

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}
REFUSED = "Refused: this request came from another site's page. Open this server's own page and try again."


def _host_port(netloc: str, scheme: str) -> str | None:
    """`host:port` in lower case with the scheme's default port written out (None: unparseable)."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    host = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets
    return f"{host}:{port or DEFAULT_PORTS.get(scheme, 0)}"


def normalize_origin(origin: str) -> str | None:
    """`scheme://host:port` of an origin or URL, lower case, default port written (None: not http(s))."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.netloc:
        return None
    where = _host_port(parts.netloc, scheme)
    return f"{scheme}://{where}" if where else None


def check_trusted_origins(origins: Iterable[str]) -> frozenset[str]:
    """The operator's origins, normalized; ValueError names one that is not `https://host[:port]`."""
    out = set()
    for origin in origins:
        normal = normalize_origin(origin) if isinstance(origin, str) else None
        parts = urlsplit(origin) if normal else None
        if normal is None or parts is None or parts.path.strip("/") or parts.query or parts.fragment:
            raise ValueError(
                f"a trusted origin looks like https://chat.example.org or http://host:7860, got {origin!r}"
            )
        out.add(normal)
    return frozenset(out)


def refusal(headers: dict[str, str], trusted: frozenset[str] = frozenset()) -> str | None:
    """Why a state-changing request with these (lower-case) headers is refused, or None: it is ours."""
    source = headers.get("origin")
    if source is None:
        source = headers.get("referer")
    if source is None:
        # no Origin and no Referer: a browser still says where the request came from
        return REFUSED if headers.get("sec-fetch-site") in ("cross-site", "same-site") else None
    origin = normalize_origin(source)  # "null" and garbage are None: foreign
    if origin is None:
        return REFUSED
    if origin in trusted:
        return None
    scheme = origin.partition("://")[0]
    # the scheme is not compared: behind a TLS proxy the app sees http while the page is https
    own = _host_port(headers.get("host", ""), scheme)
    return None if own is not None and origin == f"{scheme}://{own}" else REFUSED


class SameOriginMiddleware:
    """403 for an unsafe request outside the API that another site's page sent (see refusal)."""

    def __init__(self, app, trusted_origins: Iterable[str] = ()):
        self.app = app
        self.trusted = check_trusted_origins(trusted_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS or scope.get("path", "").startswith(API_PREFIXES):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        why = refusal(headers, self.trusted)
        if why is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"detail": why}).encode()
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
