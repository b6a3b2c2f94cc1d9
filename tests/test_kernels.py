"""Kernels against their torch references, and the attention reference against a float64 loop.

On a CPU-only machine the Triton kernels run under Triton's interpreter. TRITON_INTERPRET=1 is read
when a kernel is defined (Triton's own helpers at `import triton`), so this module sets it before
importing the kernels; if triton was imported first (tests/conftest.py imports chatengine, which
imports kernels/), the kernel tests here skip and `test_interpreter_in_subprocess` reruns this file
in a fresh interpreter instead. On a GPU machine
the same tests run compiled on CUDA (bigger shapes) and the CPU ones skip; run
`TRITON_INTERPRET=1 pytest tests/test_kernels.py` there to exercise the interpreter.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ imports triton

from chatengine.kernels import (  # noqa: E402
    cache_ops,
    fp8_ops,
    fused_ops,
    grammar_masks,
    logprob_ops,
    placeholders,
    sampling,
)
from chatengine.kernels import paged_attention as pa
from chatengine.kernels.invariant_matmul import same_bits

tl, triton = pa.tl, pa.triton  # (None without triton)

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = pa.interpreting()
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is first imported"),
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not HAS_CUDA or INTERPRETED, reason="needs CUDA and compiled (not interpreted) kernels"
        ),
    ),
]


def interpreted_subset(device: str, keep: bool) -> None:
    """The interpreter runs a kernel ~1000x slower than a GPU: on the CPU a combinatorial test keeps
    the cases that exercise a distinct code path (`keep`); CUDA runs them all."""
    if device == "cpu" and not keep:
        pytest.skip("interpreted: a case of the same code path runs; all run on CUDA")


REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}  # max err / max |ref|
CLOSE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# (q_lens, seq_lens): decode of a 1-token sequence, fresh prefill, cached prefix + chunk, decodes
MIXED = ([1, 7, 17, 1, 33, 5], [1, 7, 33, 100, 100, 64])
DECODE = ([1, 1, 1, 1], [1, 17, 100, 300])
MIXED_CUDA = ([1, 300, 17, 1, 1000, 64, 1], [1, 300, 529, 2000, 1100, 4000, 4097])
DECODE_CUDA = ([1] * 6, [1, 17, 1000, 4096, 8191, 20000])


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def make_batch(q_lens, seq_lens, H_q, H_kv, D, page_size, dtype, device, num_layers=2):
    """Varlen queries (a strided view of a packed qkv) and one layer's K/V views of a random
    page-first cache; every sequence gets shuffled pages, tables padded with -1."""
    B = len(q_lens)
    num_pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(num_pages) + 3  # a few pages that belong to nobody
    kv = torch.randn(num_blocks, num_layers, 2, page_size, H_kv, D).to(device, dtype)
    perm = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((B, max(num_pages) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(num_pages):
        block_tables[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    T = sum(q_lens)
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(device, dtype)
    q = qkv[:, : H_q * D].view(T, H_q, D)  # stride(0) != H_q * D
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    layer = num_layers - 1
    return (q, kv[:, layer, 0], kv[:, layer, 1], cu_seqlens_q.to(device), seq_lens.to(device), block_tables.to(device))


def naive_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window=0):
    """float64, one sequence and one head at a time, causal (and sliding-window) mask by hand."""
    T, H_q, D = q.shape
    page_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H_q, D, dtype=torch.float64)
    cu, lens, tables = cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.tolist()
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    for b, L in enumerate(lens):
        start, q_len = cu[b], cu[b + 1] - cu[b]
        pos = torch.arange(L)
        pages = torch.tensor(tables[b])[pos // page_size]
        keys = k_cache[pages, pos % page_size].double()  # (L, H_kv, D)
        values = v_cache[pages, pos % page_size].double()
        for h in range(H_q):
            kv_head = h // (H_q // H_kv)
            scores = q[start : start + q_len, h].cpu().double() @ keys[:, kv_head].T * scale  # (q_len, L)
            for i in range(q_len):  # query i sits at position L - q_len + i
                scores[i, L - q_len + i + 1 :] = float("-inf")
                if window:  # it sees only keys at positions > its own - window
                    scores[i, : max(L - q_len + i - window + 1, 0)] = float("-inf")
            out[start : start + q_len, h] = scores.softmax(-1) @ values[:, kv_head]
    return out


def rel_err(out, expected):
    return ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()


# ---------------------------------------------------------------------------- attention reference
@pytest.mark.parametrize("batch", [MIXED, DECODE])
@pytest.mark.parametrize("H_q, H_kv, page_size", [(4, 4, 16), (8, 2, 32), (7, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_ref_matches_naive(batch, H_q, H_kv, page_size, dtype):
    args = make_batch(*batch, H_q, H_kv, 64, page_size, dtype, "cpu")
    out = pa.paged_attention_ref(*args, scale=0.125)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel_err(out, naive_attention(*args, scale=0.125)) < REL_TOL[dtype]


# ---------------------------------------------------------------------------- vectorised torch attention
# (q_lens, seq_lens) beyond MIXED / DECODE: decodes at page edges (16, 17, 32, 33 keys), one fresh
# prefill, fresh prefills of several lengths (SDPA's causal mask, queries padded), one prefix + odd
# chunk, and prefill-only batches with and without a cached prefix
EDGES = ([1] * 5, [5, 16, 17, 32, 33])
PREFILL_ONE = ([13], [13])
PREFILL_FRESH = ([13, 40, 5], [13, 40, 5])
PREFILL_PREFIX = ([7, 9, 1], [7, 40, 1])


@pytest.mark.parametrize(
    "batch", [MIXED, DECODE, EDGES, PREFILL_ONE, PREFILL_FRESH, PREFILL_PREFIX, ([1], [1]), ([2], [35])]
)
@pytest.mark.parametrize("H_q, H_kv, page_size", [(4, 4, 16), (8, 2, 32), (9, 3, 16), (7, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_torch_matches_ref(batch, H_q, H_kv, page_size, dtype):
    args = make_batch(*batch, H_q, H_kv, 64, page_size, dtype, "cpu")
    out = pa.paged_attention_torch(*args, scale=0.125)
    assert out.shape == args[0].shape and out.dtype == dtype
    # same SDPA over the same padded keys: rounding-level differences (GQA rows batched differently)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(out, pa.paged_attention_ref(*args, scale=0.125), **tol)
    assert rel_err(out, naive_attention(*args, scale=0.125)) < REL_TOL[dtype]


def test_attention_torch_plan_is_per_step_not_per_layer():
    # one plan serves every layer (any cache of the same page size); contiguous caches work too
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(*MIXED, 8, 2, 64, 16, torch.float32, "cpu")
    plan = pa.plan_paged_attention_torch(cu, seq_lens, tables, 16, 8, torch.float32)
    assert [g.decode for g in plan.groups] == [True, False]
    for kc, vc in ((k_cache, v_cache), (v_cache, k_cache), (k_cache.contiguous(), v_cache.contiguous())):
        out = pa.paged_attention_torch(q, kc, vc, cu, seq_lens, tables, 0.125, plan=plan)
        torch.testing.assert_close(
            out, pa.paged_attention_ref(q, kc, vc, cu, seq_lens, tables, 0.125), atol=2e-6, rtol=2e-6
        )


def test_attention_torch_falls_back_on_other_layouts():
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(*MIXED, 4, 2, 64, 16, torch.float32, "cpu")
    k_t, v_t = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))  # head-major pages
    assert not pa.torch_attention_supported(k_t, v_t)
    torch.testing.assert_close(
        pa.paged_attention_torch(q, k_t, v_t, cu, seq_lens, tables, 0.125),
        pa.paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, tables, 0.125),
    )


def test_attention_torch_empty_batch():
    q = torch.empty(0, 4, 64)
    k_cache = torch.zeros(2, 16, 2, 64)
    no_seqs = torch.zeros(0, dtype=torch.int32)
    out = pa.paged_attention_torch(
        q, k_cache, k_cache, torch.zeros(1, dtype=torch.int32), no_seqs, torch.zeros(0, 1, dtype=torch.int32), 0.125
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("window", [1, 5, 20, 64])
@pytest.mark.parametrize("batch", [MIXED, DECODE, PREFILL_PREFIX])
def test_sliding_window_ref_and_torch_match_naive(window, batch):
    args = make_batch(*batch, 8, 2, 32, 16, torch.float32, "cpu")
    ref = pa.paged_attention_ref(*args, scale=0.125, window=window)
    assert rel_err(ref, naive_attention(*args, scale=0.125, window=window)) < 1e-5
    torch.testing.assert_close(pa.paged_attention_torch(*args, scale=0.125, window=window), ref, atol=2e-6, rtol=2e-6)
    plan = pa.plan_paged_attention_torch(*args[3:6], 16, 8, torch.float32)  # a full-attention plan
    with pytest.raises(AssertionError, match="another window"):
        pa.paged_attention_torch(*args, scale=0.125, plan=plan, window=window)


# ---------------------------------------------------------------------------- paged attention
def check_attention(device, batch, H_q, H_kv, D, page_size, dtype, num_splits=None, window=0):
    q, *rest = make_batch(*batch, H_q, H_kv, D, page_size, dtype, device)
    scale = D**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)  # poisoned
    res = pa.paged_attention_triton(q, *rest, scale, num_splits=num_splits, out=out, window=window)
    assert res is out and not out.isnan().any()
    assert rel_err(out, naive_attention(q, *rest, scale, window)) < REL_TOL[dtype]
    torch.testing.assert_close(out, pa.paged_attention_ref(q, *rest, scale, window=window), **CLOSE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 20, 70])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_attention(device, window, num_splits):
    """Windowed layers (Gemma 3, Mistral): a query sees only its last `window` keys, in prefill
    chunks on a cached prefix, in decodes, split or not."""
    interpreted_subset(device, num_splits is None or window == 20)
    for batch in (MIXED_CUDA, DECODE_CUDA) if device == "cuda" else (MIXED, DECODE):
        check_attention(device, batch, 8, 2, 64, 16, torch.float32, num_splits, window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H_q, H_kv", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed(device, H_q, H_kv, page_size, dtype):
    check_attention(device, MIXED_CUDA if device == "cuda" else MIXED, H_q, H_kv, 64, page_size, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "H_q, H_kv, D, page_size, dtype",
    [
        (14, 2, 128, 64, torch.bfloat16),
        (2, 1, 32, 16, torch.float32),
        (4, 2, 256, 32, torch.float16),
        (4, 1, 96, 16, torch.float32),
    ],
)  # head_dim 96: not a power of two
def test_paged_attention_shapes(device, H_q, H_kv, D, page_size, dtype):
    check_attention(device, MIXED_CUDA if device == "cuda" else MIXED, H_q, H_kv, D, page_size, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("H_q, H_kv, dtype", [(8, 2, torch.bfloat16), (7, 7, torch.float32), (7, 1, torch.float32)])
def test_split_kv_decode(device, num_splits, H_q, H_kv, dtype, monkeypatch):
    interpreted_subset(device, num_splits in (None, 8) or H_kv == 2)
    # poison every buffer the launcher allocates (partial outputs, lse): each split must write its own
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    check_attention(device, DECODE_CUDA if device == "cuda" else DECODE, H_q, H_kv, 64, 16, dtype, num_splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("block_n, page_size", [(16, 16), (32, 16), (16, 32), (128, 16)])
@pytest.mark.parametrize("pad_table", [0, 3])
def test_decode_key_tiles(device, num_splits, block_n, page_size, pad_table):
    interpreted_subset(device, (num_splits == 5) == (pad_table == 3))
    # split decodes at the tile sizes the launch rules use (128 keys: `_decode_launch`) and smaller:
    # tiles across page edges, fewer tiles than splits (empty splits), lengths that end mid-tile and
    # mid-page, a table exactly as wide as the longest sequence or wider with -1 padding
    q_lens, seq_lens = [1] * 5, [1, page_size, 3 * block_n + 5, 7 * page_size, 160]
    q, k_cache, v_cache, cu, lens, tables = make_batch(q_lens, seq_lens, 8, 2, 64, page_size, torch.float32, device)
    width = -(-max(seq_lens) // page_size) + pad_table
    tables = torch.cat([tables, torch.full((5, 3), -1, dtype=tables.dtype, device=device)], 1)[:, :width]
    tables = tables.contiguous()
    out = torch.full(q.shape, float("nan"), device=device)
    pa.paged_attention_triton(
        q,
        k_cache,
        v_cache,
        cu,
        lens,
        tables,
        0.125,
        max_seqlen_q=1,
        num_splits=num_splits,
        out=out,
        launch=(block_n, 4, 2),
    )
    assert rel_err(out, naive_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdl", [False, "merge", True])
@pytest.mark.parametrize("num_splits", [1, 6])
@pytest.mark.parametrize("launch", [None, (128, 4, 3)])  # the rule's, and 1 x 32k's: pipelined, PDL
def test_decode_pdl_in_cuda_graph(device, pdl, num_splits, launch):
    interpreted_subset(device, pdl is False)  # no PDL and no graphs under the interpreter
    # programmatic dependent launch (sm_90+; a no-op elsewhere): eager, then a CUDA graph of two
    # dependent layers replayed twice on new inputs, the second layer reading the first's output
    q, k_cache, v_cache, cu, lens, tables = make_batch(
        *(DECODE_CUDA if device == "cuda" else DECODE), 8, 2, 64, 16, torch.float32, device
    )

    def two_layers():
        mid = pa.paged_attention_triton(
            q, k_cache, v_cache, cu, lens, tables, 0.125, max_seqlen_q=1, num_splits=num_splits, pdl=pdl, launch=launch
        )
        return pa.paged_attention_triton(
            mid,
            v_cache,
            k_cache,
            cu,
            lens,
            tables,
            0.125,
            max_seqlen_q=1,
            num_splits=num_splits,
            pdl=pdl,
            launch=launch,
        )

    def expected():
        mid = naive_attention(q, k_cache, v_cache, cu, lens, tables, 0.125).to(device, q.dtype)
        return naive_attention(mid, v_cache, k_cache, cu, lens, tables, 0.125)

    assert rel_err(two_layers(), expected()) < 2 * REL_TOL[torch.float32]
    if device != "cuda":
        return
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two_layers()
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, expected()) < 2 * REL_TOL[torch.float32]


def test_pdl_support():
    assert not pa.pdl_supported(torch.device("cpu"))


def test_decode_launch_rule():
    # one wave of split programs (<= 4 per SM) at head_dim 64: 128-key tiles and PDL; 3 stages for
    # splits of several tiles
    assert pa._decode_launch(8, 64, 8192, 64) == ((128, 4, 2), True)  # 1 x 8k, 8 KV heads
    assert pa._decode_launch(8, 64, 32768, 64) == ((128, 4, 3), True)  # 1 x 32k
    assert pa._decode_launch(8, 32, 4096, 64) == ((128, 4, 2), True)  # a bs-1 graph, max_model_len 4096
    # other split decodes, and one split under 4 programs per SM: pipelined 128-key tiles, no PDL
    for args in ((128, 8, 4096, 64), (512, 1, 1024, 64), (8, 1, 100, 64), (8, 64, None, 64)):  # None: length unknown
        assert pa._decode_launch(*args) == ((128, 4, 3), False), args
    # one split from 4 programs per SM, and other head dims: the table
    for args in ((2048, 1, 1024, 64), (528, 1, 1024, 64), (8, 64, 8192, 128), (8, 64, 8192, 32)):
        assert pa._decode_launch(*args) == (pa._launch(pa.DECODE_LAUNCH, args[3]), False), args


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_prefill(device):
    # splits in a mixed batch: splits past a query block's causal limit are empty (lse = -inf)
    check_attention(device, MIXED, 8, 2, 64, 16, torch.float32, num_splits=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [2, 4, 8])
@pytest.mark.parametrize("batch, H_q, H_kv", [("MIXED", 8, 2), ("MIXED", 7, 1), ("DECODE", 14, 2)])
def test_merge_several_heads_per_program(device, heads, batch, H_q, H_kv, monkeypatch):
    interpreted_subset(device, (heads, H_q) in ((2, 14), (4, 7), (8, 8)))
    # the merge with `heads` query heads per program, some of them past H_q (7, 14 heads), from
    # poisoned partials
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(pa, "_merge_heads", lambda *a: heads)
    shapes = {"MIXED": MIXED, "DECODE": DECODE_CUDA if device == "cuda" else DECODE}
    check_attention(device, shapes[batch], H_q, H_kv, 64, 16, torch.float32, num_splits=3)


def test_merge_heads_rule():
    assert pa._merge_heads(128, 32, 132) == 8  # a 128-token chunk: 512 programs, not 4096
    assert pa._merge_heads(64, 32, 132) == 4  # a 64-sequence split decode: 512 programs
    assert pa._merge_heads(1, 32, 132) == 1  # one token: all 32 programs
    assert pa._merge_heads(16, 14, 132) == 1


def test_prefill_split_rule():
    # a 128-token turn on a 2k prefix, Llama-1B heads (group 4, 8 KV heads): 64 programs -> 5 splits
    assert pa._prefill_splits(1, 128, 4, 8, 2176, 132) == 5
    assert pa._prefill_splits(1, 2048, 4, 8, 2048, 132) == 1  # a long chunk fills the GPU itself
    assert pa._prefill_splits(1, 128, 4, 8, 200, 132) == 1  # too few keys to split
    assert pa._prefill_splits(1, 16, 4, 8, 100_000, 132) == pa.MAX_PREFILL_SPLITS


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    q = torch.empty(0, 4, 64, device=device)
    k_cache = torch.zeros(2, 16, 2, 64, device=device)
    no_seqs = torch.zeros(0, dtype=torch.int32, device=device)
    out = pa.paged_attention_triton(
        q,
        k_cache,
        k_cache,
        torch.zeros(1, dtype=torch.int32, device=device),
        no_seqs,
        torch.zeros(0, 1, dtype=torch.int32, device=device),
        0.125,
    )
    assert out.shape == (0, 4, 64)
    cache_ops.store_kv_triton(q[:, :2], q[:, :2], k_cache, k_cache, no_seqs)  # nothing to write
    assert not k_cache.any()


def test_decode_splits_heuristic():
    assert pa._decode_splits(num_programs=2, max_seqlen_k=32768) == pa.MAX_SPLITS  # small batch, long context
    assert pa._decode_splits(num_programs=2, max_seqlen_k=1000) == 7  # splits of >= 128 keys
    assert pa._decode_splits(num_programs=128, max_seqlen_k=4096) == 8  # ~8 programs per SM (16x4k)
    assert pa._decode_splits(num_programs=256, max_seqlen_k=32768) == 4
    assert pa._decode_splits(num_programs=264, max_seqlen_k=4096) == 1  # >= 2 per SM: no split (64x1k: 512)
    assert pa._decode_splits(num_programs=1, max_seqlen_k=100) == 1
    assert pa._decode_splits(num_programs=8, max_seqlen_k=8192, sms=78) == pa.MAX_SPLITS
    # other head dims: ~23 programs per SM, one split from 7 per SM
    assert pa._decode_splits(num_programs=512, max_seqlen_k=4096, block_d=128) == 6
    assert pa._decode_splits(num_programs=924, max_seqlen_k=4096, block_d=128) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_decode_lanes(device, num_splits):
    # CUDA-graph padding: lanes with seq_len 0 and an all -1 block table read nothing and give 0
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch([1, 1, 1], [5, 40, 1], 8, 2, 64, 16, torch.float32, device)
    q = torch.cat([q, torch.randn(2, 8, 64, device=device)])
    cu = torch.arange(6, dtype=torch.int32, device=device)
    seq_lens = torch.cat([seq_lens, torch.zeros(2, dtype=torch.int32, device=device)])
    tables = torch.cat([tables, torch.full((2, tables.shape[1]), -1, dtype=torch.int32, device=device)])
    out = torch.full(q.shape, float("nan"), device=device)
    pa.paged_attention_triton(
        q, k_cache, v_cache, cu, seq_lens, tables, 0.125, max_seqlen_q=1, num_splits=num_splits, out=out
    )
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    expected = naive_attention(q[:3], k_cache, v_cache, cu[:4], seq_lens[:3], tables[:3], 0.125)
    assert rel_err(out[:3], expected) < REL_TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", [(16, 2, 2), (64, 4, 3), (128, 4, 3)])
def test_launch_overrides(device, launch):
    # the parameters gpu_bench.py sweeps compute the same function
    q, *rest = make_batch(*DECODE, 8, 2, 64, 16, torch.float32, device)
    out = pa.paged_attention_triton(q, *rest, 0.125, launch=launch)
    assert rel_err(out, naive_attention(q, *rest, 0.125)) < REL_TOL[torch.float32]


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("CHATENGINE_KERNELS", raising=False)
    assert pa.resolve_backend(torch.device("cpu")) == "ref"
    assert pa.resolve_backend(torch.device("cpu"), "triton") == "triton"
    assert pa.resolve_backend(torch.device("cuda")) == ("triton" if pa.triton else "ref")
    monkeypatch.setenv("CHATENGINE_KERNELS", "triton")
    assert pa.resolve_backend(torch.device("cpu")) == "triton"
    assert pa.resolve_backend(torch.device("cpu"), "ref") == "ref"
    with pytest.raises(ValueError):
        pa.resolve_backend(torch.device("cpu"), "cuda")


# ---------------------------------------------------------------------------- cache ops
def make_cache(num_blocks, page_size, H_kv, D, dtype, device, num_layers=3):
    return torch.randn(num_blocks, num_layers, 2, page_size, H_kv, D).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_store_kv(device, page_size, dtype, cache_dtype):
    H_q, H_kv, D, T = 6, 3, 64, 37
    kv = make_cache(8, page_size, H_kv, D, cache_dtype, device)
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(device, dtype)
    key = qkv[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D)  # strided views
    value = qkv[:, (H_q + H_kv) * D :].view(T, H_kv, D)
    slots = torch.randperm(8 * page_size)[:T].to(device, torch.int32)
    slots[::5] = -1  # padding lanes
    expected = kv.clone()
    cache_ops.store_kv_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    cache_ops.store_kv_triton(key, value, kv[:, 1, 0], kv[:, 1, 1], slots)
    # exact, except that Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
    tol = dict(rtol=2**-7, atol=0) if device == "cpu" and dtype != cache_dtype else dict(rtol=0, atol=0)
    torch.testing.assert_close(kv, expected, **tol)  # written slots and untouched ones alike
    keep = slots >= 0
    blocks, offsets = slots[keep].long() // page_size, slots[keep].long() % page_size
    torch.testing.assert_close(kv[blocks, 1, 0, offsets], key[keep].to(cache_dtype), **tol)
    torch.testing.assert_close(kv[blocks, 1, 1, offsets], value[keep].to(cache_dtype), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks(device, dtype):
    kv = make_cache(12, 16, 2, 64, dtype, device)  # page = 3*2*16*2*64 = 12288 elements
    src = torch.tensor([3, 0, 7, 7], dtype=torch.int32, device=device)
    dst = torch.tensor([5, 11, 1, 2], dtype=torch.int32, device=device)
    expected = kv.clone()
    cache_ops.copy_blocks_ref(expected, src, dst)
    cache_ops.copy_blocks_triton(kv, src, dst)
    assert torch.equal(kv, expected)
    assert torch.equal(kv[11], kv[0]) and torch.equal(kv[2], kv[7])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="CUDA"))])
def test_gather_scatter_roundtrip(device):
    kv = make_cache(10, 16, 2, 32, torch.bfloat16, device)
    ids = torch.tensor([4, 1, 8], device=device)
    pages = cache_ops.gather_blocks(kv, ids).cpu()  # to CPU, as the offload tier does
    assert pages.is_contiguous() and pages.shape == (3, *kv.shape[1:])
    other = torch.zeros_like(kv)
    cache_ops.scatter_blocks(other, torch.tensor([0, 2, 9], device=device), pages)
    assert torch.equal(other[[0, 2, 9]], kv[[4, 1, 8]]) and not other[[1, 3]].any()


def test_page_runs_merge_only_consecutive_pairs():
    assert cache_ops.page_runs([3, 4, 5, 9, 10, 2], [7, 8, 9, 0, 2, 3]) == [(3, 7, 3), (9, 0, 1), (10, 2, 1), (2, 3, 1)]
    assert cache_ops.page_runs([5, 4], [0, 1]) == [(5, 0, 1), (4, 1, 1)] and cache_ops.page_runs([], []) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="CUDA"))])
def test_copy_pages_from_host_pool_equals_scatter(device):
    kv = make_cache(10, 16, 2, 32, torch.bfloat16, device)
    pool = torch.randn(6, *kv.shape[1:]).to(torch.bfloat16)
    if device == "cuda":
        pool = pool.pin_memory()
    slots, blocks = [1, 2, 3, 5, 0], [6, 7, 8, 2, 3]
    expected = kv.clone()
    cache_ops.scatter_blocks_ref(expected, torch.tensor(blocks, device=device), pool[slots])
    cache_ops.copy_pages(kv, blocks, pool, slots)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(kv, expected)


# ---------------------------------------------------------------------------- invariant mode
def invariant_launches(device, dtype, L, H_q, H_kv, split_keys, chunk, decode_at, key_tile=0):
    """One sequence of L keys attended in several launches with `split_keys`: cold (all L queries),
    the queries `chunk` on their cached prefix, one decode, the chunk beside another sequence, and
    with a graph's larger split count. Returns (cold output, [(rows, output)] of the others)."""
    q, k_cache, v_cache, cu, lens, table = make_batch([L], [L], H_q, H_kv, 64, 16, dtype, device)
    scale = 64**-0.5

    def attend(q_rows, q_lens, seq_lens, tables, num_splits=None):
        cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        return pa.paged_attention_triton(
            q_rows,
            k_cache,
            v_cache,
            cu_q,
            sl,
            tables,
            scale,
            num_splits=num_splits,
            split_keys=split_keys,
            key_tile=key_tile,
        )

    cold = attend(q, [L], [L], table)
    torch.testing.assert_close(
        cold, pa.paged_attention_ref(q, k_cache, v_cache, cu, lens, table, scale), **CLOSE[dtype]
    )
    c0, c1 = chunk
    other = torch.randn(37, H_q, 64, device=device).to(dtype)
    two = torch.cat([table, table])  # the other sequence: 37 new queries on the same pages
    runs = [
        (range(c0, c1), attend(q[c0:c1], [c1 - c0], [c1], table)),
        (range(decode_at, decode_at + 1), attend(q[decode_at : decode_at + 1], [1], [decode_at + 1], table)),
        (range(c0, c1), attend(torch.cat([other, q[c0:c1]]), [37, c1 - c0], [L, c1], two)[37:]),
        (range(c0, c1), attend(q[c0:c1], [c1 - c0], [c1], table, num_splits=L // split_keys + 3)),
    ]
    # rows the cold prefill writes in place (all their keys in the first split) against the merge
    s = split_keys
    runs.append((range(s - 20, s + 30), attend(q[s - 20 : s + 30], [50], [s + 30], table)))  # straddles split 1
    runs.append((range(s // 2, s // 2 + 1), attend(q[s // 2 : s // 2 + 1], [1], [s // 2 + 1], table)))
    # launches of one split (every key before split_keys): in place, no merge
    runs.append((range(0, s - 10), attend(q[: s - 10], [s - 10], [s - 10], table)))
    runs.append((range(9, s - 3), attend(q[9 : s - 3], [s - 12], [s - 3], table)))
    return cold, runs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_tile", [0, 128])  # 64 keys a step (INVARIANT_LAUNCH), and few KV heads' 128
@pytest.mark.parametrize(
    "H_q, H_kv, dtype",
    [(8, 2, torch.float32), (14, 2, torch.bfloat16), (32, 8, torch.bfloat16)],
)
def test_invariant_attention_rows_do_not_depend_on_the_launch(device, dtype, H_q, H_kv, key_tile, request):
    """split_keys: a query row's output is bit for bit the same in a cold prefill, a chunk on its
    cached prefix (starting mid-tile), a decode, beside another sequence, and with more (empty)
    splits; rows a launch writes in place (all their keys in its first split) as the merge gives them."""
    interpreted_subset(device, H_q == 8 and H_kv == 2)
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    assert pa.launch_plan(1, 1, H_q, H_kv, 64, 1, 1, None, 132, 128, key_tile).launch[0] == (key_tile or 64)
    split_keys = 128 if device == "cuda" else key_tile or 64
    L, chunk = (1100, (333, 470)) if device == "cuda" else (split_keys + 86, (37, 83))
    cold, runs = invariant_launches(device, dtype, L, H_q, H_kv, split_keys, chunk, L - 1, key_tile)
    for rows, out in runs:
        assert same_bits(out, cold[rows.start : rows.stop]), f"rows {rows} differ from the cold prefill"


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_attention_never_drops_keys(device):
    """A split count that cannot cover the keys is refused when the launch knows them; a one-split
    launch given keys past split_keys anyway attends to every one (not the same tiles as a split
    launch's, but never a wrong answer)."""
    q, k_cache, v_cache, cu, lens, table = make_batch([5], [200], 8, 2, 64, 16, torch.float32, device)
    with pytest.raises(ValueError, match="splits of 64 keys miss"):
        pa.paged_attention_triton(q, k_cache, v_cache, cu, lens, table, 0.125, 5, 200, 1, split_keys=64)
    got = pa.paged_attention_triton(q, k_cache, v_cache, cu, lens, table, 0.125, 5, None, 1, split_keys=64)
    ref = pa.paged_attention_ref(q, k_cache, v_cache, cu, lens, table, 0.125)
    torch.testing.assert_close(got, ref, **CLOSE[torch.float32])


@pytest.mark.skipif(
    INTERPRETED or HAS_CUDA or pa.triton is None,
    reason="only when triton was imported, compiled, before this module on a CPU box",
)
def test_interpreter_in_subprocess():
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider", __file__]
    run = subprocess.run(
        cmd,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "needs TRITON_INTERPRET" not in run.stdout, run.stdout[-4000:]


# ---------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "k"), [(3001, 5), (1500, 0), (4097, 20), (7, 3)])
def test_row_logprobs_kernel_matches_the_reference(device, dtype, vocab, k):
    """Values as row_logprobs' (float rounding); each id's logprob is its value (bf16 ties may take
    another id of the same value than torch.topk's), ids distinct, chosen tokens exact."""
    from chatengine.engine.logprobs import row_logprobs

    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(device, dtype)
    chosen = torch.tensor([0, vocab - 1, vocab // 2, 3 % vocab], device=device)
    temps = [0.0, 0.7, 1.0, 1.3]
    ref = row_logprobs(logits, chosen, k, temps).to_host(False).packed
    got = logprob_ops.row_logprobs_triton(logits, chosen, k, torch.tensor(temps, device=device)).cpu()
    assert torch.equal(got[:, 0], chosen.cpu().float())
    torch.testing.assert_close(got[:, 1 : 2 + k], ref[:, 1 : 2 + k], atol=1e-5, rtol=1e-5)
    x = logits.float().cpu() / torch.tensor([t or 1.0 for t in temps])[:, None]
    ids = got[:, 2 + k :].long()
    torch.testing.assert_close(torch.log_softmax(x, -1).gather(1, ids), got[:, 2 : 2 + k], atol=1e-5, rtol=1e-5)
    assert all(len(set(row.tolist())) == k for row in ids)


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_greedy_rows_exact(device, dtype):
    logits = torch.randn(6, 5003).to(device, dtype)  # vocab not a multiple of the block
    logits[2, 17] = logits[2, 4000] = logits[2].max() + 1  # a tie: the lowest index wins
    temps = torch.tensor([0, 0.7, 0, 1.0, 0, 0], device=device)
    out = torch.full((6,), -1, dtype=torch.int64, device=device)
    sampling.sample_triton(logits, temps, seed=5, out=out)
    greedy = (temps == 0).nonzero().flatten()
    assert torch.equal(out[greedy], logits.float().argmax(-1)[greedy]) and out[2] == 17
    assert ((out >= 0) & (out < 5003)).all()
    assert torch.equal(sampling.sample_ref(logits, temps)[greedy], out[greedy])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_triton_is_argmax_with_first_index_ties(device, dtype):
    from chatengine.engine.sampler import greedy

    g = torch.Generator().manual_seed(3)
    for n, v, chunk in [(1, 128256, 4096), (5, 5003, 1024), (2, 100, 64), (3, 16, 64)]:  # odd vocab, one chunk
        logits = torch.randn(n, v, generator=g).to(device, dtype)
        out = sampling.greedy_triton(logits, chunk=chunk)
        assert out.dtype == torch.int64 and out.tolist() == logits.argmax(-1).tolist() == greedy(logits).tolist()
    logits = torch.zeros(4, 5003, device=device, dtype=dtype)
    logits[0, [5, 3000]] = 1.0  # ties across chunks
    logits[1, [1030, 1029]] = 2.0  # ties inside a chunk
    logits[2] = float("-inf")  # nothing finite: index 0, as torch
    logits[3, 5002] = 1.0  # the last column, in a partial chunk
    assert sampling.greedy_triton(logits, chunk=1024).tolist() == [5, 1029, 0, 5002]
    assert sampling.greedy_triton(logits[:0], chunk=1024).shape == (0,)
    buf = torch.full((6,), -7, dtype=torch.int64, device=device)  # into a given buffer (the runner's)
    assert sampling.greedy_triton(logits, chunk=1024, out=buf[:4]).data_ptr() == buf.data_ptr()
    assert buf.tolist() == [5, 1029, 0, 5002, -7, -7]


@pytest.mark.parametrize("device", DEVICES)
def test_fill_placeholders_equals_reference(device):
    sampled = torch.tensor([900, 901, 902, 903, 904], dtype=torch.int64, device=device)
    # lanes 0, 2 and 3 carry placeholders (input rows 4, 0, 6 take samples 2, 0, 4); -1: none
    dst = torch.tensor([4, -1, 0, 6, -1, -1, -1], dtype=torch.int32, device=device)
    src = torch.tensor([2, 3, 0, 4, 1, 1, 1], dtype=torch.int32, device=device)
    a = torch.arange(10, 18, dtype=torch.int32, device=device)
    a[[0, 4, 6]] = 0  # staged as 0
    b = a.clone()
    placeholders.fill_placeholders_triton(a, sampled, dst, src)
    placeholders.fill_placeholders_ref(b, sampled, dst, src)
    assert a.tolist() == b.tolist() == [900, 11, 12, 13, 902, 15, 904, 17]
    placeholders.fill_placeholders_triton(a, sampled, dst[:0], src[:0])  # no lanes: nothing
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_sample_distribution(device):
    # N rows of one small distribution: frequencies within 4 sigma of softmax(logits / T), for the
    # kernel (Philox uniforms) and the reference (torch uniforms) alike; the interpreter runs ~50 rows/s
    V, N, T = 12, (4000 if device == "cuda" else 200), 0.7
    logits = torch.randn(V).repeat(N, 1).to(device)
    temps = torch.full((N,), T, device=device)
    p = torch.softmax(logits[0].cpu().double() / T, -1)
    sigma = (p * (1 - p) / N).sqrt()
    for ids in (sampling.sample_triton(logits, temps, seed=11), sampling.sample_ref(logits, temps)):
        freq = torch.bincount(ids.cpu(), minlength=V).double() / N
        assert ((freq - p).abs() <= 4 * sigma + 1e-3).all(), (freq, p)
    a, b = sampling.sample_triton(logits[:32], temps[:32], 11), sampling.sample_triton(logits[:32], temps[:32], 12)
    assert torch.equal(a, sampling.sample_triton(logits[:32], temps[:32], 11)) and not torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_philox_reference_is_tl_rand_bit_for_bit(device):
    """philox_uniform_ref is Triton's tl.rand (Philox4x32-10, its float conversion) in plain torch."""
    if triton is None:
        pytest.skip("triton is not installed")

    @triton.jit
    def draw(Out, key, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Out + offs, tl.rand(key, offs * 7919 + 3))

    offsets = torch.arange(256, device=device) * 7919 + 3
    for key in (1, 123456789, 2**32 + 17, 2**40 + 5, 2**63 - 1):
        out = torch.empty(256, device=device)
        draw[(1,)](out, key, N=256)
        ref = sampling.philox_uniform_ref(key, offsets)
        assert torch.equal(out, ref), key
        assert (ref >= 0).all() and (ref < 1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_of_the_fused_sampler_are_their_own(device):
    """A row with a key draws from that key alone: the kernel equals the torch reference on it, and
    moving it to another row, beside other rows or another step seed, gives the same token."""
    g = torch.Generator().manual_seed(5)
    V = 3001
    logits = torch.randn(6, V, generator=g).to(device)
    temps = torch.tensor([0.7, 0.0, 1.0, 0.5, 1.3, 0.9], device=device)
    keys = torch.tensor([5, 0, 2**62 + 3, 77, 0, 9], dtype=torch.int64, device=device)
    got = sampling.sample_triton(logits, temps, seed=3, keys=keys)
    ref = sampling.sample_ref(logits, temps, keys=keys)
    own = keys.cpu() != 0
    own[1] = True  # the greedy row too
    assert torch.equal(got.cpu()[own], ref.cpu()[own])
    order = torch.tensor([3, 0, 5, 2], device=device)  # the keyed rows alone, shuffled, another seed
    alone = sampling.sample_triton(logits[order], temps[order], seed=99, keys=keys[order])
    assert alone.tolist() == got[order].tolist()
    # different keys, different draws (a flat row: each key picks its own token)
    flat = torch.zeros(64, V, device=device)
    ids = sampling.sample_triton(flat, torch.ones(64, device=device), 0, keys=torch.arange(1, 65, device=device))
    assert len(set(ids.tolist())) > 50


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_follow_the_distribution(device):
    """Keys from position_key over many positions: frequencies within 4 sigma of softmax(x / T)."""
    from chatengine.engine.sampler import position_key, seed_key

    V, N, T = 12, (4000 if device == "cuda" else 120), 0.7
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)).repeat(N, 1).to(device)
    base = seed_key(1234, 0)
    keys = torch.tensor([position_key(base, pos) for pos in range(N)], dtype=torch.int64, device=device)
    ids = sampling.sample_triton(logits, torch.full((N,), T, device=device), 0, keys=keys)
    p = torch.softmax(logits[0].cpu().double() / T, -1)
    freq = torch.bincount(ids.cpu(), minlength=V).double() / N
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / N).sqrt() + 1e-3).all(), (freq, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_from_vocabulary_slices_are_the_whole_rows_draws(device, dtype):
    """Tensor parallelism samples each rank's slice of the vocabulary apart: the best candidate over
    the slices (largest value, ties to the lowest column) is the token the whole row gives, for
    greedy, unseeded and seeded rows, and the greedy slices' values are their maxima."""
    g = torch.Generator().manual_seed(7)
    V, parts = 3001, 3  # slices of 1001 columns, the last one short
    logits = torch.randn(5, V, generator=g).to(device, dtype)
    logits[0, [10, 2500]] = logits[0].max() + 1  # a greedy tie across slices: the lowest column
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3], device=device)
    keys = torch.tensor([0, 0, 2**40 + 1, 0, 31], dtype=torch.int64, device=device)
    whole = sampling.sample_triton(logits, temps, seed=9, keys=keys)
    width = -(-V // parts)
    vals, ids = [], []
    for r in range(parts):
        piece = logits[:, r * width : (r + 1) * width]
        v, i = sampling.sample_slice_triton(piece, temps, 9, keys, col0=r * width, vocab_size=V)
        vals.append(v)
        ids.append(i)
        if r == 1:  # the all-greedy path: each slice's max and its first column
            gv, gi = sampling.greedy_slice_triton(piece, r * width, chunk=256)
            best = piece.float().max(-1)
            assert torch.equal(gv, best.values) and gi.tolist() == (best.indices + r * width).tolist()
    vals, ids = torch.stack(vals), torch.stack(ids)
    drawn = ids.gather(0, vals.argmax(0, keepdim=True)).squeeze(0)
    assert drawn.tolist() == whole.tolist() and drawn[0] == 10
    assert (ids >= torch.arange(parts, device=device)[:, None] * width).all()  # columns of the whole row


# ---------------------------------------------------------------------------- fused layer ops
# Against the torch references (which round to bf16 after every op): a bf16 ulp or two (inputs
# ~N(0, 1)); the float64 comparison is the accuracy check.
def ulp_close(device, dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2**-5, rtol=2**-5)


def truncation(device, dtype) -> int:
    """Slack on the float64 comparison for the interpreter's truncating bf16 casts."""
    return 2 if device == "cpu" and dtype == torch.bfloat16 else 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("N", [96, 2048])
def test_rms_norm(device, dtype, with_residual, N):
    T = 37
    x = torch.randn(T, 2 * N).to(device, dtype)[:, :N]  # strided rows
    w = (1 + 0.1 * torch.randn(N)).to(device, dtype)
    r = torch.randn(T, N).to(device, dtype) if with_residual else None
    got = fused_ops.rms_norm_triton(x, w, 1e-5, r)
    ref = fused_ops.rms_norm_ref(x, w, 1e-5, r)
    exact = fused_ops.rms_norm_ref(x.double(), w.double(), 1e-5, None if r is None else r.double())
    if with_residual:
        torch.testing.assert_close(got[1], ref[1], **ulp_close(device, dtype))
        got, ref, exact = got[0], ref[0], exact[0]
    torch.testing.assert_close(got, ref, **ulp_close(device, dtype))
    assert rel_err(got, exact.cpu()) < truncation(device, dtype) * REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H_q, H_kv, D", [(32, 8, 64), (14, 2, 64), (4, 4, 128)])
def test_rotary(device, dtype, H_q, H_kv, D):
    T = 29
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(device, dtype)  # q, k: views of one qkv
    q = qkv[:, : H_q * D].view(T, H_q, D)
    k = qkv[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(4096).float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    positions = torch.randint(0, 4096, (T,), dtype=torch.int32, device=device)
    ref_q, ref_k = fused_ops.rotary_ref(positions.long(), q, k, cos, sin)
    exact_q, _ = fused_ops.rotary_ref(positions.long(), q.double(), k.double(), cos.double(), sin.double())
    v_before = qkv[:, (H_q + H_kv) * D :].clone()
    got_q, got_k = fused_ops.rotary_triton(positions, q, k, cos, sin)
    assert got_q is q and got_k is k  # in place
    torch.testing.assert_close(q, ref_q, **ulp_close(device, dtype))
    torch.testing.assert_close(k, ref_k, **ulp_close(device, dtype))
    assert torch.equal(qkv[:, (H_q + H_kv) * D :], v_before)  # v untouched
    assert rel_err(q, exact_q.cpu()) < truncation(device, dtype) * REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("H_q, H_kv, D", [(32, 8, 64), (14, 2, 64), (4, 4, 128)])
def test_rotary_store_kv_is_rotary_then_store_kv(device, dtype, cache_dtype, H_q, H_kv, D):
    """The fused launch writes the same bits as the two kernels it replaces (q in place, the cache),
    skips padding lanes, and leaves k and v as they were; and it is close to the torch reference."""
    T, page_size = 29, 16
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(device, dtype)  # q, k, v: views of one qkv
    views = (
        lambda x: (
            x[:, : H_q * D].view(T, H_q, D),
            x[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D),  # noqa: E731
            x[:, (H_q + H_kv) * D :].view(T, H_kv, D),
        )
    )
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.arange(4096).float()[:, None] * inv_freq] * 2, -1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    positions = torch.randint(0, 4096, (T,), dtype=torch.int32, device=device)
    slots = torch.randperm(8 * page_size)[:T].to(device, torch.int32)
    slots[::5] = -1  # padding lanes
    kv = make_cache(8, page_size, H_kv, D, cache_dtype, device)

    two, kv_two = qkv.clone(), kv.clone()  # the unfused pair
    q2, k2, v2 = views(two)
    fused_ops.rotary_triton(positions, q2, k2, cos, sin)
    cache_ops.store_kv_triton(k2, v2, kv_two[:, 1, 0], kv_two[:, 1, 1], slots)
    one, kv_one = qkv.clone(), kv.clone()
    q1, k1, v1 = views(one)
    got = fused_ops.rotary_store_kv_triton(positions, q1, k1, v1, cos, sin, kv_one[:, 1, 0], kv_one[:, 1, 1], slots)
    assert got is q1 and torch.equal(q1, q2)
    assert torch.equal(kv_one, kv_two)  # written slots and the rest
    assert torch.equal(one[:, H_q * D :], qkv[:, H_q * D :])  # k and v untouched

    ref, kv_ref = qkv.clone(), kv.clone()
    q_ref = fused_ops.rotary_store_kv_ref(
        positions.long(), *views(ref), cos, sin, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots
    )
    torch.testing.assert_close(got, q_ref, **ulp_close(device, dtype))
    torch.testing.assert_close(kv_one, kv_ref, **ulp_close(device, cache_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I", [300, 8192])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul(device, dtype, I, act):
    gate_up = (3 * torch.randn(19, 2 * I)).to(device, dtype)  # gate values far into both tails too
    triton_fn, ref = getattr(fused_ops, f"{act}_mul_triton"), getattr(fused_ops, f"{act}_mul_ref")
    got = triton_fn(gate_up)
    torch.testing.assert_close(got, ref(gate_up), **ulp_close(device, dtype))
    assert rel_err(got, ref(gate_up.double()).cpu()) < truncation(device, dtype) * REL_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_equals_reference(device, dtype):
    """One launch, two passes over each row (K past one 1024 block); an all-zero row; a strided view."""
    x = torch.randn(6, 2500, device=device, dtype=dtype) * torch.tensor([1e-3, 1, 30, 1, 1, 1], device=device)[:, None]
    x[3] = 0
    x = torch.cat([x, x], dim=1)[:, :2500]  # row stride 5000, columns contiguous
    q, scale = fp8_ops.quantize_rows_triton(x)
    q_ref, scale_ref = fp8_ops.quantize_rows_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [77, 5000])
def test_row_masks_equal_reference_and_touch_only_their_rows(device, vocab):
    """The packed grammar masks: row k's mask words go to logits row rows[k] (rows out of order),
    bits past the vocabulary are ignored, and rows not named are neither read nor changed."""
    from chatengine.engine.structured import apply_bitmask_ref

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    rows = [4, 1, 2]
    packed, masks = grammar_masks.pack_row_masks(rows, vocab, pin=False)
    masks.copy_(torch.randint(-(2**31), 2**31, masks.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    masks[1] = -1  # row 1: all allowed
    masks[2] = 0  # row 2: none
    masks[0, -1] = 0  # row 4's bits past V are 0 too: nothing may be written past V (row 5 stays)
    assert packed[:3].tolist() == rows
    a, b = logits.clone().to(device), logits.clone()
    grammar_masks.apply_row_masks_triton(a, packed.to(device), len(rows))
    grammar_masks.apply_row_masks_ref(b, packed, len(rows))
    assert torch.equal(a.cpu(), b)
    full = torch.full((6, masks.shape[1]), -1, dtype=torch.int32)
    full[rows] = masks
    c = logits.clone()
    apply_bitmask_ref(c, full)  # the N-row form of the same masks
    assert torch.equal(b, c)
    assert torch.equal(b[[0, 3, 5]], logits[[0, 3, 5]]) and torch.equal(b[1], logits[1])
    assert torch.isneginf(b[2]).all() and torch.isneginf(b[4]).any() and not torch.isneginf(b[4]).all()
