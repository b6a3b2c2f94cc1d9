"""The `chatengine` command, run as a subprocess (the installed console script when there is one)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chatengine.app.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXE = shutil.which("chatengine")
CMD = [EXE] if EXE else [sys.executable, "-m", "chatengine.app.cli"]


def run(*args, stdin=None, timeout=60):
    return subprocess.run([*CMD, *args], input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_console_script_is_declared():
    assert 'chatengine = "chatengine.app.cli:main"' in (ROOT / "pyproject.toml").read_text()


def call(capsys, *args):
    """main() in this process (cheap: no second torch import); (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help(capsys):
    # in this process: the real command, the installed console script in a subprocess, runs in
    # test_chat_through_stdin (a subprocess of its own here cost 4-7 s: `--help` imports torch)
    code, out, _ = call(capsys, "--help")
    assert code == 0
    for word in ("serve", "chat", "bench"):
        assert word in out


def test_subcommand_help(capsys):
    code, out, _ = call(capsys, "chat", "--help")
    assert code == 0
    for flag in ("--model", "--device", "--temperature", "--max-tokens", "--system", "--persona", "/reset", "/quit"):
        assert flag in out, flag
    code, out, _ = call(capsys, "bench", "--help")
    assert code == 0 and "SCRIPT" in out
    code, out, err = call(capsys, "serve", "--help")
    assert code == 0 and "--users" in out and "--data-dir" in out


def test_bench_list_and_unknown(capsys):
    code, out, _ = call(capsys, "bench", "--list")
    assert code == 0
    if (ROOT / "benchmarks" / "cpu_throughput.py").exists():
        assert "cpu_throughput" in out.split()
    assert "common" not in out.split()  # a helper the scripts import, not a benchmark
    code, _, err = call(capsys, "bench", "no_such_benchmark")
    assert code == 2 and "no benchmark 'no_such_benchmark'" in err


def test_chat_personas_and_bad_persona(capsys):
    code, _, err = call(capsys, "chat", "--persona", "no-such-persona")
    assert code == 2 and "no persona" in err
    code, out, _ = call(capsys, "chat", "--list-personas")
    assert code == 0 and "assistant" in out
    code, _, err = call(capsys, "chat", "--system", "x", "--persona", "assistant")
    assert code == 2 and "not allowed with" in err


def test_chat_through_stdin():
    script = "Hello!\n/help\nSay hi.\n/reset\n/quit\nnever read\n"
    out = run(
        "chat",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--kv-cache-gib",
        "0.05",
        "--persona",
        "assistant",
        stdin=script,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    answers = out.stdout.splitlines()
    assert len(answers) == 2 and all(a.strip() for a in answers), out.stdout  # one streamed line per turn
    assert "(conversation cleared)" in out.stderr and "/reset" in out.stderr


def test_chat_history_drops_oldest_turns_to_fit():
    from types import SimpleNamespace

    from chatengine.app.cli import _fit

    def one_token_per_character(messages):
        return [1] * sum(len(m["content"]) for m in messages)

    engine = SimpleNamespace(apply_chat_template=one_token_per_character, max_model_len=100)
    base = [{"role": "system", "content": "s" * 10}]
    history = [
        {"role": "user", "content": "a" * 30},
        {"role": "assistant", "content": "b" * 30},
        {"role": "user", "content": "c" * 20},
    ]
    ids = _fit(engine, base, history, max_tokens=16)
    assert len(ids) == 30 and [m["content"][0] for m in history] == ["c"]  # the oldest turn went
    with pytest.raises(ValueError, match="too long"):
        _fit(engine, base, [{"role": "user", "content": "x" * 95}], max_tokens=16)


def test_delete_user_removes_their_history_and_disk_pages_only(tmp_path, capsys):
    """`chatengine delete-user` on a stopped server's data dir: the user's conversations and their
    KV block files go (every model root); another user's stay; a running server's dir is refused."""
    from chatengine import LLM, SamplingParams
    from chatengine.app.datadir import lock_data_dir
    from chatengine.app.store import ChatStore

    data = tmp_path / "data"
    data.mkdir()
    store = ChatStore(data / "chat.db")
    for user in ("zoe", "yan"):
        store.create_conversation(user, title=f"{user}'s plans")
    store.close()
    llm = LLM("dummy:tiny", kv_store_dir=str(data / "kv"), data_dir=str(data), num_kv_blocks=32)
    p = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([list(range(40))], p, user="zoe")
    llm.generate([list(range(100, 140))], p, user="yan")
    llm.shutdown()  # flushes every page to disk
    files = lambda: len(list((data / "kv").glob("*/*/*.kv")))  # noqa: E731
    before = files()
    held = lock_data_dir(data)  # a server running on it
    assert main(["delete-user", "zoe", "--data-dir", str(data)]) == 1
    assert "in use by a running chatengine server" in capsys.readouterr().err
    held.close()
    assert main(["delete-user", "zoe", "--data-dir", str(data)]) == 0
    assert "deleted user 'zoe': 1 conversations, 2 cached KV pages" in capsys.readouterr().out
    assert files() == before - 2
    store = ChatStore(data / "chat.db")
    assert store.list_conversations("zoe") == [] and len(store.list_conversations("yan")) == 1
    store.close()
    assert main(["delete-user", "zoe", "--data-dir", str(tmp_path / "nowhere")]) == 2
