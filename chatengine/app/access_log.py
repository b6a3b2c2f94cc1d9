"""The access log names routes, not secrets: no query strings (Gradio's `session_hash=`, an `upload_id`)
and no session hash inside a path (`/gradio_api/heartbeat/<hash>`). Anyone who can read the log
could otherwise take over a signed-in user's tab."""

from __future__ import annotations

import logging
import re

_HASH_IN_PATH = re.compile(r"^(/gradio_api/(?:heartbeat|stream)/)[^/?]+")


def redact_path(path: str) -> str:
    path = path.split("?", 1)[0]
    return _HASH_IN_PATH.sub(r"\1…", path)


class RedactedAccessLog(logging.Filter):
    """On uvicorn's access logger, whose records carry (client, method, path, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_path(args[2]), *args[3:])
        return True


def install() -> None:
    """Idempotent: one filter on uvicorn's access logger for the life of the process."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactedAccessLog) for f in logger.filters):
        logger.addFilter(RedactedAccessLog())
