"""What merely reading a decode's KV bytes costs, beside the attention kernel (gpu_bench --part kernel).

Two memory-only Triton kernels, timed like the attention kernel (a CUDA graph over the same layer
copies): `paged`, one program per (sequence, KV head, 128-key tile), walks the same block table
(length -> page ids -> K and V rows of its head) and sums what it read; `contiguous` sums the same
number of bytes laid out flat, 32 KiB per program. No math beyond a sum, no split merge: what an
attention kernel over these pages could at best approach on this device at this size (for 1 x 8k
the launch and the first bytes' latency are a third of the time).
"""

import torch
import triton
import triton.language as tl

from chatengine.kernels.paged_attention import gdc_launch_dependents, gdc_wait, pdl_supported

TILE = 128  # keys per paged-read program, as the 1 x 8k decode launch
ROWS = 256  # contiguous read: 256 x 64 bf16 = 32 KiB per program (best of 8-64 KiB, H200)


@triton.jit
def _paged_read_kernel(
    K,
    V,
    Sink,
    seq_lens,
    block_tables,
    num_kv_heads,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0) // num_kv_heads
    head = tl.program_id(0) % num_kv_heads
    offs_n = tl.program_id(1) * TILE + tl.arange(0, TILE)
    n_ok = offs_n < tl.load(seq_lens + seq)
    page = tl.load(block_tables + seq * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    offs = (page * stride_kb + (offs_n % PAGE_SIZE) * stride_ks + head * stride_kh)[:, None] + tl.arange(0, HEAD_DIM)[
        None, :
    ]
    k = tl.load(K + offs, mask=n_ok[:, None], other=0.0)
    v = tl.load(V + offs, mask=n_ok[:, None], other=0.0)
    total = tl.sum(tl.sum(k.to(tl.float32) + v.to(tl.float32), 1), 0)
    tl.store(Sink + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), total)


@triton.jit
def _contiguous_read_kernel(X, Sink, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x = tl.load(X + rows[:, None] * 64 + tl.arange(0, 64)[None, :])
    tl.store(Sink + tl.program_id(0), tl.sum(tl.sum(x.to(tl.float32), 1), 0))


def read_floors(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, ctx: int, graph_time) -> dict:
    """ms per layer of each memory-only read over `cache` [pages, copies, 2, page, H_kv, D] (the
    attention benchmark's layers); `graph_time(fn)` times fn's CUDA graph (fn runs every copy)."""
    _, copies, _, page_size, H_kv, D = cache.shape
    B = lens.shape[0]
    kv_bytes = B * ctx * H_kv * D * 2 * cache.element_size()
    tiles = -(-ctx // TILE)
    sink = torch.empty(max(B * H_kv * tiles, kv_bytes // (ROWS * 64 * 2)), device=cache.device, dtype=torch.float32)
    res = {}
    for pdl in (False, True) if pdl_supported(cache.device) else (False,):

        def paged(pdl=pdl):
            for layer in range(copies):
                k, v = cache[:, layer, 0], cache[:, layer, 1]
                _paged_read_kernel[(B * H_kv, tiles)](
                    k,
                    v,
                    sink,
                    lens,
                    tables,
                    H_kv,
                    k.stride(0),
                    k.stride(1),
                    k.stride(2),
                    tables.stride(0),
                    HEAD_DIM=D,
                    TILE=TILE,
                    PAGE_SIZE=page_size,
                    PDL=pdl,
                    num_warps=4,
                    **({"launch_pdl": True} if pdl else {}),
                )

        res["paged_read_pdl_ms" if pdl else "paged_read_ms"] = graph_time(paged) / copies
    assert D == 64 and kv_bytes % (ROWS * 64 * 2) == 0, "the contiguous read tiles 64-wide rows of 32 KiB"
    flat = torch.randn(copies, kv_bytes // cache.element_size(), device=cache.device, dtype=cache.dtype)

    def contiguous():
        for layer in range(copies):
            _contiguous_read_kernel[(kv_bytes // (ROWS * 64 * 2),)](flat[layer], sink, ROWS=ROWS, num_warps=8)

    res["contiguous_read_ms"] = graph_time(contiguous) / copies
    return res
