"""The sign-in page, ours rather than Gradio's: after a wrong password Gradio's page empties both
fields, and when the sign-in throttle answers 429 it shows nothing at all. This one keeps the
name, empties only the password, and says in words what happened (wrong name or password, or how
long to wait). It posts to Gradio's own POST /login, so the session cookie is Gradio's as before.

A middleware: GET / from a browser that is not signed in gets this page; once signed in, / is
Gradio's app as usual.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from chatengine.app.session_guard import cookies_of

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
 body {{font-family: system-ui, sans-serif; background: #f8fafc; margin: 0; display: grid; place-items: center;
       min-height: 100vh; color: #0f172a}}
 form {{background: #fff; border: 1px solid #e2e8f0; border-radius: 12px; padding: 2em; width: min(420px, 90vw);
       box-shadow: 0 1px 3px rgba(0,0,0,.06)}}
 h1 {{font-size: 1.4em; margin: 0 0 .3em}} p {{margin: 0 0 1em; opacity: .8}}
 label {{display: block; font-size: .9em; margin: .8em 0 .3em}}
 input {{width: 100%; box-sizing: border-box; padding: .6em; border: 1px solid #cbd5e1; border-radius: 8px;
        font-size: 1em}}
 button {{margin-top: 1.4em; width: 100%; padding: .7em; border: 0; border-radius: 8px; background: #4f46e5;
         color: #fff; font-size: 1em; cursor: pointer}}
 button:disabled {{opacity: .6}}
 #error {{color: #b91c1c; min-height: 1.2em; margin: .8em 0 0; opacity: 1}}
</style></head>
<body><form id="signin" novalidate>
<h1>{title}</h1><p>{message}</p>
<label for="username">username</label><input id="username" name="username" autocomplete="username" autofocus>
<label for="password">password</label>
<input id="password" name="password" type="password" autocomplete="current-password">
<p id="error" role="alert"></p>
<button id="login" type="submit">Login</button>
</form>
<script>
const form = document.getElementById("signin"), error = document.getElementById("error");
const button = document.getElementById("login"), password = document.getElementById("password");
form.addEventListener("submit", async (event) => {{
  event.preventDefault();
  button.disabled = true;
  error.textContent = "";
  try {{
    const r = await fetch("login", {{method: "POST", body: new URLSearchParams(new FormData(form))}});
    if (r.ok) {{ location.reload(); return; }}
    let detail = "";
    try {{ detail = (await r.json()).detail; }} catch (e) {{}}
    error.textContent = r.status === 400 ? "Wrong username or password."
      : (typeof detail === "string" && detail) || ("Sign-in failed (HTTP " + r.status + ").");
    password.value = "";
    password.focus();
  }} catch (e) {{
    error.textContent = "The server cannot be reached; try again.";
  }} finally {{
    button.disabled = false;
  }}
}});
</script></body></html>
"""


def render(title: str, message: str) -> bytes:
    return PAGE.format(title=html.escape(title), message=html.escape(message)).encode()


class LoginPageMiddleware:
    def __init__(self, app, user_of: Callable[[dict[str, str]], str | None], title: str, message: str):
        self.app, self.user_of = app, user_of
        self.page = render(title, message)

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["method"] == "GET"
            and scope["path"] == "/"
            and self.user_of(cookies_of(scope)) is None
        ):
            headers = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": self.page})
            return
        await self.app(scope, receive, send)
