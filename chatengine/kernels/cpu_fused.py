"""Fused per-layer ops for CPU decoding, fp32: RMSNorm (+ residual add), SiLU-and-mul, RoPE with the
new K/V's store into the paged cache, and single-query (decode) attention over the paged cache.

A decode step of a small model on a CPU spent ~40% of its time in ~30 small torch ops a layer
(RMSNorm ~8, RoPE ~6, the page gather and SDPA ~10, SiLU-mul 3): at a 576-wide row each op costs
its dispatch and allocation, not its arithmetic. `cpu_fused.cpp` does each group in one ctypes
call, built and loaded like cpu_quant.cpp (system compiler, AVX2/FMA, on first use).

Every function returns what its plain-torch reference returns (fused_ops' rms_norm_ref and
silu_mul_ref, fused_ops.rotary_store_kv_ref, paged_attention_ref), to a few fp32 ulp (sums in
another order), and takes the reference's path itself when the kernel is missing (no compiler, no
AVX2, CHATENGINE_CPU_KERNELS=0 or CHATENGINE_CPU_FUSED=0) or the inputs are not what it handles
(not fp32 on the CPU, not unit-stride rows); `available()` says whether the kernel is there.
"""

import ctypes
import logging
import os
from ctypes import c_double, c_int64, c_void_p

import torch

from . import cpu_quant
from .cache_ops import store_kv_ref
from .fused_ops import rms_norm_ref, rotary_ref, silu_mul_ref
from .paged_attention import paged_attention_ref

log = logging.getLogger("chatengine")

SOURCE = cpu_quant.SOURCE.with_name("cpu_fused.cpp")


_lib: ctypes.CDLL | None = None
_lib_tried = False


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None without a compiler or AVX2, or with
    CHATENGINE_CPU_KERNELS=0 (all our CPU kernels off) or CHATENGINE_CPU_FUSED=0 (these off)."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    _lib_tried = True
    off = os.environ.get("CHATENGINE_CPU_KERNELS", "1") == "0" or os.environ.get("CHATENGINE_CPU_FUSED", "1") == "0"
    if off or not cpu_quant._cpu_has_avx2():
        return None
    try:
        lib = ctypes.CDLL(str(cpu_quant.build(SOURCE)))
    except (OSError, RuntimeError) as e:
        log.warning("fused CPU kernels unavailable (%s): using the torch ops", e)
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.cf_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, f32]
    lib.cf_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
    lib.cf_rope_store.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr]
    lib.cf_rope_store.argtypes += [ptr, ptr, i64, i64]
    lib.cf_decode_attention.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, f32, i64]
    lib.cf_decode_attention.argtypes += [ptr, i32]
    for f in (lib.cf_rms_norm, lib.cf_silu_mul, lib.cf_rope_store, lib.cf_decode_attention):
        f.restype = None
    lib.cf_decode_layer.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr]
    lib.cf_decode_layer.restype = i32
    _lib = lib
    return lib


def available() -> bool:
    return (_lib if _lib_tried else library()) is not None


def _fp32_rows(*xs: torch.Tensor) -> bool:
    """Whether the kernels can read these directly: fp32 on the CPU, 2-D with unit-stride rows."""
    return all(x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 for x in xs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm_ref: RMSNorm(x) (T, N), or (RMSNorm(x + residual), x + residual)."""
    lib = _lib if _lib_tried else library()
    if lib is None or not _fp32_rows(x, weight[None]) or (residual is not None and not _fp32_rows(residual)):
        return rms_norm_ref(x, weight, eps, residual)
    T, N = x.shape
    out = torch.empty(T, N)
    if residual is None:
        lib.cf_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), N, None, 0, T, N, eps)
        return out
    res_out = torch.empty(T, N)
    lib.cf_rms_norm(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        out.data_ptr(), N, res_out.data_ptr(), N, T, N, eps,
    )  # fmt: skip
    return out, res_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref: silu(gate) * up for gate_up = [gate | up] (T, 2I); returns (T, I)."""
    lib = _lib if _lib_tried else library()
    if lib is None or not _fp32_rows(gate_up):
        return silu_mul_ref(gate_up)
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2)
    lib.cf_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), I2 // 2, T, I2 // 2, torch.get_num_threads())
    return out


def _cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Caches (N, bs, H_kv, D) fp32 with each page's slots contiguous and one page stride for both."""
    _, _, H_kv, D = k_cache.shape
    return (
        k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.device.type == "cpu"
        and k_cache.stride()[1:] == (H_kv * D, D, 1)
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
    )


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """rotary_store_kv_ref: q (T, H_q, D) rotated (returned, a new tensor: the inputs stay as they
    were); k rotated and v written to the cache slots `slot_mapping` (< 0: skipped)."""
    lib = _lib if _lib_tried else library()
    T, H_q, D = q.shape
    H_kv = k.shape[1]
    if (
        lib is None
        or not all(x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == D for x in (q, k, v))
        or not _cache_ok(k_cache, v_cache)
        or not _fp32_rows(cos, sin)
        or cos.stride(0) != sin.stride(0)
    ):
        q, k = rotary_ref(positions, q, k, cos, sin)
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return q
    pos, slots = _int32(positions), _int32(slot_mapping)  # held: a converted copy lives through the call
    out = torch.empty(T, H_q, D)
    lib.cf_rope_store(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), T, H_q, H_kv, D,
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), pos.data_ptr(), slots.data_ptr(), out.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[1],
    )  # fmt: skip
    return out


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale: float, window: int = 0):
    """paged_attention_ref for one query token per sequence (q (B, H_q, D), row b: sequence b's last
    token): each over its sequence's seq_lens[b] cached keys, or their last `window`. Returns
    (B, H_q, D)."""
    lib = _lib if _lib_tried else library()
    B, H_q, D = q.shape
    if lib is None or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != D or D % 8:
        lib = None
    if lib is None or not _cache_ok(k_cache, v_cache) or H_q % k_cache.shape[2]:
        cu = torch.arange(B + 1, dtype=torch.int32)
        return paged_attention_ref(
            q, k_cache, v_cache, cu, seq_lens, block_tables, scale, 1, int(seq_lens.max()), window
        )
    tables, lens = _int32(block_tables), _int32(seq_lens)  # held through the call (as above)
    out = torch.empty(B, H_q, D)
    lib.cf_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[1],
        H_q, k_cache.shape[2], D, tables.data_ptr(), tables.stride(0), lens.data_ptr(), B, scale,
        window, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- a whole decode layer
class QLinear(ctypes.Structure):
    """cpu_fused.cpp's QLinear: one quantized projection and the GEMV that multiplies it."""

    _fields_ = [("gemv", c_void_p), ("fmt", c_int64), ("qs", c_void_p), ("d", c_void_p), ("m", c_void_p)]
    _fields_ += [("bias", c_void_p), ("N", c_int64), ("K", c_int64)]


class Layer(ctypes.Structure):
    """cpu_fused.cpp's Layer: a plain Llama layer's weights, shapes and cache views (raw pointers:
    whoever builds one keeps the tensors alive)."""

    _fields_ = [("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear), ("down", QLinear)]
    _fields_ += [("input_norm", c_void_p), ("post_norm", c_void_p), ("eps", c_double), ("scale", c_double)]
    _fields_ += [(n, c_int64) for n in ("H", "Hq", "Hkv", "D", "I", "window")]
    _fields_ += [("k_cache", c_void_p), ("v_cache", c_void_p), ("page_stride", c_int64), ("bs", c_int64)]
    _fields_ += [("cos", c_void_p), ("sin", c_void_p), ("ldc", c_int64)]


class Step(ctypes.Structure):
    """cpu_fused.cpp's Step: one decode step's B sequences (int32 arrays; `keep` holds them)."""

    _fields_ = [("B", c_int64), ("pos", c_void_p), ("slots", c_void_p), ("tables", c_void_p), ("ldt", c_int64)]
    _fields_ += [("lens", c_void_p), ("threads", c_int64)]
    keep: tuple


def qlinear(qw: cpu_quant.QuantWeight, bias: torch.Tensor | None = None) -> QLinear | None:
    """A projection's QLinear (its GEMV as `cpu_quant.linear` picks it), or None without the kernel."""
    lib = cpu_quant.library()
    if lib is None or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
        return None
    gemv = ctypes.cast(cpu_quant.gemv_of(lib, qw.fmt), c_void_p).value
    qs, d, m = qw.ptrs
    return QLinear(gemv, qw.fmt_id, qs, d, m, None if bias is None else bias.data_ptr(), *qw.shape)


def decode_step(positions, slot_mapping, block_tables, seq_lens) -> Step:
    """The Step of a decode step (one new token a sequence)."""
    pos, slots, tables, lens = (_int32(t) for t in (positions, slot_mapping, block_tables, seq_lens))
    step = Step(lens.shape[0], pos.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr())
    step.threads = torch.get_num_threads()
    step.keep = (pos, slots, tables, lens)  # the int32 copies live as long as the step
    return step


def decode_layer(layer: Layer, step: Step, x: torch.Tensor, residual: torch.Tensor | None):
    """One plain Llama decoder layer over a decode step's rows x (B, H) fp32: returns (MLP output,
    residual stream), DecoderLayer.forward's (same ops, same order; GEMVs as cpu_quant.linear's)."""
    assert _lib is not None and x.is_contiguous() and (residual is None or residual.is_contiguous())
    out, res_out = torch.empty(x.shape), torch.empty(x.shape)
    rc = _lib.cf_decode_layer(
        ctypes.addressof(layer), ctypes.addressof(step), x.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr(), res_out.data_ptr(),
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"cf_decode_layer failed ({rc})")
    return out, res_out
