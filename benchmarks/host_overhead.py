"""Host overhead of one engine step: the Python work around the forward (schedule, publish blocks,
stop checks, outputs), which leaves the GPU idle. Runs on CPU with a tiny random model (dummy:tiny)
and subtracts the time spent inside `ModelRunner.launch`: host = step - runner. Wall time and this
thread's CPU time are both reported; on a shared machine compare the CPU time.

Workload: --batch requests (random prompt ids, lengths uniform in [100, 500], ignore_eos, prefix
caching on) prefilled first; then --steps decode steps of the whole batch are timed. Requests
stream (an output per step, as AsyncLLM) unless --final-only (as LLM.generate).

    python benchmarks/host_overhead.py [--batch 256] [--steps 50] [--final-only] [--profile] [--out FILE.json]
    python benchmarks/host_overhead.py --async-llm [--batch 256] [--steps 100]   # the streaming path, host-bound
"""

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatengine import LLM, AsyncLLM, SamplingParams  # noqa: E402


def clocks() -> tuple[float, float]:
    """(wall, this thread's CPU time) in ms. The CPU time is what to compare on a shared machine:
    other processes stretch the wall time, not it (torch runs on this thread: one intra-op thread)."""
    return 1e3 * time.perf_counter(), 1e3 * time.thread_time()


def timed_runner(engine, profiler: cProfile.Profile | None) -> list[tuple[float, float]]:
    """Wrap engine.runner.launch (on CPU the whole forward runs in it) so each call's (wall, cpu) ms
    is appended to the returned list; the profiler (if any) is paused inside it, so the profile
    shows host work only."""
    times = []
    run = engine.runner.launch

    def wrapper(*args, **kwargs):
        if profiler:
            profiler.disable()
        t = clocks()
        try:
            return run(*args, **kwargs)
        finally:
            times.append(tuple(b - a for a, b in zip(t, clocks())))
            if profiler:
                profiler.enable()

    engine.runner.launch = wrapper
    return times


def async_streams(args) -> dict:
    """AsyncLLM end to end with the forward replaced by random tokens (host-bound): --batch callers
    stream --steps tokens each; every output crosses from the engine thread to the caller's loop."""
    rng = random.Random(args.seed)
    llm = AsyncLLM(
        "dummy:tiny",
        device="cpu",
        max_num_seqs=args.batch,
        max_num_batched_tokens=4096,
        num_kv_blocks=args.batch * (-(-(500 + args.steps) // 16) + 1) + 64,
    )
    llm.engine.runner.launch = lambda seqs, num_new_tokens: [  # a token where a chunk ends its prompt
        rng.randrange(256) if s.num_computed_tokens + n == s.num_tokens else None for s, n in zip(seqs, num_new_tokens)
    ]
    llm.engine.runner.collect = lambda launched: launched

    async def stream(prompt, params):
        return sum([1 async for _ in llm.generate(prompt, params)])

    async def run_all():
        params = SamplingParams(max_tokens=args.steps, ignore_eos=True)
        prompts = [[rng.randrange(256) for _ in range(rng.randint(100, 500))] for _ in range(args.batch)]
        t = time.perf_counter()
        num_outputs = sum(await asyncio.gather(*(stream(p, params) for p in prompts)))
        return time.perf_counter() - t, num_outputs

    try:
        wall, num_outputs = asyncio.run(run_all())
    finally:
        llm.shutdown()
    res = {
        "batch": args.batch,
        "tokens_per_request": args.steps,
        "wall_s": wall,
        "outputs": num_outputs,
        "tokens_per_s": args.batch * args.steps / wall,
    }
    print(
        f"AsyncLLM, {args.batch} streams x {args.steps} tokens, no forward: {wall:.3f} s, "
        f"{res['tokens_per_s']:.0f} tokens/s, {num_outputs} outputs delivered"
    )
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256, help="concurrent requests (all decode together)")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (none finish while timed)")
    ap.add_argument(
        "--final-only",
        action="store_true",
        help="requests as LLM.generate makes them: no output until finished (default: streamed)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the host side of the timed steps (the runner is paused out); print the top 20",
    )
    ap.add_argument(
        "--async-llm",
        action="store_true",
        help="instead: AsyncLLM streaming throughput with no forward (--steps tokens per request)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the model is tiny; leave the other cores alone
    if args.async_llm:
        res = async_streams(args)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return
    assert args.steps + 2 < args.max_tokens, "every request must still be decoding while timed"

    rng = random.Random(args.seed)
    num_blocks = args.batch * (-(-(500 + args.max_tokens) // 16) + 1) + 64
    llm = LLM(
        "dummy:tiny",
        device="cpu",
        max_num_seqs=args.batch,
        max_num_batched_tokens=4096,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=True,
        max_model_len=2048,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
    ids = []
    for _ in range(args.batch):
        req = engine.make_request([rng.randrange(256) for _ in range(rng.randint(100, 500))], params)
        req.stream = not args.final_only
        engine.add(req)
        ids.append(req.request_id)
    while any(engine.requests[r].seqs[0].num_output_tokens == 0 for r in ids):  # prefill
        engine.step()
    engine.step()  # a first all-decode step
    assert len(engine.scheduler.running) == args.batch, "the whole batch must decode together"

    profiler = cProfile.Profile() if args.profile else None
    runner_ms = timed_runner(engine, profiler)
    step_ms = []
    for _ in range(args.steps):
        if profiler:
            profiler.enable()
        t = clocks()
        engine.step()
        step_ms.append(tuple(b - a for a, b in zip(t, clocks())))
        if profiler:
            profiler.disable()
    med = statistics.median
    res = {"batch": args.batch, "steps": args.steps, "final_only": args.final_only, "profiled": bool(profiler)}
    for k, name in enumerate(("wall", "cpu")):
        host = [s[k] - r[k] for s, r in zip(step_ms, runner_ms)]
        res[name] = {
            "step_ms": med(s[k] for s in step_ms),
            "runner_ms": med(r[k] for r in runner_ms),
            "host_ms": med(host),
            "host_ms_mean": statistics.mean(host),
        }
    print(
        f"batch {args.batch}, {args.steps} decode steps, {'final-only' if args.final_only else 'streamed'} "
        f"outputs (medians)" + ("  [under cProfile: inflated]" if profiler else "")
    )
    for name in ("wall", "cpu"):
        r = res[name]
        print(
            f"  {name:4}: step {r['step_ms']:8.3f} ms, runner {r['runner_ms']:8.3f} ms, "
            f"host {r['host_ms']:6.3f} ms (mean {r['host_ms_mean']:.3f})"
        )
    if profiler:
        st = pstats.Stats(profiler)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:20]
        print(
            "top 20 by cumulative time (the runner is paused out, so the rows of its callers, e.g. step, "
            "stop counting at it)"
        )
        print(f"{'cumulative ms/step':>18} {'self ms/step':>13} {'calls/step':>11}  function")
        for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
            print(
                f"{1e3 * cumtime / args.steps:18.3f} {1e3 * tottime / args.steps:13.3f} "
                f"{ncalls / args.steps:11.1f}  {Path(file).name}:{line}({name})"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    for r in ids:
        engine.abort(r)


if __name__ == "__main__":
    main()
