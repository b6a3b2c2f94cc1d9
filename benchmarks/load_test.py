"""Load test: simulated chat users over the real OpenAI-compatible HTTP API, on loopback only.

    python benchmarks/load_test.py [--users 8] [--duration 60] [--rate 1.0] [--max-requests 400] [--quick]
                                   [--url http://127.0.0.1:7860 [--users-file users.json] [--data-dir data]]

Without --url the server runs in this process: an AsyncLLM (the default model unless --model), the
/v1 routes of `chatengine.app.api.routes.build_api` with one API key per simulated user (so every user has its
own cache salt, as in production), under uvicorn on 127.0.0.1 in a thread, with the disk KV tier in
a temporary directory. With --url it drives a running `python app.py` (loopback addresses only).

Workload, open loop: turns arrive as a Poisson process of --rate per second and go to a random
user; a user whose conversation is still streaming opens another one (a second tab), so arrivals
never wait for replies. Each user talks to one persona (prompts/*.md, so the persona's system
prompt is a prefix shared by everyone) in multi-turn conversations that send the growing history
each turn (2-5 turns, then a new chat). A share of turns asks for n=2 alternatives, and a share
hangs up mid-stream (the client closes the connection after a few chunks: the server must abort
them and free their KV). It stops by itself: arrivals end after --duration seconds or
--max-requests turns, then in-flight turns get --drain-timeout seconds.

Reports TTFT and inter-token latency p50/p99, end-to-end latency, output throughput, the prefix-
cache hit rate (engine stats in-process; usage.prompt_tokens_details.cached_tokens in any case),
and errors (anything other than a clean finish, not counting deliberate hang-ups). It ends by
checking that no KV block is in use once the server is idle (and the invariant checker, in-process)
and, with --data-dir of a running app, that its chat store passes `PRAGMA quick_check` with valid
statuses. Saves JSON + a markdown table under benchmarks/results/ (machine, commit, command).
Exit status 1 when any check fails.

--quick (CI, tests/test_load.py): 4 users, 12 s of arrivals at 1.5/s, at most 30 turns, short replies.
A soak (2000 turns with hang-ups, then zero blocks in use) is the same
script run long, with the invariant checker on after every step:

    python benchmarks/load_test.py --users 16 --duration 7200 --rate 0.5 --max-requests 2000 --debug-checks
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Give me a tip for learning faster.",
    "Explain what a KV cache is.",
    "Suggest a name for a bakery.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "What should I pack for a weekend hike?",
    "Summarise the plot of Hamlet in two sentences.",
    "How do I make a simple tomato sauce?",
    "What is a good way to practise Spanish verbs?",
    "Can you explain recursion with an example?",
    "What is 17 times 23?",
    "Describe a sunset in one line.",
    "Tell me one fun fact about octopuses.",
    "How can I make this sentence shorter: 'In order to'?",
    "What is photosynthesis?",
    "Recommend a city to visit in autumn.",
    "Why do we need sleep?",
]
FOLLOW_UPS = [
    "Tell me more.",
    "Can you give an example?",
    "Why is that?",
    "Say it in fewer words.",
    "And what else?",
    "Thanks! One more tip?",
]
STATUSES = ("streaming", "done", "aborted", "error", "interrupted")


@dataclass
class Settings:
    users: int = 8
    duration: float = 60.0
    rate: float = 1.0  # turns per second, all users together (Poisson)
    max_requests: int = 400
    n_share: float = 0.15  # share of turns asking for n=2 alternatives
    hangup_share: float = 0.1  # share of turns the client abandons mid-stream
    min_tokens: int = 16
    max_tokens: int = 64
    max_turns: int = 5
    drain_timeout: float = 180.0
    request_timeout: float = 300.0
    seed: int = 0


@dataclass
class Turn:
    user: int
    conversation: int
    turn: int
    n: int
    max_tokens: int
    hangup_after: int | None  # content chunks before hanging up (None: read to the end)
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    status: str = "pending"  # ok | hangup | error
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list = field(default_factory=list)


# ---- the server ---------------------------------------------------------------------------------
def check_loopback(url: str) -> str:
    host = urlsplit(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"--url must be a loopback address (127.0.0.0/8, ::1 or localhost), got {host!r}")
    return url.rstrip("/")


class InProcessServer:
    """AsyncLLM + the /v1 API under uvicorn on 127.0.0.1 (an ephemeral port) in a thread."""

    def __init__(self, num_users: int, model: str | None, engine_options: dict):
        from chatengine import AsyncLLM
        from chatengine.app.api.routes import build_api
        from chatengine.app.server import ServerThread

        self.kv_dir = tempfile.TemporaryDirectory(prefix="load-test-kv-") if engine_options.pop("disk_kv") else None
        if self.kv_dir is not None:
            engine_options["kv_store_dir"] = self.kv_dir.name
        self.engine = AsyncLLM(model, **engine_options)
        self.keys = [f"sk-load-user-{i}" for i in range(num_users)]
        users = {f"user{i}": {"api_key": key} for i, key in enumerate(self.keys)}
        self.server = ServerThread(build_api(self.engine, users, model_name=str(self.engine.model_id)))
        self.url = self.server.url

    def stats(self) -> dict:
        return self.engine.stats()

    def wait_idle(self, timeout: float) -> tuple[bool, dict]:
        """True when no request is left and no KV block is in use (the leak check)."""
        core = self.engine.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if not core.requests and stats["kv_blocks_used"] == 0:
                core.check_invariants()
                return True, stats
            time.sleep(0.05)
        return False, self.stats()

    def close(self) -> None:
        self.server.stop()
        self.engine.shutdown()
        if self.kv_dir is not None:
            self.kv_dir.cleanup()


def check_store(path: Path) -> dict:
    """A running app's chat store, read-only: quick_check, valid statuses, no orphan messages."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        quick = conn.execute("PRAGMA quick_check").fetchone()[0]
        statuses = dict(conn.execute("SELECT status, COUNT(*) FROM messages GROUP BY status").fetchall())
        orphans = conn.execute(
            "SELECT COUNT(*) FROM messages m LEFT JOIN conversations c ON c.id = m.conversation_id WHERE c.id IS NULL"
        ).fetchone()[0]
    finally:
        conn.close()
    ok = quick == "ok" and set(statuses) <= set(STATUSES) and orphans == 0
    return {"ok": ok, "quick_check": quick, "statuses": statuses, "orphan_messages": orphans}


# ---- the clients --------------------------------------------------------------------------------
class LoadTest:
    def __init__(self, url: str, keys: list[str], settings: Settings, model: str):
        self.url, self.keys, self.s, self.model = url, keys, settings, model
        self.rng = random.Random(settings.seed)
        from chatengine.personas import load_personas

        personas = list(load_personas().values())
        if not personas:
            raise SystemExit("no personas found (prompts/*.md)")
        # two users per persona (where there are enough): its system prompt is a prefix they share
        k = max(1, min(len(personas), (settings.users + 1) // 2))
        self.personas = [personas[i % k] for i in range(settings.users)]
        # per user: their open conversations (message lists); a busy one is not reused
        self.conversations: list[list[dict]] = [[] for _ in range(settings.users)]
        self.busy: list[set[int]] = [set() for _ in range(settings.users)]
        self.num_conversations = 0
        self.turns: list[Turn] = []

    def _conversation_for(self, user: int) -> tuple[int, list[dict]]:
        convs = self.conversations[user]
        for i, messages in enumerate(convs):
            if i not in self.busy[user] and messages is not None:
                return i, messages
        self.num_conversations += 1
        convs.append([{"role": "system", "content": self.personas[user].system_prompt}])
        return len(convs) - 1, convs[-1]

    async def run(self) -> float:
        import httpx

        s, rng = self.s, self.rng
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=httpx.Timeout(s.request_timeout, connect=30), limits=limits) as client:
            tasks = []
            start = time.monotonic()
            next_at = start
            while len(tasks) < s.max_requests:
                next_at += rng.expovariate(s.rate)
                if next_at - start > s.duration:
                    break
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                user = rng.randrange(s.users)
                tasks.append(asyncio.ensure_future(self._turn(client, user, len(tasks))))
            done, pending = await asyncio.wait(tasks, timeout=s.drain_timeout) if tasks else (set(), set())
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception() is not None:  # a bug in this script: report it, never hide it
                    raise t.exception()
            return time.monotonic() - start

    async def _turn(self, client, user: int, index: int) -> None:
        s = self.s
        rng = random.Random(s.seed * 1_000_003 + index)  # this turn's draws: the same in every run
        ci, messages = self._conversation_for(user)
        n_turn = sum(1 for m in messages if m["role"] == "user")
        text = rng.choice(QUESTIONS) if n_turn == 0 else rng.choice(FOLLOW_UPS + QUESTIONS)
        turn = Turn(
            user,
            ci,
            n_turn,
            n=2 if _every(index, s.n_share, 0.0) else 1,
            max_tokens=rng.randint(s.min_tokens, s.max_tokens),
            hangup_after=rng.randint(1, 4) if _every(index, s.hangup_share, 0.5) else None,
        )
        self.turns.append(turn)
        body = {
            "model": self.model,
            "messages": messages + [{"role": "user", "content": text}],
            "max_tokens": turn.max_tokens,
            "n": turn.n,
            "temperature": 0.7,
            "top_p": 0.95,
            "seed": rng.randrange(2**31),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.keys[user % len(self.keys)]}"} if self.keys else {}
        self.busy[user].add(ci)
        texts = [""] * turn.n
        last_chunk_at: list[float | None] = [None] * turn.n
        chunks = 0
        turn.start = time.monotonic()
        try:
            async with client.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    turn.status, turn.error = "error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        turn.status, turn.error = "error", f"stream error: {event['error'].get('message')}"
                        return
                    if event.get("usage"):
                        u = event["usage"]
                        turn.prompt_tokens, turn.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                        turn.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for choice in event.get("choices", []):
                        i = choice["index"]
                        content = (choice.get("delta") or {}).get("content")
                        now = time.monotonic()
                        if content:
                            texts[i] += content
                            if turn.ttft is None:
                                turn.ttft = now - turn.start
                            if last_chunk_at[i] is not None:
                                turn.itl.append(now - last_chunk_at[i])
                            last_chunk_at[i] = now
                            chunks += 1
                        if choice.get("finish_reason"):
                            turn.finish_reasons.append(choice["finish_reason"])
                    if turn.hangup_after is not None and chunks >= turn.hangup_after:
                        turn.status = "hangup"  # leave: the connection closes with this block
                        return
                turn.e2e = time.monotonic() - turn.start
                if turn.hangup_after is not None and turn.status != "hangup":
                    turn.status = "hangup"  # it finished before we hung up: no error either
                if not done:
                    turn.status, turn.error = "error", "the stream ended without [DONE]"
                elif len(turn.finish_reasons) != turn.n or any(
                    r not in ("stop", "length") for r in turn.finish_reasons
                ):
                    turn.status, turn.error = "error", f"finish reasons {turn.finish_reasons} for n={turn.n}"
                elif turn.completion_tokens < 1 or turn.completion_tokens > turn.n * turn.max_tokens:
                    turn.status, turn.error = "error", f"{turn.completion_tokens} completion tokens"
                elif turn.status == "pending":
                    turn.status = "ok"
                    # the conversation goes on with the first alternative, as the UI would show it
                    messages.append({"role": "user", "content": text})
                    messages.append({"role": "assistant", "content": texts[0]})
        except asyncio.CancelledError:
            turn.status, turn.error = "error", "not finished within the drain timeout"
            raise
        except Exception as e:  # noqa: BLE001 - any failure is counted
            turn.status, turn.error = "error", f"{type(e).__name__}: {e}"
        finally:
            self.busy[user].discard(ci)
            if turn.status != "ok" or sum(1 for m in messages if m["role"] == "user") >= s.max_turns:
                self.conversations[user][ci] = None  # closed: this user's next turn opens a new chat


def _every(i: int, share: float, phase: float) -> bool:
    """Exactly `share` of the turns, evenly spread (turn i is picked when (i+1)*share+phase crosses
    an integer): the mix is the same in every run, and a short run still has some of each."""
    return int((i + 1) * share + phase) > int(i * share + phase)


# ---- the report ---------------------------------------------------------------------------------
def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(p / 100 * len(v) + 0.5) - 1))]


def machine(device: str | None) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def summarize(turns: list[Turn], wall: float, before: dict | None, after: dict | None) -> dict:
    ok = [t for t in turns if t.status == "ok"]
    hang = [t for t in turns if t.status == "hangup"]
    err = [t for t in turns if t.status == "error"]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    itl = [x for t in ok for x in t.itl]
    e2e = [t.e2e for t in ok if t.e2e is not None]
    tokens = sum(t.completion_tokens for t in ok)
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    out = {
        "requests": len(turns),
        "ok": len(ok),
        "hangups": len(hang),
        "errors": len(err),
        "n2_requests": sum(1 for t in turns if t.n > 1),
        "error_samples": sorted({t.error for t in err})[:10],
        "wall_s": round(wall, 2),
        "ttft_ms": {"p50": _ms(pct(ttft, 50)), "p99": _ms(pct(ttft, 99))},
        "itl_ms": {"p50": _ms(pct(itl, 50)), "p99": _ms(pct(itl, 99))},
        "e2e_s": {"p50": _r(pct(e2e, 50)), "p99": _r(pct(e2e, 99))},
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate_usage": round(cached / prompt, 4) if prompt else 0.0,
    }
    if before is not None and after is not None:
        queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
        hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        out["hit_rate_engine"] = round(hits / queried, 4) if queried else 0.0
        for key in ("num_preemptions", "evictions", "blocks_restored", "num_forks", "num_generated_tokens"):
            if key in after:
                out[key] = after[key] - before.get(key, 0)
    return out


def _ms(x):
    return None if x is None else round(x * 1000, 1)


def _r(x):
    return None if x is None else round(x, 3)


def markdown(report: dict) -> str:
    r, m = report["results"], report["machine"]
    s = report["settings"]
    rows = [
        ("requests (ok / hang-ups / errors)", f"{r['requests']} ({r['ok']} / {r['hangups']} / {r['errors']})"),
        ("n=2 requests", r["n2_requests"]),
        ("TTFT p50 / p99", f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} ms"),
        ("inter-token latency p50 / p99", f"{r['itl_ms']['p50']} / {r['itl_ms']['p99']} ms"),
        ("end-to-end p50 / p99", f"{r['e2e_s']['p50']} / {r['e2e_s']['p99']} s"),
        ("output throughput", f"{r['output_tok_s']} tok/s ({r['output_tokens']} tokens in {r['wall_s']} s)"),
        ("completed turns/s", r["requests_per_s"]),
        ("prefix-cache hit rate (usage.cached_tokens)", r["hit_rate_usage"]),
    ]
    if "hit_rate_engine" in r:
        rows.append(("prefix-cache hit rate (engine stats)", r["hit_rate_engine"]))
        rows.append(
            (
                "preemptions / evictions / restored blocks / forks",
                f"{r.get('num_preemptions')} / {r.get('evictions')} / {r.get('blocks_restored')} / "
                f"{r.get('num_forks')}",
            )
        )
    c = report["checks"]
    rows.append(("KV blocks in use after drain", c.get("kv_blocks_used_after", "n/a (remote)")))
    rows.append(("chat store", c.get("store", "not checked")))
    rows.append(("checks", "PASS" if c["passed"] else f"FAIL: {c['failures']}"))
    lines = [
        f"# Load test — {report['model']} on {m['device']}",
        "",
        f"{report['date']}, commit {report['commit']}, {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['torch_threads']} torch threads, load average {m.get('load_average_1m')} at the end), "
        f"torch {m['torch']}",
        "",
        f"`{report['command']}`",
        "",
        f"{s['users']} users, Poisson arrivals at {s['rate']}/s for {s['duration']} s (at most "
        f"{s['max_requests']} turns), replies of {s['min_tokens']}-{s['max_tokens']} tokens, "
        f"{int(s['n_share'] * 100)} % n=2, {int(s['hangup_share'] * 100)} % hang-ups, "
        f"up to {s['max_turns']} turns per conversation",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


# ---- main -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=d.users, help="simulated users")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=d.rate, help="turns per second, all users together (Poisson)")
    p.add_argument("--max-requests", type=int, default=d.max_requests, help="most turns in all")
    p.add_argument("--n-share", type=float, default=d.n_share, help="share of turns with n=2")
    p.add_argument("--hangup-share", type=float, default=d.hangup_share, help="share of turns abandoned mid-stream")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="turns before a user starts a new chat")
    p.add_argument(
        "--drain-timeout", type=float, default=d.drain_timeout, help="seconds for in-flight turns at the end"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quick", action="store_true", help="a short run for CI (overrides the sizes above)")
    p.add_argument("--url", help="a running server (loopback only), e.g. http://127.0.0.1:7860")
    p.add_argument("--users-file", help="with --url: the server's users file, for the API keys")
    p.add_argument("--data-dir", help="with --url: the server's data directory, to check its chat store")
    p.add_argument("--model", default=None, help="in-process: model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="in-process: KV pool size on CPU")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="in-process: token budget per step")
    p.add_argument("--no-disk-kv", action="store_true", help="in-process: no disk KV tier")
    p.add_argument("--debug-checks", action="store_true", help="in-process: invariant checks after every step")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    p.add_argument("--no-save", action="store_true", help="print only")
    return p


def run(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    s = Settings(
        users=args.users,
        duration=args.duration,
        rate=args.rate,
        max_requests=args.max_requests,
        n_share=args.n_share,
        hangup_share=args.hangup_share,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        max_turns=args.max_turns,
        drain_timeout=args.drain_timeout,
        seed=args.seed,
    )
    if args.quick:
        s = Settings(
            users=4,
            duration=12,
            rate=1.5,
            max_requests=30,
            n_share=0.2,
            hangup_share=0.2,
            min_tokens=4,
            max_tokens=12,
            max_turns=3,
            drain_timeout=40,
            request_timeout=60,
            seed=args.seed,
        )
    if min(s.users, s.max_requests, s.min_tokens) < 1 or s.rate <= 0 or s.duration <= 0 or s.max_tokens < s.min_tokens:
        raise SystemExit("--users, --max-requests, --min-tokens must be >= 1; --rate, --duration > 0")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    server = None
    failures = []
    checks: dict = {}
    try:
        if args.url:
            url = check_loopback(args.url)
            keys = []
            if args.users_file:
                from chatengine.app.auth import load_users

                keys = [u["api_key"] for u in load_users(args.users_file).values() if u.get("api_key")]
            import httpx

            model = httpx.get(
                url + "/v1/models", timeout=30, headers={"Authorization": f"Bearer {keys[0]}"} if keys else {}
            ).json()["data"][0]["id"]
            before = after = None
            device = "remote server"
        else:
            server = InProcessServer(
                s.users,
                args.model,
                dict(
                    kv_cache_gib=args.kv_cache_gib,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    debug_checks=args.debug_checks or args.quick,
                    disk_kv=not args.no_disk_kv,
                ),
            )
            url, keys = server.url, server.keys
            model = str(server.engine.model_id)
            before = server.stats()
            device = before["device"]
        test = LoadTest(url, keys, s, model)
        print(
            f"load test: {s.users} users, {s.rate}/s for {s.duration} s (<= {s.max_requests} turns) against {url}",
            flush=True,
        )
        wall = asyncio.run(test.run())
        if server is not None:
            idle, after = server.wait_idle(timeout=15)
            checks["kv_blocks_used_after"] = after["kv_blocks_used"]
            checks["requests_left"] = len(server.engine.engine.requests)
            if not idle:
                failures.append(f"{after['kv_blocks_used']} KV blocks still in use after the drain")
        if args.data_dir:
            store = check_store(Path(args.data_dir) / "chat.db")
            checks["store"] = store
            if not store["ok"]:
                failures.append(f"chat store: {store}")
        results = summarize(test.turns, wall, before, after)
        results["conversations"] = test.num_conversations
        if results["errors"]:
            failures.append(f"{results['errors']} errors: {results['error_samples']}")
        if results["ok"] == 0:
            failures.append("no turn finished")
    finally:
        if server is not None:
            server.close()
    checks["passed"], checks["failures"] = not failures, failures
    argv_used = argv if argv is not None else sys.argv[1:]
    date = datetime.now(UTC).isoformat(timespec="seconds")
    report = {
        "benchmark": "load_test",
        "model": model,
        "date": date,
        "commit": commit(),
        "command": "python benchmarks/load_test.py " + " ".join(argv_used),
        "machine": machine(device),
        "url": "in-process" if server is not None else url,
        "settings": asdict(s),
        "results": results,
        "checks": checks,
        "turns": [asdict(t) | {"itl": [round(x, 4) for x in t.itl]} for t in test.turns],
    }
    md = markdown(report)
    print(md, flush=True)
    if not args.no_save:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"load_test-{report['date'][:19].replace(':', '')}-{report['commit']}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        stem.with_suffix(".md").write_text(md)
        report["saved"] = str(stem)
        print(f"saved {stem}.json and .md")
    return report


def main(argv=None) -> int:
    return 0 if run(argv)["checks"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
