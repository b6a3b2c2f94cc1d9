"""Attention backends: how a layer stores its new K/V and attends over the paged cache, plus the
per-layer elementwise ops (RMSNorm with an optional residual add, rotary embedding, SiLU- or
GELU-and-mul).

"torch" is plain torch, vectorised for CPU (attention: kernels/paged_attention.py
`paged_attention_torch`, which tests hold to `paged_attention_ref`; RMSNorm and SiLU-mul: the kernels'
*_ref; RoPE: `rotary_ref`'s arithmetic in fewer ops); "triton" runs the Triton kernels (on CUDA, or
on CPU under TRITON_INTERPRET=1 for tests): one launch per op instead of ~8 (RMSNorm), ~14 (RoPE) or
2 (SiLU-mul) small torch kernels, which dominate a small-batch decode step.
"""

import torch

from chatengine.kernels import cache_ops, cpu_fused, fused_ops, paged_attention


class TorchBackend:
    """Plain torch, vectorised for CPU. What is the same in every layer of a step (gather indices,
    masks, the cache rows of the new tokens) is computed at the step's first layer and reused by the
    others; a layer then costs two index_copy_ (store), two index_select (gather) and one SDPA per
    group of sequences (kernels/paged_attention.py, `paged_attention_torch`).

    The reuse is opt-in: the model runner calls `begin_step(meta)` before each forward, and only
    calls with that very `meta` (and its `slot_mapping`) reuse the step's plan; any other call
    computes its own, so nothing stale is ever read from reused staging buffers.

    fp32 on the CPU, `fused` (kernels/cpu_fused.py, when its kernel builds) does RMSNorm, RoPE + the
    KV store and SiLU-mul in one call each, and a decode step's attention (one query a sequence) in
    one call over the paged cache, instead of ~30 small torch ops a layer. Off in deterministic mode
    (its attention computes each row alone: paged_attention_rows_torch)."""

    name = "torch"

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic  # attention one query row at a time (invariant mode)
        self._meta = self._positions = None  # the current step's metadata and positions (begin_step)
        self._plans: dict = {}  # window -> (geometry, its TorchAttentionPlan), built at the first layer
        self._store = None  # its (cache rows, keep mask) for store_kv
        self._rope = None  # its (cos, sin, dtype, cos rows, signed sin rows)
        self.fused = not deterministic and cpu_fused.available()

    def _fused(self, x) -> bool:
        return self.fused and x.dtype == torch.float32 and x.device.type == "cpu"

    def begin_step(self, meta, positions=None):
        self._meta, self._positions = meta, positions
        self._store = self._rope = None
        self._plans = {}

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        """k/v [T, H_kv, D] into the cache slots `slot_mapping` (< 0: skipped): one index_copy_ each
        into the layer's rows of one slot (H_kv * D elements), not an advanced-index put on the
        strided layer view (~1000x slower on CPU)."""
        N, bs, H_kv, D = k_cache.shape
        width = H_kv * D
        if (
            not paged_attention.torch_attention_supported(k_cache, v_cache)
            or k_cache.stride(0) % width
            or k.dtype != k_cache.dtype
        ):
            return cache_ops.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        rows_per_page = k_cache.stride(0) // width
        step = self._meta is not None and slot_mapping is self._meta.slot_mapping
        if step and self._store is not None and self._store[0] == rows_per_page:
            _, rows, keep = self._store
        else:
            slots = slot_mapping.long()
            keep = slots >= 0
            keep = None if bool(keep.all()) else keep
            if keep is not None:
                slots = slots[keep]
            rows = slots // bs * rows_per_page + slots % bs
            if step:
                self._store = (rows_per_page, rows, keep)
        if keep is not None:
            k, v = k[keep], v[keep]
        n = (N - 1) * rows_per_page + bs
        for x, cache in ((k, k_cache), (v, v_cache)):
            slots_view = cache.as_strided((n, width), (width, 1), cache.storage_offset())
            slots_view.index_copy_(0, rows, x.reshape(-1, width))

    def attention(self, q, k_cache, v_cache, meta, scale, window=0):
        """Each query over its sequence's cached keys: all before it, or its last `window`."""
        if self._fused(q) and meta.max_seqlen_q == 1 and q.shape[0] == meta.seq_lens.shape[0]:  # a decode step
            return cpu_fused.decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, window)
        if self.deterministic:
            return paged_attention.paged_attention_rows_torch(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, window
            )
        if not paged_attention.torch_attention_supported(k_cache, v_cache):
            return paged_attention.paged_attention_ref(
                q,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                window,
            )
        geometry = (k_cache.shape[1], q.shape[1], q.dtype)  # what the plan depends on
        cached = self._plans.get(window) if meta is self._meta else None
        if cached is not None and cached[0] == geometry:
            plan = cached[1]
        else:
            plan = paged_attention.plan_paged_attention_torch(
                meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, k_cache.shape[1], q.shape[1], q.dtype, window
            )
            if meta is self._meta:
                self._plans[window] = (geometry, plan)
        return paged_attention.paged_attention_torch(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            plan=plan,
            window=window,
        )

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm(x), or (RMSNorm(x + residual), x + residual)."""
        if self._fused(x):
            return cpu_fused.rms_norm(x, weight, eps, residual)
        return fused_ops.rms_norm_ref(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        """(q, k) rotated by the fp32 tables' rows `positions` (the triton backend rotates in place).

        `rotary_ref`'s arithmetic in 4 ops instead of ~14: x * cos + [x2, x1] * [-sin1, sin2] is
        x * cos + [-x2, x1] * sin exactly (a sign flip commutes with rounding); the table rows are
        gathered once per step, and q and k, adjacent heads of the qkv projection, rotate as one."""
        T, H_q, D = q.shape
        r = self._rope
        if r is None or r[0] is not cos or r[1] is not sin or r[2] != q.dtype or positions is not self._positions:
            c = cos[positions].unsqueeze(1).to(q.dtype)
            s = sin[positions].unsqueeze(1).to(q.dtype)
            r = (cos, sin, q.dtype, c, torch.cat((-s[..., : D // 2], s[..., D // 2 :]), dim=-1))
            if positions is self._positions:
                self._rope = r
        c, signed_sin = r[3], r[4]

        def rotate(x):
            return x * c + torch.cat((x[..., D // 2 :], x[..., : D // 2]), dim=-1) * signed_sin

        if (
            q.stride() == k.stride()
            and q.stride(1) == D
            and k.dtype == q.dtype
            and k.data_ptr() == q.data_ptr() + H_q * D * q.element_size()
        ):
            qk = rotate(q.as_strided((T, H_q + k.shape[1], D), q.stride(), q.storage_offset()))
            return qk[:, :H_q], qk[:, H_q:]
        return rotate(q), rotate(k)

    def rotary_store_kv(self, positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        """q rotated (returned); k rotated and v stored into the cache slots `slot_mapping`."""
        if self._fused(q):
            return cpu_fused.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        q, k = self.rotary(positions, q, k, cos, sin)
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def silu_mul(self, gate_up):
        if self._fused(gate_up):
            return cpu_fused.silu_mul(gate_up)
        return fused_ops.silu_mul_ref(gate_up)

    def gelu_tanh_mul(self, gate_up):
        return fused_ops.gelu_tanh_mul_ref(gate_up)


class TritonBackend:
    name = "triton"

    def __init__(self, deterministic: bool = False, num_kv_heads: int = 0, head_dim: int = 0):
        self.deterministic = deterministic
        # invariant mode: attention splits at fixed key positions (paged_attention_triton's split_keys),
        # in the model's key tiles (the whole model's KV heads: every tensor-parallel rank alike)
        self.split_keys = paged_attention.INVARIANT_SPLIT_KEYS if deterministic else 0
        self.key_tile = paged_attention.invariant_key_tile(num_kv_heads, head_dim) if deterministic else 0

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        cache_ops.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale, window=0):
        # num_splits: fixed by the model runner for a CUDA graph (no host-dependent launch inside it)
        return paged_attention.paged_attention_triton(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            getattr(meta, "num_splits", None),
            window=window,
            split_keys=self.split_keys,
            key_tile=self.key_tile,
        )

    def rms_norm(self, x, weight, eps, residual=None):
        return fused_ops.rms_norm_triton(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        return fused_ops.rotary_triton(positions, q, k, cos, sin)

    def rotary_store_kv(self, positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return fused_ops.rotary_store_kv_triton(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up):
        return fused_ops.silu_mul_triton(gate_up)

    def gelu_tanh_mul(self, gate_up):
        return fused_ops.gelu_tanh_mul_triton(gate_up)


def get_backend(name: str, device_type: str, deterministic: bool = False, num_kv_heads: int = 0, head_dim: int = 0):
    """`num_kv_heads`, `head_dim`: the whole model's (the Triton backend's invariant key tile)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "triton":
        return TritonBackend(deterministic, num_kv_heads, head_dim)
    return TorchBackend(deterministic)
