"""CORS for browser clients of the API (`serve --cors-origins`): off by default.

Only the API's paths (/v1/..., /health) answer cross-origin requests, with Starlette's CORSMiddleware:
the listed origins ("*" for any), any request header (Authorization, Content-Type, the OpenAI SDK's
x-stainless-*), and no credentials: a page on another origin may call the API with an API key but
never reads anything with the user's UI session cookie.
"""

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

API_PREFIXES = ("/v1/", "/health")


def check_origins(origins) -> list[str]:
    """The origins as given ("https://example.org", or "*"), or ValueError naming a bad one."""
    if isinstance(origins, str) or not all(isinstance(o, str) and o for o in origins):
        raise ValueError("cors_origins must be a list of origins such as https://example.org (or '*')")
    for origin in origins:
        if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.rstrip("/") != origin):
            raise ValueError(f"a CORS origin looks like https://example.org or http://localhost:3000, got {origin!r}")
    return list(origins)


class APICORSMiddleware:
    """CORSMiddleware for the API's paths only; everything else passes by untouched."""

    def __init__(self, app: ASGIApp, origins: list[str]):
        self.app = app
        self.cors = CORSMiddleware(
            app,
            allow_origins=check_origins(origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Chatengine-Tools"],  # tools ignored (tools.py): readable by the page
            allow_credentials=False,
            max_age=600,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(API_PREFIXES):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
