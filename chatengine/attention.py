"""Attention backends: how a layer stores its new K/V and attends over the paged cache, plus the
per-layer elementwise ops (RMSNorm with an optional residual add, rotary embedding, SiLU-and-mul).

"torch" is the plain-torch reference (kernels/*_ref: gather the sequence's pages, masked SDPA; the
elementwise ops as chatengine/models/llama.py writes them); "triton" runs the Triton kernels (on
CUDA, or on CPU under TRITON_INTERPRET=1 for tests): one launch per op instead of ~8 (RMSNorm),
~14 (RoPE) or 2 (SiLU-mul) small torch kernels, which dominate a small-batch decode step.
"""
from kernels import cache_ops, fused_ops, paged_attention


class TorchBackend:
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cache_ops.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale):
        return paged_attention.paged_attention_ref(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                   meta.block_tables, scale, meta.max_seqlen_q, meta.max_seqlen_k)

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm(x), or (RMSNorm(x + residual), x + residual)."""
        return fused_ops.rms_norm_ref(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        """(q, k) rotated by the fp32 tables' rows `positions` (the triton backend rotates in place)."""
        return fused_ops.rotary_ref(positions, q, k, cos, sin)

    def silu_mul(self, gate_up):
        return fused_ops.silu_mul_ref(gate_up)


class TritonBackend:
    name = "triton"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cache_ops.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale):
        # num_splits: fixed by the model runner for a CUDA graph (no host-dependent launch inside it)
        return paged_attention.paged_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                      meta.block_tables, scale, meta.max_seqlen_q,
                                                      meta.max_seqlen_k, getattr(meta, "num_splits", None))

    def rms_norm(self, x, weight, eps, residual=None):
        return fused_ops.rms_norm_triton(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        return fused_ops.rotary_triton(positions, q, k, cos, sin)

    def silu_mul(self, gate_up):
        return fused_ops.silu_mul_triton(gate_up)


def get_backend(name: str, device_type: str):
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    return {"torch": TorchBackend, "triton": TritonBackend}[name]()
