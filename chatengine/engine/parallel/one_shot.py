"""A one-shot all-reduce over NVLink for the small sums a decode step makes.

A tensor-parallel decode step sums a (batch, hidden) activation twice a layer: 65 all-reduces of
0.1-2 MB for an 8B model. NCCL's ring costs ~16-35 us each at those sizes on two H200s (mostly its
protocol's latency, not bandwidth). Here every rank copies its part into a buffer the other ranks
can address (torch's symmetric memory: peer-mapped device memory, no NVLink multicast), meets the
others at a device-side barrier and adds all ranks' parts itself (torch's one-shot kernel): one
launch, one hop; ~11 us at 0.5 MB and ~21 us at 2 MB there.

Only on CUDA, only up to `max_bytes`, and only after a self-test at start agreed with NCCL; any
other case (CPU, a bigger tensor, a failed set-up) goes through NCCL as before.

One process group a process: torch keeps a group's symmetric-memory registration by its name for
the life of the process, and a later group (another engine in the same process, after the first
one's group is gone) gets the same name, whose stale registration makes the rendezvous hang. So a
process's second tensor-parallel engine sums through NCCL alone (logged); worker processes are new
for each engine, and the decision is collective (rank 0 says).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def max_bytes_for(size: int) -> int:
    """The largest tensor worth one shot at `size` ranks: each rank reads size - 1 peer copies, so
    the win over NCCL's ring shrinks as tensors and ranks grow (2: up to 2 MB, e.g. 256 x 4096 in
    bf16; 4: 512 KB; more: 256 KB)."""
    if size == 2:
        return 2 << 20
    return 512 << 10 if size <= 4 else 256 << 10


class OneShotAllReduce:
    """The peer-addressable buffer of one process group, and the sum through it."""

    def __init__(self, device: torch.device, size: int, max_bytes: int | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes_for(size) if max_bytes is None else max_bytes
        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op) in newer torch, needed in older
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank, same point

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, as a new tensor of x's shape (x must `fit`)."""
        nbytes = x.numel() * x.element_size()
        symm = self.buffer[:nbytes].view(x.dtype)
        flat = torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x.reshape(-1), "sum", self.group_name)
        return flat.view(x.shape)


# set once this process has registered a group for symmetric memory (see the module's docstring)
_registered = False


def try_one_shot(device: torch.device, size: int) -> OneShotAllReduce | None:
    """The one-shot path if it can run here and sums as NCCL does, else None (NCCL only).
    Collective: every rank calls it at the same point and all get the same answer."""
    global _registered
    if device.type != "cuda" or size < 2:
        return None
    if not _everywhere(not _registered, device):
        log.warning("one-shot all-reduce: a process's second tensor-parallel group sums through NCCL alone")
        return None
    _registered, one_shot = True, None
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
