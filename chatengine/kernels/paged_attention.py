"""Paged attention over the page-first KV cache: a Triton kernel family and its plain-torch reference.

The cache of one layer is a view `[num_blocks, block_size, kv_heads, head_dim]` of the page-first
tensor `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]` (so its block stride is
`num_layers * 2 * block_size * kv_heads * head_dim`, not `block_size * kv_heads * head_dim`).

A batch is varlen: the new queries of all sequences are packed into `q [T, H_q, D]`;
sequence b owns rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`, has `seq_lens[b]` tokens of context in
total (cached prefix + new), and its pages are `block_tables[b, :ceil(seq_lens[b] / block_size)]`.
Query i of sequence b sits at absolute position `seq_lens[b] - q_len[b] + i` and attends causally
to every key at or before it; with a sliding `window` > 0 only to the last `window` of them
(keys at positions > its own - window, as Hugging Face masks sliding-window layers). Decode is the
case q_len = 1.

Backends: `paged_attention(..., backend=None)` runs Triton on CUDA tensors and the torch reference
elsewhere; `backend="triton"` (or `CHATENGINE_KERNELS=triton`) forces Triton. On CPU tensors Triton
runs only under its interpreter (slow: for tests), and only if TRITON_INTERPRET=1 was set before
triton was first imported: the flag is read when a kernel is defined, Triton's own helpers included.
`paged_attention_torch` is the reference's function vectorised for CPU, with a plan built once per
step and shared by the layers: the torch attention backend (chatengine/attention.py) runs it.

Ideas adapted (code is our own): online softmax from the Triton fused-attention tutorial; the
per-key page lookup and the two-stage split-KV decode (partial outputs + log-sum-exp merge) from
SGLang/lightllm's `decode_attention` as kept in vLLM; packing the query heads of one KV head into the
rows of one program (GQA) from vLLM's `triton_unified_attention`.
"""

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # CPU-only installs: the torch references still work
    triton, jit = None, (lambda fn: fn)

    class tl:  # type: ignore[no-redef]  # just enough for the kernel signatures to be defined
        constexpr = None


try:  # programmatic dependent launch (sm_90+), triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """ "triton" or "ref": the argument, else $CHATENGINE_KERNELS, else Triton on CUDA, ref elsewhere."""
    backend = (
        backend
        or os.environ.get("CHATENGINE_KERNELS")
        or ("triton" if device.type == "cuda" and triton is not None else "ref")
    )
    if backend not in ("triton", "ref"):
        raise ValueError(f"kernel backend must be 'triton' or 'ref', not {backend!r}")
    if backend == "triton" and triton is None:
        raise RuntimeError("the Triton kernel backend was asked for, but triton is not installed")
    return backend


# The split count is a runtime argument, never specialized: as a constexpr (or a specialized int)
# each new count compiled both kernels anew in the middle of serving (~0.6 s with the engine
# stopped, the TTFT p99 of a chat server at 20 requests/s); SPLIT alone picks the code path.
_jit_splits = triton.jit(do_not_specialize=["num_splits"]) if triton is not None else jit


@_jit_splits
def _paged_attention_kernel(
    Q,
    K,
    V,
    Out,
    PartialOut,
    PartialLse,  # PartialOut/Lse: (T, H_q, num_splits, [D]) fp32
    cu_seqlens_q,
    seq_lens,
    block_tables,
    scale_log2,  # softmax scale * log2(e): we use exp2
    window,  # > 0: a query sees only keys at positions > its own - window
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,  # head_dim strides are 1 everywhere
    stride_kb,
    stride_ks,
    stride_kh,  # (block, slot, head): the block stride is large
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    num_splits,  # > 1: split the keys, write partials + lse
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows = BLOCK_Q query tokens x GROUP heads
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per step; may span several pages
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1
    SPLIT_KEYS: tl.constexpr,  # > 0: split s covers keys [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS) (invariant)
    PDL: tl.constexpr,  # programmatic dependent launch (see launcher)
    DOT_DTYPE: tl.constexpr,  # tl.dot operand dtype: the input's, but see launcher
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no TF32), else None
):
    if PDL:
        gdc_launch_dependents()  # the merge kernel's programs may get resident now
        gdc_wait()  # if launched early: until our predecessor is done
    seq = tl.program_id(0) // num_kv_heads  # axis 0: B * H_kv can pass the 65535 of axis 1
    kv_head = tl.program_id(0) % num_kv_heads
    q_block = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len  # cached prefix before the new queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # query token within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position: sees keys <= q_pos
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    t = q_start + q_idx
    q = tl.load(
        Q + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # (M, D)

    # keys of this program: its split of [lo, seq_len), cut at the block's last query (causal); lo is
    # the first key the block's first query sees (0 without a window)
    lo = tl.where(window > 0, tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0), 0)
    if SPLIT_KEYS > 0:  # fixed absolute boundaries: a key falls in the same split in every launch
        lo = lo // SPLIT_KEYS * SPLIT_KEYS
        # one split: every key up to the block's end (the launcher's callers give it none past
        # split_keys, so the same tiles as a split's; a caller that did still gets every key)
        split_len = SPLIT_KEYS if SPLIT else seq_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    kv_start = lo + split * split_len
    block_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)  # past the block's last query
    kv_end = tl.minimum(block_end, kv_start + split_len)
    # invariant mode: a block whose keys all fall in its first split writes its rows itself, as the
    # in-order merge would (weight 1 for that split, exactly 0 for the empty ones after it), and
    # marks them merged; its other splits have nothing to do
    direct = (SPLIT_KEYS > 0) & (block_end <= lo + SPLIT_KEYS)  # (a constant False without SPLIT_KEYS)
    if direct & (split > 0):
        return
    q_low = tl.where(window > 0, q_pos - window, -1)  # keys must be past it

    # finite start for the running max: fully masked rows then give p = 0, never NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        page = tl.load(block_tables + seq * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        page = page.to(tl.int64)  # page * block stride can pass 2**31
        slot = offs_n % PAGE_SIZE
        k = tl.load(
            K + page[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (D, N)
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # (M, N)
        seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_low[:, None])
        s = tl.where(row_ok[:, None] & n_ok[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT or direct:
        if SPLIT_KEYS > 0:  # as the in-order merge's first addition, 0 + x, would: -0.0 -> 0.0
            acc = tl.where(acc == 0.0, 0.0, acc)
        if SPLIT:  # (direct) the merge skips rows marked merged
            row = ((t * num_kv_heads * GROUP + head) * num_splits).to(tl.int64)
            tl.store(PartialLse + row, tl.full([BLOCK_M], float("inf"), tl.float32), mask=row_ok)
        tl.store(
            Out + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            acc.to(Out.dtype.element_ty),
            mask=mask,
        )
    else:
        row = ((t * num_kv_heads * GROUP + head) * num_splits + split).to(tl.int64)
        tl.store(PartialOut + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        # an empty split (past this block's causal limit) gets lse = -inf: weight 0 in the merge
        tl.store(PartialLse + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


@_jit_splits
def _merge_splits_kernel(
    Out,
    PartialOut,
    PartialLse,
    num_q_heads,
    stride_ot,
    stride_oh,
    num_splits,
    BLOCK_S: tl.constexpr,  # the next power of two >= num_splits
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[t, h] = the splits' partial outputs weighted by their softmax mass, for BLOCK_H query
    heads h of token t (one (H, S, D) tile: a few heads per program, see _merge_heads)."""
    if PDL:
        gdc_launch_dependents()  # the next kernel may get resident (it must wait)
        gdc_wait()  # launched while the attention kernel runs: wait for it
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_q_heads
    hs_ok = h_ok[:, None] & (offs_s < num_splits)[None, :]
    rows = (t * num_q_heads + offs_h).to(tl.int64)[:, None] * num_splits + offs_s[None, :]  # (H, S)
    # both loads before any use: in flight together, one L2 round trip after the wait instead of two
    lse = tl.load(PartialLse + rows, mask=hs_ok, other=float("-inf"))
    part = tl.load(
        PartialOut + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=hs_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
        other=0.0,
    )  # (H, S, D)
    # every split is empty only for a padded lane (seq_len 0, CUDA graphs): write 0 there, not NaN
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])  # (H, S)
    w_sum = tl.sum(w, 1)
    out = tl.sum(w[:, :, None] * part, 1) / tl.where(w_sum > 0, w_sum, 1.0)[:, None]  # (H, D)
    tl.store(
        Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@_jit_splits
def _merge_splits_in_order_kernel(
    Out,
    PartialOut,
    PartialLse,
    num_q_heads,
    stride_ot,
    stride_oh,
    num_splits,
    BLOCK_H: tl.constexpr,  # the next power of two >= num_q_heads: every head of token t
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`_merge_splits_kernel`'s sum for token t, added split after split in order: an empty split
    (weight 0) adds exactly 0 wherever it stands, so the result does not depend on how many
    trailing splits a launch had (invariant mode). Rows the attention kernel wrote itself (split
    0's lse +inf: all their keys in that split) are left as they are."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (t * num_q_heads + offs_h).to(tl.int64) * num_splits  # (H,) split 0 of each head
    h_ok = offs_h < num_q_heads
    h_ok = h_ok & (tl.load(PartialLse + rows, mask=h_ok, other=0.0) != float("inf"))
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(PartialLse + rows + s, mask=h_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # a padded lane: every split empty
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(PartialLse + rows + s, mask=h_ok, other=float("-inf")) - m)
        part = tl.load(PartialOut + (rows + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=hd_ok, other=0.0)
        acc += w[:, None] * part
        w_sum += w
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(
        Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty), mask=hd_ok
    )


def _merge_heads(num_tokens: int, num_q_heads: int, sms: int = 132) -> int:
    """Query heads per merge program: up to 8, while that still leaves ~2 programs per
    multiprocessor. One head per program made 4096 programs of one (S, D) tile for a 128-token
    chunk on 32 heads (7.8 us a layer on an H200, a third of the attention kernel's time);
    a single decode token keeps one head per program (32 programs only)."""
    heads = 1
    while heads < 8 and num_tokens * -(-num_q_heads // (2 * heads)) >= 2 * sms:
        heads *= 2
    return heads


def check_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or interpreting()):
        raise RuntimeError(
            "Triton kernels take CPU tensors only under TRITON_INTERPRET=1, set before triton is first imported"
        )


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be set before
    triton is first imported in the process. Only then can they take CPU tensors."""
    if triton is None:
        return False
    compiled = (_paged_attention_kernel, tl.cdiv)  # ours, and Triton's own (defined at its import)
    return not any(isinstance(f, triton.runtime.JITFunction) for f in compiled)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on an H100 SXM / H200); 132 under the interpreter."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _decode_splits(num_programs: int, max_seqlen_k: int, sms: int = 132, block_d: int = 64) -> int:
    """Flash-decoding split count for num_programs = batch x kv_heads decode programs.

    Head_dim 64, measured on an H200 (benchmarks/NOTES.md, v14): from two programs per multiprocessor
    up, one split is best: the partials and the merge kernel cost more than one program's pipelined
    128-key tiles lose (64x1k on 8 KV heads, 512 programs: 6 splits 44.9 us, one 38.2; 48x1k 36.5 ->
    31.5; 64x4k 138 -> 131). Below, split to ~8 programs per multiprocessor (16x4k: 8 splits 43.4 us,
    24 splits 45.0; 32x4k: 4 splits 75.9, 12 splits 78.8). Other head dims keep v4's rule, measured
    with their smaller tiles: one split from ~7 programs per multiprocessor, else ~23 per
    multiprocessor (64x4k at head_dim 64 then: 6 splits 137 us, 2 splits 173, 1 split 162). Each
    split keeps >= MIN_SPLIT_KEYS keys so the merge stays cheap; at most MAX_SPLITS."""
    one_split, per_sm = (2, 8) if block_d == 64 else (7, 23)
    if num_programs >= one_split * sms:
        return 1
    want = round(per_sm * sms / num_programs)
    return max(1, min(want, max_seqlen_k // MIN_SPLIT_KEYS, MAX_SPLITS))


def _prefill_splits(B: int, max_seqlen_q: int, group: int, num_kv_heads: int, max_seqlen_k: int, sms: int = 132) -> int:
    """Key splits for a prefill launch. A short chunk on a long cached prefix (a new chat turn: 128
    tokens after 2k) makes few programs (B x kv_heads x query blocks), each walking every key:
    64 programs on 132 multiprocessors left the GPU half idle (76 us a layer for 128 x 2176).
    Below one program per multiprocessor, split the keys to ~2 programs per multiprocessor, keeping
    >= MIN_SPLIT_KEYS keys per split. H200 sweep (`sweep_bench.py --sweep prefill`, graph
    replay): 128 x 2176: 41 us at 1 split, 27 at 5; 32 x 8192: 139 -> 21 us at 16; from ~one
    program per multiprocessor (512 x 4096, 4 x 128 x 2048) one split is best (a second costs ~5-15%)."""
    block_q = max(64, triton.next_power_of_2(group)) // group
    programs = B * num_kv_heads * -(-max_seqlen_q // block_q)
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), max_seqlen_k // MIN_SPLIT_KEYS, MAX_PREFILL_SPLITS))


MAX_PREFILL_SPLITS = 16
# Invariant mode: keys per split, a multiple of every launch's BLOCK_N. Splits are fixed, so they
# cannot follow the batch: they cost a busy step (a second program per sequence past them, partials
# and the merge; a block within the first split writes its rows itself) and they give a lone long
# decode its parallelism. 2048: the nano-vllm workload's contexts (up to 2048) never split; one
# sequence at 32k keys still makes 16 splits x its KV heads of programs.
INVARIANT_SPLIT_KEYS = 2048
MIN_SPLIT_KEYS = 128
MAX_SPLITS = 64
# Launch parameters, (BLOCK_N, num_warps, num_stages) by kind and padded head_dim; BLOCK_N keys per
# loop step (may span pages). `benchmarks/sweep_bench.py` measures alternatives
# (benchmarks/NOTES.md). Registers bound head_dim >= 128: each K/V tile holds one 64-bit pointer per
# element, so 64 keys at head_dim 128, or 4 warps at head_dim >= 128, spill (ptxas, sm_90).
DECODE_LAUNCH = {64: (64, 4, 2), 128: (32, 8, 2), 256: (16, 8, 2)}  # 64: H200 sweep, NOTES.md v1
PREFILL_LAUNCH = {64: (64, 4, 2), 128: (32, 8, 2), 256: (16, 8, 2)}  # 64: H200 prefill sweep (6 configs)
# Invariant mode: one tile for decodes and prefill chunks alike (a row's sums must not depend on
# which kind of launch computes it): rows per program (query tokens x the GQA group) and the launch.
INVARIANT_BLOCK_M = 16
INVARIANT_LAUNCH = PREFILL_LAUNCH
# A model of at most INVARIANT_FEW_KV_HEADS KV heads (the whole model's, so that one rank and two tile
# alike) at head_dim 64 makes under 4 programs per multiprocessor even in a full decode step (256
# sequences on 132 multiprocessors): it takes default mode's tiles for such decodes, 128 keys a step,
# pipelined (NOTES.md v14: Qwen-0.5B at 256 x 1k, 15% faster than 64-key tiles).
INVARIANT_FEW_KV_HEADS = 2
INVARIANT_FEW_HEADS_LAUNCH = (128, 4, 3)


def invariant_key_tile(num_kv_heads: int, head_dim: int) -> int:
    """Keys per step of a model's invariant attention: a function of the model alone (0: the
    INVARIANT_LAUNCH table's)."""
    few = num_kv_heads <= INVARIANT_FEW_KV_HEADS and triton is not None and triton.next_power_of_2(head_dim) == 64
    return INVARIANT_FEW_HEADS_LAUNCH[0] if few else 0


def _launch(table: dict, block_d: int) -> tuple[int, int, int]:
    return table[max(64, block_d)] if max(64, block_d) in table else table[256]


def _decode_launch(
    num_programs: int, num_splits: int, max_seqlen_k: int | None, block_d: int, sms: int = 132
) -> tuple[tuple[int, int, int], bool]:
    """((BLOCK_N, num_warps, num_stages), PDL) for a decode launch of num_programs = batch x kv_heads.

    Head_dim 64 (H200, NOTES.md v8, v12, v14): split decodes whose programs all fit in one wave (<= 4
    per multiprocessor: 1 x 8k and 1 x 32k on Llama-1B's 8 KV heads x 64 splits) are latency-bound:
    128-key tiles put more bytes in flight per program, and programmatic dependent launch overlaps
    the merge kernel's launch with the attention kernel, and the attention kernel's with its
    predecessor's tail. A split of one tile has no loop to pipeline (2 stages): 1 x 8k 11.9 -> 10.6
    us; longer splits pipeline their tiles (3 stages): 1 x 32k 28.4 -> 25.0 us, with PDL 24.4 -> 23.3.
    Other split decodes, and one-split decodes of fewer than 4 programs per multiprocessor, also take
    pipelined 128-key tiles (64x1k 45.9 -> 38.2 us at one split, 16x4k at 8 splits 46.3 -> 43.4);
    from 4 per multiprocessor (80-112 x 1k), several programs per multiprocessor hide the latency
    and DECODE_LAUNCH's 64-key tiles are faster (96x1k 56.4 us vs 61.4). Other head dims keep
    DECODE_LAUNCH without PDL (128 keys at head_dim 128 spill; PDL moved other shapes by +-1%, v8b)."""
    if block_d != 64:
        return _launch(DECODE_LAUNCH, block_d), False
    if num_splits > 1 and num_programs * num_splits <= 4 * sms and max_seqlen_k:
        return ((128, 4, 2) if -(-max_seqlen_k // num_splits) <= 128 else (128, 4, 3)), True
    if num_splits > 1 or num_programs < 4 * sms:
        return (128, 4, 3), False
    return DECODE_LAUNCH[64], False


@dataclass(frozen=True)
class LaunchPlan:
    """What one paged-attention call launches, from its shapes alone (no tensor read): each distinct
    (attention_variant, merge_variant) is one Triton compile (attention_warmup.py compiles them all
    at start)."""

    num_splits: int
    block_d: int  # head_dim padded to a power of two
    block_m: int  # rows per program: BLOCK_Q query tokens x the GQA group
    block_q: int
    launch: tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)
    pdl: bool  # by the rule; the caller drops it where the device lacks it
    merge_heads: int  # query heads per merge program (num_splits > 1)
    split_keys: int = 0  # > 0: invariant mode (splits at fixed key positions, the in-order merge)

    def attention_variant(self) -> tuple:
        split = self.num_splits > 1
        return (self.block_d, self.block_m, self.block_q, self.launch, split, self.pdl, self.split_keys)

    def merge_variant(self) -> tuple | None:
        """None without a merge (the split count is a runtime argument there too: never a key)."""
        if self.num_splits == 1:
            return None
        if self.split_keys:
            return ("in order", self.block_d)
        return (
            self.block_d,
            triton.next_power_of_2(self.num_splits),
            self.merge_heads,
            self.pdl,
        )


@functools.lru_cache(maxsize=4096)  # per layer of every eager step: the same few shapes
def launch_plan(
    T: int,
    B: int,
    H_q: int,
    H_kv: int,
    D: int,
    max_seqlen_q: int,
    max_seqlen_k: int | None,
    num_splits: int | None,
    sms: int,
    split_keys: int = 0,
    key_tile: int = 0,
) -> LaunchPlan:
    """The rules of `paged_attention_triton` for T query tokens of B sequences (max_seqlen_k may be
    None only with num_splits given). `key_tile`: invariant mode's `invariant_key_tile`."""
    group = H_q // H_kv
    block_d = triton.next_power_of_2(D)
    if split_keys:  # invariant: one tile for every launch, splits at fixed key positions
        launch = INVARIANT_FEW_HEADS_LAUNCH if key_tile == 128 else _launch(INVARIANT_LAUNCH, block_d)
        assert split_keys % launch[0] == 0, "split_keys must be a multiple of BLOCK_N"
        block_m = max(INVARIANT_BLOCK_M, triton.next_power_of_2(group))
        # a decode's one query fills only its GQA group's rows: one query a program (the rows' layout,
        # BLOCK_M x BLOCK_N, and so each row's arithmetic stay as in the chunks' programs)
        block_q = 1 if max_seqlen_q == 1 else block_m // group
        if num_splits is None:
            assert max_seqlen_k is not None
            num_splits = max(1, -(-max_seqlen_k // split_keys))
        return LaunchPlan(num_splits, block_d, block_m, block_q, launch, False, 1, split_keys)
    if max_seqlen_q == 1:  # decode: one token, the GQA group in the rows
        block_m, block_q = max(16, triton.next_power_of_2(group)), 1  # tl.dot needs M >= 16
        if num_splits is None:
            assert max_seqlen_k is not None
            num_splits = _decode_splits(B * H_kv, max_seqlen_k, sms, block_d)
        launch, pdl = _decode_launch(B * H_kv, num_splits, max_seqlen_k, block_d, sms)
    else:  # prefill chunks (mixed with decodes)
        block_m = max(64, triton.next_power_of_2(group))
        block_q = block_m // group
        if num_splits is None:
            assert max_seqlen_k is not None
            num_splits = _prefill_splits(B, max_seqlen_q, group, H_kv, max_seqlen_k, sms)
        launch, pdl = _launch(PREFILL_LAUNCH, block_d), False
    heads = _merge_heads(T, H_q, sms) if num_splits > 1 else 1
    return LaunchPlan(num_splits, block_d, block_m, block_q, launch, pdl, heads)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    launch: tuple[int, int, int] | None = None,
    pdl: bool | str | None = None,
    window: int = 0,
    split_keys: int = 0,
    key_tile: int = 0,
) -> torch.Tensor:
    """Triton varlen paged attention, same contract as `paged_attention_ref`; writes `out` if given.

    `split_keys` > 0: the invariant mode (deterministic engines). Every launch, decode or prefill,
    runs one tile configuration (the model's: `key_tile`, from `invariant_key_tile`), and split s
    holds keys [s * split_keys, (s + 1) * split_keys), merged in order: a query row reduces its keys
    tile by tile from key 0 in the same order whatever the batch, its chunk, or the launch's split
    count (num_splits: enough splits for max_seqlen_k; more only add empty ones). A launch of one
    split (every key before split_keys) writes its rows in place and skips the merge.

    Decode-only batches (max_seqlen_q == 1) put the GQA group of one KV head in one program and
    split long contexts over `num_splits` programs (default: a heuristic on max_seqlen_k); other
    batches tile BLOCK_Q queries x GROUP heads per program. Pass max_seqlen_q (and num_splits, or
    max_seqlen_k, for decode) to avoid a host sync; a fixed num_splits is safe for CUDA graphs.
    Overrides of the rules (`_decode_launch`, the tables), for benchmarks/gpu_bench.py: `launch` =
    (BLOCK_N, num_warps, num_stages); `pdl` = programmatic dependent launch (sm_90+, ignored
    elsewhere): False; "merge" (the merge kernel launches while the attention kernel runs and waits
    for it on the device); True (the attention kernel too, overlapping the kernel before it). A kernel
    launched early waits (griddepcontrol.wait) before its first read: it never reads its
    predecessor's writes unfinished, so any kernel may come before or after, in CUDA graphs too.
    """
    T, H_q, D = q.shape
    B = seq_lens.shape[0]
    _, page_size, H_kv, _ = k_cache.shape
    assert H_q % H_kv == 0 and k_cache.shape == v_cache.shape and q.dtype == k_cache.dtype
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    check_device(q)
    if out is None:
        out = torch.empty(T, H_q, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # host sync
    if num_splits is None and max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max())  # host sync
    sms = num_sms(q.device)
    if split_keys and num_splits is not None and max_seqlen_k is not None and num_splits * split_keys < max_seqlen_k:
        raise ValueError(f"invariant attention: {num_splits} splits of {split_keys} keys miss some of {max_seqlen_k}")
    plan = launch_plan(T, B, H_q, H_kv, D, max_seqlen_q, max_seqlen_k, num_splits, sms, split_keys, key_tile)
    group, block_d, num_splits = H_q // H_kv, plan.block_d, plan.num_splits
    block_m, block_q = plan.block_m, plan.block_q
    block_n, num_warps, num_stages = launch or plan.launch
    pdl = (plan.pdl if pdl is None else pdl) if pdl_supported(q.device) else False
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q.dtype]
    if interpreting() and q.dtype == torch.bfloat16:
        dot_dtype = tl.float32  # triton 3.9's interpreter multiplies bf16 bit patterns
    # invariant mode, one split (every key before split_keys): each row written in place, as the
    # multi-split launches write such rows (`direct`), so the two kinds of launch agree bit for bit
    split = num_splits > 1
    if split:
        partial = torch.empty(T, H_q, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, H_q, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # unused
    grid = (B * H_kv, triton.cdiv(max_seqlen_q, block_q), num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        partial,
        lse,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale * 1.4426950408889634,
        window,
        H_kv,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),  # page-first: (block, slot, head)
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SPLIT=split,
        SPLIT_KEYS=split_keys,
        PDL=bool(pdl),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl is True else {}),
    )
    merge_args = (out, partial, lse, H_q, out.stride(0), out.stride(1), num_splits)  # both merges'
    if split_keys and split:
        _merge_splits_in_order_kernel[(T,)](
            *merge_args,
            BLOCK_H=triton.next_power_of_2(H_q),
            HEAD_DIM=D,
            BLOCK_D=block_d,
        )
    elif num_splits > 1:
        heads = plan.merge_heads
        _merge_splits_kernel[(T, triton.cdiv(H_q, heads))](
            *merge_args,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_H=heads,
            HEAD_DIM=D,
            BLOCK_D=block_d,
            PDL=bool(pdl),
            num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels (not the interpreter) on sm_90+, with a triton
    that has griddepcontrol (tl.extra.cuda.gdc_*, triton >= 3.4)."""
    return (
        gdc_wait is not None
        and device.type == "cuda"
        and not interpreting()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Reference varlen paged attention (prefill chunks and decodes mixed). Returns [T, H_q, D]."""
    T, H_q, D = q.shape
    B = seq_lens.shape[0]
    block_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max())
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max())
    num_pages = (max_seqlen_k + block_size - 1) // block_size
    pages = block_tables[:, :num_pages].clamp(min=0).long().reshape(-1)  # (B*P,); padding reads page 0
    # index_select, not k_cache[pages]: advanced indexing of the strided view is ~1000x slower on CPU
    k = k_cache.index_select(0, pages).reshape(B, num_pages * block_size, H_kv, D)  # (B, S, H_kv, D)
    v = v_cache.index_select(0, pages).reshape(B, num_pages * block_size, H_kv, D)
    if H_q != H_kv:  # GQA: expand KV heads (SDPA's enable_gqa takes a slow path on CPU)
        k = k.repeat_interleave(H_q // H_kv, dim=2)
        v = v.repeat_interleave(H_q // H_kv, dim=2)

    # pad the packed queries to (B, max_q): row t of q goes to (batch_idx[t], pos_in_seq[t])
    batch_idx = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=T)  # no sync
    pos_in_seq = torch.arange(T, device=q.device) - cu_seqlens_q[:-1].long()[batch_idx]
    qp = q.new_zeros(B, max_seqlen_q, H_q, D)
    qp[batch_idx, pos_in_seq] = q

    # mask[b, i, j]: key j is real and not after query i's absolute position
    q_abs = (seq_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=q.device)[None, :]  # (B, Q)
    key_pos = torch.arange(num_pages * block_size, device=q.device)
    mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    if window > 0:  # sliding window: only the last `window` keys
        mask &= key_pos[None, None, :] > q_abs[:, :, None] - window
    mask[:, :, 0] |= ~mask.any(-1)  # padded query rows: avoid NaN

    # an additive float mask and contiguous inputs: with a bool mask or strided inputs CPU SDPA
    # falls back to a path ~50x slower
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        attn_mask=bias[:, None],
        scale=scale,
    )  # (B, H_q, Q, D)
    return out.transpose(1, 2)[batch_idx, pos_in_seq]


# ---------------------------------------------------------------------------- vectorised torch (CPU)
# `paged_attention_ref` rebuilds its gather indices and mask in every layer and expands the KV heads
# for GQA: on CPU that is ~30 small ops per layer, and its advanced-index copies of the strided
# layer view take milliseconds. `paged_attention_torch` computes the same function from a
# `TorchAttentionPlan` built once per step (block tables, lengths and masks are the same in every
# layer), so that a layer costs, per group of sequences, two page gathers and one SDPA:
# - decodes (one query each): the G query heads of a KV head are G query rows of that head (same
#   position, same mask), so K/V are not expanded for GQA, and q / out are views, not copies;
# - prefill chunks: queries padded to the longest chunk, KV heads expanded, one causal mask.
# A page of one layer's K (or V) is one contiguous span (block_size * H_kv * D), so the gather is one
# index_select of whole pages (sequential copies: ~1.5x faster than gathering rows per head) into
# (batch, key, head, dim); SDPA takes its (batch, head, key, dim) transpose without a copy.


@dataclass
class AttentionGroup:
    """Sequences of one kind (decodes, or prefill chunks) attended together."""

    decode: bool
    rows: torch.Tensor | None  # (T_g,) their tokens' rows of q; None: all of q, in order
    dest: torch.Tensor | None  # prefill: padded row (b * Q + i) of each token; None: no padding
    pages: torch.Tensor  # (B_g * P,) int64 page ids (table padding -1 -> page 0, masked)
    bias: torch.Tensor | None  # (B_g, 1, 1 or Q, P * block_size) additive mask: 0 or -inf; None: causal
    batch: int  # B_g
    max_q: int  # Q: padded queries per sequence (1 for decodes)
    num_pages: int  # P: pages gathered per sequence


@dataclass
class TorchAttentionPlan:
    num_tokens: int
    num_q_heads: int
    groups: list
    window: int = 0


def _page_view(cache: torch.Tensor) -> torch.Tensor:
    """One layer's [num_blocks, block_size, H_kv, D] cache as [num_blocks, block_size * H_kv * D]
    rows (a view: the page stride stays the page-first one)."""
    N, bs, H_kv, D = cache.shape
    return cache.as_strided((N, bs * H_kv * D), (cache.stride(0), 1), cache.storage_offset())


def torch_attention_supported(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches have the layout `paged_attention_torch` (and `_page_view`) indexes: each
    page's (slot, head, dim) contiguous; any page stride."""
    N, bs, H_kv, D = k_cache.shape
    return (
        k_cache.stride()[1:] == (H_kv * D, D, 1)
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
    )


def plan_paged_attention_torch(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_q_heads: int,
    dtype: torch.dtype,
    window: int = 0,
) -> TorchAttentionPlan:
    """Indices and masks of one step for `paged_attention_torch`, the same for every layer of one
    `window` (computed on the host: a sync on CUDA)."""
    device = block_tables.device
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    tables = block_tables.cpu().long().clamp(min=0)
    q_lens = cu[1:] - cu[:-1]
    T = int(cu[-1])
    groups = []
    for decode in (True, False):
        sel = torch.nonzero(q_lens == 1 if decode else q_lens > 1).flatten()
        if sel.numel() == 0:
            continue
        B_g, ql, sl = sel.numel(), q_lens[sel], lens[sel]
        Q = int(ql.max())
        P = max(-(-int(sl.max()) // block_size), 1)
        S = P * block_size
        # token rows of q: sequence b owns rows cu[b] .. cu[b+1]-1
        b_of = torch.repeat_interleave(torch.arange(B_g), ql)  # (T_g,)
        i_of = torch.arange(b_of.numel()) - (torch.cumsum(ql, 0) - ql)[b_of]  # index within its chunk
        rows = cu[:-1][sel][b_of] + i_of
        all_rows = rows.numel() == T and bool((rows == torch.arange(T)).all())
        bias: torch.Tensor | None = None
        # every chunk starts at position 0: the mask is SDPA's own causal one (query i sees keys 0..i;
        # keys past a sequence's end come after all its queries), whose CPU kernel skips the key
        # blocks above the diagonal (~half of a fresh prompt's attention) where an explicit mask
        # computes them all
        if decode or window > 0 or not bool((sl == ql).all()):
            # mask[b, i, s]: key s is real (< seq_len) and not after query i's absolute position
            s = torch.arange(S)
            q_abs = (sl - ql)[:, None] + torch.arange(Q)[None, :]  # (B_g, Q)
            ok = (s[None, None, :] <= q_abs[:, :, None]) & (s[None, None, :] < sl[:, None, None])
            if window > 0:
                ok &= s[None, None, :] > q_abs[:, :, None] - window
            ok[:, :, 0] |= ~ok.any(-1)  # padded rows: no NaN
            bias = torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, float("-inf"))[:, None]
        dest = None if (decode or B_g == 1) else b_of * Q + i_of
        groups.append(
            AttentionGroup(
                decode=decode,
                rows=None if all_rows else rows.to(device),
                dest=None if dest is None else dest.to(device),
                pages=tables[sel, :P].reshape(-1).to(device),
                bias=None if bias is None else bias.to(device),
                batch=B_g,
                max_q=Q,
                num_pages=P,
            )
        )
    return TorchAttentionPlan(num_tokens=T, num_q_heads=num_q_heads, groups=groups, window=window)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    plan: TorchAttentionPlan | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`paged_attention_ref`'s function, vectorised for CPU; pass the step's `plan`
    (`plan_paged_attention_torch`) to share it between layers. Returns [T, H_q, D]."""
    T, H_q, D = q.shape
    _, bs, H_kv, _ = k_cache.shape
    G = H_q // H_kv
    if not torch_attention_supported(k_cache, v_cache):
        return paged_attention_ref(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k, window
        )
    if plan is None:
        plan = plan_paged_attention_torch(cu_seqlens_q, seq_lens, block_tables, bs, H_q, q.dtype, window)
    assert plan.window == window, "the plan was made for another window"
    k_pages, v_pages = _page_view(k_cache), _page_view(v_cache)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = []
    for g in plan.groups:
        B, Q, S = g.batch, g.max_q, g.num_pages * bs
        k = k_pages.index_select(0, g.pages).view(B, S, H_kv, D)
        v = v_pages.index_select(0, g.pages).view(B, S, H_kv, D)
        qg = q if g.rows is None else q.index_select(0, g.rows)  # (T_g, H_q, D)
        if g.decode:
            o = sdpa(
                qg.reshape(B, H_kv, G, D), k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.bias, scale=scale
            ).reshape(B, H_q, D)  # a view on CPU; CUDA may permute
        else:
            if g.dest is not None:  # pad to (B, Q)
                qg = qg.new_zeros(B * Q, H_q, D).index_copy_(0, g.dest, qg)
            if G > 1:  # SDPA's enable_gqa takes a slow path on CPU
                k = k[:, :, :, None].expand(B, S, H_kv, G, D).reshape(B, S, H_q, D)
                v = v[:, :, :, None].expand(B, S, H_kv, G, D).reshape(B, S, H_q, D)
            o = (
                sdpa(
                    qg.reshape(B, Q, H_q, D).transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=g.bias,
                    is_causal=g.bias is None,
                    scale=scale,
                )
                .transpose(1, 2)
                .reshape(B * Q, H_q, D)
            )
            if g.dest is not None:
                o = o.index_select(0, g.dest)
        outs.append((g.rows, o))
    if len(outs) == 1 and outs[0][0] is None:
        return outs[0][1]
    out = q.new_empty(T, H_q, D)
    for rows, o in outs:
        out.index_copy_(0, rows, o)
    return out


# ---------------------------------------------------------------------------- invariant torch (CPU)
def paged_attention_rows_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """`paged_attention_ref`'s function with each query row computed alone, over exactly the keys it
    sees, in fp32 (invariant mode on the torch backend). Every op's shape then depends on the row's
    position only, so its result does not depend on the batch, its chunk or the cached prefix
    (SDPA and BLAS choose their blocking by the whole call's shape). One row at a time: slow for
    long prompts, meant for tests and small models. Returns [T, H_q, D]."""
    T, H_q, D = q.shape
    _, bs, H_kv, _ = k_cache.shape
    G = H_q // H_kv
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    tables = block_tables.long()
    paged = torch_attention_supported(k_cache, v_cache)
    out = q.new_zeros(T, H_q, D)
    for b, seq_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0 or seq_len == 0:
            continue
        pages = tables[b, : -(-seq_len // bs)]
        if paged:  # whole pages by index_select (advanced indexing of the strided view is slow)
            k = _page_view(k_cache).index_select(0, pages).view(-1, H_kv, D)[:seq_len].float()  # (S, H_kv, D)
            v = _page_view(v_cache).index_select(0, pages).view(-1, H_kv, D)[:seq_len].float()
        else:
            pos = torch.arange(seq_len, device=q.device)
            k, v = (c[pages[pos // bs], pos % bs].float() for c in (k_cache, v_cache))
        k, v = k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None]  # (H_kv, 1, S, D)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = max(0, p - window + 1) if window > 0 else 0
            qi = q[cu[b] + i].float().view(H_kv, G, 1, D)
            s = (qi * k[:, :, lo : p + 1]).sum(-1) * scale  # (H_kv, G, L)
            w = torch.softmax(s, dim=-1)
            o = (w[..., None] * v[:, :, lo : p + 1]).sum(-2)  # (H_kv, G, D)
            out[cu[b] + i] = o.reshape(H_q, D).to(q.dtype)
    return out
