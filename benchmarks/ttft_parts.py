"""Where a chat turn's time to first token goes, under serve_bench's arrivals through AsyncLLM.

    python benchmarks/ttft_parts.py --model DIR [--rates 60] [--requests 400] [--cache on off]
        [--switch-interval S] [--engine-options '{...}']

Each request's TTFT (from its scheduled arrival, as serve_bench counts it) is cut at the moments
the engine's own methods mark, so the parts add up to it:

  late      the arrival's scheduled time -> generate() called (the client's event loop was busy)
  handoff   generate() -> the engine thread adds it (the engine finishing the step it was in)
  wait      added -> its first step launched (scheduling with the prefix-cache lookup, staging the
            step's inputs, launching it; later, if a full step leaves it no room)
  steps     launched -> its first token advanced (the step ahead of it on the device, its own, and
            the host receiving it after launching the next: async scheduling)
  deliver   advanced -> the caller reads the chunk (the output handed to the event loop)

Per cache setting and rate: p50 / mean / p90 of each part and of TTFT. The hooks wrap
LLMEngine.add / _advance and the runner's launch for this process only; the workload, warm-up and
arrivals are serve_bench's, and so are the options (--targets, --concurrency and --step-log are not
used here). --switch-interval sets sys.setswitchinterval first (how long a thread
waiting for the GIL lets the holder run on: the engine thread and the clients share one process).
Saves JSON under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.common import save_json  # noqa: E402

PARTS = ("late", "handoff", "wait", "steps", "deliver", "ttft")


class Marks:
    """perf_counter of each request's first add, launch and advanced token, keyed by request id."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}

    def mark(self, request_id: str, what: str) -> None:
        self.at.setdefault(request_id, {}).setdefault(what, time.perf_counter())

    def hook(self, llm) -> None:
        """Wrap this AsyncLLM's engine (its instance only) to mark each request's moments."""
        engine, runner = llm.engine, llm.engine.runner
        add, advance, launch = engine.add, engine._advance, runner.launch

        def marked_add(req):
            self.mark(req.request_id, "add")
            return add(req)

        def marked_advance(out, launched, sampled):
            outputs = advance(out, launched, sampled)
            for seq, _, _ in sampled:
                self.mark(seq.request_id, "token")
            return outputs

        def marked_launch(seqs, *args, **kwargs):
            step = launch(seqs, *args, **kwargs)
            for seq in seqs:
                self.mark(seq.request_id, "launch")
            return step

        engine.add, engine._advance, runner.launch = marked_add, marked_advance, marked_launch


class MarkedTarget(serve_bench.AsyncTarget):
    """serve_bench's AsyncLLM target with named requests, whose moments `marks` keeps."""

    def __init__(self, model: str, options: dict, marks: Marks):
        super().__init__(model, options)
        self.marks, self.count = marks, 0
        marks.hook(self.llm)

    async def stream(self, ids: list[int], max_tokens: int, rec) -> None:
        from chatengine import SamplingParams

        self.count += 1
        rec.request_id = request_id = f"t{self.count}"
        self.marks.mark(request_id, "send")
        params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
        async for out in self.llm.generate(ids, params, request_id=request_id, user="bench"):
            n = len(out.outputs[0].token_ids)
            if n > rec.tokens:
                rec.chunks.append(time.perf_counter())
                rec.tokens = n
            rec.cached = out.num_cached_tokens


def parts(recs, marks: Marks) -> dict[str, list[float]]:
    """Each part's milliseconds over the requests that got a token."""
    out: dict[str, list[float]] = {p: [] for p in PARTS}
    for rec in recs:
        at = marks.at.get(getattr(rec, "request_id", ""), {})
        if not rec.chunks or not {"send", "add", "launch", "token"} <= at.keys():
            continue
        edges = [rec.scheduled, at["send"], at["add"], at["launch"], at["token"], rec.chunks[0]]
        for name, a, b in zip(PARTS, edges, edges[1:]):
            out[name].append(1e3 * (b - a))
        out["ttft"].append(1e3 * (rec.chunks[0] - rec.scheduled))
    return out


def summary(values: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            "p50_ms": statistics.median(v),
            "mean_ms": statistics.mean(v),
            "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))],
            "n": len(v),
        }
        for name, v in values.items()
        if v
    }


async def run_cache(cache: str, args) -> dict:
    marks = Marks()
    options = serve_bench.engine_options(args, cache)
    target = await asyncio.to_thread(MarkedTarget, args.model, options, marks)
    rows = {}
    try:
        workload = serve_bench.Workload(target.vocab, args.personas, args.persona_len, args.seed, args.quick)
        await serve_bench.warm(target, workload)
        for rate in args.rates:
            marks.at.clear()
            recs, _ = await serve_bench.run_rate(target, workload, rate, args.requests, args)
            rows[str(rate)] = summary(parts(recs, marks))
            line = ", ".join(f"{k} {v['p50_ms']:.2f}" for k, v in rows[str(rate)].items())
            print(f"[cache {cache}] {rate}/s, p50 ms: {line}", flush=True)
    finally:
        await target.aclose()
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = serve_bench.build_parser()
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.set_defaults(rates=[60.0], targets=["async"])
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s) for the run")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    body = {"switch_interval_s": sys.getswitchinterval(), "parts": {}}
    for cache in args.cache:
        body["parts"][cache] = asyncio.run(run_cache(cache, args))
    report, path = save_json("ttft_parts", args, argv, body)
    print(f"saved {path}", flush=True)
    return report


if __name__ == "__main__":
    main()
