"""Attention backends: how a layer stores its new K/V and attends over the paged cache.

"torch" is the plain-torch reference (kernels/*_ref: gather the sequence's pages, masked SDPA);
"triton" runs the Triton kernels (on CUDA, or on CPU under TRITON_INTERPRET=1 for tests).
"""
from kernels import cache_ops, paged_attention


class TorchBackend:
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cache_ops.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale):
        return paged_attention.paged_attention_ref(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                   meta.block_tables, scale, meta.max_seqlen_q, meta.max_seqlen_k)


class TritonBackend:
    name = "triton"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cache_ops.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale):
        # num_splits: fixed by the model runner for a CUDA graph (no host-dependent launch inside it)
        return paged_attention.paged_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                      meta.block_tables, scale, meta.max_seqlen_q,
                                                      meta.max_seqlen_k, getattr(meta, "num_splits", None))


def get_backend(name: str, device_type: str):
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    return {"torch": TorchBackend, "triton": TritonBackend}[name]()
