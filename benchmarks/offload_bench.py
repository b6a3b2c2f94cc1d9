"""Restore vs recompute: time to bring back an idle conversation's KV from host memory, against
recomputing its prefill, and the effective host-to-device bandwidth of the restore copy.

On CUDA: dummy:llama-3.2-1b in bf16 (the issue's shape). On CPU: the default model in fp32.
Saves JSON + markdown under benchmarks/results/ and prints the table last.

    python benchmarks/offload_bench.py [--model dummy:llama-3.2-1b] [--contexts 1024 4096] [--repeats 5]
"""
import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.2-1b" if cuda else None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one restore")
    args = ap.parse_args(argv)

    llm = LLM(args.model, cpu_offload_gib=4.0 if cuda else 1.0, max_num_batched_tokens=8192 if cuda else 2048,
              max_model_len=8192, **({} if cuda else {"kv_cache_gib": 1.0}))
    engine, runner = llm.engine, llm.engine.runner
    vocab = min(engine.model_config.vocab_size, 10000)
    rng = random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([[rng.randrange(vocab) for _ in range(64)]], one)     # warm-up
    rows = []
    for ctx in args.contexts:
        recompute, restore, copy_s = [], [], []
        for _ in range(args.repeats):
            prompt = [rng.randrange(vocab) for _ in range(ctx + 1)]
            sync(); t = time.perf_counter()
            first = llm.generate([prompt], one)[0]                      # cold: a full prefill
            sync(); recompute.append(time.perf_counter() - t)
            assert first.num_cached_tokens == 0
            moved = engine.offload_cached_blocks()                      # the conversation goes idle
            assert moved >= ctx // engine.config.block_size
            sync(); t = time.perf_counter()
            back = llm.generate([prompt], one)[0]                       # restored from host memory
            sync(); restore.append(time.perf_counter() - t)
            assert back.num_cached_tokens == ctx and back.outputs[0].token_ids == first.outputs[0].token_ids
            # the copy alone: the same pages host -> device
            n = ctx // engine.config.block_size
            pages = torch.empty((n, *runner.kv_cache.shape[1:]), dtype=runner.dtype, pin_memory=cuda)
            ids = list(range(n))
            runner.restore_blocks(ids, pages, ids)
            sync(); t = time.perf_counter()
            runner.restore_blocks(ids, pages, ids)
            sync(); copy_s.append(time.perf_counter() - t)
            engine.offload_cached_blocks()
        if args.profile:                                               # where a restore's time goes
            from torch.profiler import ProfilerActivity, profile
            prompt = [rng.randrange(vocab) for _ in range(ctx + 1)]
            llm.generate([prompt], one)
            engine.offload_cached_blocks()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts, with_stack=False) as prof:
                llm.generate([prompt], one)
                sync()
            print(f"--- restore of {ctx} tokens, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            if cuda:
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
            import cProfile, pstats
            prompt = [rng.randrange(vocab) for _ in range(ctx + 1)]
            llm.generate([prompt], one)
            engine.offload_cached_blocks()
            pr = cProfile.Profile()
            pr.enable()
            llm.generate([prompt], one)
            sync()
            pr.disable()
            pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
            engine.offload_cached_blocks()
        nbytes = (ctx // engine.config.block_size) * runner.block_bytes
        row = {"context": ctx, "recompute_ms": 1e3 * statistics.median(recompute),
               "restore_ms": 1e3 * statistics.median(restore), "copy_ms": 1e3 * statistics.median(copy_s),
               "kv_bytes": nbytes}
        row["speedup"] = row["recompute_ms"] / row["restore_ms"]
        row["copy_gb_s"] = nbytes / (row["copy_ms"] / 1e3) / 1e9
        rows.append(row)
    device = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    meta = {"benchmark": "offload", "model": engine.model_id, "dtype": str(runner.dtype), "device": device,
            "commit": commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "repeats": args.repeats,
            "command": "python benchmarks/offload_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"offload-{'cuda' if cuda else 'cpu'}-{meta['date'][:10]}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=1))
    lines = [f"# Restore from host memory vs recompute — {meta['model']} {meta['dtype']} on {device}", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, median of {args.repeats}", "",
             "| context | recompute (prefill) ms | restore + 1 token ms | speedup | H2D copy ms | copy GB/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['recompute_ms']:.1f} | {r['restore_ms']:.1f} | {r['speedup']:.1f}x | "
              f"{r['copy_ms']:.2f} | {r['copy_gb_s']:.1f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
