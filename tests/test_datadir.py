"""The data directory is private whatever the umask: the directory 0700, the chat database and its
-wal/-shm files 0600, older files tightened at start; a users file others can read is warned about."""

import logging
import os
import stat

import pytest

from chatengine.app.datadir import create_private_file, make_private, warn_if_shared
from chatengine.app.store import ChatStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the loosest umask: everything created is world-readable unless we say otherwise
    yield
    os.umask(old)


def test_a_new_data_dir_and_database_are_private(tmp_path, open_umask):
    data = make_private(tmp_path / "data")
    db = data / "chat.db"
    create_private_file(db)
    store = ChatStore(db)
    store.create_conversation("alice", title="secret plans")  # writes: the -wal and -shm files appear
    files = sorted(p.name for p in data.iterdir())
    assert {"chat.db", "chat.db-wal", "chat.db-shm"} <= set(files), files
    assert mode(data) == 0o700
    assert {p.name: mode(p) for p in data.iterdir()} == {name: 0o600 for name in files}
    store.close()


def test_an_older_data_dir_is_tightened(tmp_path, open_umask):
    data = tmp_path / "data"
    (data / "kv" / "ab").mkdir(parents=True, mode=0o755)
    (data / "chat.db").write_bytes(b"")
    (data / "kv" / "ab" / "x.kv").write_bytes(b"")
    os.chmod(data / "chat.db", 0o644)
    os.chmod(data / "kv" / "ab" / "x.kv", 0o644)
    make_private(data)
    assert mode(data) == mode(data / "kv") == mode(data / "kv" / "ab") == 0o700
    assert mode(data / "chat.db") == mode(data / "kv" / "ab" / "x.kv") == 0o600


def test_a_users_file_others_can_read_is_warned_about(tmp_path, caplog):
    users = tmp_path / "users.json"
    users.write_text("{}")
    os.chmod(users, 0o644)
    with caplog.at_level(logging.WARNING, logger="chatengine.server"):
        assert warn_if_shared(users)
    assert "chmod 600" in caplog.text
    os.chmod(users, 0o600)
    assert not warn_if_shared(users)


def test_the_server_makes_its_data_dir_private(tmp_path, open_umask):
    """create_app's first steps (no model loaded for this: a missing model stops it after the store)."""
    from chatengine.app import server

    data = tmp_path / "data"
    with pytest.raises(ValueError):
        server.create_app(data_dir=data, model=str(tmp_path / "no-such-model"))
    assert mode(data) == 0o700 and mode(data / "chat.db") == 0o600


# ---- start-up checks: one clear line before the model loads ----------------------------------------
def test_check_data_dir_refuses_what_it_cannot_use(tmp_path, monkeypatch):
    from chatengine.app import datadir

    assert datadir.check_data_dir(tmp_path / "ok") == tmp_path / "ok"
    assert os.listdir(tmp_path / "ok") == []  # the write probe is gone
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(datadir.DataDirError, match="cannot write to the data directory .*--data-dir"):
        datadir.check_data_dir(tmp_path / "file")
    monkeypatch.setattr(datadir.shutil, "disk_usage", lambda p: _Usage(5 << 20))
    with pytest.raises(datadir.DataDirError, match="only 5 MiB free .* at least 64 MiB"):
        datadir.check_data_dir(tmp_path / "ok")


class _Usage:
    def __init__(self, free):
        self.free = free


def _start(tmp_path, data_dir):
    """`python app.py` on data_dir; (exit code, stderr lines, seconds)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    app = Path(__file__).resolve().parents[1] / "app.py"
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(app), "--data-dir", str(data_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    return proc.returncode, proc.stderr.strip().splitlines(), time.monotonic() - t


@pytest.mark.slow  # restarts or loads a whole server: left out of CI, run with the whole suite (README)
def test_a_damaged_database_or_unusable_dir_stops_the_server_with_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.db").write_bytes(b"this is not an SQLite database" * 100)
    rc, err, _ = _start(tmp_path, data)
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("error: the chat database") and "damaged" in err[0] and "move it aside" in err[0]
    (tmp_path / "plain-file").write_text("x")
    rc, err, _ = _start(tmp_path, tmp_path / "plain-file")
    assert rc == 1 and len(err) == 1 and "cannot write to the data directory" in err[0], err


def test_one_server_per_data_dir(tmp_path):
    from chatengine.app.datadir import DataDirError, lock_data_dir

    first = lock_data_dir(tmp_path)
    with pytest.raises(DataDirError, match=f"in use by a running chatengine server \\(pid {os.getpid()}\\)"):
        lock_data_dir(tmp_path)
    first.close()
    lock_data_dir(tmp_path).close()  # free again once the holder is gone
