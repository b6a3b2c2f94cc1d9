"""Decode-kernel launch sweeps: launch configs (BLOCK_N, num_warps, num_stages), split counts and
programmatic dependent launch, per batch x context, on the Llama-3.2-1B attention shape; and the
prefill split counts. What chatengine/kernels/paged_attention.py's launch rules were chosen from.

    python benchmarks/sweep_bench.py [--sweep launch|splits|prefill|decode|both|all] [--quick] [--out DIR]
"""

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from benchmarks.gpu_bench import (  # noqa: E402
    attention_bench,
    free_memory,
    graph_time,
    kv_setup,
    log,
    variant_name,
)
from chatengine.kernels import paged_attention as pa  # noqa: E402


def part_sweep(args, res):
    """Launch configs (BLOCK_N, num_warps, num_stages) at the default split count, then split counts
    with the default config, per batch x context. Each point compiles once (~1 s)."""
    out = res.setdefault("sweep", {"launch": [], "splits": []})
    if args.sweep in ("launch", "both", "all"):
        pairs = [(2, 2), (4, 2), (4, 3)] if args.quick else [(2, 2), (4, 2), (4, 3), (4, 4), (8, 3)]
        configs = [None] + [
            (bn, w, st) for bn in ((16, 32, 64) if args.quick else (16, 32, 64, 128)) for w, st in pairs
        ]
        for B, ctx in [(1, 8192), (16, 4096), (256, 1024), (256, 4096)]:
            r = attention_bench(B, ctx, sdpa=False, configs=configs)
            ok = [x for x in r["rows"] if "paged_ms" in x]
            best = min(ok, key=lambda x: x["paged_ms"])
            out["launch"].append(r)
            log(
                f"[sweep] {B}x{ctx}: best {best['launch']}: {best['paged_ms'] * 1e3:.1f} us "
                f"({best['paged_bytes_per_s'] / 1e12:.2f} TB/s); default {ok[0]['paged_ms'] * 1e3:.1f} us; "
                f"{len(r['rows']) - len(ok)} configs failed"
            )
    if args.sweep in ("prefill", "both", "all"):
        for B, q_len, ctx in [
            (1, 128, 2176),
            (1, 32, 8192),
            (1, 512, 4096),
            (4, 128, 2048),
            (1, 2048, 2048),
            (8, 256, 1024),
            (1, 128, 512),
            (2, 1024, 1024),
        ]:
            r = prefill_split_bench(
                B,
                q_len,
                ctx,
                [None, 1, 2, 4, 8, 16, 32],
                configs=[None, (64, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 2), (16, 4, 2)],
            )
            out.setdefault("prefill", []).append(r)
            best = min(r["rows"], key=lambda x: x["ms"])
            for cfg in dict.fromkeys(x["launch"] for x in r["rows"]):
                log(
                    f"[sweep] prefill B={B} q={q_len} ctx={ctx} {cfg}: "
                    + ", ".join(
                        f"{x['num_splits']}{'*' if x['default'] else ''}: {x['ms'] * 1e3:.1f}"
                        for x in r["rows"]
                        if x["launch"] == cfg
                    )
                    + " us"
                )
            log(f"[sweep] prefill B={B} q={q_len} ctx={ctx}: best {best['launch']} x {best['num_splits']} splits")
    if args.sweep in ("decode", "all"):
        part_sweep_decode(args, res, out)
    if args.sweep in ("splits", "both", "all"):
        for B, ctx in [
            (1, 8192),
            (1, 32768),
            (8, 8192),
            (16, 4096),
            (32, 4096),
            (64, 1024),
            (64, 4096),
            (128, 2048),
            (256, 1024),
        ]:
            splits = [x for x in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if ctx // x >= 128]
            r = attention_bench(B, ctx, sdpa=False, splits=splits)
            ok = sorted((x for x in r["rows"] if "paged_ms" in x), key=lambda x: x["paged_ms"])
            r["heuristic"] = pa._decode_splits(B * 8, ctx, pa.num_sms(torch.device("cuda")))
            out["splits"].append(r)
            log(
                f"[sweep] {B}x{ctx} splits: "
                + ", ".join(
                    f"{x['num_splits']}: {x['paged_ms'] * 1e3:.1f}" for x in sorted(ok, key=lambda x: x["num_splits"])
                )
                + f" us; best {ok[0]['num_splits']}, heuristic {r['heuristic']}"
            )


# decode variants (benchmarks/NOTES.md v8): launch configs x programmatic dependent launch x splits
_PDL = (False, "merge", True)
DECODE_SWEEP = {
    (1, 8192): [
        dict(num_splits=64, launch=cfg, pdl=pdl)
        for cfg in ((64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 2))
        for pdl in _PDL
    ]
    + [
        dict(num_splits=ns, launch=cfg, pdl=pdl)
        for ns, cfg in ((32, (128, 4, 2)), (32, (64, 4, 2)), (128, (64, 4, 2)))
        for pdl in ("merge", True)
    ],
    (1, 32768): [
        dict(num_splits=64, launch=cfg, pdl=pdl)
        for cfg in ((64, 4, 2), (128, 4, 2), (128, 4, 3), (64, 4, 3))
        for pdl in _PDL
    ],
    **{
        shape: [dict(launch=cfg, pdl=pdl) for cfg in ((64, 4, 2), (128, 4, 2)) for pdl in _PDL]
        for shape in ((8, 8192), (16, 4096), (64, 1024), (64, 4096))
    },
    (256, 1024): [dict(pdl=True)],
    (256, 4096): [dict(pdl=True)],
}
DECODE_SWEEP[(16, 4096)] += [dict(num_splits=6, launch=(128, 4, 2), pdl=pdl) for pdl in ("merge", True)]


@pa.jit
def _touch_kernel(X):  # one store per program: the launch floor in a graph
    pa.tl.store(X + pa.tl.program_id(0), 1.0)


def part_sweep_decode(args, res, out):
    """Decode variants on the kernel table's shapes (each against its default, the first row), and
    three timings that split 1x8k's time: a CUDA-graph launch of a trivial kernel, the 1x8k attention
    kernel without its merge (output wrong: timing only), and the merge kernel alone."""
    shapes = list(DECODE_SWEEP)[:2] if args.quick else list(DECODE_SWEEP)
    for B, ctx in shapes:
        r = attention_bench(B, ctx, sdpa=False, variants=[{}] + DECODE_SWEEP[(B, ctx)])
        out.setdefault("decode", []).append(r)
        ok = sorted((x for x in r["rows"] if "paged_ms" in x), key=lambda x: x["paged_ms"])
        for x in r["rows"]:
            log(
                f"[sweep] {B}x{ctx} {variant_name(x):40s} "
                + (
                    f"{x['paged_ms'] * 1e3:6.1f} us {x['paged_bytes_per_s'] / 1e12:5.2f} TB/s |diff| "
                    f"{x['max_abs_diff_vs_sdpa']:.1e}"
                    if "paged_ms" in x
                    else x["error"]
                )
            )
        log(f"[sweep] {B}x{ctx}: best {variant_name(ok[0])} {ok[0]['paged_ms'] * 1e3:.1f} us")
    out["diagnostics"] = diag = {}
    try:
        x = torch.zeros(1024, device="cuda")
        for n in (1, 132):
            diag[f"empty_kernel_{n}_programs_us"] = (
                1e3 * graph_time(lambda: [_touch_kernel[(n,)](x) for _ in range(16)]) / 16
            )
    except Exception as e:
        diag["empty_kernel_error"] = f"{type(e).__name__}: {e}"[:300]
    real = pa._merge_splits_kernel

    class NoMerge:  # the launcher's merge launch, skipped
        def __getitem__(self, grid):
            return lambda *a, **k: None

    try:
        pa._merge_splits_kernel = NoMerge()
        r = attention_bench(
            1,
            8192,
            sdpa=False,
            variants=[dict(num_splits=64, launch=(64, 4, 2)), dict(num_splits=64, launch=(128, 4, 2))],
        )
        diag["decode_only_1x8k_us"] = [
            (x["num_splits"], x["launch"], 1e3 * x.get("paged_ms", float("nan"))) for x in r["rows"]
        ]
    except Exception as e:
        diag["decode_only_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        pa._merge_splits_kernel = real
    try:
        part = torch.zeros(32, 64, 64, device="cuda")
        lse = torch.zeros(32, 64, device="cuda")
        o = torch.empty(1, 32, 64, device="cuda", dtype=torch.bfloat16)
        diag["merge_only_1x8k_us"] = (
            1e3
            * graph_time(
                lambda: [
                    real[(1, 32)](
                        o,
                        part,
                        lse,
                        32,
                        o.stride(0),
                        o.stride(1),
                        64,
                        BLOCK_S=64,
                        HEAD_DIM=64,
                        BLOCK_D=64,
                        PDL=False,
                        num_warps=4,
                    )
                    for _ in range(16)
                ]
            )
            / 16
        )
    except Exception as e:
        diag["merge_only_error"] = f"{type(e).__name__}: {e}"[:300]
    log(f"[sweep] diagnostics: {diag}")


def prefill_split_bench(B, q_len, ctx, splits, H_q=32, H_kv=8, D=64, page=16, configs=(None,)) -> dict:
    """A prefill chunk of q_len new tokens per sequence on top of a cached prefix (ctx tokens in all):
    the kernel per split count (the engine's chunked prefill and every cached-prefix turn)."""
    cache, tables, _, _, lens = kv_setup(B, ctx, H_q, H_kv, D, page, 1)
    q = torch.randn(B * q_len, H_q, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda") * q_len
    out = torch.empty_like(q)
    rows = []
    for cfg in configs:
        for ns in splits:

            def run():
                pa.paged_attention_triton(
                    q,
                    cache[:, 0, 0],
                    cache[:, 0, 1],
                    cu,
                    lens,
                    tables,
                    D**-0.5,
                    max_seqlen_q=q_len,
                    max_seqlen_k=ctx,
                    num_splits=ns,
                    out=out,
                    launch=cfg,
                )

            rows.append(
                {
                    "num_splits": ns or pa._prefill_splits(B, q_len, H_q // H_kv, H_kv, ctx, pa.num_sms(q.device)),
                    "launch": cfg,
                    "default": ns is None and cfg is None,
                    "ms": graph_time(run),
                }
            )  # device time: no host launch gaps
    cache = None
    free_memory()
    return {"batch": B, "q_len": q_len, "context": ctx, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sweep",
        choices=["launch", "splits", "prefill", "decode", "both", "all"],
        default="both",
        help="what to vary (decode: launch x PDL x splits on the kernel shapes; all: all)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--commit", default=None, help="commit to record (default: $CHATENGINE_COMMIT, else git)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_bench.py needs a CUDA GPU")
    meta = {
        "benchmark": "sweep_bench",
        "device": torch.cuda.get_device_name(),
        "commit": commit(args.commit),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/sweep_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    res: dict = {}
    part_sweep(args, res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sweep_bench-{meta['date'][:10]}-{meta['commit']}-{args.sweep}.json"
    path.write_text(json.dumps({**meta, "args": vars(args), "results": res}, indent=1, default=str))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
