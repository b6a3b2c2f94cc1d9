"""The decode GEMVs of the default model alone, per activation mode (kernels/cpu_quant.cpp): how fast a
decode step streams its quantized weights on this CPU.

Random weights in SmolLM2-135M's shapes and the embedded GGUF's formats: 30 layers of q4_1 blocks
(fused qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536) and the q8_0 LM head
(49152 x 576), ~96 MB, more than the last-level cache, so every token reads them from memory as a
decode step does. For each mode (fp32, q8, q16) and each number of rows of x (decode steps of 1, 2,
4, 8 sequences) the whole set is multiplied once per round; rounds alternate between modes and the
table gives the fastest and the median round in ms and GB/s of weights.

    python benchmarks/cpu_gemv_bench.py [--threads 2] [--rounds 9] [--rows 1 2 4 8]
"""

import argparse
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine.kernels import cpu_quant as cq  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


def weights(layers: int) -> tuple[list[cq.QuantWeight], cq.QuantWeight]:
    g = torch.Generator().manual_seed(0)
    body = [cq.quantize(torch.randn(n, k, generator=g) * 0.05, "q4_1") for _ in range(layers) for n, k in LAYER_SHAPES]
    return body, cq.quantize(torch.randn(*HEAD_SHAPE, generator=g) * 0.05, "q8_0")


def one_pass(lib, mode: str, ws: list[cq.QuantWeight], x: torch.Tensor, y: torch.Tensor, threads: int) -> float:
    M = x.shape[0]
    t = time.perf_counter()
    for w in ws:
        N, K = w.shape
        cq.gemv_of(lib, w.fmt, mode)(w.fmt_id, *w.ptrs, N, K, x.data_ptr(), M, K, y.data_ptr(), N, threads)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    lib = cq.library()
    if lib is None:
        sys.exit("the quantized CPU kernel is unavailable here (no compiler or no AVX2)")
    torch.set_num_threads(args.threads)
    body, head = weights(args.layers)
    sets = {"layers (q4_1)": body, "LM head (q8_0)": [head]}
    modes = ["fp32", "q8", "q16"]
    lines = ["| rows of x | weights | MB | " + " | ".join(f"{m} ms (GB/s), best / median" for m in modes) + " |"]
    lines.append("|---|---|---|" + "---|" * len(modes))
    for M in args.rows:
        x, y = torch.randn(M, 1536), torch.empty(M, HEAD_SHAPE[0])
        for label, ws in sets.items():
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for m in modes:
                    times[m].append(one_pass(lib, m, ws, x, y, args.threads))
            mb = sum(w.nbytes for w in ws) / 1e6
            cells = []
            for m in modes:
                best, med = min(times[m]), statistics.median(times[m])
                cells.append(f"{1e3 * best:.2f} ({mb / 1e3 / best:.1f}) / {1e3 * med:.2f} ({mb / 1e3 / med:.1f})")
            lines.append(f"| {M} | {label} | {mb:.0f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    stamp = datetime.now(UTC)
    head_line = (
        f"# cpu_gemv_bench {stamp:%Y-%m-%d %H:%M} UTC ({commit()})\n\n{platform.processor() or platform.machine()}, "
        f"{args.threads} threads, {args.rounds} alternating rounds, torch {torch.__version__}\n"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu_gemv_bench-{stamp:%Y-%m-%dT%H%M}-{commit()}.md"
    path.write_text(head_line + "\n" + "\n".join(lines) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
