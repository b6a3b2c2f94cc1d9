"""POST /login and POST /logout, ours rather than Gradio's: Gradio keeps sign-ins in a dict of the
process (every restart logged everyone out) under a cookie name it draws anew at each start. These
keep them in the store through LoginSessions (sessions.py), and Gradio asks us who is signed in
(its ``auth_dependency``).

The answers are those the sign-in page (login_page.py) and the throttle (login_throttle.py) read:
200 signed in, 400 wrong name or password; 403 (same_origin.py, in front of these routes) for a
POST that another site's page sent. Logging out is a POST too: a GET any page can make (an <img>)
would sign the user out; GET /logout answers a page with the button that posts.

The cookie is Secure when the request came over https, which behind a TLS-terminating proxy it
seems not to (unless uvicorn trusts the proxy's forwarded headers): ``secure`` (serve
--secure-cookies) makes it Secure always.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from chatengine.app.sessions import COOKIE, LoginSessions

MAX_FIELD_CHARS = 1024  # a name or a password longer than this is no sign-in

LOGOUT_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Log out</title></head>
<body style="font-family: system-ui, sans-serif; display: grid; place-items: center; min-height: 90vh">
<form method="post" action="logout"><p>Log out of this browser?</p><button type="submit">Log out</button>
<a href="./">Back to the chats</a></form></body></html>
"""


def add_login_routes(
    app: FastAPI,
    sessions: LoginSessions,
    check: Callable[[str, str], Awaitable[bool]],
    *,
    secure: bool = False,
) -> Callable[[Request], str | None]:
    """Add the routes to ``app`` (before Gradio is mounted, so they come first); returns Gradio's
    auth_dependency: request -> the signed-in user or None. ``secure``: the cookie is Secure even
    when the request seems to be plain http (a TLS proxy in front)."""

    def cookie_flags(request: Request) -> dict:
        return dict(
            path="/",
            httponly=True,  # page scripts never see it
            samesite="lax",  # other sites' pages cannot post with it
            secure=secure or request.url.scheme == "https",
        )

    async def login(request: Request) -> Response:
        form = await request.form()
        username, password = str(form.get("username") or "").strip(), str(form.get("password") or "")
        too_long = len(username) > MAX_FIELD_CHARS or len(password) > MAX_FIELD_CHARS
        if too_long or not username or not await check(username, password):
            return JSONResponse({"detail": "Incorrect credentials."}, status_code=400)
        # a sign-in replaces this browser's previous one: that cookie must not live on elsewhere
        await run_in_threadpool(sessions.revoke, request.cookies.get(COOKIE))
        cookie = await run_in_threadpool(sessions.create, username)
        response = JSONResponse({"success": True})
        response.set_cookie(COOKIE, cookie, max_age=int(sessions.ttl_s), **cookie_flags(request))
        return response

    async def logout(request: Request) -> Response:
        await run_in_threadpool(sessions.revoke, request.cookies.get(COOKIE))
        # 303: the browser follows with a GET; relative: right under a path prefix too
        response = RedirectResponse(url="./", status_code=303)
        response.delete_cookie(COOKIE, **cookie_flags(request))
        return response

    async def logout_page(request: Request) -> Response:
        return HTMLResponse(LOGOUT_PAGE, headers={"cache-control": "no-store"})

    for path in ("/login", "/login/"):
        app.add_api_route(path, login, methods=["POST"], include_in_schema=False)
    app.add_api_route("/logout", logout, methods=["POST"], include_in_schema=False)
    # not Gradio's GET /logout (behind ours), which would leave our session signed in
    app.add_api_route("/logout", logout_page, methods=["GET"], include_in_schema=False)
    return lambda request: sessions.user_of(request.cookies.get(COOKIE))
