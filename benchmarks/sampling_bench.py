"""What structured outputs and logprobs cost the other requests, through AsyncLLM, in one run.

`--clients` concurrent streams (closed loop) run `--requests` requests (random prompt ids of
100..512 tokens, `--max-tokens` new tokens, temperature 0.6, ignore_eos for the plain ones):
  plain      every request plain
  json       a quarter of the requests constrained by a JSON schema (they end when the object
             is complete), the rest plain: the plain requests' time per output token (TPOT) and
             tokens/s against `control`'s
  control    json's round again with its quarter plain, each as long as it was under its grammar
             (the same arrivals and lengths without grammars: what the grammars themselves cost)
  json-bounded, control-bounded   the same with a schema whose strings and array are bounded
             (maxLength / maxItems: a mask fill inside such a string costs ~8x an open one's)
  control-again  control's round once more, run after it: how far two rounds of the same work
             differ on this host (the noise a json round's ratio must be read against)
  logprobs   every request with logprobs=5, its client reading each new token's candidates as a
             streaming client does: total tokens/s against `plain`'s
Rounds alternate (plain, json, control, control-again, json-bounded, control-bounded, logprobs) x --rounds; the
table gives medians and ratios. --model needs a tokenizer (grammars): the default model, or a
random-weight directory of a real shape (benchmarks/random_hf_model.py); --logprob-model
(dummy:llama-3.2-1b, a 128k vocabulary) runs plain and logprobs too. Saves JSON + markdown under --out.

    python benchmarks/sampling_bench.py [--model DIR] [--requests 256 --clients 64 --rounds 3] [--dry-run]
        [--kinds plain logprobs] [--engine-process] [--switch-interval S]

--engine-process runs the engine in a process of its own (DataParallelLLM with one replica, as
`serve --engine-process`), so the clients' Python work never takes the engine's interpreter lock.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ThreadBusy, commit, freeze_heap  # noqa: E402
from chatengine import AsyncLLM, DataParallelLLM, SamplingParams, StructuredOutputs  # noqa: E402

OPEN_SCHEMA = {  # as a pydantic model with a str, an int and a list[str] gives it
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


KINDS = ["plain", "json", "control", "control-again", "json-bounded", "control-bounded", "logprobs"]


def json_of(kind: str) -> str:
    """The json round whose lengths a control round repeats."""
    return "json-bounded" if kind == "control-bounded" else "json"


def workload(n: int, max_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 10000)) for _ in range(rng.randint(100, 512))] for _ in range(n)]


def params_for(kind: str, i: int, max_tokens: int, lengths: dict[int, int]) -> SamplingParams:
    common = dict(temperature=0.6, max_tokens=max_tokens)
    if kind.startswith("json") and i % 4 == 0:
        schema = SCHEMA if kind.endswith("bounded") else OPEN_SCHEMA
        return SamplingParams(**common, structured_outputs=StructuredOutputs(json=schema))
    if kind.startswith("control") and i % 4 == 0:
        return SamplingParams(temperature=0.6, max_tokens=max(lengths[json_of(kind)][i], 1), ignore_eos=True)
    if kind == "logprobs":
        return SamplingParams(**common, ignore_eos=True, logprobs=5)
    return SamplingParams(**common, ignore_eos=True)


async def run_round(llm: AsyncLLM, prompts, kind: str, clients: int, max_tokens: int, lengths: dict) -> dict:
    """One round; `lengths` (json kind -> request index -> tokens of its constrained output) is
    filled by a json round and read by its control round."""
    todo = list(enumerate(prompts))
    records = []

    async def client():
        while todo:
            i, ids = todo.pop()
            p = params_for(kind, i, max_tokens, lengths)
            t0, first, n, read, candidates = time.perf_counter(), None, 0, 0, 0
            async for out in llm.generate(ids, p):
                c = out.outputs[0]
                n = len(c.token_ids)
                if first is None and n:
                    first = time.perf_counter()
                if c.logprobs is not None:  # as a streaming client does: each new token's candidates, once
                    candidates += sum(len(d) for d in c.logprobs[read:n])
                    read = n
            end = time.perf_counter()
            plain = not kind.startswith(("json", "control")) or i % 4 != 0
            if kind.startswith("json") and not plain:
                lengths.setdefault(kind, {})[i] = n
            records.append(
                {"plain": plain, "tokens": n, "candidates": candidates, "ttft": first - t0,
                 "tpot": (end - first) / max(n - 1, 1)}
            )  # fmt: skip

    threads = ThreadBusy(engine_thread(llm))
    threads.mark()
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    busy = threads.busy()
    plain = [r for r in records if r["plain"]]
    return {
        "kind": kind,
        "wall_s": wall,
        "tok_s": sum(r["tokens"] for r in records) / wall,
        "plain_tok_s": sum(r["tokens"] for r in plain) / wall,
        "plain_tpot_ms_p50": 1e3 * statistics.median(r["tpot"] for r in plain),
        "plain_tpot_ms_p90": 1e3 * statistics.quantiles([r["tpot"] for r in plain], n=10)[-1],
        "plain_ttft_ms_p50": 1e3 * statistics.median(r["ttft"] for r in plain),
        "constrained": len(records) - len(plain),
        "logprob_candidates": sum(r["candidates"] for r in records),  # read by the clients
        "constrained_tokens_mean": statistics.mean([r["tokens"] for r in records if not r["plain"]] or [0]),
        **{f"busy_{k}": v for k, v in busy.items()},  # the threads' CPU over the wall time
    }


def engine_thread(llm) -> tuple[int, int]:
    """(pid, tid) of the engine's loop: the replica process's main thread, or AsyncLLM's loop thread."""
    if isinstance(llm, DataParallelLLM):
        pid = llm.replicas[0].process.pid
        return pid, pid
    return os.getpid(), llm._thread.native_id


def bench_model(model: str, kinds: list[str], args) -> list[dict]:
    options = {"device": "cpu", "dtype": "float32"} if args.dry_run else {}
    if args.engine_process:
        llm = DataParallelLLM(model, data_parallel_size=1, **options)
    else:
        llm = AsyncLLM(model, **options)
    freeze_heap()  # as `chatengine serve` does after start-up
    prompts = workload(args.requests, args.max_tokens, llm.vocab_size)
    rows = []

    async def main():
        warm = prompts[: max(4, args.clients)]
        await run_round(llm, warm, "plain", args.clients, 16, {})  # warm-up: graphs, allocator
        for kind in [k for k in kinds if k.startswith("json")]:  # the grammar compiler and both schemas
            await run_round(llm, warm[:4], kind, 4, 16, {})
        for r in range(args.rounds):
            lengths: dict[str, dict[int, int]] = {}
            for kind in kinds:
                row = await run_round(llm, prompts, kind, args.clients, args.max_tokens, lengths)
                rows.append({"model": model or "default", "round": r, **row})
                print(json.dumps(rows[-1]), flush=True)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    return rows


def _paired_ratios(rows: list[dict], model: str, kind: str, control: str) -> list[float]:
    """Each round's plain TPOT under `kind` over its `control` round's (run after it in the same
    round): on a host whose speed drifts, rounds minutes apart say less than a pair run together."""
    tpot = {(r["kind"], r["round"]): r["plain_tpot_ms_p50"] for r in rows if r["model"] == model}
    return [tpot[kind, i] / tpot[control, i] for k, i in sorted(tpot) if k == kind and (control, i) in tpot]


def summarize(rows: list[dict]) -> list[str]:
    lines = [
        "| model | run | tok/s | plain tok/s | plain TPOT p50 ms | p90 ms | plain TTFT p50 ms "
        "| busy: API / engine / other | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        med = {}
        for kind in dict.fromkeys(r["kind"] for r in rows if r["model"] == model):
            sel = [r for r in rows if r["model"] == model and r["kind"] == kind]
            med[kind] = {k: statistics.median(r[k] for r in sel) for k in sel[0] if isinstance(sel[0][k], float)}
        for kind, m in med.items():
            control = kind.replace("json", "control") if kind.startswith("json") else "control"
            if kind == "control-again" and control in med:
                paired = _paired_ratios(rows, model, kind, control)
                each = ", ".join(f"{x:.3f}" for x in paired)
                ratio = f"plain TPOT x{statistics.median(paired):.3f} of control's, same round ({each}): the noise"
            elif kind.startswith("json") and control in med:
                paired = _paired_ratios(rows, model, kind, control)
                ratio = (
                    f"plain TPOT x{m['plain_tpot_ms_p50'] / med[control]['plain_tpot_ms_p50']:.3f} of {control}'s; "
                    f"same round: x{statistics.median(paired):.3f} ({', '.join(f'{x:.3f}' for x in paired)})"
                )
            elif kind == "logprobs" and "plain" in med:
                ratio = f"tok/s x{m['tok_s'] / med['plain']['tok_s']:.3f}"
            else:
                ratio = "1"
            lines.append(
                f"| {model} | {kind} | {m['tok_s']:.0f} | {m['plain_tok_s']:.0f} | "
                f"{m['plain_tpot_ms_p50']:.2f} | {m['plain_tpot_ms_p90']:.2f} | "
                f"{m['plain_ttft_ms_p50']:.0f} | {_busy(m)} | {ratio} |"
            )
    return lines


def _busy(m: dict) -> str:
    """The median round's thread loads: the API process's main thread (event loop and clients), the
    engine's loop (the replica's main thread with --engine-process, else AsyncLLM's loop thread), the
    busiest thread besides."""
    keys = ("busy_api_main", "busy_engine_main", "busy_other_max")
    return " / ".join(f"{m[k]:.0%}" for k in keys) if all(k in m for k in keys) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model with a tokenizer (default: the embedded one)")
    ap.add_argument("--logprob-model", default="dummy:llama-3.2-1b", help="'' to skip")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) for the run: how soon the engine thread gets the GIL back from the clients'",
    )
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS, help="rounds to run, in this order")
    ap.add_argument("--engine-process", action="store_true", help="the engine in a process of its own")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny counts: checks the script runs")
    args = ap.parse_args()
    if args.dry_run:
        args.requests, args.clients, args.max_tokens, args.rounds, args.logprob_model = 8, 4, 8, 1, ""
    for kind in args.kinds:
        if kind.startswith("control") and json_of(kind) not in args.kinds[: args.kinds.index(kind)]:
            ap.error(f"--kinds: {kind} repeats the lengths of a {json_of(kind)} round before it")
        if kind == "control-again" and "control" not in args.kinds[: args.kinds.index(kind)]:
            ap.error("--kinds: control-again repeats a control round before it")
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    rows = bench_model(args.model, args.kinds, args)
    logprob_kinds = [k for k in args.kinds if k in ("plain", "logprobs")]
    if args.logprob_model and logprob_kinds:
        rows += bench_model(args.logprob_model, logprob_kinds, args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    meta = {"device": device, "commit": commit(), "torch": torch.__version__, "args": vars(args)}
    table = summarize(rows)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sampling_bench-{stamp}-{meta['commit']}" + ("-engine-process" if args.engine_process else "")
    name += "-dry" if args.dry_run else ""
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(f"{meta}\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
