"""A conversation as a file to download: Markdown (the branch on screen, as a person reads it) or
JSON (the whole tree: every version of every message, with parent ids, for a program).

GET /export/<conversation id>.md|.json answers only the signed-in user's own conversations: the
store checks the owner in SQL, and another user's id is a 404 exactly like an id that does not
exist. The file is an attachment with nosniff and no caching, so a browser saves it and never
renders it as a page.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from chatengine.app.store import ChatStore, NotFound

FORMATS = {"md": "text/markdown; charset=utf-8", "json": "application/json"}
SPEAKERS = {"system": "System", "user": "You", "assistant": "Assistant"}
# what a JSON export keeps of a message (token ids are the model's business, and large)
MESSAGE_FIELDS = ("id", "parent_id", "role", "content", "status", "settings", "stats", "created_at", "updated_at")


def to_markdown(conv: dict, path: list[dict]) -> str:
    """The title, the persona, then each message of the branch on screen under who wrote it."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv["created_at"]))
    lines = [f"# {conv['title']}", "", f"*{when}" + (f" · persona: {conv['persona']}*" if conv["persona"] else "*")]
    for m in path:
        if m["role"] == "system":
            continue
        note = "" if m["status"] == "done" else f" *({m['status']})*"
        lines += ["", f"**{SPEAKERS[m['role']]}:**{note}", "", m["content"]]
    return "\n".join(lines) + "\n"


def to_json(conv: dict, messages: list[dict], path: list[dict]) -> str:
    keep = ("id", "title", "persona", "settings", "pinned", "created_at", "updated_at")
    out = {
        "conversation": {k: conv[k] for k in keep},
        "active_path": [m["id"] for m in path],
        "messages": [{k: m[k] for k in MESSAGE_FIELDS} for m in messages],
    }
    return json.dumps(out, ensure_ascii=False, indent=2) + "\n"


def export(store: ChatStore, user: str, conv_id: str, fmt: str) -> tuple[str, str]:
    """(file name, text) of the user's conversation; NotFound for anyone else's, ValueError for an
    unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"export as one of {', '.join(FORMATS)}, not {fmt!r}")
    conv = store.get_conversation(user, conv_id)
    path = store.active_path(user, conv_id)
    text = to_markdown(conv, path) if fmt == "md" else to_json(conv, store.messages(user, conv_id), path)
    return f"{file_stem(conv['title'])}.{fmt}", text


def file_stem(title: str) -> str:
    """A file name a person recognises, safe on every OS: letters, digits, - and _ (others become -)."""
    stem = re.sub(r"[^\w-]+", "-", title, flags=re.UNICODE).strip("-_")[:60]
    return stem or "chat"


def _ascii(filename: str) -> str:
    """The name for browsers that read only the plain filename parameter."""
    return "".join(c if c.isascii() else "_" for c in filename)


def add_export_route(app: FastAPI, store: ChatStore, user_of: Callable[[Request], str | None]) -> None:
    """GET /export/{id}.{fmt} for ``user_of(request)`` (None: not signed in, 401)."""

    async def download(request: Request, name: str) -> Response:
        user = user_of(request)
        if user is None:
            return JSONResponse({"detail": "sign in first"}, status_code=401)
        conv_id, _, fmt = name.rpartition(".")
        try:
            filename, text = await run_in_threadpool(export, store, user, conv_id, fmt)
        except NotFound:
            return JSONResponse({"detail": "conversation not found"}, status_code=404)
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        headers = {
            "content-disposition": f"attachment; filename=\"{_ascii(filename)}\"; filename*=UTF-8''{quote(filename)}",
            "x-content-type-options": "nosniff",
            "cache-control": "no-store",
        }
        return Response(text, media_type=FORMATS[fmt], headers=headers)

    app.add_api_route("/export/{name}", download, methods=["GET"], include_in_schema=False)
