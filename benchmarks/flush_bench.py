"""The KV flush to the disk store (what an engine's close does): how long writing every cached page
takes with the process otherwise idle, and beside other Python threads that keep computing (an
API server's event loop, a busy engine thread elsewhere, a profiler). Each write lets go of the GIL
a few times and, beside a busy thread, waits up to a switch interval (5 ms) to get it back each
time: a flush of N pages can then take N x tens of ms. The flush's extra writer threads
(disk_store.DiskStore.helpers) are what this measures.

Fills an engine's device pool with the pages of --prompts prompts while the disk writer is held
back (so every page is left to the flush), then times `engine.flush_kv()`; the same with
--busy-threads threads spinning in Python; the median of --repeats runs. Prints a table; saves JSON
under benchmarks/results/.

    python benchmarks/flush_bench.py [--model dummy:tiny] [--prompts 48] [--prompt-len 1000]
                                     [--busy-threads 0 1] [--helpers 0 3] [--repeats 3] [--dir /dev/shm]
"""

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import save_json  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402
from chatengine.engine.kv import transfers  # noqa: E402


def spinning(n: int):
    """n threads that compute in Python until the returned stop() is called."""
    done = threading.Event()

    def spin():
        x = 0
        while not done.is_set():
            x += 1

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()

    def stop():
        done.set()
        for t in threads:
            t.join()

    return stop


def one_flush(args, busy: int, helpers: int) -> dict:
    store = tempfile.mkdtemp(prefix="flush-bench-", dir=args.dir)
    llm = LLM(args.model, num_kv_blocks=args.kv_blocks, kv_store_dir=store, max_model_len=args.prompt_len + 16)
    try:
        disk = llm.engine.tiers.disk
        write_behind, reserve = disk.write_behind, disk.reserve
        disk.write_behind, disk.reserve = (lambda *a, **k: False), (lambda n: 0)  # a writer that is behind
        rng = random.Random(0)
        prompts = [[rng.randrange(5, 200) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
        disk.write_behind, disk.reserve = write_behind, reserve
        transfers.FLUSH_HELPERS = helpers
        stop = spinning(busy)
        t = time.perf_counter()
        llm.engine.flush_kv()
        seconds = time.perf_counter() - t
        stop()
        pages = len(disk.index)
        ms = 1e3 * seconds / pages
        return {"busy_threads": busy, "helpers": helpers, "pages": pages, "seconds": seconds, "ms_a_page": ms}
    finally:
        llm.shutdown()
        shutil.rmtree(store, ignore_errors=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--busy-threads", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--helpers", type=int, nargs="+", default=[0, transfers.FLUSH_HELPERS])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each setting: the median is reported")
    ap.add_argument("--dir", default=None, help="where the store goes (default: the temp dir; /dev/shm: no disk)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    rows = []
    for busy in args.busy_threads:
        for helpers in args.helpers:
            runs = [one_flush(args, busy, helpers) for _ in range(args.repeats)]
            rows.append({**runs[0], "seconds": statistics.median(r["seconds"] for r in runs), "runs": runs})
            rows[-1]["ms_a_page"] = 1e3 * rows[-1]["seconds"] / rows[-1]["pages"]
    report, path = save_json("flush_bench", args, argv, {"rows": rows})
    print("| busy threads | flush helpers | pages | seconds | ms a page |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['busy_threads']} | {r['helpers']} | {r['pages']} | {r['seconds']:.2f} | {r['ms_a_page']:.2f} |")
    print(f"saved {path}")
    return report


if __name__ == "__main__":
    main()
