"""The all-reduces of one tensor-parallel decode step, alone: what each NCCL protocol costs at the sizes
a decode step reduces, to see how much of TP=2's step they are (tp_bench.py --part profile), through
the engine's one-shot path and through NCCL alone.

    python benchmarks/allreduce_bench.py [--ranks 2] [--rows 64 256 1024] [--hidden 4096] [--calls 65]
    python benchmarks/allreduce_bench.py --device cpu --ranks 2 --rows 4 --hidden 64   # gloo smoke run

Each variant (one-shot, then NCCL with NCCL_PROTO unset, LL, LL128, Simple) runs in fresh processes
(NCCL reads its settings at start): `--calls` all-reduces of a (rows, hidden) bf16 tensor, as a
decode step of a 32-layer model makes (two a layer and one after the vocabulary-parallel
embedding), captured in one CUDA graph and replayed; prints microseconds per all-reduce (median of
--repeats replays) on rank 0. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatengine.engine.parallel.group import TPGroup, connect_store, host_store, no_nvlink_multicast  # noqa: E402

# "one-shot": the engine's default path (parallel/one_shot.py; NCCL past its size limit), summing a
# tensor copied in by the kernel (the embedding's sum); "one-shot-inplace": a tensor already in the
# peer-addressable buffer (a row-parallel layer's) summed by the one-shot kernel
# (CHATENGINE_IN_PLACE_SUM=one-shot), "two-shot-inplace" by the two-shot one (the default at two
# ranks); the rest are NCCL alone (CHATENGINE_ALL_REDUCE=nccl)
# with NCCL_PROTO unset ("default") or set
PROTOCOLS = ["one-shot", "one-shot-inplace", "two-shot-inplace", "default", "LL", "LL128", "Simple"]


def timed_calls(group: TPGroup, x: torch.Tensor, calls: int, repeats: int) -> float:
    """Median seconds of `calls` all-reduces of x (a CUDA graph replay on GPUs, eager on CPU)."""
    cuda = x.device.type == "cuda"

    def step() -> None:
        for _ in range(calls):
            group.all_reduce(x)  # one shot: a new tensor each call (x stays zeros: sums stay finite)

    step()
    replay = step
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
    times = []
    for _ in range(repeats):
        group.all_reduce(torch.zeros(1, device=x.device))  # line the ranks up
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        replay()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rank_main(rank: int, size: int, address: str, args, results, protocol: str) -> None:
    group = TPGroup.join(rank, size, connect_store(address, size), args.device)
    if rank == 0 and os.environ["CHATENGINE_ALL_REDUCE"] == "one-shot":
        state = f"on, up to {group.one_shot.max_bytes} bytes" if group.one_shot else "off"
        print(f"one-shot path: {state}", flush=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for rows in args.rows:
        x = torch.zeros(rows, args.hidden, dtype=dtype, device=group.device)  # sums stay finite
        if protocol.endswith("-inplace"):  # where a row-parallel layer writes (NCCL past the limit)
            buffer = group.sum_buffer(tuple(x.shape), dtype)
            x = x if buffer is None else buffer.zero_()
        seconds = timed_calls(group, x, args.calls, args.repeats)
        if rank == 0:
            results.put((rows, 1e6 * seconds / args.calls))
    group.leave()


def run_variant(protocol: str, args) -> list[tuple[int, float]]:
    no_nvlink_multicast()
    os.environ["CHATENGINE_ALL_REDUCE"] = "one-shot" if protocol.endswith(("one-shot", "-inplace")) else "nccl"
    os.environ["CHATENGINE_IN_PLACE_SUM"] = "two-shot" if protocol == "two-shot-inplace" else "one-shot"
    if protocol in ("one-shot", "one-shot-inplace", "two-shot-inplace", "default"):
        os.environ.pop("NCCL_PROTO", None)
    else:
        os.environ["NCCL_PROTO"] = protocol
    store, address = host_store(args.ranks)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, args.ranks, address, args, results, protocol)) for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in args.rows:  # read before joining: a child joins only once its queue is drained
            rows.append(results.get(timeout=600))
    finally:
        for p in procs:
            p.join(timeout=60)
        del store
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{protocol}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024], help="sequences (tokens) in the step")
    ap.add_argument("--hidden", type=int, default=4096, help="the model's hidden size (llama-3.1-8b: 4096)")
    ap.add_argument("--calls", type=int, default=65, help="all-reduces a step (two a layer, one after the embedding)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=PROTOCOLS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"error: needs {args.ranks} GPUs, this machine has {torch.cuda.device_count()}")
    protocols = args.protocols if args.device == "cuda" else ["default"]  # gloo has no protocols
    print(f"| protocol | {' | '.join(f'{r} x {args.hidden}' for r in args.rows)} |  (us per all-reduce)")
    print("|---|" + "---|" * len(args.rows))
    for protocol in protocols:
        row = run_variant(protocol, args)
        print(f"| {protocol} | " + " | ".join(f"{us:.1f}" for _, us in sorted(row)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
