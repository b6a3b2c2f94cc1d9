"""The API process alone: its CPU per streamed token, against a replica that runs no model.

    python benchmarks/api_bench.py [--streams 256] [--requests 1024] [--prompt-len 16]
        [--max-tokens 256] [--step-ms 4] [--rounds 3] [--model dummy:tiny]

`serve --engine-process` puts the engine in a process of its own (engine/replicas/); the API
process (uvicorn, the routes, the deltas put back together, SSE) then has a core to itself and
its GIL, and at 256 streams on a GPU it is the bottleneck. This runs that API process as
serve_bench's http target does (one replica, the same lean HTTP client, /v1/completions with
token-id prompts streamed with usage), but its replica is a stand-in: every --step-ms it adds one
token to each running request and sends the step's deltas as a real replica does (DeltaEncoder,
one pipe message a step). So the engine is never the limit, on any machine, and the figures are
the API process's: output tokens/s, and its CPU seconds per 1000 streamed tokens (from
/proc/<pid>/stat). A step every 4 ms at 256 streams offers 64k tokens/s, more than one core
relays: a reader that lags gets several tokens a chunk. A slow step (--step-ms 30) keeps it at one
token a chunk. Tokens are counted from usage, not chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.common import save_json  # noqa: E402
from benchmarks.serve_bench import HttpTarget, Record  # noqa: E402

WORDS = [" the", " of", " and", " to", " a", " in", " that", " is", " was", "é", "\n", ' "quoted"', " x\\y", " 12"]


def stand_in_replica(spec, conn) -> None:
    """A replica's process without an engine (replica.py's pipe protocol): one token a running
    request every FAKE_STEP_S seconds, the step's deltas in one ("out", deltas, []) message; a
    request's delta every stream_interval steps (its first token and its end at once), as an engine's,
    or as a replica's engine chunks them when it is None (replica.relay_interval)."""
    from chatengine.engine.replicas.deltas import DeltaEncoder
    from chatengine.engine.replicas.replica import relay_interval
    from chatengine.outputs import CompletionOutput, RequestOutput

    step_s = float(os.environ["CHATENGINE_API_BENCH_STEP_S"])
    conn.send(("ready", {"num_blocks": 1 << 20, "model_id": "stand-in", "stats": {}}))
    lock, stop = threading.Lock(), threading.Event()
    # request id -> [max_tokens, aborted, arrival, prompt ids, CompletionOutput, steps held]
    running: dict[str, list] = {}

    def read() -> None:
        while True:
            try:
                m = conn.recv()
            except (EOFError, OSError):
                m = ("stop",)
            with lock:
                if m[0] == "add":
                    c = CompletionOutput(0, "", [], logprobs=[] if m[4].logprobs is not None else None)
                    running[m[1]] = [m[4].max_tokens, False, time.monotonic(), m[3], c, None]
                elif m[0] == "abort" and m[1] in running:
                    running[m[1]][1] = True
                elif m[0] == "stop":
                    stop.set()
                    return

    threading.Thread(target=read, daemon=True).start()
    encoder, k, relay = DeltaEncoder(), 0, relay_interval(getattr(spec, "replicas", 1))
    while not stop.is_set():
        t0 = time.monotonic()
        deltas = []
        with lock:
            interval = spec.config.stream_interval or relay(len(running))
            for rid, entry in list(running.items()):
                max_tokens, aborted, arrival, ids, c, held = entry
                if not aborted:
                    k += 1
                    c.token_ids.append(k % 256)
                    c.text += WORDS[k % len(WORDS)]
                    if c.logprobs is not None:
                        c.logprobs.append({k % 256: -0.5, 7: -1.5})
                    c.cumulative_logprob = -0.5 * len(c.token_ids)
                done = aborted or len(c.token_ids) >= max_tokens
                if done:
                    c.finish_reason = "abort" if aborted else "length"
                    del running[rid]
                entry[5] = 0 if done or held is None or held + 1 >= interval else held + 1
                if entry[5] == 0:
                    deltas.append(encoder.encode(RequestOutput(rid, None, ids, [c], 0, done, None, arrival, arrival)))
        if deltas:
            conn.send(("out", deltas, []))
        time.sleep(max(0.0, step_s - (time.monotonic() - t0)))
    conn.send(("stopped",))


def serve(model: str) -> None:
    """--serve: serve_bench's server with --engine-process, its one replica the stand-in."""
    import types

    from chatengine.engine.replicas import handle

    handle.replica = types.SimpleNamespace(main=stand_in_replica)  # what ReplicaHandle spawns
    serve_bench.serve(model, {"device": "cpu", "register_personas": False}, engine_process=True)


def start_server(args) -> HttpTarget:
    env = {**os.environ, "CHATENGINE_API_BENCH_STEP_S": str(args.step_ms / 1000)}
    return HttpTarget(args.model, {}, engine_process=True, script=__file__, env=env)


async def one_round(target: HttpTarget, args, rng: random.Random) -> dict:
    prompts = [[rng.randrange(target.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    recs = [Record(args.prompt_len, 0.0) for _ in prompts]
    queue = list(range(args.requests))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await target.stream(prompts[i], args.max_tokens, recs[i])

    cpu0, client0, t0 = target.server_cpu_s(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.streams)))
    wall = time.perf_counter() - t0
    cpu = target.server_cpu_s() - cpu0
    tokens = sum(r.tokens for r in recs)
    return {
        "output_tok_s": tokens / wall,
        "tokens": tokens,
        "chunks": sum(len(r.chunks) for r in recs),
        "errors": sum(1 for r in recs if r.error),
        "api_cpu_s_per_1k_tokens": 1000 * cpu / max(1, tokens),
        "api_cores": cpu / wall,
        "client_cores": (time.process_time() - client0) / wall,
    }


async def run(args) -> list[dict]:
    target = await asyncio.to_thread(start_server, args)
    try:
        rng = random.Random(args.seed)
        warm = [[rng.randrange(target.vocab) for _ in range(8)] for _ in range(args.streams)]
        await asyncio.gather(*(target.stream(p, 4, Record(8, 0.0)) for p in warm))
        rounds = []
        for _ in range(args.rounds):
            rounds.append(await one_round(target, args, rng))
            r = rounds[-1]
            print(
                f"{r['output_tok_s']:.0f} tok/s, {r['tokens'] / max(1, r['chunks']):.2f} tokens a chunk, API "
                f"{r['api_cpu_s_per_1k_tokens']:.4f} CPU s per 1000 tokens ({r['api_cores']:.2f} cores), client "
                f"{r['client_cores']:.2f} cores, errors {r['errors']}",
                file=sys.stderr,
                flush=True,
            )
        return rounds
    finally:
        await target.aclose()


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:tiny", help="its tokenizer and shape only: no weights are used")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024, help="per round")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=4.0, help="the stand-in replica's step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine-options", help=argparse.SUPPRESS)  # (HttpTarget passes them; the stand-in needs none)
    ap.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.model)
        return None
    rounds = asyncio.run(run(args))
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    report, path = save_json("api_bench", args, argv, {"rounds": rounds, "median": median}, skip=("serve", "out"))
    print(json.dumps(median))
    print(f"saved {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
