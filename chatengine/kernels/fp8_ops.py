"""Row-wise FP8 (e4m3) quantization of activations, one launch.

Before each FP8 matmul every token's row x is scaled by amax(|x|) / 448 and cast to e4m3. In eager
torch that is ~6 small kernels (abs, amax, clamp, divide, clamp, cast) per linear layer, four
linear layers per decoder layer: at decode sizes each costs a launch, not bandwidth, and together
they cost more than the halved weight reads save. The Triton kernel reads each row twice (its
amax, then the scaled cast) in one program; `quantize_rows_ref` is the same arithmetic in torch.
The kernel rounds to the e4m3 grid itself (nearest, ties to even, as torch's cast) so that the cast
only ever sees exact values: the result is bit-identical wherever it runs, including Triton's CPU
interpreter, whose fp8 cast mis-rounds at binade edges.
"""

import torch

from .paged_attention import check_device, jit, tl

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE_AMAX = 1e-12  # an all-zero row still gets a finite, positive scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scales (M,)) with x ~= q * scale[:, None]."""
    scale = x.abs().amax(dim=1).float().clamp(min=MIN_SCALE_AMAX) / E4M3_MAX
    q = (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@jit
def _quantize_rows_kernel(
    X, Q, S, stride_x, stride_q, K, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr
):  # AMAX_MIN, QMAX: MIN_SCALE_AMAX, E4M3_MAX (compiled kernels read no module globals)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), AMAX_MIN) / QMAX
    tl.store(S + row, scale)
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(x / scale, -QMAX), QMAX))
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=cols < K)


@jit
def _round_to_e4m3(v):
    """fp32 v in [-448, 448] to the nearest e4m3 value (ties to even), still in fp32: 3 mantissa bits,
    so a step of 2^(e - 3) at exponent e, and 2^-9 below the smallest normal (2^-6)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return ((v / step + 12582912.0) - 12582912.0) * step  # + 1.5 * 2^23: fp32 rounds to an integer, ties to even


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref's result in one launch; x (M, K) with unit column stride."""
    check_device(x)
    M, K = x.shape
    assert x.stride(1) == 1
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](
            x, q, scale, x.stride(0), q.stride(0), K, AMAX_MIN=MIN_SCALE_AMAX, QMAX=E4M3_MAX, BLOCK=1024, num_warps=4
        )
    return q, scale
