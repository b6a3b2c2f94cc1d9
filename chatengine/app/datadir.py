"""The server's data directory (chat database, KV store, server secret): private to the user who
runs the server, whatever the umask. Conversations are there in plain text.

`check_data_dir` runs before the model loads, so a directory the server cannot use costs one clear
line at once instead of a traceback after the load."""

import fcntl
import logging
import os
import shutil
import stat
import uuid
from pathlib import Path

log = logging.getLogger("chatengine.server")


MIN_FREE_BYTES = 64 << 20  # room for the database to grow and its WAL to checkpoint


class DataDirError(ValueError):
    """The data directory cannot be used; the message says why and what to do, in one line."""


def check_data_dir(path: str | os.PathLike, min_free_bytes: int = MIN_FREE_BYTES) -> Path:
    """make_private(path), then prove a file can be written and synced there and enough space is free."""
    where = os.fspath(path)
    try:
        root = make_private(path)
        probe = root / f".write-check-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as e:
        raise DataDirError(
            f"cannot write to the data directory {where} ({e.strerror or e}): "
            "fix its permissions or choose another with --data-dir"
        ) from None
    if free < min_free_bytes:
        raise DataDirError(
            f"only {free >> 20} MiB free on the disk of the data directory {where}; the server needs at least "
            f"{min_free_bytes >> 20} MiB to save conversations: free some space or choose another --data-dir"
        )
    return root


LOCK_FILE = ".lock"


def lock_data_dir(root: str | os.PathLike):
    """An exclusive lock on the data directory for as long as the returned file stays open (the OS
    drops it when the process dies): two servers on one directory would corrupt each other's KV
    store, and a user deleted offline would come back from a running server's memory."""
    path = Path(root) / LOCK_FILE
    f = open(path, "a+")  # noqa: SIM115 - held open for the life of the lock
    os.chmod(path, 0o600)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise DataDirError(
            f"the data directory {os.fspath(root)} is in use by a running chatengine server ({holder}): "
            "stop it first, or choose another --data-dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


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
