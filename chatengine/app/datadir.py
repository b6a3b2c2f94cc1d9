"""The server's data directory (chat database, KV store, server secret): private to the user who
runs the server, whatever the umask. Conversations are there in plain text."""

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("chatengine.server")


def make_private(path: str | os.PathLike) -> Path:
    """Create the directory if needed; then it and everything in it: directories 0700, files 0600."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o700)
        for name in filenames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o600)
            except FileNotFoundError:  # a temp file that went away meanwhile
                pass
    return root


def create_private_file(path: str | os.PathLike) -> None:
    """Create an empty file readable by its owner only, if it does not exist (SQLite then gives its
    -wal and -shm files the same permissions)."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chmod(path, 0o600)


def warn_if_shared(path: str | os.PathLike) -> bool:
    """Log a warning when a file holding secrets (the users file) is readable by others; True then."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing or unreadable: loading it says so in words
        return False
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s holds passwords and API keys but is readable by other users (mode %o): chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
        return True
    return False
