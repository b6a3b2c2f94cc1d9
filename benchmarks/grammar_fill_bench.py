"""How long filling the next-token bitmasks of N grammar rows takes on this host, per way of doing it:
row by row, xgrammar's BatchGrammarMatcher with T threads, and a Python thread pool of T workers
(each row's fill releases the GIL). The rows sit inside a JSON string, where a fill costs most.
CPU only; a step of a batch with grammar rows waits for this.

    python benchmarks/grammar_fill_bench.py --tokenizer DIR [--rows 16] [--repeat 50]
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sampling_bench import SCHEMA  # noqa: E402
from chatengine import StructuredOutputs  # noqa: E402
from chatengine.engine.structured import Grammars, allocate_bitmask  # noqa: E402


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    compiled = grammars.compile(StructuredOutputs(json=SCHEMA))
    states = [grammars.matcher(compiled) for _ in range(args.rows)]
    for t in tok.encode('{"name": "ab', add_special_tokens=False):
        assert all(s.accept(t) for s in states)
    matchers = [s._matcher for s in states]
    bitmask = allocate_bitmask(args.rows, len(tok))
    rows = list(range(args.rows))
    cores = len(os.sched_getaffinity(0))
    print(f"cores {cores}, rows {args.rows}, vocab {len(tok)}")

    def serial():
        for m, r in zip(matchers, rows):
            m.fill_next_token_bitmask(bitmask, r)

    print(f"row by row: {timed(serial, args.repeat):.3f} ms")
    for threads in sorted({2, 4, 8, max(1, cores // 2), cores}):
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        ms = timed(lambda b=batch: b.batch_fill_next_token_bitmask(matchers, bitmask, rows), args.repeat)
        pool = ThreadPoolExecutor(threads)
        chunks = [rows[i::threads] for i in range(threads)]

        def pooled(pool=pool, chunks=chunks):
            list(pool.map(lambda c: [matchers[r].fill_next_token_bitmask(bitmask, r) for r in c], chunks))

        print(f"threads {threads}: xgrammar batch {ms:.3f} ms, python pool {timed(pooled, args.repeat):.3f} ms")
        pool.shutdown()


if __name__ == "__main__":
    main()
