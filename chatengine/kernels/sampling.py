"""Sampling in one pass over the logits: greedy and temperature rows, Gumbel-max, no host sync.

argmax(logits / T + G) with G = -log(-log(U)), U ~ Uniform(0, 1), is a draw from softmax(logits / T)
(the Gumbel-max trick, the log form of the sampler's exponential race); T = 0 rows take the plain
argmax. One program reads one row once and keeps a running (max, index) per lane, so a step
costs one read of the (N, V) logits instead of the ~10 passes of temperature, softmax, noise and
argmax done separately in torch. Ties go to the lowest index, as in `torch.argmax`.

The uniforms come from Triton's Philox (`tl.rand(seed, row * V + column)`): a step's `seed` and the
row fix the draw. The torch reference takes its uniforms from a torch.Generator, so the two agree
exactly on greedy rows and in distribution on sampled rows (tests/test_kernels.py checks both).
Top-k / top-p and per-request seeded generators stay in chatengine/sampler.py. `greedy_triton` is
the all-greedy step's argmax, split over chunks of the vocabulary.
"""

import torch

from .paged_attention import check_device, jit, tl, triton

# a new seed every step: no value specialization (each would compile the kernel again)
_jit = triton.jit(do_not_specialize=["seed"]) if triton is not None else jit


@_jit
def _sample_kernel(Logits, Temps, Out, stride_l, vocab_size, seed, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(Temps + row)
    inv_temp = 1.0 / tl.where(temp > 0, temp, 1.0)
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    base = Logits + row.to(tl.int64) * stride_l
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs
        ok = cols < vocab_size
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if temp > 0:
            u = tl.rand(seed, row * vocab_size + cols)  # [0, 1)
            u = tl.maximum(u, 1.0e-20)  # log(0) guard
            x = x * inv_temp - tl.log(-tl.log(u))
        x = tl.where(ok, x, float("-inf"))
        better = x > best  # strict: the first index wins
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, x, best)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    tl.store(Out + row, idx.to(tl.int64))


def sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seed: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Token ids (N,) int64 drawn from softmax(logits / T) per row; rows with T == 0 are greedy.

    logits (N, V) of any float dtype, rows contiguous; temperatures (N,) fp32 on the same device;
    seed an int in [0, 2**31) (the same seed and logits give the same ids)."""
    check_device(logits)
    N, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (N,) and temperatures.dtype == torch.float32
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    _sample_kernel[(N,)](logits, temperatures, out, logits.stride(0), V, seed, BLOCK_V=2048, num_warps=8)
    return out


@jit
def _chunk_argmax_kernel(Logits, Vals, Idx, stride_l, vocab_size, num_chunks, CHUNK: tl.constexpr):
    """Per (row, chunk): the chunk's max (fp32) and the first column holding it."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < vocab_size
    x = tl.load(Logits + row.to(tl.int64) * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    first = tl.min(tl.where(ok & (x == top), cols, 2147483647), 0)
    tl.store(Vals + row * num_chunks + chunk, top)
    tl.store(Idx + row * num_chunks + chunk, first)


@jit
def _rows_argmax_kernel(Vals, Idx, Out, num_chunks, BLOCK_C: tl.constexpr):
    """Per row: the first column of the best chunk max (chunks are in column order)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < num_chunks
    vals = tl.load(Vals + row * num_chunks + offs, mask=ok, other=float("-inf"))
    idx = tl.load(Idx + row * num_chunks + offs, mask=ok, other=2147483647)
    top = tl.max(vals, 0)
    tl.store(Out + row, tl.min(tl.where(ok & (vals == top), idx, 2147483647), 0).to(tl.int64))


def greedy_triton(logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """argmax over the vocabulary (N,) int64, ties to the first index as `torch.argmax` (NaN aside:
    never chosen here). Two launches that spread a row over many programs: one 128k row (batch 1)
    is ~32 programs, not the one block torch gives a row. Reference: chatengine.engine.sampler.greedy."""
    check_device(logits)
    N, V = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    C = triton.cdiv(V, chunk)
    vals = torch.empty(N, C, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, C, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(N, C)](logits, vals, idx, logits.stride(0), V, C, CHUNK=chunk, num_warps=4)
    _rows_argmax_kernel[(N,)](vals, idx, out, C, BLOCK_C=max(16, triton.next_power_of_2(C)), num_warps=1)
    return out


def sample_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The same function in plain torch, its uniforms from `generator`."""
    x = logits.float()
    u = torch.rand(x.shape, generator=generator, device=x.device).clamp_(min=1e-20)
    sampled = (x / temperatures.clamp(min=1e-30)[:, None] - torch.log(-torch.log(u))).argmax(-1)
    return torch.where(temperatures > 0, sampled, x.argmax(-1))
