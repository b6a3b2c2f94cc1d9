"""The sum of one tensor over the GPUs of a host, in one kernel that reads the peers' copies.

Each rank owns a buffer every other rank can address (peer-mapped memory) and a pad of int32
flags the others write into. One launch, `PROGRAMS` programs on every rank, program p:
  1. copies its tiles of x into its own buffer (tiles p, p + PROGRAMS, ...);
  2. tells every rank "program p of rank r is at epoch e" (pad[p * WORLD + r] = e, a release
     store at system scope after a block barrier, so the copied tiles are visible first);
  3. waits until every rank's program p said e (acquire loads), then
  4. adds its tiles from every rank's buffer in rank order (in fp32) and writes them out.
Program p only reads tiles that program p of each rank copied, so one flag per (program, rank)
is the whole barrier. The epoch is a per-program counter on the device, bumped by the kernel
itself, so a CUDA graph that replays the launch keeps counting. The buffer has two halves used
by alternate epochs: when a rank starts epoch e, every peer has started e - 1 (it waited for
them), so their reads of e - 2, the half about to be overwritten, are done; no closing barrier.
Every rank adds the same values in the same order: the ranks get bit-identical sums.

`peer_sum_ref` is the same arithmetic in plain torch over the parts.
"""

import torch

from .paged_attention import check_device, jit, tl

PROGRAMS = 64  # fixed: every launch must use the same programs for the flags to pair up
BLOCK = 2048  # elements a program moves per tile


@jit
def _peer_sum_kernel(X, Out, BufPtrs, PadPtrs, Epochs, n, half, rank, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(Epochs + p) + 1  # int32, wraps: compared by difference below
    tl.store(Epochs + p, epoch)
    base = (epoch & 1).to(tl.int64) * half  # this epoch's half of every buffer
    dtype = X.dtype.element_ty
    mine = tl.load(BufPtrs + rank).to(tl.pointer_type(dtype)) + base
    offs = tl.arange(0, BLOCK)
    for start in range(p * BLOCK, n, programs * BLOCK):
        idx = start + offs
        m = idx < n
        tl.store(mine + idx, tl.load(X + idx, mask=m), mask=m)
    tl.debug_barrier()  # every thread's copy before the flags that announce it
    for r in tl.static_range(WORLD):
        pad = tl.load(PadPtrs + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pad + p * WORLD + rank, epoch, sem="release", scope="sys")
    own = tl.load(PadPtrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        # a peer may already be an epoch ahead (it needs nothing more from us to finish this one)
        while tl.atomic_add(own + p * WORLD + r, 0, sem="acquire", scope="sys") - epoch < 0:
            pass
    tl.debug_barrier()  # every thread reads after the flags
    for start in range(p * BLOCK, n, programs * BLOCK):
        idx = start + offs
        m = idx < n
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):  # rank order on every rank
            part = tl.load(BufPtrs + r).to(tl.pointer_type(dtype)) + base
            acc += tl.load(part + idx, mask=m, other=0.0, volatile=True).to(tl.float32)
        tl.store(Out + idx, acc.to(Out.dtype.element_ty), mask=m)


def peer_sum_triton(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    epochs: torch.Tensor,
    half_elems: int,
    rank: int,
) -> torch.Tensor:
    """x's sum over the ranks. buffer_ptrs / pad_ptrs: (WORLD,) int64 addresses of each rank's
    buffer (two halves of `half_elems` elements of x's dtype) and flag pad (PROGRAMS * WORLD
    int32, zeros at first); epochs: (PROGRAMS,) int32 on the device, zeros at first, this rank's."""
    check_device(x)
    n = x.numel()
    if n > half_elems:
        raise ValueError(f"{n} elements do not fit a buffer half of {half_elems}")
    out = torch.empty_like(x)
    world = buffer_ptrs.numel()
    _peer_sum_kernel[(PROGRAMS,)](x, out, buffer_ptrs, pad_ptrs, epochs, n, half_elems, rank, WORLD=world, BLOCK=BLOCK)
    return out


def peer_sum_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' parts added in rank order in fp32, in their dtype: what every rank gets."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        acc += part.float()
    return acc.to(parts[0].dtype)
