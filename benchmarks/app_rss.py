"""Peak resident memory of `python app.py` on the default model while it serves chat completions
(issue #23's bar: 800 MB on a laptop CPU).

    python benchmarks/app_rss.py [--requests 4] [--max-tokens 64] [-- extra app.py flags]

Starts `python app.py` on a free loopback port with a fresh data directory (no users file: the
API is open to loopback callers), waits for /health, sends --requests streamed chat completions one
after another, then reads the server's VmHWM (peak RSS) and VmRSS from /proc and stops it. Linux only.
Prints one line and saves JSON + markdown under --out.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb(pid: int) -> dict[str, float]:
    """VmHWM and VmRSS of `pid` in MB (the kernel's kB / 1024)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300.0) -> float:
    """Seconds until /health answers (the app loads its model first)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("app.py did not answer /health")


def chat(base: str, max_tokens: int) -> int:
    """One streamed chat completion; the number of SSE data lines received."""
    body = {
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return sum(1 for line in r if line.startswith(b"data:"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("app_args", nargs="*", help="flags passed on to app.py (after --)")
    args = ap.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data:
        cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--data-dir", data, *args.app_args]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ready_s = wait_ready(base, proc)
            chunks = [chat(base, args.max_tokens) for _ in range(args.requests)]
            mem = memory_mb(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    res = {
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00"),
        "command": "python benchmarks/app_rss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "ready_s": ready_s,
        "stream_chunks": chunks,
        "peak_rss_mb": mem["VmHWM"],
        "rss_mb": mem["VmRSS"],
    }
    line = (
        f"app.py: ready in {ready_s:.1f} s, {args.requests} streamed chat completions "
        f"({sum(chunks)} SSE chunks), peak RSS {mem['VmHWM']:.0f} MB, RSS now {mem['VmRSS']:.0f} MB"
    )
    print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"app_rss-{datetime.now(UTC):%Y-%m-%dT%H%M}-{res['commit']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(f"# app_rss {res['date']} ({res['commit']})\n\n`{res['command']}`\n\n{line}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
