"""Fused per-layer elementwise ops: RMSNorm (+ residual add), rotary embedding (alone, or with the
new K/V's store into the paged cache), SiLU-and-mul.

In eager torch these are ~8 (RMSNorm), ~14 (RoPE on q and k) and 2 (SiLU * up) small kernels per
use: at decode sizes each costs a launch, not bandwidth, and ~40 of them per layer made a Llama-1B
decode step 3x its roofline floor (benchmarks/NOTES.md). Each Triton kernel here is one launch,
reads its inputs once and computes in fp32. RMSNorm keeps Hugging Face's order (normalise in fp32,
cast, then scale by the weight), so it matches its torch reference below (chatengine/models/llama.py's
code) to one bf16 ulp (fp32 sum order); RoPE and SiLU-mul round once where torch rounds after every
op, so they are within a bf16 ulp or two of it and closer to the float64 result.

Ideas from lightllm's `rmsnorm.py` (one program per row) and vLLM's fused add+RMSNorm.
"""

import torch
import torch.nn.functional as F

from .cache_ops import store_kv_ref
from .paged_attention import check_device, jit, tl, triton


# ---------------------------------------------------------------------------- RMSNorm (+ residual)
@jit
def _rms_norm_kernel(
    X,
    Res,
    W,
    Out,
    ResOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # x + residual, rounded as torch's add rounds
        x = x.to(tl.float32) + tl.load(Res + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)  # HF: normalise in fp32, cast
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x (T, N), or of x + residual: returns out, or (out, x + residual)."""
    check_device(x)
    T, N = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if T:
        r = residual if residual is not None else x
        _rms_norm_kernel[(T,)](
            x,
            r,
            weight,
            out,
            res_out,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            res_out.stride(0),
            N,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=triton.next_power_of_2(N),
            num_warps=4 if N <= 4096 else 8,
        )
    return out if residual is None else (out, res_out)


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, x)


# ---------------------------------------------------------------------------- rotary embedding
@jit
def _rope_row(Cos, Sin, Positions, t, stride_c, X, HALF: tl.constexpr):
    """Token t's (cos, sin), each [1, HALF] in fp32. The tables are fp32 and [cos(f), cos(f)]: the
    first half serves both halves; torch casts them to the activation dtype (X's) before
    multiplying, so do we."""
    pos = tl.load(Positions + t).to(tl.int64)
    d = tl.arange(0, HALF)
    c = tl.load(Cos + pos * stride_c + d).to(X.dtype.element_ty).to(tl.float32)[None, :]
    s = tl.load(Sin + pos * stride_c + d).to(X.dtype.element_ty).to(tl.float32)[None, :]
    return c, s


@jit
def _rotated(X, t, stride_t, stride_h, c, s, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Token t's H heads of X rotated, in fp32: (first halves, second halves, heads [BLOCK_H, 1],
    columns [1, HALF], mask)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < H
    p = X + t * stride_t + h * stride_h + d
    x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]
    return x1 * c - x2 * s, x2 * c + x1 * s, h, d, ok


@jit
def _rotate_heads(X, t, stride_t, stride_h, c, s, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    r1, r2, h, d, ok = _rotated(X, t, stride_t, stride_h, c, s, H, BLOCK_H, HALF)
    p = X + t * stride_t + h * stride_h + d
    tl.store(p, r1.to(X.dtype.element_ty), mask=ok)
    tl.store(p + HALF, r2.to(X.dtype.element_ty), mask=ok)


@jit
def _rotary_kernel(
    Q,
    K,
    Cos,
    Sin,
    Positions,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    H_Q: tl.constexpr,
    H_KV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c, s = _rope_row(Cos, Sin, Positions, t, stride_c, Q, HALF)
    _rotate_heads(Q, t, stride_qt, stride_qh, c, s, H_Q, BLOCK_HQ, HALF)
    _rotate_heads(K, t, stride_kt, stride_kh, c, s, H_KV, BLOCK_HKV, HALF)


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q (T, H_q, D) and k (T, H_kv, D) in place by the tables' rows `positions`; returns (q, k)."""
    check_device(q)
    T, H_q, D = q.shape
    H_kv = k.shape[1]
    assert q.stride(2) == k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert D % 2 == 0 and triton.next_power_of_2(D // 2) == D // 2, "head_dim / 2 must be a power of two"
    if T:
        _rotary_kernel[(T,)](
            q,
            k,
            cos,
            sin,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            H_Q=H_q,
            H_KV=H_kv,
            BLOCK_HQ=triton.next_power_of_2(H_q),
            BLOCK_HKV=triton.next_power_of_2(H_kv),
            HALF=D // 2,
            num_warps=4,
        )
    return q, k


def rotary_ref(positions, q, k, cos, sin):
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ---------------------------------------------------------------------------- RoPE + KV store
@jit
def _rotary_store_kv_kernel(
    Q,
    K,
    V,
    Cos,
    Sin,
    Positions,
    slot_mapping,
    KCache,
    VCache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    H_Q: tl.constexpr,
    H_KV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one token: its q heads, k heads and v heads
    c, s = _rope_row(Cos, Sin, Positions, t, stride_c, Q, HALF)
    _rotate_heads(Q, t, stride_qt, stride_qh, c, s, H_Q, BLOCK_HQ, HALF)
    slot = tl.load(slot_mapping + t).to(tl.int64)  # int64: block * block stride can pass 2**31
    if slot >= 0:  # < 0: a padding lane, nothing to store
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        r1, r2, h, d, ok = _rotated(K, t, stride_kt, stride_kh, c, s, H_KV, BLOCK_HKV, HALF)
        # rounded to k's dtype first, as the unfused rotary (in place) then store_kv would
        pkc = KCache + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
        tl.store(pkc, r1.to(K.dtype.element_ty).to(KCache.dtype.element_ty), mask=ok)
        tl.store(pkc + HALF, r2.to(K.dtype.element_ty).to(KCache.dtype.element_ty), mask=ok)
        pv = V + t * stride_vt + h * stride_vh + d
        pvc = VCache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
        tl.store(pvc, tl.load(pv, mask=ok).to(VCache.dtype.element_ty), mask=ok)
        tl.store(pvc + HALF, tl.load(pv + HALF, mask=ok).to(VCache.dtype.element_ty), mask=ok)


def rotary_store_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary_store_kv_ref` in one launch (was two: rotary, then store_kv): q rotates in place and is
    returned; rotated k and v go straight to the cache slots (slot < 0: skipped); k itself is left as
    it was (attention reads keys from the cache)."""
    check_device(q)
    T, H_q, D = q.shape
    H_kv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert cos.is_contiguous() and sin.is_contiguous()
    assert D % 2 == 0 and triton.next_power_of_2(D // 2) == D // 2, "head_dim / 2 must be a power of two"
    if T:
        _rotary_store_kv_kernel[(T,)](
            q,
            k,
            v,
            cos,
            sin,
            positions,
            slot_mapping,
            k_cache,
            v_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            H_Q=H_q,
            H_KV=H_kv,
            BLOCK_HQ=triton.next_power_of_2(H_q),
            BLOCK_HKV=triton.next_power_of_2(H_kv),
            HALF=D // 2,
            PAGE_SIZE=k_cache.shape[1],
            num_warps=4,
        )
    return q


def rotary_store_kv_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """q rotated (returned); k rotated and v written to the cache slots `slot_mapping` (< 0: skipped)."""
    q, k = rotary_ref(positions, q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


# ---------------------------------------------------------------------------- SiLU-and-mul, GeGLU
@jit
def _act_mul_kernel(GateUp, Out, stride_g, stride_o, I, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(GateUp + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GateUp + t * stride_g + I + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # tanh-approximated GELU: 0.5 g (1 + tanh(y)) = g * sigmoid(2y)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        a = g / (1.0 + tl.exp(-2.0 * y))
    else:  # SiLU: g * sigmoid(g)
        a = g / (1.0 + tl.exp(-g))
    tl.store(Out + t * stride_o + cols, (a * u).to(Out.dtype.element_ty), mask=ok)


def _act_mul_triton(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    check_device(gate_up)
    T, I2 = gate_up.shape
    I = I2 // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(I))
        _act_mul_kernel[(T, triton.cdiv(I, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), I, GELU=gelu, BLOCK=block, num_warps=4
        )
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (T, 2I); returns (T, I)."""
    return _act_mul_triton(gate_up, gelu=False)


def gelu_tanh_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU) for gate_up = [gate | up] (T, 2I); returns (T, I)."""
    return _act_mul_triton(gate_up, gelu=True)


def silu_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
