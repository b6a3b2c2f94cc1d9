"""Determinism: does a request's answer depend on its neighbours, the cache, a tier or the budget?

Per model and mode (default, then deterministic: EngineConfig.deterministic), `--prompts` target
prompts of random ids, lengths uniform in [--min-len, --max-len], each answered with --new-tokens
tokens greedily and seeded (temperature 1, seed per prompt), with logprobs. Each target's answer in
case (a) is the reference; the other cases count the targets whose tokens, or logprobs, differ:
  a  cold, alone
  b  cold, in one batch with --neighbours other prompts of lengths in the same range
  c  its prefix cached on the device (a's pages)
  d  restored from host memory (every cached page offloaded first)
  e  restored from the disk store after a restart (a new engine on the same store)
  f  cold, with the step's token budget lowered to --budget-f (chunk boundaries moved)
Runs stay cold where they should by running as other users (a user's pages are salted with its
name): one engine serves a-d, a second one (the restart, on the same disk store) e, and a third, with
no disk tier, b and f. Cases c-f run the targets together in one batch; --alone runs them one at a
time too.

    python benchmarks/determinism_bench.py [--models dummy:llama-3.2-1b dummy:qwen2.5-0.5b]
        [--modes default deterministic] [--prompts 200] [--neighbours 255] [--new-tokens 64]

Saves JSON + markdown under --out (device and commit named) and prints the table last; the JSON
after every step too, so that a run cut short keeps its counts. The issue's 200 x 255 per model and
mode takes longer than one device call: run it in shards side by side (each shard's targets still
sit among all the neighbours in case b), then add them up:

    CUDA_VISIBLE_DEVICES=g python benchmarks/determinism_bench.py --models M --modes MODE \
        --shard k/4 --num-kv-blocks 20000 --out DIR      # k = 0..3, several to a GPU
    python benchmarks/determinism_bench.py --merge DIR/*.json --out benchmarks/results

(`bash benchmarks/determinism_shards.sh` does both for the issue's two models and two modes.)

    python benchmarks/determinism_bench.py --gemm   # CUDA: the invariant matmul's tile configs vs cuBLAS
"""

import argparse
import json
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402
from chatengine.engine.loader import DUMMY_SHAPES  # noqa: E402

CASES = {
    "b": "cold, in a batch",
    "c": "prefix cached on the device",
    "d": "restored from host memory",
    "e": "restored from disk after a restart",
    "f": "another token budget",
}


def kv_gib(model: str, tokens: int) -> float:
    """GiB of bf16 KV for `tokens` tokens of a dummy shape (8 for other models)."""
    c = DUMMY_SHAPES.get(model.removeprefix("dummy:"))
    if c is None:
        return 8.0
    return tokens * c["num_layers"] * 2 * c["num_kv_heads"] * c["head_dim"] * 2 / 2**30


def answers(outs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare(ref, got) -> dict:
    """Targets whose tokens differ from the reference; whose logprobs differ (tokens or not)."""
    tokens = sum(a[0] != b[0] for a, b in zip(ref, got))
    logprobs = sum(a[1] != b[1] for a, b in zip(ref, got))
    first = [next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None) for a, b in zip(ref, got)]
    return {
        "targets": len(ref),
        "tokens_differ": tokens,
        "logprobs_differ": logprobs,
        "first_token_diffs": [f for f in first if f is not None],
    }


def counts(runs: dict, cached: dict) -> dict:
    """compare() of every case run so far against its kind's case a."""
    out: dict = {}
    for kind, got in runs.items():
        if "a" in got:
            out[kind] = {case: compare(got["a"], got[case]) for case in CASES if case in got}
            for case, hit in cached[kind].items():
                out[kind][case]["cached_tokens"] = hit
    return out


def run_mode(model, deterministic, targets, neighbours, args, engine_kw, indices=None, save=None) -> dict:
    """Every case for one model and mode. `indices`: the targets' places among all --prompts (a
    shard's), which seed their samples. `save`: called with the counts so far after each step, so
    that a run cut short still leaves what it measured."""
    indices = indices or list(range(len(targets)))
    store = tempfile.mkdtemp(prefix="det-kv-")
    kw = dict(engine_kw, deterministic=deterministic, kv_store_dir=store)
    kinds = {
        "greedy": [SamplingParams(temperature=0, max_tokens=args.new_tokens, logprobs=5, ignore_eos=True)]
        * len(targets),
        "seeded": [
            SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=args.new_tokens, logprobs=5, ignore_eos=True)
            for i in indices
        ],
    }
    out: dict = {}
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    startup = time.perf_counter() - t0
    engine = llm.engine
    runs: dict = {kind: {} for kind in kinds}
    cached: dict = {kind: {} for kind in kinds}

    def batch(prompts, params, user):
        return llm.generate(prompts, params, user=user)

    def each(prompts, params, user):
        return [llm.generate([p], sp, user=user)[0] for p, sp in zip(prompts, params)]

    together = each if args.alone else batch

    mode = "deterministic" if deterministic else "default"

    def done(what: str) -> None:  # progress, so that a run cut short still says where its time went
        print(f"  [{model} {mode}] {what}: {time.perf_counter() - t0:.0f} s", flush=True)
        if save is not None:
            save({**counts(runs, cached), "seconds": time.perf_counter() - t0, "partial": what})

    done("started")
    for kind, params in kinds.items():
        user = f"a-{kind}"
        runs[kind]["a"] = answers(each(targets, params, user))
        done(f"{kind} a")
        outs = together(targets, params, user)
        runs[kind]["c"], cached[kind]["c"] = answers(outs), sum(o.num_cached_tokens for o in outs)
        engine.offload_cached_blocks()
        outs = together(targets, params, user)
        runs[kind]["d"], cached[kind]["d"] = answers(outs), sum(o.num_cached_tokens for o in outs)
        done(f"{kind} c, d")
    shut_down(llm, args.profile_shutdown)  # flushes the cached pages, the targets', to the disk store
    done("shut down")
    llm = LLM(model, **kw)  # the restart
    done("restarted")
    for kind, params in kinds.items():
        outs = together(targets, params, f"a-{kind}")
        runs[kind]["e"], cached[kind]["e"] = answers(outs), sum(o.num_cached_tokens for o in outs)
        done(f"{kind} e")
    llm.shutdown()
    done("shut down again")
    shutil.rmtree(store, ignore_errors=True)
    # b and f need no disk tier: without one, the neighbours' pages are not written out
    llm = LLM(model, **{k: v for k, v in kw.items() if k != "kv_store_dir"})
    engine = llm.engine
    done("started without a disk tier")
    for kind, params in kinds.items():
        # the targets among the neighbours, at random places
        rng = random.Random(kind)
        order = list(range(len(targets) + len(neighbours)))
        rng.shuffle(order)
        mixed = [targets[i] if i < len(targets) else neighbours[i - len(targets)] for i in order]
        other = SamplingParams(temperature=params[0].temperature, max_tokens=args.new_tokens, ignore_eos=True)
        mixed_params = [params[i] if i < len(targets) else other for i in order]
        outs = llm.generate(mixed, mixed_params, user=f"b-{kind}")
        at = {i: j for j, i in enumerate(order) if i < len(targets)}
        runs[kind]["b"] = answers([outs[at[i]] for i in range(len(targets))])
        budget = engine.scheduler.max_num_batched_tokens
        engine.scheduler.max_num_batched_tokens = args.budget_f  # chunk boundaries move
        runs[kind]["f"] = answers(together(targets, params, f"f-{kind}"))
        engine.scheduler.max_num_batched_tokens = budget
        done(f"{kind} b, f")
    llm.shutdown()
    out.update(counts(runs, cached))
    out["seconds"] = time.perf_counter() - t0
    out["startup_s"] = startup
    return out


def shut_down(llm, profile: bool) -> None:
    """llm.shutdown(); `profile`: under cProfile, printing where the engine's thread spent it."""
    if not profile:
        return llm.shutdown()
    import cProfile
    import pstats

    with cProfile.Profile() as prof:
        llm.shutdown()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


GEMM_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (64, 64, 64, 4, 4),  # NARROW
    (64, 32, 128, 4, 4),
    (64, 64, 128, 4, 3),
    (32, 64, 128, 4, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),  # WIDE
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (128, 64, 128, 8, 3),
    (64, 32, 256, 4, 3),
    (32, 32, 256, 4, 3),
]
GEMM_ROWS = (1, 64, 256, 1024, 4096, 16384)


def gemm_table(model: str, configs: bool = False, rows=GEMM_ROWS, layers=None) -> list[str]:
    """us per call of the invariant matmul against cuBLAS (F.linear) on the model's projection shapes
    at decode and prefill sizes (CUDA): its committed tiles loaded by pointers and by the TMA (and
    whether the two give the same bits), or with `configs` every tile config of GEMM_CONFIGS. Each
    call is timed replayed in a CUDA graph, as the engine's decode steps run: device time, not the
    host's launch overhead."""
    import triton.testing

    from chatengine.kernels import invariant_matmul as im

    c = DUMMY_SHAPES[model.removeprefix("dummy:")]
    H, D, I = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    shapes = {  # (K, N, segments)
        "qkv": (H, (c["num_heads"] + 2 * c["num_kv_heads"]) * D, 1),
        "o": (c["num_heads"] * D, H, 2),
        "gate_up": (H, 2 * I, 1),
        "down": (I, H, 2),
        "lm_head": (H, c["vocab_size"], 1),
    }
    if configs:
        variants = {str(cfg): dict(config=cfg) for cfg in GEMM_CONFIGS}
    else:
        variants = {"pointer": dict(tma=False), "tma": dict(tma=True)}
    lines = [
        f"## {model}: invariant matmul, us per call (committed tiles unless named; cuBLAS is F.linear)",
        "",
        "| layer | M | cuBLAS | " + " | ".join(variants) + " | cuBLAS / best | same bits |",
        "|---|---:|---:|" + "---:|" * len(variants) + "---:|---|",
    ]
    bench = triton.testing.do_bench_cudagraph
    for name, (K, N, segments) in shapes.items():
        if layers and name not in layers:
            continue
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            times = [bench(lambda: torch.nn.functional.linear(x, w))]
            outs = []
            for kw in variants.values():
                kw = {"config": im.config_for(N, M), "segments": segments, **kw}

                def call(kw=kw):
                    return im.linear_triton(x, w, **kw)

                outs.append(call())
                times.append(bench(call))
            same = all(im.same_bits(o, outs[0]) for o in outs[1:])
            cells = " | ".join(f"{1e3 * t:.1f}" for t in times)
            lines.append(f"| {name} | {M} | {cells} | {times[0] / min(times[1:]):.2f} | {same} |")
            print(lines[-1], flush=True)
    return lines


ATTENTION_SHAPES = [(1, 1024), (64, 1024), (256, 1024), (256, 2048), (16, 4096)]  # decodes: (batch, context)
ATTENTION_PREFILL = [(16, 1024), (4, 4096)]  # prefills: (sequences, tokens each)


def attention_table(model: str) -> list[str]:
    """us per paged-attention call on one layer of the model, default mode's rules against the
    invariant mode's (deterministic engines: split_keys, the model's key tile), decodes and whole
    prefills over shuffled pages, each replayed in a CUDA graph (the decode graphs' way); the
    invariant decodes also with a graph's split count for an 8k context (empty splits, the merge)."""
    import triton.testing

    from chatengine.kernels import paged_attention as pa

    c = DUMMY_SHAPES[model.removeprefix("dummy:")]
    H_q, H_kv, D, page = c["num_heads"], c["num_kv_heads"], c["head_dim"], 16
    key_tile = pa.invariant_key_tile(H_kv, D)
    keys = pa.INVARIANT_SPLIT_KEYS
    lines = [
        f"## {model}: paged attention, us per call (one layer; graph replay)",
        "",
        "| step | default | invariant | invariant, 8k graph's splits | invariant / default |",
        "|---|---:|---:|---:|---:|",
    ]
    steps = [("decode", B, ctx, 1) for B, ctx in ATTENTION_SHAPES] + [
        ("prefill", B, n, n) for B, n in ATTENTION_PREFILL
    ]
    for kind, B, ctx, q_len in steps:
        pages = B * -(-ctx // page)
        kv = torch.randn(pages + 8, 2, page, H_kv, D, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(pages + 8, device="cuda")[:pages].view(B, -1).to(torch.int32)
        q = torch.randn(B * q_len, H_q, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, B * q_len + 1, q_len, device="cuda", dtype=torch.int32)
        lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)

        def call(split_keys=0, num_splits=None):
            return pa.paged_attention_triton(
                q,
                kv[:, 0],
                kv[:, 1],
                cu,
                lens,
                tables,
                D**-0.5,
                q_len,
                ctx,
                num_splits,
                out=out,
                split_keys=split_keys,
                key_tile=key_tile if split_keys else 0,
            )

        variants = [dict(), dict(split_keys=keys)]
        if kind == "decode":
            variants.append(dict(split_keys=keys, num_splits=8192 // keys))
        times = []
        for kw in variants:
            call(**kw)
            times.append(1e3 * triton.testing.do_bench_cudagraph(lambda kw=kw: call(**kw)))
        cells = " | ".join(f"{t:.1f}" for t in times) + (" | -" if len(times) == 2 else "")
        lines.append(f"| {kind} {B} x {ctx} | {cells} | {times[1] / times[0]:.2f} |")
        print(lines[-1], flush=True)
    return lines


def summary(r: dict) -> str:
    """One line: per sampling, case -> (tokens differ, logprobs differ), and the cached tokens of c-e."""
    if "error" in r:
        return r["error"]
    parts = []
    for kind in ("greedy", "seeded"):
        got = r.get(kind, {})
        cells = " ".join(f"{c}:{got[c]['tokens_differ']}/{got[c]['logprobs_differ']}" for c in CASES if c in got)
        hits = "/".join(str(got[c].get("cached_tokens", 0)) for c in "cde" if c in got)
        parts.append(f"{kind} {cells} (cached tokens c/d/e {hits})")
    return "; ".join(parts) + f"; {r['seconds']:.0f} s"


def cell(c: dict | None, prompts: int) -> str:
    """'tokens differ (logprobs differ)', and of how many targets when a run cut short compared fewer."""
    if c is None:
        return "not run"
    of = f" of {c['targets']}" if c.get("targets", prompts) != prompts else ""
    return f"{c['tokens_differ']} ({c['logprobs_differ']}){of}"


def markdown(meta, results, args) -> str:
    lines = [
        f"# Determinism — {meta['device']}, commit {meta['commit']}, {meta['date']}",
        "",
        f"{args.prompts} target prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens, "
        f"{args.neighbours} neighbours in case b, budget {args.max_num_batched_tokens} (f: {args.budget_f}); "
        f"cases c-f {'one at a time' if args.alone else 'in one batch'}. Targets whose tokens (logprobs) differ "
        "from their cold run alone:",
        "",
        "| model | mode | sampling | " + " | ".join(f"{k}: {v}" for k, v in CASES.items()) + " | s |",
        "|---|---|---|" + "---:|" * (len(CASES) + 1),
    ]
    for model, modes in results.items():
        for mode, r in modes.items():
            if "error" in r:
                lines.append(f"| {model} | {mode} | error: {r['error'][:80]} |")
            if not any(kind in r for kind in ("greedy", "seeded")):
                continue
            for kind in ("greedy", "seeded"):
                cells = [cell(r.get(kind, {}).get(c), args.prompts) for c in CASES]
                lines.append(f"| {model} | {mode} | {kind} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models", nargs="+", default=["dummy:llama-3.2-1b", "dummy:qwen2.5-0.5b"] if cuda else ["dummy:tiny"]
    )
    ap.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"])
    ap.add_argument("--prompts", type=int, default=200, help="target prompts (the issue: 200)")
    ap.add_argument("--neighbours", type=int, default=255, help="other prompts beside the targets in case b")
    ap.add_argument("--min-len", type=int, default=100 if cuda else 20)
    ap.add_argument("--max-len", type=int, default=3000 if cuda else 200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192 if cuda else 64)
    ap.add_argument("--budget-f", type=int, default=1000 if cuda else 40, help="case f's token budget")
    ap.add_argument("--alone", action="store_true", help="cases c-f one target at a time (slower)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gemm", action="store_true", help="only time the invariant matmul's kernels (CUDA)")
    ap.add_argument("--gemm-configs", action="store_true", help="with --gemm: every tile config instead")
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=list(GEMM_ROWS), help="with --gemm: the Ms")
    ap.add_argument(
        "--gemm-layers", nargs="+", default=None, help="with --gemm: only these (qkv o gate_up down lm_head)"
    )
    ap.add_argument("--profile-shutdown", action="store_true", help="cProfile the first engine's shutdown (its flush)")
    ap.add_argument("--attention", action="store_true", help="only time invariant attention against default (CUDA)")
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="fixed KV pages (several runs on one GPU)")
    ap.add_argument("--shard", default="", help="K/N: only targets K, K+N, K+2N, ... (all N shards: --merge)")
    ap.add_argument("--merge", nargs="+", default=[], help="JSON results of shards to add up into one table")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.gemm:
        for model in args.models:
            print("\n".join(gemm_table(model, args.gemm_configs, args.gemm_rows, args.gemm_layers)), flush=True)
        return
    if args.attention:
        for model in args.models:
            print("\n".join(attention_table(model)), flush=True)
        return

    rng = random.Random(0)
    vocab = 256 if not cuda else 10000

    def prompt():
        return [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]

    targets = [prompt() for _ in range(args.prompts)]
    neighbours = [prompt() for _ in range(args.neighbours)]
    indices = list(range(args.prompts))
    if args.shard:  # the neighbours stay whole: each shard's targets sit among all of them in case b
        k, n = map(int, args.shard.split("/"))
        if not 0 <= k < n <= args.prompts:
            ap.error(f"--shard {args.shard}: K/N with 0 <= K < N <= --prompts")
        indices = indices[k::n]
        targets = [targets[i] for i in indices]
    device = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    meta = {
        "benchmark": "determinism",
        "device": device,
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "command": "python benchmarks/determinism_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "indices": indices,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(out, "cuda" if cuda else "cpu", meta["date"], meta["commit"], args)
    results: dict = {}

    def write() -> None:  # after every step: a run cut short leaves its counts so far
        save_json(Path(stem + ".json"), {**meta, "args": vars(args), "results": results})

    for model in args.models:
        tokens = sum(map(len, targets)) + len(targets) * args.new_tokens
        engine_kw = dict(
            dtype=args.dtype,
            max_num_seqs=256,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_len + args.new_tokens + 16,
            register_personas=False,
            cpu_offload_gib=2 * kv_gib(model, tokens) + 0.5,  # every target's pages, with room
            kv_store_gib=2 * kv_gib(model, tokens) + 0.5,
            num_kv_blocks=args.num_kv_blocks or (None if cuda else 4096),
        )
        for mode in args.modes:

            def save(partial, model=model, mode=mode):
                results.setdefault(model, {})[mode] = partial
                write()

            try:
                r = run_mode(model, mode == "deterministic", targets, neighbours, args, engine_kw, indices, save)
            except Exception as e:  # report the others, and keep what this one had counted
                r = {**results.get(model, {}).get(mode, {}), "error": f"{type(e).__name__}: {e}"}
            results.setdefault(model, {})[mode] = r
            write()
            print(f"[determinism] {model} {mode}: {summary(r)}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    md = markdown(meta, results, args)
    Path(stem + ".md").write_text(md + "\n")
    print(md)


def result_stem(out: Path, where: str, date: str, commit: str, args) -> str:
    """The results' path less .json / .md; a shard's names its models, modes and place. (Not
    Path.with_suffix: a model's name has dots, "llama-3.2-1b", and every shard's would collide.)"""
    stem = f"determinism-{where}-{date[:10]}-{commit}"
    if args.shard:
        models = "-".join(m.removeprefix("dummy:").replace("/", "_") for m in args.models)
        stem += f"-{models}-{'-'.join(args.modes)}-shard{args.shard.replace('/', 'of')}"
    return str(out / stem)


def save_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a run killed at its limit mid-write leaves the last save)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def merge(files: list[str], out_dir: str) -> None:
    """Add up shards' counts per model, mode, sampling and case into one table. Shards run side by
    side (several GPUs, or several runs on one), so a mode's seconds are its slowest shard's."""
    runs = []
    for f in files:
        run = json.loads(Path(f).read_text())
        if "indices" in run:
            runs.append(run)
        else:  # e.g. an earlier merge's output caught by the same glob
            print(f"[determinism] {f}: not a shard's results (no indices), left out")
    results: dict = {}
    covered: dict = {}
    for run in runs:
        for model, modes in run["results"].items():
            for mode, r in modes.items():
                covered.setdefault((model, mode), []).extend(run["indices"])
                into = results.setdefault(model, {}).setdefault(mode, {"seconds": 0.0})
                if "error" in r:  # its counts up to the error still add up
                    into["error"] = "; ".join(filter(None, [into.get("error"), r["error"]]))
                into["seconds"] = max(into["seconds"], r.get("seconds", 0.0))
                if "partial" in r:  # a shard cut short: the step it had got to
                    into.setdefault("partial", []).append(r["partial"])
                for kind in ("greedy", "seeded"):
                    for case, counts in r.get(kind, {}).items():
                        cell = into.setdefault(kind, {}).setdefault(case, {})
                        for key, value in counts.items():
                            cell[key] = cell.get(key, [] if isinstance(value, list) else 0) + value
    if not runs:
        raise SystemExit("--merge: no shard results among the files")
    first = runs[0]
    for (model, mode), got in covered.items():  # shards missing: their targets are left out (cell())
        if sorted(got) != list(range(first["args"]["prompts"])):
            print(f"[determinism] {model} {mode}: shards of {len(got)} of {first['args']['prompts']} targets")
    args = argparse.Namespace(**first["args"])
    commits = sorted({run["commit"] for run in runs})
    meta = {k: first[k] for k in ("benchmark", "device", "date", "torch")}
    meta.update(commit=",".join(commits), shards=[run["command"] for run in runs])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    where = Path(files[0]).name.split("-")[1]  # cuda or cpu, as the shards named it
    stem = str(out / f"determinism-{where}-{meta['date'][:10]}-{meta['commit']}-merged")
    save_json(Path(stem + ".json"), {**meta, "args": vars(args), "results": results})
    md = markdown(meta, results, args) + f"\n\nAdded up from {len(runs)} shards run side by side (`--merge`)."
    Path(stem + ".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("chatengine").setLevel(logging.INFO)  # e.g. where a slow shutdown went
    main()
