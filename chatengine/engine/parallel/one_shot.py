"""A one-shot all-reduce over NVLink for the small sums a decode step makes.

A tensor-parallel decode step sums a (batch, hidden) activation twice a layer: 64 all-reduces of
0.1-2 MB for an 8B model. NCCL's ring costs ~15-35 us each at those sizes (mostly its protocol's
latency, not bandwidth). Here every rank copies its part into a buffer the other ranks can address
(torch's symmetric memory: peer-mapped device memory, no NVLink multicast), meets the others at a
device-side barrier, and reads and adds all ranks' parts itself: one kernel, one hop.

Only on CUDA, only up to `max_bytes`, and only after a self-test on the first use agreed with NCCL
to the bit; anything else (CPU, a bigger tensor, a torch without these ops, a failed set-up) goes
through NCCL as before. The summation order is the rank order on every rank, so the ranks keep
identical activations.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def max_bytes_for(size: int) -> int:
    """The largest tensor worth one shot at `size` ranks: each rank reads size - 1 peer copies, so
    the win over a ring shrinks with the ranks (2: up to 8 MB; 4: 512 KB; more: 256 KB)."""
    if size == 2:
        return 8 << 20
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


def try_one_shot(device: torch.device, size: int) -> OneShotAllReduce | None:
    """The one-shot path if it can run here and sums exactly as NCCL does, else None (NCCL only).
    Collective: every rank calls it at the same point and all get the same answer."""
    if device.type != "cuda" or size < 2:
        return None
    ok, one_shot = True, None
    try:
        one_shot = OneShotAllReduce(device, size)
        ok = _agrees_with_nccl(one_shot, device)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL alone, never a broken engine
        log.warning("one-shot all-reduce unavailable, NCCL only: %s", e)
        ok = False
    verdict = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # one rank's failure turns it off everywhere
    return one_shot if int(verdict.item()) == 1 else None


def _agrees_with_nccl(one_shot: OneShotAllReduce, device: torch.device) -> bool:
    """Both paths sum the same bf16 and fp32 tensors (a decode size and the largest that fits) alike."""
    rank = dist.get_rank()
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for numel in (64 * 512, one_shot.max_bytes // torch.empty(0, dtype=dtype).element_size()):
            x = torch.randn(numel, generator=gen, device=device).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            if not torch.equal(one_shot(x), want):
                log.warning("one-shot all-reduce differs from NCCL (%s, %d elements): NCCL only", dtype, numel)
                return False
    return True
