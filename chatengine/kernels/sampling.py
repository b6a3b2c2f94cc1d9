"""Sampling in one pass over the logits: greedy and temperature rows, Gumbel-max, no host sync.

argmax(logits / T + G) with G = -log(-log(U)), U ~ Uniform(0, 1), is a draw from softmax(logits / T)
(the Gumbel-max trick, the log form of the sampler's exponential race); T = 0 rows take the plain
argmax. One program reads one row once and keeps a running (max, index) per lane, so a step
costs one read of the (N, V) logits instead of the ~10 passes of temperature, softmax, noise and
argmax done separately in torch. Ties go to the lowest index, as in `torch.argmax`.

The uniforms come from Triton's Philox: an unseeded row draws `tl.rand(seed, row * V + column)`
(the step's `seed` and the row fix the draw); a seeded row draws `tl.rand(key, column)` with its own
64-bit key (sampler.position_key: the request's seed, its sample index and the token's position),
so its token depends on nothing else in the batch, and a seeded batch costs what an unseeded one
does. `philox_uniform_ref` is Philox4x32-10 in plain torch, bit for bit Triton's `tl.rand`, so the
seeded rows of the kernel and of `sample_ref` agree exactly; unseeded rows of the reference take
their uniforms from a torch.Generator (the two agree in distribution; tests/test_kernels.py checks
both). Top-k / top-p stay in engine/sampler.py. `greedy_triton` is the all-greedy step's argmax,
split over chunks of the vocabulary.
"""

import torch

from .paged_attention import check_device, jit, tl, triton

# a new seed every step: no value specialization (each would compile the kernel again)
_jit = triton.jit(do_not_specialize=["seed"]) if triton is not None else jit


@_jit
def _sample_kernel(
    Logits,
    Temps,
    Keys,
    Out,
    Vals,
    stride_l,
    vocab_size,
    col0,
    row_width,
    seed,
    SEEDED: tl.constexpr,
    WRITE_VALS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # a row's columns are col0 + [0, vocab_size) of a vocabulary row_width wide (col0 = 0 and
    # row_width = vocab_size, unless the row is one rank's slice): the Philox counters and the ids
    # written are the whole vocabulary's, so slices sampled apart pick what the whole row would
    row = tl.program_id(0)
    temp = tl.load(Temps + row)
    inv_temp = 1.0 / tl.where(temp > 0, temp, 1.0)
    key = seed.to(tl.int64)
    first = row * row_width + col0  # the column's Philox counter, less the local column
    if SEEDED:  # Keys[row] != 0: the row's own stream, counters from 0
        own = tl.load(Keys + row)
        key = tl.where(own != 0, own, key)
        first = tl.where(own != 0, col0, first)
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    base = Logits + row.to(tl.int64) * stride_l
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs
        ok = cols < vocab_size
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if temp > 0:
            u = tl.rand(key, first + cols)  # [0, 1)
            u = tl.maximum(u, 1.0e-20)  # log(0) guard
            x = x * inv_temp - tl.log(-tl.log(u))
        x = tl.where(ok, x, float("-inf"))
        better = x > best  # strict: the first index wins
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, x, best)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    tl.store(Out + row, idx.to(tl.int64) + col0)
    if WRITE_VALS:
        tl.store(Vals + row, top)


def sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed: int,
    out: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids (N,) int64 drawn from softmax(logits / T) per row; rows with T == 0 are greedy.

    logits (N, V) of any float dtype, rows contiguous; temperatures (N,) fp32 on the same device;
    seed an int in [0, 2**31) (the same seed and logits give the same ids); keys (N,) int64 or None:
    a row with a nonzero key draws from that key's stream alone (whatever the seed and its row)."""
    return _sample(logits, temperatures, seed, keys, out=out)[0]


def sample_slice_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seed: int, keys: torch.Tensor | None, col0: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_triton` over one slice of each row: logits (N, n) are columns [col0, col0 + n) of a
    vocabulary of `vocab_size`. Returns (the best perturbed value (N,) fp32, its column in the whole
    vocabulary (N,) int64): the row's draw is the slice with the largest value (ties: the lowest
    column), the same token `sample_triton` draws from the whole row with the same seed and keys."""
    ids, vals = _sample(logits, temperatures, seed, keys, col0=col0, row_width=vocab_size, vals=True)
    return vals, ids


def _sample(logits, temperatures, seed, keys, out=None, col0=0, row_width=None, vals=False):
    check_device(logits)
    N, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (N,) and temperatures.dtype == torch.float32
    assert keys is None or (keys.shape == (N,) and keys.dtype == torch.int64)
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=logits.device)
    best = torch.empty(N, dtype=torch.float32, device=logits.device) if vals else None
    if N == 0:
        return out, best
    _sample_kernel[(N,)](
        logits,
        temperatures,
        temperatures if keys is None else keys,  # not read unless SEEDED
        out,
        out if best is None else best,  # not written unless WRITE_VALS
        logits.stride(0),
        V,
        col0,
        row_width or V,
        seed,
        SEEDED=keys is not None,
        WRITE_VALS=vals,
        BLOCK_V=2048,
        num_warps=8,
    )
    return out, best


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
def _rows_argmax_kernel(Vals, Idx, Out, Best, num_chunks, col0, BLOCK_C: tl.constexpr, WRITE_BEST: tl.constexpr):
    """Per row: the first column of the best chunk max (chunks are in column order), plus col0."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < num_chunks
    vals = tl.load(Vals + row * num_chunks + offs, mask=ok, other=float("-inf"))
    idx = tl.load(Idx + row * num_chunks + offs, mask=ok, other=2147483647)
    top = tl.max(vals, 0)
    tl.store(Out + row, tl.min(tl.where(ok & (vals == top), idx, 2147483647), 0).to(tl.int64) + col0)
    if WRITE_BEST:
        tl.store(Best + row, top)


def greedy_triton(logits: torch.Tensor, chunk: int = 4096, out: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the vocabulary (N,) int64 (into `out` if given), ties to the first index as
    `torch.argmax` (NaN aside: never chosen here). Two launches that spread a row over many
    programs: one 128k row (batch 1) is ~32 programs, not the one block torch gives a row.
    Reference: chatengine.engine.sampler.greedy."""
    return _greedy(logits, chunk, out=out)[0]


def greedy_slice_triton(logits: torch.Tensor, col0: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_triton` over columns [col0, col0 + n) of each row: (the slice's max (N,) fp32, its
    first column in the whole vocabulary (N,) int64)."""
    ids, vals = _greedy(logits, chunk, col0, best=True)
    return vals, ids


def _greedy(logits, chunk, col0=0, best=False, out=None):
    check_device(logits)
    N, V = logits.shape
    assert logits.stride(1) == 1
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=logits.device)
    top = torch.empty(N if best else 0, dtype=torch.float32, device=logits.device)
    if N == 0:
        return out, top
    C = triton.cdiv(V, chunk)
    vals = torch.empty(N, C, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, C, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(N, C)](logits, vals, idx, logits.stride(0), V, C, CHUNK=chunk, num_warps=4)
    block_c = max(16, triton.next_power_of_2(C))
    _rows_argmax_kernel[(N,)](
        vals, idx, out, top if best else vals, C, col0, BLOCK_C=block_c, WRITE_BEST=best, num_warps=1
    )
    return out, top


def sample_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same function in plain torch: rows with a nonzero key take Philox uniforms exactly as the
    kernel does; the other rows take theirs from `generator`."""
    x = logits.float()
    u = torch.rand(x.shape, generator=generator, device=x.device)
    for row, key in enumerate([] if keys is None else keys.tolist()):
        if key:
            u[row] = philox_uniform_ref(key, torch.arange(x.shape[1], device=x.device))
    inv = 1.0 / torch.where(temperatures > 0, temperatures, 1.0)  # as the kernel: x * (1 / T)
    sampled = (x * inv[:, None] - torch.log(-torch.log(u.clamp_(min=1e-20)))).argmax(-1)
    return torch.where(temperatures > 0, sampled, x.argmax(-1))


# Philox4x32-10 (the counter-based generator behind tl.rand), in int64 torch arithmetic: every value
# is an unsigned 32-bit word held in an int64; products are split in 16-bit halves to stay in range.
_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a 32-bit constant a and 32-bit words b."""
    lo_part = a * (b & 0xFFFF)  # < 2**48
    t = a * (b >> 16) + (lo_part >> 16)  # a * b == t * 2**16 + lo_part % 2**16
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox_uniform_ref(key: int, offsets: torch.Tensor) -> torch.Tensor:
    """tl.rand(key, offsets) in plain torch: float32 uniforms in [0, 1). key a 64-bit int (its low
    and high words are Philox's key), offsets non-negative ints below 2**31 (the first counter word)."""
    c0 = offsets.to(torch.int64) & _M32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = key & _M32, (key >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # the word as int32, as Triton reads it
    return torch.where(signed < 0, -signed - 1, signed).to(torch.int32).float() * 4.6566127342e-10
