"""Weight-only quantized linear layers for the CPU: GGML's Q8_0, Q4_0 and Q4_1 blocks of 32 weights,
fp32 activations.

Decoding a small model on a CPU is memory-bound: each step reads every weight once, so fp32 weights
(4 bytes) cost ~6x the time of 4-bit blocks (~5 bits a weight with their scales). torch's own packed
low-bit CPU matmuls (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are ~50x slower than an
fp32 F.linear at decode sizes on an AVX2 machine, so the multiply is ours: `cpu_quant.cpp`, plain C
with AVX2/FMA/F16C and OpenMP, built with the system compiler on first use into the cache directory
and loaded with ctypes. Without a compiler (or an AVX2 CPU) every call takes the plain-torch path
(`linear_ref`: dequantize, then F.linear), which is also the reference the kernel is tested against.

A quantized weight (N, K) is a `QuantWeight`: `qs` (N, K) int8 (q8_0) or (N, K/2) uint8 (two 4-bit
levels a byte: block byte j holds weight j low and weight j + 16 high), `d` (N, K/32) fp16 scales and,
for q4_1, `m` (N, K/32) fp16 minimums:
    q8_0: w = d * q          (q in -127..127, d = amax / 127)
    q4_0: w = d * (q - 8)    (q in 0..15, d = -max / 8 where max is the value of largest magnitude)
    q4_1: w = d * q + m      (q in 0..15, d = (max - min) / 15, m = min)
The quantizers follow GGML's reference rounding, so re-quantizing weights that came from a GGUF's
blocks of the same format gives those blocks back exactly (q4_1: the min element is m, the max m + 15d).

Few rows (a decode step: M <= GEMV_MAX_ROWS) go through one of the kernel's three GEMVs, chosen by
CHATENGINE_CPU_ACTIVATIONS (`ACTIVATIONS`):
- "fp32": x stays fp32, each weight block is unpacked to floats (linear_ref's arithmetic, in another
  order).
- "q16": each row of x is quantized to int16 blocks (`quantize_rows16_ref`: levels, an fp32 scale
  per 32, amax / 32767) and each weight block costs two int16 multiply-adds with them
  (`linear_q16_ref`); x's rounding (at most amax / 65534 an input) is ~260x finer than q8's. The
  kernel takes eight weight rows at a time (two rows of x a pass over them), whose scales it reads
  column-major in one load, and prefetches the weights ahead: on a 2-core AVX2 VM the 135M model's
  layer GEMVs stream at ~8-12 GB/s instead of ~5.
- "q8": llama.cpp's arithmetic: each row of x is quantized to q8 blocks (`quantize_rows_ref`: int8
  levels, an fp32 scale per 32) and each weight block costs one integer dot with them
  (`linear_q8_ref`). Its greedy output leaves the fp32 model's sooner (README), so it is opt-in.
- "auto" (default): q16 for every format.
More rows dequantize the weight and use torch's GEMM (dense_linear): in fp32 (linear_ref's result),
except in a step of prompt chunks only (`prefill_step`, set by the model runner), which takes the
dtype CHATENGINE_CPU_PREFILL (`PREFILL`) names: "fp32", "bf16" (x and W rounded to bf16, the output
rounded to bf16 and returned as fp32: `linear_bf16_ref`), or "auto" (default): bf16 where the CPU has
bf16 dot products (AVX512_BF16 or AMX), whose GEMM there runs ~4x the fp32 one (a 1000-token prompt of
the default model: 1.5 -> 0.75 s on a 2-core AMD EPYC VM), else fp32. A step with decode rows stays
fp32: bf16's 8 significant bits would reach the sampled tokens of every sequence decoding beside a
prompt (greedy agreement of single prompts with fp32: 94.3% with bf16 prefill, 100% without).
"""

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

log = logging.getLogger("chatengine")

FORMATS = ("q8_0", "q4_0", "q4_1")
_FORMAT_IDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # cpu_quant.cpp's enum Format
QK = 32  # weights per block
GEMV_MAX_ROWS = 16  # above: dequantize + torch GEMM (the GEMV unpacks each block once per 2 rows)
DENSE_ROWS = 4096  # weight rows dequantized at a time by dense_linear: an LM head's table is never whole in fp32
SOURCE = Path(__file__).with_name("cpu_quant.cpp")
ACTIVATIONS = os.environ.get("CHATENGINE_CPU_ACTIVATIONS", "auto")  # fp32, q16, q8: the decode GEMV's x (above)
PREFILL = os.environ.get("CHATENGINE_CPU_PREFILL", "auto")  # fp32, bf16: the prefill GEMM's dtype (above)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


@dataclass
class QuantWeight:
    fmt: str  # one of FORMATS
    qs: torch.Tensor  # (N, K) int8 or (N, K/2) uint8
    d: torch.Tensor  # (N, K/32) fp16
    m: torch.Tensor | None  # (N, K/32) fp16 (q4_1), else None
    shape: tuple[int, int]  # (N, K) of the weight

    def __post_init__(self):
        # the kernel reads d and m column-major ((K/32, N) in memory: a block's scales of eight
        # neighbouring rows in one load); as tensors they stay (N, K/32)
        self.d = _column_major(self.d)
        self.m = None if self.m is None else _column_major(self.m)

    @property
    def fmt_id(self) -> int:
        return _FORMAT_IDS[self.fmt]

    @property
    def ptrs(self) -> tuple[int, int, int | None]:
        return self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """t (N, G) as a view of a (G, N) contiguous tensor (the same values)."""
    return t if t.stride() == (1, t.shape[0]) else t.t().contiguous().t()


QUANTIZE_ROWS = 4096  # rows quantized at a time: the fp32 temporaries of a 49k-row table stay small


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """w (N, K) with K a multiple of 32 -> its blocks (GGML's reference rounding, computed in fp32)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; known: {', '.join(FORMATS)}")
    N, K = w.shape
    if K % QK:
        raise ValueError(f"{fmt} needs the input features ({K}) to be a multiple of {QK}")
    if N > QUANTIZE_ROWS:
        parts = [_quantize(w[i : i + QUANTIZE_ROWS], fmt) for i in range(0, N, QUANTIZE_ROWS)]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
        return QuantWeight(fmt, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m, (N, K))
    return _quantize(w, fmt)


def _quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    N, K = w.shape
    x = w.detach().float().reshape(N, K // QK, QK)
    m = None
    if fmt == "q8_0":
        d = x.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(x * inv[..., None]).to(torch.int8)
        qs = q.reshape(N, K)
    else:
        if fmt == "q4_0":
            idx = x.abs().argmax(-1, keepdim=True)
            d = x.gather(-1, idx).squeeze(-1) / -8
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.floor(x * inv[..., None] + 8.5).clamp(0, 15)
        else:
            lo, hi = x.amin(-1), x.amax(-1)
            d = (hi - lo) / 15
            inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            q = torch.floor((x - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15)
            m = lo.half()
        q = q.to(torch.uint8)
        qs = (q[..., : QK // 2] | (q[..., QK // 2 :] << 4)).reshape(N, K // 2)
    return QuantWeight(fmt, qs.contiguous(), d.half().contiguous(), m, (N, K))


def levels(qw: QuantWeight) -> torch.Tensor:
    """The integer levels (N, K // 32, 32) as fp32: q (q8_0, q4_1) or q - 8 (q4_0)."""
    N, K = qw.shape
    if qw.fmt == "q8_0":
        return qw.qs.reshape(N, K // QK, QK).float()
    b = qw.qs.reshape(N, K // QK, QK // 2)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()
    return q - 8 if qw.fmt == "q4_0" else q


def dequantize_ref(qw: QuantWeight) -> torch.Tensor:
    """The fp32 weight (N, K) the blocks stand for (d * q is exact in fp32: the kernel's FMA agrees)."""
    w = levels(qw) * qw.d.float()[..., None]
    if qw.m is not None:
        w = w + qw.m.float()[..., None]
    return w.reshape(qw.shape)


def linear_ref(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) on the dequantized weight, in fp32."""
    return F.linear(x.float(), dequantize_ref(qw), None if bias is None else bias.float()).to(x.dtype)


def linear_bf16_ref(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with x and the dequantized weight rounded to bf16 (torch's bf16 GEMM, whose
    output is bf16), returned as fp32 with the bias added in fp32."""
    y = F.linear(x.to(torch.bfloat16), dequantize_ref(qw).to(torch.bfloat16)).float()
    return y if bias is None else y + bias.float()


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> q8 blocks: levels q (M, K) int8, scales d (M, K/32) and scaled sums
    s = d * sum(q) (M, K/32), fp32: d = amax / 127, q = round-half-even(x * (1 / d)) as the kernel."""
    M, K = x.shape
    b = x.float().reshape(M, K // QK, QK)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None])
    return q.to(torch.int8).reshape(M, K), d, d * q.sum(-1)


def quantize_rows16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> q16 blocks: levels q (M, K) int16, scales d (M, K/32) and block sums
    s (M, K/32) of x itself, fp32: d = amax / 32767, q = round-half-even(x * (1 / d)) as the kernel."""
    M, K = x.shape
    b = x.float().reshape(M, K // QK, QK)
    d = b.abs().amax(-1) / 32767
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(b * inv[..., None]).to(torch.int16).reshape(M, K), d, b.sum(-1)


def linear_q16_ref(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's "q16" GEMV arithmetic in torch (fp64 sums): y = sum_g dw dx (q . qx) (+ m s for
    q4_1, s the block sums of x; q4_0 as levels q - 8)."""
    N, K = qw.shape
    qx, dx, s = quantize_rows16_ref(x.reshape(-1, K))
    dots = torch.einsum("ngk,mgk->mng", levels(qw).double(), qx.double().reshape(-1, K // QK, QK))
    y = (dots * qw.d.double()[None] * dx.double()[:, None]).sum(-1)
    if qw.m is not None:
        y += s.double() @ qw.m.double().T
    if bias is not None:
        y += bias.double()
    return y.float().reshape(*x.shape[:-1], N)


def linear_q8_ref(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's GEMV arithmetic in torch (fp64 sums): x's q8 blocks dotted with W's integer
    levels block by block, y = sum_g dw dx (q . qx) (+ m s for q4_1; q4_0 as levels q - 8)."""
    N, K = qw.shape
    x2 = x.reshape(-1, K)
    qx, dx, _ = quantize_rows_ref(x2)
    dots = torch.einsum("ngk,mgk->mng", levels(qw).double(), qx.double().reshape(-1, K // QK, QK))
    y = (dots * qw.d.double()[None] * dx.double()[:, None]).sum(-1)
    if qw.m is not None:  # the minimums meet x's own (quantized) block sums
        y += dx.double() * qx.double().reshape(-1, K // QK, QK).sum(-1) @ qw.m.double().T
    if bias is not None:
        y += bias.double()
    return y.float().reshape(*x.shape[:-1], N)


# -- the compiled kernel ----------------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_lib_tried = False


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        return frozenset(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return frozenset()


def _cpu_has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


_PREFILL_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("chatengine_prefill_step", default=False)


@contextlib.contextmanager
def prefill_step(on: bool) -> Iterator[None]:
    """Within: dense_linear's GEMMs take PREFILL's dtype when `on` (a step of prompt chunks only)."""
    token = _PREFILL_STEP.set(on)
    try:
        yield
    finally:
        _PREFILL_STEP.reset(token)


def prefill_dtype(mode: str | None = None) -> torch.dtype:
    """The prefill GEMM's dtype under `mode` (PREFILL if None): "fp32", "bf16", or "auto": bf16 where
    the CPU multiplies bf16 natively (AVX512_BF16 or AMX), else fp32."""
    mode = mode or PREFILL
    if mode not in ("auto", "fp32", "bf16"):
        raise ValueError(f"CHATENGINE_CPU_PREFILL must be auto, fp32 or bf16, got {mode!r}")
    if mode == "auto":
        return torch.bfloat16 if _cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32
    return torch.bfloat16 if mode == "bf16" else torch.float32


def _build_dir() -> Path:
    # the engine's cache directory (kernels import nothing of ours: loader.cache_dir's rule, repeated)
    return Path(os.environ.get("CHATENGINE_CACHE", Path.home() / ".cache" / "chatengine")) / "kernels"


def build(source: Path = SOURCE) -> Path:
    """Compile `source` (this module's cpu_quant.cpp, or cpu_fused.cpp) once per (source, flags,
    compiler); later calls find the .so."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    key = hashlib.sha256(source.read_bytes() + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    out = _build_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (the torch path) without a compiler or AVX2, or
    with CHATENGINE_CPU_KERNELS=0."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    _lib_tried = True
    if os.environ.get("CHATENGINE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx2():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        log.warning("quantized CPU kernel unavailable (%s): using the slower torch path", e)
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for gemv in (lib.cq_gemv_f32, lib.cq_gemv_q8, lib.cq_gemv_q16):
        gemv.argtypes = [i32, ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
        gemv.restype = i32
    lib.cq_dequant.argtypes = [i32, ptr, ptr, ptr, i64, i64, ptr, i32]
    lib.cq_quantize_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.cq_quantize_rows.restype = None
    lib.cq_quantize_rows16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.cq_quantize_rows16.restype = None
    lib.cq_dequant.restype = i32
    _lib = lib
    return lib


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """dequantize_ref's result (bit for bit), from the kernel when it is there."""
    lib = library()
    if lib is None:
        return dequantize_ref(qw)
    out = torch.empty(qw.shape, dtype=torch.float32)
    lib.cq_dequant(qw.fmt_id, *qw.ptrs, *qw.shape, out.data_ptr(), torch.get_num_threads())
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows_ref's blocks of x (M, K) fp32, from the kernel (bit for bit)."""
    lib = library()
    if lib is None:
        return quantize_rows_ref(x)
    M, K = x.shape
    x = x.contiguous()
    q, d, s = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // QK), torch.empty(M, K // QK)
    lib.cq_quantize_rows(x.data_ptr(), M, K, K, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def gemv_of(lib: ctypes.CDLL, fmt: str, activations: str | None = None):
    """The kernel's GEMV entry point for weights in `fmt` under `activations` (ACTIVATIONS if None)."""
    mode = activations or ACTIVATIONS
    if mode == "auto":
        mode = "q16"
    return lib.cq_gemv_q16 if mode == "q16" else lib.cq_gemv_q8 if mode == "q8" else lib.cq_gemv_f32


def linear(
    x: torch.Tensor,
    qw: QuantWeight,
    bias: torch.Tensor | None = None,
    activations: str | None = None,
    prefill: str | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) for fp32 x (..., K): a kernel GEMV for few rows (`activations`, default
    ACTIVATIONS: "fp32", linear_ref's arithmetic, "q16", linear_q16_ref's, "q8", linear_q8_ref's, or
    "auto": q16), else dequantize + torch's GEMM (dense_linear, `prefill` its dtype). Without the
    kernel: linear_ref.
    A decode step calls this ~120 times: the common path touches as few torch ops as it can."""
    lib = _lib if _lib_tried else library()
    N, K = qw.shape
    M = x.numel() // K
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return linear_ref(x, qw, bias)
    if M > GEMV_MAX_ROWS:
        return dense_linear(x, qw, bias, prefill)
    x2 = x if x.dim() == 2 else x.reshape(M, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    gemv = gemv_of(lib, qw.fmt, activations)
    gemv(qw.fmt_id, *qw.ptrs, N, K, x2.data_ptr(), M, x2.stride(0), y.data_ptr(), N, torch.get_num_threads())
    if bias is not None:
        y += bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)


def dense_linear(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None, prefill: str | None = None
) -> torch.Tensor:
    """Many rows of fp32 x: the weight dequantized DENSE_ROWS rows at a time, each part multiplied by
    torch's GEMM in prefill_dtype(prefill) (default: PREFILL's within a prefill_step, else fp32):
    fp32 gives linear_ref's result, bf16 linear_bf16_ref's."""
    if prefill is None:
        prefill = PREFILL if _PREFILL_STEP.get() else "fp32"
    bf16 = prefill_dtype(prefill) == torch.bfloat16
    xs = x.to(torch.bfloat16) if bf16 else x
    N = qw.shape[0]
    if N <= DENSE_ROWS:
        return _dense_part(xs, dequantize(qw), bias, bf16)
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    for a in range(0, N, DENSE_ROWS):
        b = min(N, a + DENSE_ROWS)
        part = QuantWeight(qw.fmt, qw.qs[a:b], qw.d[a:b], None if qw.m is None else qw.m[a:b], (b - a, qw.shape[1]))
        y[..., a:b] = _dense_part(xs, dequantize(part), None if bias is None else bias[a:b], bf16)
    return y


def _dense_part(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, bf16: bool) -> torch.Tensor:
    if not bf16:
        return F.linear(x, w, bias)
    y = F.linear(x, w.to(torch.bfloat16)).float()
    return y if bias is None else y.add_(bias)


def embedding(ids: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """Rows `ids` of the dequantized table (..., K): a quantized embedding (tied to the LM head)."""
    flat = ids.reshape(-1)
    rows = QuantWeight(
        qw.fmt, qw.qs[flat], qw.d[flat], None if qw.m is None else qw.m[flat], (flat.numel(), qw.shape[1])
    )
    return dequantize(rows).reshape(*ids.shape, qw.shape[1])
