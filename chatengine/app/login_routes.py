"""POST /login and GET /logout, ours rather than Gradio's: Gradio keeps sign-ins in a dict of the
process (every restart logged everyone out) under a cookie name it draws anew at each start. These
keep them in the store through LoginSessions (sessions.py), and Gradio asks us who is signed in
(its ``auth_dependency``).

The answers are those the sign-in page (login_page.py) and the throttle (login_throttle.py) read:
200 signed in, 400 wrong name or password.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from chatengine.app.sessions import COOKIE, LoginSessions

MAX_FIELD_CHARS = 1024  # a name or a password longer than this is no sign-in


def add_login_routes(
    app: FastAPI, sessions: LoginSessions, check: Callable[[str, str], Awaitable[bool]]
) -> Callable[[Request], str | None]:
    """Add the routes to ``app`` (before Gradio is mounted, so they come first); returns Gradio's
    auth_dependency: request -> the signed-in user or None."""

    async def login(request: Request) -> Response:
        form = await request.form()
        username, password = str(form.get("username") or "").strip(), str(form.get("password") or "")
        too_long = len(username) > MAX_FIELD_CHARS or len(password) > MAX_FIELD_CHARS
        if too_long or not username or not await check(username, password):
            return JSONResponse({"detail": "Incorrect credentials."}, status_code=400)
        cookie = await run_in_threadpool(sessions.create, username)
        response = JSONResponse({"success": True})
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=int(sessions.ttl_s),
            path="/",
            httponly=True,  # page scripts never see it
            samesite="lax",  # other sites' pages cannot post with it
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(request: Request) -> Response:
        await run_in_threadpool(sessions.revoke, request.cookies.get(COOKIE))
        response = RedirectResponse(url="./", status_code=302)  # relative: right under a path prefix too
        response.delete_cookie(COOKIE, path="/")
        return response

    for path in ("/login", "/login/"):
        app.add_api_route(path, login, methods=["POST"], include_in_schema=False)
    app.add_api_route("/logout", logout, methods=["GET"], include_in_schema=False)
    return lambda request: sessions.user_of(request.cookies.get(COOKIE))
