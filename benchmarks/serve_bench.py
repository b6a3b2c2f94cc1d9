"""Online serving benchmark: chat turns arriving over time, measured as a user feels them.

    python benchmarks/serve_bench.py [--model dummy:llama-3.2-1b] [--rates 5 20 60] [--requests 400]
        [--arrivals poisson|bursty] [--targets async http] [--cache on off] [--concurrency 256] [--quick]

Workload (fixed by --seed): multi-turn chat sessions over --personas shared system prompts of
--persona-len tokens. A session's turn k resends the persona, the earlier user messages and replies,
and a new user message (32-256 tokens); replies are 64-256 tokens (ignore_eos). The replies resent
in the history are fixed token sequences of the generated length (the same for every target and
cache setting, so a run is comparable with another; an engine caches its own reply's tokens, which
no turn asks for again). Arrivals: a Poisson process of each --rates value (or bursty: gamma gaps
with shape 0.25, the same mean); an arrival continues a session whose last reply has finished
(--return-share of the time, when there is one) or starts a new one, so sessions come back with
growing histories. TTFT counts from the scheduled arrival.

Targets: `async` drives AsyncLLM in this process; `http` drives the OpenAI-compatible API
(/v1/completions with token-id prompts, streamed as SSE) of a server in a child process (engine and
uvicorn there, as deployed; the client here); with --engine-process that server's engine runs in a
process of its own (`serve --engine-process`), so HTTP and the engine's Python work never share a
GIL. Each (target, cache) pair gets a fresh engine, warmed (CUDA graphs captured, each persona seen
once), then runs every rate in turn.

Reports per rate: TTFT, ITL (gaps between streamed chunks), TPOT ((end - first token) / (tokens - 1))
and end-to-end latency at p50/p90/p99, output tokens/s, goodput (requests/s meeting --slo-ttft-ms
and --slo-tpot-ms), and the prefix hit rate (cached / prompt tokens). --concurrency N adds a closed
loop of N concurrent streams of single turns through each target (the HTTP overhead at load:
throughput of http / async). Saves JSON, a markdown table and a plot of latency vs rate
(matplotlib) under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit, freeze_heap, stat_fields  # noqa: E402

PCTS = (50, 90, 99)
BENCH_KEY = "sk-serve-bench"


# ---- workload -----------------------------------------------------------------------------------


class Session:
    """One conversation: its persona, and per turn a user message and the reply length."""

    def __init__(self, rng: random.Random, persona: list[int], vocab: int, quick: bool):
        self.persona = persona
        n_turns = rng.randint(2, 5)
        lo, hi = (8, 32) if quick else (32, 256)
        rlo, rhi = (4, 12) if quick else (64, 256)
        self.users = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n_turns)]
        self.reply_lens = [rng.randint(rlo, rhi) for _ in range(n_turns)]
        # what the history resends for each reply: fixed ids of the reply's length
        self.replies = [[rng.randrange(vocab) for _ in range(n)] for n in self.reply_lens]
        self.turn = 0

    def next_prompt(self) -> tuple[list[int], int]:
        """(prompt ids, max tokens) of the next turn; advances the session."""
        k = self.turn
        ids = list(self.persona)
        for u, r in zip(self.users[:k], self.replies[:k]):
            ids += u + r
        self.turn += 1
        return ids + self.users[k], self.reply_lens[k]

    @property
    def done(self) -> bool:
        return self.turn >= len(self.users)


class Workload:
    def __init__(self, vocab: int, personas: int, persona_len: int, seed: int, quick: bool):
        self.rng = random.Random(seed)
        self.vocab, self.quick = min(vocab, 10_000), quick
        self.personas = [[self.rng.randrange(self.vocab) for _ in range(persona_len)] for _ in range(personas)]

    def session(self) -> Session:
        return Session(self.rng, self.rng.choice(self.personas), self.vocab, self.quick)


def arrival_times(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    """Seconds from the start of each of n arrivals at `rate` per second on average."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if kind == "poisson" else rng.gammavariate(0.25, 1 / (0.25 * rate))
        out.append(t)
    return out


# ---- clients ------------------------------------------------------------------------------------


@dataclass
class Record:
    prompt_tokens: int
    scheduled: float  # perf_counter of the arrival
    chunks: list[float] = field(default_factory=list)  # perf_counter of each chunk with tokens
    tokens: int = 0
    cached: int = 0
    error: str | None = None


class StepLog:
    """--step-log: the engine thread's steps, timed: (seconds, prefill tokens, decode rows) of each
    step() call. With async scheduling a step launches one forward and collects the one before, so
    its time is about the longer of the GPU's work for the step before and the host's own."""

    BUCKETS = [(0, 0), (1, 256), (257, 1024), (1025, 1 << 30)]

    def __init__(self, engine):
        self.rows: list[tuple[float, int, int]] = []
        self._last = (0, 0)
        schedule, step = engine.scheduler.schedule, engine.step

        def timed_schedule():
            out = schedule()
            n = out.num_new_tokens
            self._last = (sum(k for k in n if k > 1), sum(1 for k in n if k == 1))
            return out

        def timed_step():
            t = time.perf_counter()
            outputs = step()
            self.rows.append((time.perf_counter() - t, *self._last))
            return outputs

        engine.scheduler.schedule, engine.step = timed_schedule, timed_step

    def summary(self) -> dict:
        """Per bucket of prefill tokens: steps, and their p50 / p99 / max duration in ms; then clear."""
        out = {}
        for lo, hi in self.BUCKETS:
            ms = sorted(1e3 * t for t, p, _ in self.rows if lo <= p <= hi)
            if ms:
                out[f"{lo}-{hi if hi < 1 << 30 else 'up'}"] = {
                    "steps": len(ms),
                    "p50_ms": ms[len(ms) // 2],
                    "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                    "max_ms": ms[-1],
                    "mean_decode_rows": statistics.mean(d for t, p, d in self.rows if lo <= p <= hi),
                }
        self.rows.clear()
        return out


class AsyncTarget:
    """AsyncLLM in this process; one user for every request (the personas' pages are shared)."""

    name = "async"

    def __init__(self, model: str, options: dict, step_log: bool = False):
        from chatengine import AsyncLLM

        self.llm = AsyncLLM(model, **options)
        self.steps = StepLog(self.llm.engine) if step_log else None
        freeze_heap()  # as the server does after start-up

    @property
    def vocab(self) -> int:
        return self.llm.vocab_size

    async def stream(self, ids: list[int], max_tokens: int, rec: Record) -> None:
        from chatengine import SamplingParams

        params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
        async for out in self.llm.generate(ids, params, user="bench"):
            n = len(out.outputs[0].token_ids)
            if n > rec.tokens:
                rec.chunks.append(time.perf_counter())
                rec.tokens = n
            rec.cached = out.num_cached_tokens

    async def aclose(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


class HttpTarget:
    """The /v1 API of a server in a child process (this script with --serve), over loopback. The
    client is lean (raw HTTP/1.1 on asyncio streams, one connection per request, a chunk's JSON
    parsed only when it carries usage) so that at 256 streams it measures the server, not itself;
    its own CPU time is reported next to the server's."""

    name = "http"

    def __init__(self, model: str, options: dict, engine_process: bool = False, script: str = __file__, env=None):
        """`script`: the file whose --serve starts the server (api_bench.py's: a stand-in replica)."""
        extra = ["--engine-process"] if engine_process else []
        self.proc = subprocess.Popen(
            [sys.executable, script, "--serve", "--model", model, "--engine-options", json.dumps(options), *extra],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r}")
        _, self.url, vocab = line.split()
        self.host, port = self.url.split("//", 1)[1].rstrip("/").split(":")
        self.port = int(port)
        self._vocab = int(vocab)

    @property
    def vocab(self) -> int:
        return self._vocab

    def server_cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (Linux /proc)."""
        fields = stat_fields(f"/proc/{self.proc.pid}/stat")
        if fields is None:
            raise OSError(f"no /proc stat for the server (pid {self.proc.pid})")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def stream(self, ids: list[int], max_tokens: int, rec: Record) -> None:
        body = json.dumps(
            {
                "model": "bench",
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0.6,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {BENCH_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(head + body)
            status = await reader.readline()
            if b" 200 " not in status:
                rec.error = f"HTTP {status.decode().strip()}: {(await reader.read(300))!r}"
                return
            while (await reader.readline()).strip():  # the headers (chunked or not: lines below)
                pass
            async for line in _sse_lines(reader):
                if line == b"data: [DONE]":
                    break
                if b'"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
                    rec.tokens = usage["completion_tokens"]
                    rec.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if b'"text":"' in line and b'"text":""' not in line:
                    rec.chunks.append(time.perf_counter())
        finally:
            writer.close()

    async def aclose(self) -> None:
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _sse_lines(reader: asyncio.StreamReader):
    """The `data: ...` lines of a streamed body, chunked transfer encoding or not: a chunk's size
    line is a bare hex number, never a `data:` line, and an SSE line never spans two chunks here
    (the server writes whole events)."""
    while True:
        line = await reader.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield line.rstrip(b"\r\n")


def serve(model: str, options: dict, engine_process: bool) -> None:
    """--serve: an AsyncLLM (or, with --engine-process, the engine in a process of its own: a
    DataParallelLLM of one replica) and the /v1 routes under uvicorn on loopback; prints READY url vocab."""
    from chatengine import AsyncLLM, DataParallelLLM
    from chatengine.app.api.routes import build_api
    from chatengine.app.server import ServerThread

    llm = DataParallelLLM(model, data_parallel_size=1, **options) if engine_process else AsyncLLM(model, **options)
    server = ServerThread(build_api(llm, {"bench": {"api_key": BENCH_KEY}}, model_name="bench"))
    freeze_heap()  # as `chatengine serve` does after start-up
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("READY", server.url, llm.vocab_size, flush=True)
    stop.wait()
    server.stop()
    llm.shutdown()


# ---- runs ---------------------------------------------------------------------------------------


async def warm(target, workload: Workload) -> None:
    """CUDA graphs captured and each persona seen once (production keeps its personas warm)."""
    recs = [Record(len(p), time.perf_counter()) for p in workload.personas]
    await asyncio.gather(*(target.stream(p + [1, 2, 3], 8, r) for p, r in zip(workload.personas, recs)))
    n = 4 if workload.quick else 64  # a batch of 64: the decode graphs most rates use
    bursts = [[random.Random(i).randrange(workload.vocab) for _ in range(40 + i)] for i in range(n)]
    await asyncio.gather(*(target.stream(b, 16, Record(len(b), 0)) for b in bursts))


async def run_rate(target, workload: Workload, rate: float, n: int, args) -> tuple[list[Record], float]:
    rng = random.Random(args.seed * 1000 + int(rate * 10))
    times = arrival_times(n, rate, args.arrivals, rng)
    ready: list[Session] = []
    tasks = []

    async def turn(sess: Session, ids: list[int], max_tokens: int, rec: Record) -> None:
        try:
            await target.stream(ids, max_tokens, rec)
        except Exception as e:  # a failed request counts as one, the run goes on
            rec.error = f"{type(e).__name__}: {e}"
        if not sess.done:
            ready.append(sess)

    t0 = time.perf_counter()
    for at in times:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        sess = ready.pop(rng.randrange(len(ready))) if ready and rng.random() < args.return_share else None
        sess = sess or workload.session()
        ids, max_tokens = sess.next_prompt()
        rec = Record(len(ids), t0 + at)
        tasks.append((rec, asyncio.create_task(turn(sess, ids, max_tokens, rec))))
    await asyncio.gather(*(t for _, t in tasks))
    return [r for r, _ in tasks], time.perf_counter() - t0


def pct(values: list[float], p: float) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else None


def summarize(recs: list[Record], wall: float, args) -> dict:
    ok = [r for r in recs if r.error is None and r.chunks]
    ttft = [1e3 * (r.chunks[0] - r.scheduled) for r in ok]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tpot = [1e3 * (r.chunks[-1] - r.chunks[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    e2e = [1e3 * (r.chunks[-1] - r.scheduled) for r in ok]
    good = [
        r
        for r, t in zip(ok, ttft)
        if t <= args.slo_ttft_ms
        and (r.tokens <= 1 or 1e3 * (r.chunks[-1] - r.chunks[0]) / (r.tokens - 1) <= args.slo_tpot_ms)
    ]
    out = {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "first_errors": [r.error for r in recs if r.error][:3],
        "seconds": wall,
        "output_tok_s": sum(r.tokens for r in ok) / wall,
        "goodput_req_s": len(good) / wall,
        "prefix_hit_rate": sum(r.cached for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
    }
    for name, vals in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        for p in PCTS:
            out[f"{name}_p{p}_ms"] = pct(vals, p)
    return out


async def closed_loop(target, workload: Workload, streams: int, n: int) -> dict:
    """n single turns (persona + message), `streams` at a time: output tokens/s."""
    prompts = [workload.session().next_prompt() for _ in range(n)]
    recs = [Record(len(p), 0.0) for p, _ in prompts]
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            recs[i].scheduled = time.perf_counter()
            await target.stream(prompts[i][0], prompts[i][1], recs[i])

    server_cpu = getattr(target, "server_cpu_s", None)
    t0, c0, s0 = time.perf_counter(), time.process_time(), server_cpu() if server_cpu else 0.0
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in recs)
    out = {"streams": streams, "requests": n, "seconds": wall, "output_tok_s": tokens / wall, "tokens": tokens}
    out["errors"] = sum(1 for r in recs if r.error)
    if server_cpu:  # (in process, the engine's CPU is this process's too)
        out["client_cpu_share"] = (time.process_time() - c0) / wall  # of one core: near 1, the client limits
        out["server_cpu_share"] = (server_cpu() - s0) / wall
    return out


def engine_options(args, cache: str) -> dict:
    opts = dict(json.loads(args.engine_options))
    opts["enable_prefix_caching"] = cache == "on"
    return opts


async def bench_target(kind: str, cache: str, args) -> dict:
    if kind == "async":
        target = await asyncio.to_thread(AsyncTarget, args.model, engine_options(args, cache), args.step_log)
    else:
        target = await asyncio.to_thread(HttpTarget, args.model, engine_options(args, cache), args.engine_process)
    try:
        workload = Workload(target.vocab, args.personas, args.persona_len, args.seed, args.quick)
        await warm(target, workload)
        steps = getattr(target, "steps", None)
        if steps is not None:
            steps.summary()  # the warm-up's steps go
        rows = {}
        for rate in args.rates:
            recs, wall = await run_rate(target, workload, rate, args.requests, args)
            rows[str(rate)] = summarize(recs, wall, args)
            r = rows[str(rate)]
            if steps is not None:
                r["steps"] = steps.summary()
                for bucket, st in r["steps"].items():
                    log(
                        f"[{kind} cache {cache}] {rate}/s steps with {bucket} prefill tokens: {st['steps']}, "
                        f"p50 {st['p50_ms']:.1f} p99 {st['p99_ms']:.1f} max {st['max_ms']:.1f} ms, "
                        f"{st['mean_decode_rows']:.1f} decode rows"
                    )
            log(
                f"[{kind} cache {cache}] {rate}/s: TTFT p50 {fmt(r['ttft_p50_ms'])} p99 {fmt(r['ttft_p99_ms'])}, "
                f"ITL p50 {fmt(r['itl_p50_ms'])} p99 {fmt(r['itl_p99_ms'])}, {r['output_tok_s']:.0f} tok/s, "
                f"hit {r['prefix_hit_rate']:.2f}, errors {r['errors']}"
            )
        result = {"rates": rows}
        if args.concurrency and cache == "on":
            result["closed_loop"] = await closed_loop(target, workload, args.concurrency, args.concurrency_requests)
            loop = result["closed_loop"]
            log(
                f"[{kind}] {args.concurrency} streams: {loop['output_tok_s']:.0f} tok/s, errors {loop['errors']}"
                + (
                    f", CPU client {loop['client_cpu_share']:.2f} server {loop['server_cpu_share']:.2f} cores"
                    if "server_cpu_share" in loop
                    else ""
                )
            )
        return result
    finally:
        await target.aclose()


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f} ms"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- report -------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    m = report["meta"]
    L = [
        f"# Serving benchmark — {m['device']}",
        "",
        f"commit `{m['commit']}`, {m['date']}, model `{m['model']}`, {m['arrivals']} arrivals, "
        f"{m['requests']} requests per rate, {m['personas']} personas of {m['persona_len']} tokens; "
        f"SLO TTFT ≤ {m['slo_ttft_ms']} ms, TPOT ≤ {m['slo_tpot_ms']} ms.",
        "",
        f"`{m['command']}`",
        "",
        "| target | prefix cache | rate/s | TTFT p50 | p90 | p99 | ITL p50 | p99 | TPOT p50 | p99 | e2e p50 | p99 "
        "| tok/s | goodput req/s | hit rate | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, res in report["results"].items():
        kind, cache = key.split("/")
        for rate, r in res["rates"].items():
            cells = [
                r[f"{n}_p{p}_ms"]
                for n, ps in (("ttft", PCTS), ("itl", (50, 99)), ("tpot", (50, 99)), ("e2e", (50, 99)))
                for p in ps
            ]
            L.append(
                f"| {kind} | {cache} | {rate} | "
                + " | ".join("-" if c is None else f"{c:.1f}" for c in cells)
                + f" | {r['output_tok_s']:.0f} | {r['goodput_req_s']:.2f} | {r['prefix_hit_rate']:.2f}"
                + f" | {r['errors']} |"
            )
    loops = {k: v["closed_loop"] for k, v in report["results"].items() if "closed_loop" in v}
    if loops:
        L += ["", "Closed loop (single turns, prefix cache on):", "", "| target | streams | tok/s |", "|---|---:|---:|"]
        L += [f"| {k.split('/')[0]} | {v['streams']} | {v['output_tok_s']:.0f} |" for k, v in loops.items()]
        a, h = loops.get("async/on"), loops.get("http/on")
        if a and h:
            L += ["", f"HTTP / AsyncLLM throughput: {h['output_tok_s'] / a['output_tok_s']:.3f}"]
    return "\n".join(L) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, res in report["results"].items():
        rates = [float(r) for r in res["rates"]]
        for ax, metric in zip(axes, ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms")):
            ys = [r[metric] if r[metric] is not None else float("nan") for r in res["rates"].values()]
            ax.plot(rates, ys, marker="o", label=f"{key.replace('/', ', cache ')}")
    for ax, title in zip(axes, ("TTFT p50", "TTFT p99", "ITL p99")):
        ax.set(title=title, xlabel="arrival rate (requests/s)", ylabel="ms", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{report['meta']['model']} on {report['meta']['device']} ({report['meta']['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--rates", nargs="+", type=float, default=[5.0, 20.0, 60.0])
    ap.add_argument("--requests", type=int, default=400, help="arrivals per rate")
    ap.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    ap.add_argument("--targets", nargs="+", choices=["async", "http"], default=["async", "http"])
    ap.add_argument("--cache", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--personas", type=int, default=4)
    ap.add_argument("--persona-len", type=int, default=1500)
    ap.add_argument("--return-share", type=float, default=0.7, help="arrivals that continue a finished session")
    ap.add_argument("--slo-ttft-ms", type=float, default=200.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0)
    ap.add_argument("--concurrency", type=int, default=0, help="closed loop of N streams per target (0: none)")
    ap.add_argument("--concurrency-requests", type=int, default=1024)
    ap.add_argument("--engine-options", default="{}", help='JSON of LLM options (e.g. \'{"device": "cpu"}\')')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="short messages and replies (a smoke run)")
    ap.add_argument("--step-log", action="store_true", help="async: time the engine's steps, by prefill tokens in them")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="the http target's server runs its engine in a process of its own (serve --engine-process)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return ap


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


def main(argv=None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.serve:
        serve(args.model, json.loads(args.engine_options), args.engine_process)
        return None
    results = {}
    for kind in args.targets:
        for cache in args.cache:
            results[f"{kind}/{cache}"] = asyncio.run(bench_target(kind, cache, args))
    meta = {
        "device": device_name(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "command": "python benchmarks/serve_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{
            k: getattr(args, k)
            for k in (
                "arrivals",
                "requests",
                "personas",
                "persona_len",
                "slo_ttft_ms",
                "slo_tpot_ms",
                "rates",
                "engine_process",
            )
        },
    }
    report = {"meta": meta, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"serve_bench-{time.strftime('%Y-%m-%dT%H%M')}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    plot(report, stem.with_suffix(".png"))
    print(markdown(report))
    log(f"saved {stem}.json, .md, .png")
    return report


if __name__ == "__main__":
    main()
