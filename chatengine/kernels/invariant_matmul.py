"""Batch-invariant linear layers: y = x W^T (+ b) where row i of y depends on row i of x only, never
on how many rows share the call (deterministic mode, EngineConfig.deterministic).

cuBLAS picks its algorithm by the shape: a decode step of 3 rows and a prefill of 2048 may reduce
the same row's dot products in different orders (split-K, other tiles, other instructions), and in
bf16 a near-tie between two tokens then flips. Here a row's reduction never depends on M:
- CUDA: a Triton kernel that walks K in order in BLOCK_K steps, never split across programs (but
  at the fixed segments below): a row's sums are the same instructions in the same order whatever
  its tile's other rows hold (zeros past M included). The tile shape follows M and N
  (`config_for`): it moves the work between programs, not the arithmetic -- each output element is
  still one fp32 accumulator fed k16 tensor-core products in K order. That every tile shape,
  BLOCK_K and load path (pointers or the TMA) gives the same bits is measured, not built in: on an
  H200 for every Llama-1B layer shape (`benchmarks/determinism_bench.py --gemm`, `--gemm-configs`),
  in the CUDA tests across M, and by `check_tiles` on each deterministic engine's own layers at
  start, which pins one configuration per layer for every M (invariant by construction, slower)
  on a device where it does not hold.
- CPU: `linear_tiled_torch`, the rows in tiles of TILE_ROWS (the last one padded with zeros), one
  BLAS call of that fixed shape per tile: BLAS chooses by shape, so every call chooses the same.
`linear_ref` (F.linear) is what both compute, up to the summation order.

`segments=2` reduces K as two halves, each from zero, added at the end in fp32: the sum a two-rank
tensor-parallel group computes for a row-parallel layer (each rank its half, all-reduced in fp32), so
that deterministic answers are the same on one GPU and on two (models/parallel_layers.py). A call
with fewer tiles than the device has multiprocessors (a decode step) runs each segment in programs of
its own and adds their stored fp32 sums after, in the same order: the same additions, so the same
bits, whichever way M sends it.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from .paged_attention import check_device, jit, tl, triton

log = logging.getLogger("chatengine.kernels")

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no triton, or one without host-side tensor descriptors
    TensorDescriptor = None  # type: ignore[assignment,misc]
try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no triton: never raised
    OutOfResources = RuntimeError  # type: ignore[assignment,misc]

# Tile configurations, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), by the call's rows M and
# the layer's output width N. Narrow layers (q/k/v, o, down) take small tiles, so that a decode step
# still makes enough programs; wide ones (gate/up, the LM head) have programs enough with large
# tiles, which reuse each loaded tile twice as often in a long prefill. Decode-sized calls take
# deeper K steps. Measured on an H200 (`determinism_bench.py --gemm-configs`, CUDA graph replay, us,
# Llama-1B shapes; benchmarks/results/device-logs-2026-11-28[cd].md):
# - 64 rows, against the tiles of long calls: SMALL_NARROW qkv 5.6 vs 7.7, o 5.9 vs 6.8, down 11.7 vs
#   16.2; SMALL_WIDE gate/up 19.5 vs 27.6, LM head 134 vs 192 (cuBLAS 139).
# - 128 rows: SMALL_NARROW qkv 7.5, o 6.9, down 16.5 (the 64x64x128 tiles: 7.8, 6.8, 18.8); MID_WIDE
#   gate/up 21.6 vs WIDE's 25.9 (cuBLAS 20.9); the LM head keeps WIDE (HEAD_FROM).
# - 256 rows: MID_NARROW qkv 9.8, o 8.7, down 21.8 (64x64x128: 9.6, 8.8, 23.4; cuBLAS 6.9, 6.1, 21.8).
# - From LARGE_ROWS every layer has tiles enough for WIDE (qkv at 2048 rows: 384), whose loads serve
#   twice the products: at 16k rows NARROW ran at 0.50-0.55 of cuBLAS (qkv 555 us vs 305, o 361 vs 198,
#   down 1631 vs 817). (128 x 256 tiles gain another 8% at 16k rows on one-segment layers, qkv 329 us
#   vs 357, gate/up 1787 vs 1946, but spill with two segments, o 1302 vs 254, and their fp32 output
#   tile leaves no shared memory to fp32 operands: not taken.)
NARROW = (64, 64, 64, 4, 4)
WIDE = (128, 128, 64, 8, 3)
SMALL_NARROW = (64, 32, 128, 4, 4)
SMALL_WIDE = (64, 64, 128, 4, 3)
MID_NARROW = (64, 128, 128, 4, 3)
MID_WIDE = (64, 128, 64, 4, 4)
SMALL_ROWS, MID_ROWS, LARGE_ROWS = 128, 256, 2048  # the largest M of the first two, the least of the last
WIDE_FROM = 8192  # output features
# an LM head's (a vocabulary's) output features: at 65-128 rows MID_WIDE reads its weight twice,
# out of L2's reach (128 rows: 178 us vs WIDE's 154, cuBLAS 145), where gate/up's stays in L2
HEAD_FROM = 32768
TILE_ROWS = 16  # CPU: rows per BLAS call
# Load tiles with the tensor memory accelerator where the device has one, from this many rows: a
# 64-row box for one row cost more than masked loads (LM head at M=1: 233 us vs 137), from 64 rows
# the TMA is ahead (o at 64: 6.6 vs 7.4; LM head at 16k: 14.7 ms vs 17.8)
USE_TMA = True
TMA_FROM_ROWS = 33


def config_for(N: int, M: int, by_rows: bool = True) -> tuple[int, int, int, int, int]:
    """The tiles of a call of M rows on a layer N wide. `by_rows` False (a device where check_tiles
    found tiles moving a row's bits): one configuration for every M, invariant by construction."""
    wide = N >= WIDE_FROM
    if not by_rows:
        return WIDE if wide else NARROW
    if M <= SMALL_ROWS:
        if not wide:
            return SMALL_NARROW
        return SMALL_WIDE if M <= 64 else MID_WIDE if N < HEAD_FROM else WIDE
    if M <= MID_ROWS:
        return WIDE if wide else MID_NARROW
    return WIDE if wide or M >= LARGE_ROWS else NARROW


# M (and M * N, the stride between segments) is never specialized (Triton compiles a variant for 1
# and for multiples of 16 otherwise): one compiled kernel per tile configuration, load path and
# segment layout, whatever M (with CUDA graphs they compile at start, in the captures and the
# full-budget profile forward; eager, at first use)
_jit_rows = triton.jit(do_not_specialize=["M", "stride_ys"]) if triton is not None else jit


@jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in grouped order (as the Triton matmul tutorial):
    GROUP_M row tiles share a column tile of W in L2. The order moves no arithmetic."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@_jit_rows
def _matmul_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    SEG_K,
    HAS_BIAS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # SEG_K % BLOCK_K == 0: no step runs past its segment, loads need no K mask
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # a second grid axis when segments run apart (linear_triton): this program's segment of K, its
    # fp32 sums to Y's slice of that segment (else one program, seg 0, walks every segment)
    seg = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_ptr = X + seg * SEG_K + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptr = W + seg * SEG_K + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # (K, N): W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SEGMENTS):  # K's segments [s * SEG_K, (s + 1) * SEG_K), in order
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        end = (s + 1) * SEG_K
        for k0 in range(s * SEG_K, end, BLOCK_K):  # from the segment's start, never split
            if EVEN_K:
                x = tl.load(x_ptr + k0, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptr + k0, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k0 + ks < end
                x = tl.load(x_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            part = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), part, input_precision=DOT_PRECISION)
        if s == 0:
            acc = part
        else:
            acc += part
    if HAS_BIAS:  # added in fp32 before the one rounding (a fixed order too)
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + seg.to(tl.int64) * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@_jit_rows
def _matmul_tma_kernel(
    XD,  # descriptors: x (M, K) in (BLOCK_M, BLOCK_K) blocks, W (N, K) in (BLOCK_N, BLOCK_K)
    WD,
    B,
    Y,
    M,
    N,
    stride_ym,
    stride_ys,
    SEG_K,
    HAS_BIAS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_matmul_kernel` with its tiles loaded by the tensor memory accelerator (sm_90+): the same
    products added in the same order (so the same bits), the rows past M zero-filled by the copy
    engine instead of masked loads. Needs SEG_K % BLOCK_K == 0 (a block never crosses a segment)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    seg = tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SEGMENTS):
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        start = (seg + s) * SEG_K  # one of seg and s is 0 (segments apart, or in one program)
        for k0 in range(start, start + SEG_K, BLOCK_K):
            x = XD.load([row0, k0]).to(DOT_DTYPE)
            w = WD.load([col0, k0]).to(DOT_DTYPE)
            part = tl.dot(x, w.T, part, input_precision=DOT_PRECISION)
        if s == 0:
            acc = part
        else:
            acc += part
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + seg.to(tl.int64) * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


@_jit_rows
def _sum_segments_kernel(
    P,  # (PARTS, M, N) fp32: each segment's sums
    B,
    Y,
    M,
    N,
    stride_ys,  # M * N
    stride_ym,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Y = P[0] + P[1] + ... (+ bias) in fp32, in that order, rounded once to Y's dtype: the
    additions `_matmul_kernel` makes when one program walks every segment."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, PARTS):
        acc += tl.load(P + s * stride_ys + offs, mask=ok, other=0.0)
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(B + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (offs // N) * stride_ym + col, acc.to(Y.dtype.element_ty), mask=ok)


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config=None,
    segments: int = 1,
    out_dtype: torch.dtype | None = None,
    tma: bool | None = None,
    by_rows: bool = True,
) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias (N,)) in the tiles of `config_for` (N, M), or `config`:
    another (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), for benchmarks or a split layer's
    whole width. `segments`: K in that many equal parts (module docstring). `out_dtype`:
    the result's (float32: the sums before their rounding to x's dtype). `tma`: load tiles with the
    TMA where it fits (default USE_TMA); the pointer kernel otherwise (the same bits). `by_rows`
    False: nothing follows M -- the default tiles, the load path, segments in one program."""
    check_device(x)
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == K and weight.dtype == x.dtype
    assert K % segments == 0, f"K={K} does not split into {segments} segments"
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    block_m, block_n, block_k, warps, stages = config or config_for(N, M, by_rows)
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[x.dtype]
    if x.device.type != "cuda" and x.dtype == torch.bfloat16:
        dot_dtype = tl.float32  # the interpreter multiplies bf16 bit patterns
    tiles, parts, use_tma = route(M, N, (block_m, block_n), segments, x.device, by_rows)
    out = torch.empty(parts, M, N, dtype=torch.float32, device=x.device) if parts > 1 else y
    seg_k = K // segments
    common = dict(
        HAS_BIAS=bias is not None and parts == 1,
        SEGMENTS=segments // parts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        num_warps=warps,
        num_stages=stages,
    )
    b = bias if bias is not None else weight
    args: tuple
    if (tma if tma is not None else use_tma) and tma_fits(x2, weight, block_k, seg_k):
        xd = TensorDescriptor.from_tensor(x2, [block_m, block_k])
        wd = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        kernel, args = _matmul_tma_kernel, (xd, wd, b, out, M, N, out.stride(-2), M * N, seg_k)
    else:
        kernel = _matmul_kernel
        args = (x2, weight, b, out, M, N, x2.stride(0), weight.stride(0), out.stride(-2), M * N, seg_k)
        common["EVEN_K"] = seg_k % block_k == 0
    _launch_fitted(kernel, (tiles, parts), args, common, (x.dtype, out.dtype))
    if parts > 1:
        _sum_segments_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            out, b, y, M, N, M * N, y.stride(0), PARTS=parts, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK
        )
    return y.view(*lead, N)


SUM_BLOCK = 1024  # elements per program of the segments' sum
_stages: dict[tuple, int] = {}  # (kernel, tiles, stages asked, dtypes) -> pipeline stages that fit


def _launch_fitted(kernel, grid, args, common: dict, dtypes: tuple) -> None:
    """Launch with the config's pipeline stages, or as many as fit the device's shared memory: fp32
    operands take twice bf16's room (an H200 fits MID_NARROW's 3 stages in bf16, not in fp32). Stages
    only pipeline the loads: the arithmetic, and so the bits, stay. Triton checks before it runs
    anything; the count that fits is kept, so a CUDA graph's capture finds it."""
    # shared memory follows the tiles, the stages and the dtypes (cheap to key on: every eager call)
    key = (id(kernel), common["BLOCK_M"], common["BLOCK_N"], common["BLOCK_K"], common["num_stages"], *dtypes)
    stages = _stages.get(key, common["num_stages"])
    while True:
        try:
            kernel[grid](*args, **{**common, "num_stages": stages})
            break
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
    _stages[key] = stages


def route(M: int, N: int, blocks: tuple[int, int], segments: int, device: torch.device, by_rows: bool):
    """(tiles, programs per tile along K, whether the TMA may load them) of a call of M rows on N
    outputs in (BLOCK_M, BLOCK_N) tiles. Too few tiles to fill the device (a decode step): each
    segment of K in programs of its own, its fp32 sums stored, then added in order in fp32 -- the very
    additions the one-program path makes (its segments each from zero, then acc += part), so the
    same bits for any M, either way."""
    tiles = -(-M // blocks[0]) * -(-N // blocks[1])
    parts = segments if by_rows and segments > 1 and tiles < split_below(device) else 1
    return tiles, parts, USE_TMA and by_rows and M >= TMA_FROM_ROWS


def tma_fits(x2: torch.Tensor, weight: torch.Tensor, block_k: int, seg_k: int) -> bool:
    """Whether the TMA kernel can take this call: a GPU with the tensor memory accelerator (sm_90+;
    the interpreter emulates it), 16-byte aligned bases and row strides, whole BLOCK_K steps per
    segment. Elsewhere the pointer kernel computes the same bits."""
    if TensorDescriptor is None or seg_k % block_k:
        return False
    if x2.is_cuda and _sm_major(x2.device) < 9:
        return False
    size = x2.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0 for t in (x2, weight))


CHECK_MAX_ROWS = 16384  # the calls check_tiles considers: 1..this many rows
CHECK_MAX_N = 4096  # output features it computes of a one-segment layer (the tiles follow `width`)
CHECK_REF_ROWS = 16  # rows compared in every call


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def paths(N: int, width: int, segments: int, device: torch.device, by_rows: bool = True) -> list[int]:
    """The least M of every distinct way linear_triton runs a layer (N of `width` output features
    here) over 1..CHECK_MAX_ROWS rows: its tiles, whether the TMA may load them, its segments in one
    program or apart."""
    seen, ms = set(), []
    for M in range(1, CHECK_MAX_ROWS + 1):
        config = config_for(width, M, by_rows)
        key = (config, *route(M, N, config[:2], segments, device, by_rows)[1:])
        if key not in seen:
            seen.add(key)
            ms.append(M)
    return ms


@torch.no_grad()
def check_tiles(layers, devices=("cuda",)) -> bool:
    """Deterministic mode on CUDA, once at start: for each (weight (N, K), bias, width, segments) of
    the model, does every way linear_triton runs it across M (`paths`) give the first rows the same
    fp32 sums, bit for bit? Measured so on an H200 for every Llama-1B shape; where it does not hold
    the caller runs the layers with by_rows False (one configuration for every M: slower, invariant
    by construction, which a second check confirms -- else this raises)."""
    ok = True
    for by_rows in (True, False):
        for weight, bias, width, segments in layers:
            if weight.device.type in devices and not _rows_keep_their_bits(weight, bias, width, segments, by_rows):
                if not by_rows:
                    raise RuntimeError("deterministic mode: the invariant matmul's rows move with M on this device")
                log.warning(
                    "deterministic mode: a layer of %s (%s segments) changed a row's bits with the batch size: "
                    "its tiles no longer follow it (slower)", tuple(weight.shape), segments,
                )  # fmt: skip
                ok = False
                break
        if ok:
            return True
    return False


def _rows_keep_their_bits(weight, bias, width, segments, by_rows) -> bool:
    width = width or weight.shape[0]
    if segments == 1:  # the tiles follow width, not N: a slice of the outputs computes the same way
        weight = weight[:CHECK_MAX_N]
        bias = None if bias is None else bias[:CHECK_MAX_N]
    ms = paths(weight.shape[0], width, segments, weight.device, by_rows)
    gen = torch.Generator(device=weight.device).manual_seed(0)
    rows = max(*ms, CHECK_REF_ROWS)
    x = torch.randn(rows, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)

    def call(m):
        config = config_for(width, m, by_rows)
        return linear_triton(x[:m], weight, bias, config, segments, torch.float32, by_rows=by_rows)

    ref = call(CHECK_REF_ROWS)
    return all(same_bits(call(m)[:CHECK_REF_ROWS], ref[: min(m, CHECK_REF_ROWS)]) for m in ms)


@functools.lru_cache(maxsize=16)
def _sm_major(device: torch.device) -> int:
    """The device's compute capability major (asked once: tma_fits runs on every eager call)."""
    return torch.cuda.get_device_capability(device)[0]


@functools.lru_cache(maxsize=16)
def split_below(device: torch.device) -> int:
    """Tiles under which a segmented layer runs its segments in programs of their own: the device's
    multiprocessors (one wave)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def linear_tiled_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    segments: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear in tiles of TILE_ROWS rows, one BLAS call of that shape each (CPU). `segments` > 1:
    one call per equal part of K, each in x's dtype, added in fp32 in order, then rounded once to
    `out_dtype` (x's by default) -- the sum of two ranks' partials all-reduced in fp32."""
    *lead, K = x.shape
    assert K % segments == 0, f"K={K} does not split into {segments} segments"
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    pad = -M % TILE_ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, K)])
    tiles = [_tile(t, weight, bias, segments) for t in x2.split(TILE_ROWS)]
    y = torch.cat(tiles) if len(tiles) > 1 else tiles[0]
    return y[:M].view(*lead, weight.shape[0]).to(out_dtype or x.dtype)


def _tile(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int) -> torch.Tensor:
    if segments == 1:
        return F.linear(t, weight, bias)
    n = t.shape[1] // segments
    parts = [F.linear(t[:, s * n : (s + 1) * n].contiguous(), weight[:, s * n : (s + 1) * n]) for s in range(segments)]
    total = parts[0].float()
    for part in parts[1:]:
        total += part.float()
    return total if bias is None else total + bias.float()


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    width: int | None = None,
    segments: int = 1,
    out_dtype: torch.dtype | None = None,
    by_rows: bool = True,
) -> torch.Tensor:
    """The batch-invariant linear of x's device: Triton on CUDA, fixed tiles elsewhere. `width`: the
    output width that picks the tiles (a rank's share of a split layer tiles as the whole layer).
    `by_rows`: the layer's check_tiles verdict."""
    if x.device.type == "cuda":
        config = config_for(width or weight.shape[0], x.numel() // x.shape[-1], by_rows)
        return linear_triton(x, weight, bias, config, segments, out_dtype, by_rows=by_rows)
    return linear_tiled_torch(x, weight, bias, segments, out_dtype)
