"""KV cache operations on the page-first cache: Triton kernels and their plain-torch references.

`kv_cache` is `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`; one layer's K (or V) is
the strided view `kv_cache[:, layer, 0]` (or `[:, layer, 1]`) of shape `[num_blocks, block_size,
kv_heads, head_dim]`. A slot is `block_id * block_size + offset`; slot -1 means "skip this token"
(padding lanes of a CUDA graph).

Backends as in `paged_attention`: Triton on CUDA tensors, the reference elsewhere, unless the
`backend` argument or $CHATENGINE_KERNELS says otherwise.
"""

import torch

from .paged_attention import check_device, jit, resolve_backend, tl, triton


@jit
def _store_kv_kernel(
    Key,
    Value,
    KCache,
    VCache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # head_dim strides are 1
    stride_kcb,
    stride_kcs,
    stride_kch,  # (block, slot, head)
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)  # one token: all its KV heads
    slot = tl.load(slot_mapping + t).to(tl.int64)  # int64: block * block stride can pass 2**31
    if slot < 0:  # padding lane
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(Key + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(Value + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(
        KCache + block * stride_kcb + offset * stride_kcs + h * stride_kch + d, k.to(KCache.dtype.element_ty), mask=mask
    )
    tl.store(
        VCache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v.to(VCache.dtype.element_ty), mask=mask
    )


@jit
def _copy_blocks_kernel(Cache, src, dst, page_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)  # one (src, dst) pair, BLOCK elements of the page
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_numel
    src_page = tl.load(src + pair).to(tl.int64)
    dst_page = tl.load(dst + pair).to(tl.int64)
    x = tl.load(Cache + src_page * page_numel + offs, mask=mask)
    tl.store(Cache + dst_page * page_numel + offs, x, mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton `store_kv_ref`: one program per token; slots < 0 are skipped in the kernel (no sync)."""
    check_device(key)
    T, H, D = key.shape
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=H,
        HEAD_DIM=D,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_D=triton.next_power_of_2(D),
        PAGE_SIZE=k_cache.shape[1],
        num_warps=4,
    )


def copy_blocks_triton(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton `copy_blocks_ref` in one pass (the torch version gathers into a temporary first).

    NOTE: pages are copied in parallel, so `dst` must not repeat or overlap `src` (copy-on-write
    copies go to freshly allocated pages, so they never do).
    """
    check_device(kv_cache)
    assert kv_cache.is_contiguous() and src.shape == dst.shape
    if src.numel() == 0:
        return
    page_numel = kv_cache[0].numel()
    block = 2048  # elements per program: 8 KiB of fp32, 4 of bf16
    _copy_blocks_kernel[(src.numel(), triton.cdiv(page_numel, block))](
        kv_cache, src, dst, page_numel, BLOCK=block, num_warps=4
    )


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, kv_heads, head_dim] into the slots given by slot_mapping [T]."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages (every layer, K and V): kv_cache[dst[i]] = kv_cache[src[i]]."""
    kv_cache[dst.long()] = kv_cache[src.long()]


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pages block_ids as one contiguous tensor [n, num_layers, 2, block_size, kv_heads, head_dim]."""
    return kv_cache[block_ids.long()]


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Inverse of gather: kv_cache[block_ids[i]] = pages[i]."""
    kv_cache[block_ids.long()] = pages.to(kv_cache.device, kv_cache.dtype)


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend=None):
    if resolve_backend(key.device, backend) == "triton":
        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(kv_cache, src, dst, backend=None):
    if resolve_backend(kv_cache.device, backend) == "triton":
        return copy_blocks_triton(kv_cache, src, dst)
    return copy_blocks_ref(kv_cache, src, dst)


def page_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src, dst, n) runs: pairs where both ids go up by one merge, so each run is one copy."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def copy_pages(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] between two page-first tensors, e.g. the pinned host pool and
    the device cache: one contiguous copy per run of consecutive ids, nothing staged in between
    (non-blocking: host -> device from pinned memory is an async DMA on the current stream)."""
    for s, d, n in page_runs(src_ids, dst_ids):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


# A page is one contiguous span of the page-first cache, so on the GPU the torch reference already
# is one copy per page: gather is a single index_select into a contiguous output, scatter a single
# index_put_ (after one host-to-device copy of `pages`). A Triton kernel would not move fewer bytes.
gather_blocks = gather_blocks_ref
scatter_blocks = scatter_blocks_ref
