"""Several hosts (docs/SCALING.md): two `chatengine serve` processes behind sglang-router's cache-aware
policy on loopback, and what the hosts must share for a sign-in to hold on either of them."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chatengine.app.sessions import KEY_FILE, LoginSessions, load_or_create_key
from chatengine.app.store import ChatStore

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16  # the engine's default block size: only full blocks are cached
USERS = {"alice": {"api_key": "sk-alice"}, "bob": {"api_key": "sk-bob"}}
ADMIN_KEY = "sk-router-admin"  # the router's control plane (its worker list); users' keys pass through it
# Each conversation opens with its own system prompt, starting with its own letter: no block of one
# is a block of another, and the router's prefix tree (over the messages' text) finds nothing of one
# in another, so only the host that served a conversation holds its pages.
CONVERSATIONS = [
    ("alice", "Apples are the only topic here. Answer in one short sentence.", "Name a kind of apple."),
    ("bob", "Boats are the only topic here. Answer in one short sentence.", "Name a kind of boat."),
    ("alice", "Clouds are the only topic here. Answer in one short sentence.", "Name a kind of cloud."),
    ("bob", "Dogs are the only topic here. Answer in one short sentence.", "Name a kind of dog."),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A subprocess whose output goes to a log file, shown when it fails."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def wait_for(what: str, proc: Process, ready, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.proc.poll() is None, f"{what} exited:\n{proc.tail()}"
        assert time.monotonic() < deadline, f"{what} did not start:\n{proc.tail()}"
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def chat(url: str, user: str, messages: list[dict], max_tokens: int = 8, stream: bool = False) -> dict:
    """A chat completion as `user`; streamed (with the usage chunk), it is put together into the
    shape of a whole one."""
    import httpx

    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    headers = {"Authorization": f"Bearer {USERS[user]['api_key']}"}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", headers=headers, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            usage = chunk.get("usage") or usage
    return {"choices": [{"message": {"content": text}}], "usage": usage}


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow  # two servers and a router (30-70 s on 2 shared cores): out of CI, run with the whole suite (README)
def test_turns_land_where_their_pages_are(tmp_path):
    """Two hosts with their own data directories behind `sglang_router.launch_router --policy
    cache_aware`. Four conversations of two users (their own API keys, which the router passes on)
    start at once, so the router spreads them over both hosts (a new conversation goes to the host
    with fewer requests in flight); each one's second turn, streamed, then comes back with its
    first turn's pages cached, and asking each host directly shows that exactly one host holds
    each conversation's pages, and that both hosts hold some."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router, the test extra)")
    import httpx

    users = tmp_path / "users.json"
    users.write_text(json.dumps(USERS))
    users.chmod(0o600)
    hosts, procs = [], []
    try:
        for k in range(2):  # both start at once: each takes most of its time loading Gradio and the model
            port = free_port()
            hosts.append(f"http://127.0.0.1:{port}")
            args = ["--port", str(port), "--data-dir", str(tmp_path / f"host{k}"), "--users", str(users)]
            args += ["--no-disk-kv", "--kv-cache-gib", "0.1", "--max-num-batched-tokens", "256"]
            args += ["--max-model-len", "1024", "--log-level", "warning"]
            procs.append(Process([sys.executable, "app.py", *args], tmp_path / f"host{k}.log"))
        for k, (url, proc) in enumerate(zip(hosts, procs)):
            wait_for(f"host {k}", proc, lambda: httpx.get(url + "/health", timeout=2).status_code == 200)

        router_url = f"http://127.0.0.1:{free_port()}"
        router = Process(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                router_url.rsplit(":", 1)[1],
                "--worker-urls",
                *hosts,
                "--policy",
                "cache_aware",
                # without it anyone who reaches the router may add a worker and receive the traffic
                "--control-plane-api-keys",
                f"ops:operator:admin:{ADMIN_KEY}",
                # its metrics server would take port 29000 of every interface
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            tmp_path / "router.log",
        )
        procs.append(router)

        def both_registered() -> bool:
            answer = httpx.get(router_url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=2)
            workers = answer.json().get("workers", []) if answer.status_code == 200 else []
            return sum(w.get("is_healthy", False) for w in workers) == 2

        wait_for("the router", router, both_registered, timeout=60)
        assert httpx.get(router_url + "/workers", timeout=2).status_code == 401  # the worker list wants the key

        def converse(conversation):
            user, system, question = conversation
            first = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            one = chat(router_url, user, first)
            answer = one["choices"][0]["message"]["content"]
            follow_up = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Name another."}]
            return first, one, chat(router_url, user, follow_up, stream=True)  # as a chat client asks

        with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
            turns = list(pool.map(converse, CONVERSATIONS))

        owners = []
        for (user, _, _), (first, one, two) in zip(CONVERSATIONS, turns):
            assert cached(one) == 0, one["usage"]  # nothing of this conversation was anywhere before
            # the second turn reads at least the full blocks of the first turn's prompt from the cache
            assert cached(two) >= one["usage"]["prompt_tokens"] // BLOCK * BLOCK > 0, two["usage"]
            # one token asked of each host directly: only the host that served the conversation has its pages
            holders = [k for k, url in enumerate(hosts) if cached(chat(url, user, first, max_tokens=1)) > 0]
            assert len(holders) == 1, (first, holders)
            owners.append(holders[0])
        assert sorted(set(owners)) == [0, 1], f"every conversation went to host {owners[0]}"
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_sign_in_holds_on_every_host_that_shares_the_session_key(tmp_path):
    """Sign-in cookies are signed with the data directory's session.key and looked up in the store.
    Two hosts on one store (here one SQLite file, in production PostgreSQL) accept each other's
    cookies only when their data directories hold the same key: copying the first host's
    session.key into the others' directories before they start is enough."""
    store = ChatStore(tmp_path / "chat.db")
    try:
        one, two = tmp_path / "host0", tmp_path / "host1"
        for d in (one, two):
            d.mkdir()
        signed_in = LoginSessions(store, load_or_create_key(one))
        cookie = signed_in.create("alice")
        assert signed_in.user_of(cookie) == "alice"
        assert LoginSessions(store, load_or_create_key(two)).user_of(cookie) is None  # its own key: signed out

        (two / KEY_FILE).unlink()
        shutil.copy2(one / KEY_FILE, two / KEY_FILE)
        os.chmod(two / KEY_FILE, 0o600)
        other_host = LoginSessions(store, load_or_create_key(two))
        assert other_host.user_of(cookie) == "alice"
        other_host.revoke(cookie)  # logging out on one host ends the sign-in on both
        assert signed_in.user_of(cookie) is None
    finally:
        store.close()
