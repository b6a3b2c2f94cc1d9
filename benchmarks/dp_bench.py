"""Replicas: the chat workload on one engine and on N data-parallel replicas, same run.

    python benchmarks/dp_bench.py --model /tmp/m1b [--replicas 2] [--users 128] [--turns 4]
        [--personas 4] [--persona-tokens 1500] [--engine-options '{"gpu_memory_utilization": 0.85}']
    python benchmarks/dp_bench.py --model <tiny chat model dir> --device cpu --quick   # a smoke run

The workload (fixed by --seed): --users users, each a conversation of --turns turns on one of
--personas public personas (system prompts of about --persona-tokens tokens, registered, so
warmed on every replica); a turn is a user message of 32-256 tokens (8-24 with --quick) and a
reply of 64-256 tokens (4-12), ignore_eos, temperature 0.6; a turn resends the whole history as the
app does: the token ids of the last prompt, of the reply generated, and of the next user turn
(chatengine.app.chat.TurnTemplate; the messages are tokenized before the clock starts, as clients'
own work). Every user starts at once and sends the next turn when the last
reply has finished: a closed loop of --users streams.

--model needs a tokenizer and a chat template (a Hugging Face directory: on a GPU machine
`python benchmarks/random_hf_model.py --tokenizer <dir> --shape llama-3.2-1b --out /tmp/m1b` gives
random weights of a real shape). One engine is AsyncLLM on GPU 0 (--one async: the engine thread
and the clients share a process), or DataParallelLLM with one replica (--one replica: the engine in a
process of its own behind the API process, as each of the N is), or both; N replicas are
DataParallelLLM on GPUs 0..N-1. Reports output tokens/s, the ratio N : 1 against the faster one-engine
row (the goal on two GPUs: >= 1.8x), the prefix hit rate (cached / prompt tokens) of each, TTFT
p50/p99, how the router sent the turns, and the CPU of the benchmark's process (all its threads, and
its event loop's thread alone: near 1.0 the loop is the limit). Saves JSON + markdown under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from benchmarks.prefix_bench import filler  # noqa: E402


class Conversation:
    def __init__(self, rng: random.Random, tok, system: str, turns: int, quick: bool):
        lo, hi, rlo, rhi = (8, 24, 4, 12) if quick else (32, 256, 64, 256)
        self.system = system
        self.users = [filler(rng, tok, rng.randint(lo, hi)) for _ in range(turns)]
        self.reply_lens = [rng.randint(rlo, rhi) for _ in range(turns)]


def workload(tok, args) -> tuple[list[str], list[Conversation]]:
    rng = random.Random(args.seed)
    personas = [filler(rng, tok, args.persona_tokens, head=f"You are helper {i}.") for i in range(args.personas)]
    conversations = [
        Conversation(rng, tok, personas[i % args.personas], args.turns, args.quick) for i in range(args.users)
    ]
    return personas, conversations


def make_engine(kind: str, args):
    """kind: "async" (AsyncLLM) or a replica count ("1", "2", ...) for DataParallelLLM."""
    from chatengine import AsyncLLM, DataParallelLLM

    options = {"device": args.device, **json.loads(args.engine_options)}
    options = {k: v for k, v in options.items() if v is not None}
    if kind == "async":
        return AsyncLLM(args.model, **options)
    engine = DataParallelLLM(args.model, data_parallel_size=int(kind), **options)
    if args.no_capacity_rule:  # the router's rebalancing without its replicas' capacity (a comparison)
        engine.router.capacity = None
    return engine


async def run(engine, personas: list[str], conversations: list[Conversation], args) -> dict:
    from chatengine import SamplingParams

    for i, system in enumerate(personas):  # public: shared across users, warmed on every replica
        engine.register_persona(f"bench-{i}", system)
    warm = [engine.apply_chat_template([{"role": "user", "content": f"warm {i}"}]) for i in range(32)]
    await asyncio.gather(*(_drain(engine, ids, SamplingParams(max_tokens=8), f"warm{i}") for i, ids in enumerate(warm)))
    ttft, tokens, prompt_tokens, cached = [], 0, 0, 0

    from chatengine.app.chat import TurnTemplate

    turns = TurnTemplate(engine)

    # the client's tokenizing, done before the clock starts: the users' messages are fixed, and 512
    # conversations opened at once kept the event loop from the engines for seconds (most of a run)
    opening = [
        engine.apply_chat_template([{"role": "system", "content": c.system}, {"role": "user", "content": c.users[0]}])
        for c in conversations
    ]
    later = [[turns.user_ids(text) for text in c.users[1:]] for c in conversations]

    async def user(index: int, conv: Conversation) -> None:
        nonlocal tokens, prompt_tokens, cached
        ids = opening[index]
        reply: list[int] = []
        for k in range(args.turns):
            if k:
                ids = ids + turns.assistant_ids(reply) + later[index][k - 1]
            params = SamplingParams(max_tokens=conv.reply_lens[k], temperature=0.6, ignore_eos=True)
            t0, first, out = time.perf_counter(), None, None
            async for out in engine.generate(ids, params, user=f"user{index}"):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
            assert out is not None and first is not None
            reply = out.outputs[0].token_ids
            ttft.append(1e3 * (first - t0))
            tokens += len(out.outputs[0].token_ids)
            prompt_tokens += len(ids)
            cached += out.num_cached_tokens

    t0, cpu0, loop0 = time.perf_counter(), time.process_time(), time.thread_time()
    timeline: list = []
    watcher = asyncio.create_task(watch(engine, t0, timeline))
    await asyncio.gather(*(user(i, c) for i, c in enumerate(conversations)))
    wall = time.perf_counter() - t0
    watcher.cancel()
    cpu, loop_cpu = (time.process_time() - cpu0) / wall, (time.thread_time() - loop0) / wall
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else [ttft[0]] * 99
    stats = engine.stats()
    return {
        "seconds": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "prefix_hit_rate": cached / max(1, prompt_tokens),
        "ttft_p50_ms": q[49],
        "ttft_p99_ms": q[98],
        "router": stats.get("router"),
        "process_cores": cpu,
        "loop_cores": loop_cpu,
        "timeline": timeline,
    }


def occupancy(timeline: list) -> str:
    """Each engine's mean running and waiting sequences over the run's samples."""
    if not timeline:
        return "no samples"
    each = list(zip(*(engines for _, engines in timeline)))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    parts = [f"{mean([r for r, _ in e]):.0f} / {mean([w for _, w in e]):.0f}" for e in each]
    return "running / waiting " + ", ".join(parts)


async def watch(engine, t0: float, timeline: list, every: float = 0.25) -> None:
    """Every `every` s: (seconds, [(running, waiting) of each engine]) from the engines' own figures
    (a replica publishes them every 0.2 s): whether a replica queued while another had room."""
    while True:
        stats = engine.stats()
        each = stats.get("replicas") or [stats]
        timeline.append(
            (round(time.perf_counter() - t0, 2), [(s.get("num_running", 0), s.get("num_waiting", 0)) for s in each])
        )
        await asyncio.sleep(every)


async def _drain(engine, ids, params, user) -> None:
    async for _ in engine.generate(ids, params, user=user):
        pass


LABELS = {"1": "1 replica (DataParallelLLM)", "async": "1 engine (AsyncLLM)"}


def baseline(rows: dict) -> float:
    """The one-engine figure the ratios are taken against: the faster of the one-engine rows."""
    return max(rows[k]["output_tok_s"] for k in ("async", "1") if k in rows)


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["results"]
    lines = [
        f"# dp_bench — {meta['device']}, commit {meta['commit']}",
        "",
        f"`{meta['command']}`",
        "",
        "| engine | output tok/s | ratio | prefix hit rate | TTFT p50 | TTFT p99 | process / loop cores | routed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = baseline(rows)
    for n, r in rows.items():
        routed = ", ".join(f"{k} {v}" for k, v in (r["router"] or {}).items() if k != "load") or "-"
        cores = f"{r['process_cores']:.2f} / {r['loop_cores']:.2f}" if "loop_cores" in r else "-"
        lines.append(
            f"| {LABELS.get(n, n + ' replicas')} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / base:.2f}x | "
            f"{r['prefix_hit_rate']:.3f} | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms | {cores} | {routed} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory with a tokenizer")
    ap.add_argument("--device", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--one",
        choices=["async", "replica", "both"],
        default="async",
        help="the one-engine row: AsyncLLM, DataParallelLLM with one replica, or both (ratios against the faster)",
    )
    ap.add_argument("--users", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--personas", type=int, default=4)
    ap.add_argument("--persona-tokens", type=int, default=1500)
    ap.add_argument("--engine-options", default="{}", help="JSON of engine settings for every replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="short messages and replies (a smoke run)")
    ap.add_argument(
        "--no-capacity-rule",
        action="store_true",
        help="the router ignores its replicas' capacity (max_num_seqs) when it rebalances: a comparison",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    personas, conversations = workload(tok, args)
    results = {}
    kinds = {"async": ["async"], "replica": ["1"], "both": ["async", "1"]}[args.one]
    kinds += [str(args.replicas)] if args.replicas > 1 else []
    for kind in kinds:
        engine = make_engine(kind, args)
        try:
            results[kind] = asyncio.run(run(engine, personas, conversations, args))
        finally:
            engine.shutdown()
        r = results[kind]
        print(
            f"{LABELS.get(kind, kind + ' replicas')}: {r['output_tok_s']:.0f} tok/s, hit {r['prefix_hit_rate']:.3f}, "
            f"cores {r['process_cores']:.2f} (loop {r['loop_cores']:.2f}); {occupancy(r['timeline'])}",
            flush=True,
        )
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    meta = {
        "device": f"{device} x{args.replicas}" if device != "CPU" else device,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python benchmarks/dp_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    report = {"meta": meta, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"dp_bench-{time.strftime('%Y-%m-%dT%H%M')}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
