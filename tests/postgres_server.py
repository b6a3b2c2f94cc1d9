"""A throwaway PostgreSQL server for tests: Debian's binaries, a temporary cluster on a free loopback
port, password sign-in (so the tests see the password travel in a URL), no durability (fsync off:
the cluster is deleted afterwards).

    server = PostgresServer.start()            # None: no PostgreSQL binaries on this machine
    url = server.new_schema()                  # postgresql://chatengine:...@127.0.0.1:PORT/chat?options=...
    server.stop()

A test's own schema of one database is much cheaper than a database of its own (~5 ms, not ~150 ms):
its URL sets the search_path, so the store's tables go there.

PostgreSQL refuses to run as root: as root, the cluster belongs to the `postgres` system user and
its commands run through runuser.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

import psycopg

USER = "chatengine"
# durability off, and nothing the tests don't use: a faster start and faster writes
SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "listen_addresses": "127.0.0.1",
    "max_connections": "200",  # per-thread connections of the concurrency tests
    "shared_buffers": "16MB",
    "max_wal_senders": "0",
    "wal_level": "minimal",
    "autovacuum": "off",
}


def postgres_bin() -> Path | None:
    """The bin directory of the newest PostgreSQL that Debian's packages installed, if any."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(dirs[-1]).parent if dirs else None


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, bin_dir: Path, root: Path, port: int, password: str):
        self.bin_dir, self.root, self.port, self.password = bin_dir, root, port, password
        self.schemas = 0
        self._admin: psycopg.Connection | None = None

    @classmethod
    def start(cls) -> PostgresServer | None:
        bin_dir = postgres_bin()
        if bin_dir is None or (os.geteuid() == 0 and not _has_user("postgres")):
            return None
        root = Path(tempfile.mkdtemp(prefix="chatengine-pg-"))
        server = cls(bin_dir, root, free_port(), secrets.token_urlsafe(12))
        try:
            server._init_and_run()
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, *args: str) -> None:
        """A PostgreSQL command as the cluster's owner (postgres when we are root)."""
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(prefix + list(args), check=True, capture_output=True, timeout=60)

    def _init_and_run(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        pwfile = self.root / "pw"
        pwfile.write_text(self.password)
        if os.geteuid() == 0:
            shutil.chown(pwfile, "postgres", "postgres")
        data = self.root / "data"
        self._run(
            str(self.bin_dir / "initdb"), "-D", str(data), "-U", USER, "--pwfile", str(pwfile),
            "--auth", "scram-sha-256", "--no-sync", "--no-instructions", "-E", "UTF8", "--locale", "C.UTF-8",
        )  # fmt: skip
        options = " ".join(f"-c {k}={v}" for k, v in SETTINGS.items())
        options += f" -p {self.port} -k {self.root}"  # the Unix socket in our directory, not /var/run
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(data), "-l", str(self.root / "log"), "-w", "-o", options, "start"
        )

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{USER}:{pw}@127.0.0.1:{self.port}/{database}"

    def new_schema(self) -> str:
        """The URL of a new, empty schema of the database `chat`."""
        if self._admin is None:
            with psycopg.connect(self.url(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE chat")
            self._admin = psycopg.connect(self.url("chat"), autocommit=True)
        self.schemas += 1
        name = f"test{self.schemas}"
        self._admin.execute(f"CREATE SCHEMA {name}")  # our own name: no outside value in this SQL
        return self.url("chat") + "?options=" + quote(f"-c search_path={name}")

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.close()
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
