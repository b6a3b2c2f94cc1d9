"""Restore vs recompute: time to bring back an idle conversation's KV from host memory, against
recomputing its prefill, and the effective host-to-device bandwidth of the restore copy. Then, with
a disk store: how long another user's token stream pauses while a returning conversation's prefix
comes back from disk (its longest gap between tokens, against its median gap before).

Each trial also checks that the restored conversation answers as its cold prefill did (greedy token
and its logprobs): the table reports the agreement, in default mode and in deterministic mode
(EngineConfig.deterministic), where it must be every trial; in bf16 default mode a near-tie may flip.

On CUDA: dummy:llama-3.2-1b in bf16 (the issue's shape). On CPU: the default model in fp32.
Saves JSON + markdown under benchmarks/results/ and prints the table last.

    python benchmarks/offload_bench.py [--model dummy:llama-3.2-1b] [--contexts 1024 4096] [--repeats 5]
                                       [--disk-return 2048] [--modes default deterministic]
"""

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def disk_return_gaps(model, ctx: int, trials: int, engine_kw: dict) -> dict:
    """One user streams 40 tokens; after its 10th, a conversation of ctx tokens whose pages are in
    the disk store (written by an earlier engine, as after a restart) comes back. Per trial: the
    streaming user's longest gap between tokens from then on, and its median gap before."""
    kv = tempfile.mkdtemp(prefix="kv-return-")
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rng = random.Random(1)
    first = LLM(model, kv_store_dir=kv, **engine_kw)
    vocab, bs = min(first.engine.model_config.vocab_size, 10000), first.engine.config.block_size
    returning = [rng.randrange(vocab) for _ in range(ctx)]
    first.generate([returning], one)
    first.shutdown()  # flushes its pages to disk
    longest, before, cached = [], [], []
    for _ in range(trials):
        llm = LLM(model, kv_store_dir=kv, **engine_kw)
        engine = llm.engine
        streaming = engine.add_request([rng.randrange(vocab) for _ in range(100)], stream)
        gaps, t, back = [], time.perf_counter(), None
        while engine.has_unfinished_requests():
            outs = engine.step()
            sync()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == streaming:
                    gaps.append(now - t)
                    t = now
                elif o.finished:
                    cached.append(o.num_cached_tokens)
            if len(gaps) == 10 and back is None:
                back = engine.add_request(returning + [1], one)
        longest.append(1e3 * max(gaps[10:]))
        before.append(1e3 * statistics.median(gaps[2:10]))
        llm.shutdown()
    assert all(c == ctx // bs * bs for c in cached), cached  # the prefix came back from disk
    return {
        "context": ctx,
        "longest_gap_ms": statistics.median(longest),
        "median_gap_before_ms": statistics.median(before),
        "longest_gap_trials_ms": longest,
        "trials": trials,
    }


def restore_vs_recompute(args, engine_kw: dict, mode: str) -> list[dict]:
    """Per context: cold prefill vs restore from host memory, timed, and whether they agree."""
    cuda = torch.cuda.is_available()
    rows: list[dict] = []
    llm = LLM(args.model, deterministic=mode == "deterministic", **engine_kw)
    engine, runner = llm.engine, llm.engine.runner
    vocab = min(engine.model_config.vocab_size, 10000)
    rng = random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    llm.generate([[rng.randrange(vocab) for _ in range(64)]], one)  # warm-up
    for ctx in [] if args.only_disk_return else args.contexts:
        recompute, restore, copy_s, agree, agree_lp = [], [], [], 0, 0
        for _ in range(args.repeats):
            prompt = [rng.randrange(vocab) for _ in range(ctx + 1)]
            sync()
            t = time.perf_counter()
            first = llm.generate([prompt], one)[0]  # cold: a full prefill
            sync()
            recompute.append(time.perf_counter() - t)
            assert first.num_cached_tokens == 0
            moved = engine.offload_cached_blocks()  # the conversation goes idle
            assert moved >= ctx // engine.config.block_size
            sync()
            t = time.perf_counter()
            back = llm.generate([prompt], one)[0]  # restored from host memory
            sync()
            restore.append(time.perf_counter() - t)
            assert back.num_cached_tokens == ctx  # the prefix came back from host memory
            agree += back.outputs[0].token_ids == first.outputs[0].token_ids
            agree_lp += back.outputs[0].logprobs == first.outputs[0].logprobs
            # the copy alone: the same pages host -> device
            n = ctx // engine.config.block_size
            pages = torch.empty((n, *runner.kv_cache.shape[1:]), dtype=runner.dtype, pin_memory=cuda)
            ids = list(range(n))
            runner.restore_blocks(ids, pages, ids)
            sync()
            t = time.perf_counter()
            runner.restore_blocks(ids, pages, ids)
            sync()
            copy_s.append(time.perf_counter() - t)
            engine.offload_cached_blocks()
        if args.profile:  # where a restore's time goes
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
            import cProfile
            import pstats

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
        row = {
            "model": engine.model_id,
            "dtype": str(runner.dtype),
            "mode": mode,
            "context": ctx,
            "token_agreement": agree / args.repeats,
            "logprob_agreement": agree_lp / args.repeats,
            "recompute_ms": 1e3 * statistics.median(recompute),
            "restore_ms": 1e3 * statistics.median(restore),
            "copy_ms": 1e3 * statistics.median(copy_s),
            "kv_bytes": nbytes,
        }
        row["speedup"] = row["recompute_ms"] / row["restore_ms"]
        row["copy_gb_s"] = nbytes / (row["copy_ms"] / 1e3) / 1e9
        rows.append(row)
    llm.shutdown()
    return rows


def main(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.2-1b" if cuda else None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one restore")
    ap.add_argument(
        "--disk-return",
        type=int,
        default=2048,
        metavar="TOKENS",
        help="context of the conversation returning from disk while another user streams (0: skip)",
    )
    ap.add_argument("--only-disk-return", action="store_true", help="skip the restore-vs-recompute table")
    ap.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"])
    args = ap.parse_args(argv)

    engine_kw = dict(
        cpu_offload_gib=4.0 if cuda else 1.0,
        max_num_batched_tokens=8192 if cuda else 2048,
        max_model_len=8192,
        **({} if cuda else {"kv_cache_gib": 1.0}),
    )
    rows = []
    for mode in args.modes:
        rows += restore_vs_recompute(args, engine_kw, mode)
    if rows:
        model_id, dtype = rows[0]["model"], rows[0]["dtype"]
    else:  # only the disk return: the model's name and dtype
        llm = LLM(args.model, **engine_kw)
        model_id, dtype = llm.engine.model_id, str(llm.engine.runner.dtype)
        llm.shutdown()
    disk = disk_return_gaps(args.model, args.disk_return, min(args.repeats, 3), engine_kw) if args.disk_return else None
    device = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    meta = {
        "benchmark": "offload",
        "model": model_id,
        "dtype": dtype,
        "device": device,
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "command": "python benchmarks/offload_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"offload-{'cuda' if cuda else 'cpu'}-{meta['date'][:10]}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows, "disk_return": disk}, indent=1))
    lines = [
        f"# Restore from host memory vs recompute — {meta['model']} {meta['dtype']} on {device}",
        "",
        f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, median of {args.repeats}",
        "",
        "| mode | context | recompute (prefill) ms | restore + 1 token ms | speedup | H2D copy ms | copy GB/s "
        "| same token | same logprobs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['context']} | {r['recompute_ms']:.1f} | {r['restore_ms']:.1f} | {r['speedup']:.1f}x | "
        f"{r['copy_ms']:.2f} | {r['copy_gb_s']:.1f} | {100 * r['token_agreement']:.0f}% | "
        f"{100 * r['logprob_agreement']:.0f}% |"
        for r in rows
    ]
    if disk:
        lines += [
            "",
            f"A {disk['context']}-token conversation returns from the disk store while another user streams: "
            f"that user's longest gap between tokens {disk['longest_gap_ms']:.1f} ms (median of {disk['trials']} "
            f"trials), its median gap before {disk['median_gap_before_ms']:.1f} ms.",
        ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
