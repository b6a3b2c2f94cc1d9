"""A one-shot all-reduce over NVLink for the small sums a decode step makes.

A tensor-parallel decode step sums a (batch, hidden) activation twice a layer: 65 all-reduces of
0.1-2 MB for an 8B model. NCCL's ring costs ~16-35 us each at those sizes on two H200s (mostly its
protocol's latency, not bandwidth). Here every rank copies its part into a buffer the other ranks
can address (torch's symmetric memory allocates and peer-maps it; no NVLink multicast), meets the
others at a device-side barrier and adds all ranks' parts itself: one kernel
(kernels/peer_sum.py), one hop.

Only on CUDA, only up to `max_bytes`, and only after a self-test at start agreed with NCCL; any
other case (CPU, a bigger tensor, a failed set-up) goes through NCCL as before. Every rank adds the
parts in rank order, so the ranks keep bit-identical activations.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from chatengine.kernels import peer_sum

log = logging.getLogger(__name__)


def max_bytes_for(size: int) -> int:
    """The largest tensor worth one shot at `size` ranks: each rank reads size - 1 peer copies, so
    the win over NCCL's ring shrinks as tensors and ranks grow (2: up to 2 MB, e.g. 256 x 4096 in
    bf16; 4: 512 KB; more: 256 KB)."""
    if size == 2:
        return 2 << 20
    return 512 << 10 if size <= 4 else 256 << 10


class OneShotAllReduce:
    """This rank's peer-addressable buffer (two halves of `max_bytes`) and flag pad, with every
    rank's addresses, and the sum through them."""

    def __init__(self, device: torch.device, size: int, max_bytes: int | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes_for(size) if max_bytes is None else max_bytes
        group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op) in newer torch, needed in older
            symm_mem.enable_symm_mem_for_group(group_name)
        self.buffer = symm_mem.empty(2 * self.max_bytes, dtype=torch.uint8, device=device)
        self.flags = symm_mem.empty(peer_sum.PROGRAMS * size, dtype=torch.int32, device=device).zero_()
        buffers = symm_mem.rendezvous(self.buffer, group_name)  # collective: every rank, same point
        flags = symm_mem.rendezvous(self.flags, group_name)
        self.rank = buffers.rank
        self.buffer_ptrs = torch.tensor(buffers.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flags.buffer_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(peer_sum.PROGRAMS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zeros before any rank's first sum writes into them

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, as a new tensor of x's shape (x must `fit`)."""
        half = self.max_bytes // x.element_size()
        return peer_sum.peer_sum_triton(x, self.buffer_ptrs, self.flag_ptrs, self.epochs, half, self.rank)


def try_one_shot(device: torch.device, size: int) -> OneShotAllReduce | None:
    """The one-shot path if it can run here and sums as NCCL does, else None (NCCL only).
    Collective: every rank calls it at the same point and all get the same answer."""
    if device.type != "cuda" or size < 2:
        return None
    one_shot = None
    try:
        one_shot = OneShotAllReduce(device, size)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL alone, never a broken engine
        log.warning("one-shot all-reduce unavailable, NCCL only: %s", e)
    if not _everywhere(one_shot is not None, device):  # no rank starts a sum its peers would not join
        return None
    assert one_shot is not None
    return one_shot if _everywhere(_agrees_with_nccl(one_shot, device), device) else None


def _everywhere(ok: bool, device: torch.device) -> bool:
    verdict = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return int(verdict.item()) == 1


def _agrees_with_nccl(one_shot: OneShotAllReduce, device: torch.device) -> bool:
    """Both paths sum bf16 and fp32 tensors (a small one and the largest that fits) alike: to the bit
    at two ranks (one addition either way), within rounding at more; and every rank got the same.
    Every rank runs every case (no early return: the ranks' collectives stay paired)."""
    size, rank, ok = dist.get_world_size(), dist.get_rank(), True
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for numel in (64 * 512, one_shot.max_bytes // torch.empty(0, dtype=dtype).element_size()):
            for _ in range(3):  # both buffer halves, and back
                x = torch.randn(numel, generator=gen, device=device).to(dtype)
                want, got = x.clone(), one_shot(x)
                dist.all_reduce(want)
                same = [torch.empty_like(got) for _ in range(size)]
                dist.all_gather(same, got)
                close = torch.equal(got, want) if size == 2 else torch.allclose(got, want, rtol=1e-2, atol=1e-2)
                if not close or not all(torch.equal(s, got) for s in same):
                    log.warning("one-shot all-reduce differs from NCCL (%s, %d elements): NCCL only", dtype, numel)
                    ok = False
    return ok
