"""Where a decode step's time goes on the GPU, per kind of request: the step's wall time next to
the device's busy time (the gap is host time the device waited for), and the top kernels and host
functions from torch.profiler.

--batch requests (random prompts of 200 tokens, temperature 0.6, ignore_eos) are prefilled, then
--steps steps are timed and one more stretch of them is profiled, for each variant:
  plain      nothing beyond temperature
  logprobs   logprobs=5 on every request
  json       a quarter under sampling_bench's bounded JSON schema (needs a model with a tokenizer)
  json-open  the same under its open schema (strings without maxLength: cheaper fills, longer outputs)
  penalty    repetition_penalty=1.1 on every request
  prefill    a chat turn arriving beside the decodes, as serve_bench's at 20/s: each timed pair of
             steps admits one request of a 1500-token persona (cached on the device by an earlier
             turn) and --prefill-new new tokens, one reply token: the step that launches its prefill
             and the next (which waits for it)

    python benchmarks/step_profile.py --model DIR [--batch 64] [--steps 64] [--variants plain,logprobs]
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from benchmarks.sampling_bench import OPEN_SCHEMA, SCHEMA  # noqa: E402
from chatengine import LLM, SamplingParams, StructuredOutputs  # noqa: E402


def params(variant: str, i: int, max_tokens: int) -> SamplingParams:
    common = dict(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    if variant == "logprobs":
        return SamplingParams(**common, logprobs=5)
    if variant.startswith("json") and i % 4 == 0:
        schema = OPEN_SCHEMA if variant == "json-open" else SCHEMA
        return SamplingParams(temperature=0.6, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=schema))
    if variant == "penalty":
        return SamplingParams(**common, repetition_penalty=1.1)
    return SamplingParams(**common)


PERSONA_LEN = 1500
PREFILL_NEW = 100
TIMED = [False]  # True while decode_steps runs its timed steps (phase_times counts only those)


def decode_steps(llm: LLM, prompts, variant: str, steps: int) -> list[float]:
    """Per-step wall times (s) of `steps` decode steps after the batch is prefilled (variant
    prefill: of `steps` pairs of steps, each pair admitting one cached-persona turn)."""
    engine = llm.engine
    rng = random.Random(1)
    vocab = min(llm.vocab_size, 10000)
    persona = [rng.randrange(100, vocab) for _ in range(PERSONA_LEN)]
    if variant == "prefill":  # the persona's pages, cached by an earlier turn
        engine.add_request(persona + [7] * 16, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params(variant, i, 10 * steps))
    while any(s.num_computed_tokens < s.num_prompt_tokens for r in engine.requests.values() for s in r.seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    TIMED[0] = True
    try:
        for _ in range(steps):
            if variant == "prefill":
                turn = persona + [rng.randrange(100, vocab) for _ in range(PREFILL_NEW)]
                engine.add_request(turn, SamplingParams(temperature=0.6, max_tokens=1))
                t0 = time.perf_counter()
                engine.step()
                engine.step()
                times.append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        TIMED[0] = False
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def profiled(llm: LLM, prompts, variant: str, steps: int) -> tuple[str, float]:
    """Top kernels and host functions of `steps` steps, and the device busy time per step (ms)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        decode_steps(llm, prompts, variant, steps)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    table = events.table(sort_by="self_cuda_time_total" if len(acts) > 1 else "self_cpu_time_total", row_limit=12)
    host = events.table(sort_by="self_cpu_time_total", row_limit=15)
    return table + "\n" + host, device_us / 1e3 / steps


def host_profile(llm: LLM, prompts, variant: str, steps: int) -> str:
    """cProfile of the host side of `steps` steps: our functions and xgrammar's by cumulative time, then
    every function by its own time."""
    prof = cProfile.Profile()
    prof.runcall(decode_steps, llm, prompts, variant, steps)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(r"chatengine|xgrammar", 25)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)  # where the host's own time goes
    return out.getvalue()


PHASES = [  # engine-level phases, then parts of the runner's launch (dotted: an attribute's method)
    "scheduler.schedule",
    "runner.launch",
    "runner.collect",
    "_receive",
    "_advance",
    "_output",
    "runner._stage",
    "runner._uploaded.synchronize",
    "runner._tables.gather",
    "runner._upload",
    "runner._finish",
    "runner._run",
    "runner._finish_logits",
    "runner._process",
    "runner._sample",
    "runner._logprobs",
]


def phase_times(llm: LLM, prompts, variant: str, steps: int) -> dict[str, float]:
    """Host microseconds in each phase, the median over the timed steps (perf_counter around the
    method; nested phases are included in their callers': launch holds _stage .. _logprobs,
    _receive holds collect, the wait for the device, _advance holds _output). ~0.3 us a call: it
    hardly moves the step."""
    engine = llm.engine
    names = [p.rsplit(".", 1)[-1] if p.count(".") < 2 else p.split(".", 1)[1] for p in PHASES]
    now: dict[str, float] = dict.fromkeys(names, 0.0)
    per_step: list[dict[str, float]] = []
    saved = []
    for path, name in zip(PHASES, names):
        *parts, attr = path.split(".")
        obj = engine
        for part in parts:
            obj = getattr(obj, part, None)
        if obj is None:  # (no CUDA: no upload event)
            continue
        method = getattr(obj, attr)

        def timed(*args, _method=method, _name=name, **kwargs):
            if not TIMED[0]:
                return _method(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                now[_name] += time.perf_counter() - t0

        saved.append((obj, attr))
        setattr(obj, attr, timed)
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            if TIMED[0]:
                per_step.append({"step": time.perf_counter() - t0, **now})
            for k in now:
                now[k] = 0.0

    engine.step = timed_step
    try:
        decode_steps(llm, prompts, variant, steps)
    finally:
        for obj, attr in saved:
            delattr(obj, attr)
        del engine.step
    return {k: 1e6 * statistics.median(d[k] for d in per_step) for k in per_step[0]} if per_step else {}


def sync_points(llm: LLM, prompts, variant: str, steps: int) -> list[str]:
    """Where the host waits for the device during decode steps (torch's sync debug mode), as
    'file:line' of our frames, most frequent first: each one undoes async scheduling."""
    if not torch.cuda.is_available():
        return []
    import traceback
    import warnings
    from collections import Counter

    seen: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "chatengine" in f.filename]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:])) or filename] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            decode_steps(llm, prompts, variant, steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return [f"{n}x {where}" for where, n in seen.most_common(12)]


def main():
    global PREFILL_NEW
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--variants", default="plain,logprobs,json,penalty")
    ap.add_argument("--out", default=None, help="a JSON file for the summary")
    ap.add_argument("--prefill-new", type=int, default=PREFILL_NEW, help="prefill: new tokens of each turn")
    ap.add_argument(
        "--phases-only", action="store_true", help="step times and phases only: no profilers, no sync points"
    )
    args = ap.parse_args()
    PREFILL_NEW = args.prefill_new
    llm = LLM(args.model)
    rng = random.Random(0)
    vocab = min(llm.vocab_size, 10000)
    prompts = [[rng.randrange(100, vocab) for _ in range(200)] for _ in range(args.batch)]
    decode_steps(llm, prompts, "plain", 8)  # warm-up (graphs, allocator)
    summary = {"commit": commit(), "model": args.model, "batch": args.batch, "steps": args.steps, "rows": []}
    for variant in args.variants.split(","):
        walls = [decode_steps(llm, prompts, variant, args.steps) for _ in range(3)]
        wall_ms = 1e3 * statistics.median(statistics.median(w) for w in walls)
        tables, busy_ms = "", float("nan")
        if not args.phases_only:
            tables, busy_ms = profiled(llm, prompts, variant, args.steps)
            tables += "\n" + host_profile(llm, prompts, variant, args.steps)
        row = {"variant": variant, "step_ms_p50": round(wall_ms, 3), "device_busy_ms_per_step": round(busy_ms, 3)}
        row["phases_us"] = {k: round(v, 1) for k, v in phase_times(llm, prompts, variant, args.steps).items()}
        print("host us per step:", json.dumps(row["phases_us"]), flush=True)
        row["syncs"] = [] if args.phases_only else sync_points(llm, prompts, variant, 8)
        print("host waits for the device at:", *row["syncs"], sep="\n  ", flush=True)
        summary["rows"].append(row)
        print(json.dumps(row), flush=True)
        print(tables, flush=True)
    names = list(summary["rows"][0]["phases_us"]) if summary["rows"] else []
    print("| variant | step ms p50 | device busy ms/step (profiled) | " + " | ".join(names) + " (us/step) |")
    print("|---" * (3 + len(names)) + "|")
    for r in summary["rows"]:
        phases = " | ".join(f"{r['phases_us'][k]:.0f}" for k in names)
        print(f"| {r['variant']} | {r['step_ms_p50']:.3f} | {r['device_busy_ms_per_step']:.3f} | {phases} |")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
