"""A one-shot all-reduce over NVLink for the small sums a decode step makes (the default on CUDA;
`CHATENGINE_ALL_REDUCE=nccl` sums everything through NCCL).

A tensor-parallel decode step sums a (batch, hidden) activation twice a layer: 65 all-reduces of
0.1-2 MB for an 8B model. NCCL's ring costs ~17-38 us each at those sizes on two H200s (mostly its
protocol's latency, not bandwidth). Here every rank's row-parallel layer writes its partial sums
into a buffer the other ranks can address (torch's symmetric memory: peer-mapped device memory, no
NVLink multicast), and one kernel meets the others at a device-side barrier and adds all ranks'
parts: torch's one-shot kernel (each rank reads every peer's copy; ~10 us at 0.5 MB and ~19 us at
2 MB there, TP=2 1.57x TP=1 against NCCL's 1.51x) or, at two ranks, its two-shot kernel in place
(each rank adds its half of the elements and writes it to both buffers: ~8 / 13 us, TP=2 1.59-1.63x;
`in_place_kernel`). Sums of tensors made elsewhere (the embedding's) are copied in by the one-shot
kernel.

How it fails: the kernel's barrier waits on the device with no timeout, so a rank that dies in the
middle of a step leaves the others' GPUs waiting for good (NCCL's kernels are cancelled when the
engine aborts the group; here even that abort then blocks behind the stuck sum). So when a rank
dies with steps in flight, rank 0 ends its process unless they finish within ranks.STUCK_S
(plan.PlanSender.exit_if_stuck): a restart is the only way to get such a GPU back.

Only on CUDA, only for bf16 and fp32 tensors up to `max_bytes`, and only after a self-test at
start agreed with NCCL on every rank; any other case (CPU, another dtype, a bigger tensor, a torch
without these ops, a failed set-up) goes through NCCL.

One process group a process: torch keeps a group's symmetric-memory registration by its name for
the life of the process, and a later group (another engine in the same process, after the first
one's group is gone) gets the same name, whose stale registration makes the rendezvous hang. So a
process's second tensor-parallel engine sums through NCCL alone (logged); worker processes are new
for each engine. Every decision is collective: the least of the ranks' answers.
"""

from __future__ import annotations

import logging
import os
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


DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernel sums


def in_place_kernel(size: int) -> str:
    """How a sum already in the buffer (a row-parallel layer's) is made: "two-shot" (torch's
    two_shot_all_reduce_: each rank adds its share of the elements from every rank and writes the
    result to every rank's buffer, so no rank reads a whole peer copy) at two ranks, where it was
    measured (2 x H200, 16-256 rows x 4096 bf16: 7.2-13.2 us against one-shot's 7.6-19.1; TP=2 1.62x
    TP=1 against 1.60x); "one-shot" beyond, unmeasured there. CHATENGINE_IN_PLACE_SUM picks one."""
    kernel = os.environ.get("CHATENGINE_IN_PLACE_SUM") or ("two-shot" if size == 2 else "one-shot")
    if kernel not in ("one-shot", "two-shot"):
        raise ValueError(f"CHATENGINE_IN_PLACE_SUM must be one-shot or two-shot, got {kernel!r}")
    return kernel


class OneShotAllReduce:
    """The peer-addressable buffer of one process group, and the sum through it. Built in two
    halves so that every rank has its buffer before any rank enters the (collective) rendezvous."""

    def __init__(self, device: torch.device, size: int, max_bytes: int | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.two_shot = in_place_kernel(size) == "two-shot"
        for op in ("one_shot_all_reduce_copy", "two_shot_all_reduce_" if self.two_shot else "one_shot_all_reduce"):
            if not hasattr(torch.ops.symm_mem, op):
                raise RuntimeError(f"torch {torch.__version__} has no symm_mem.{op}")
        self.max_bytes = max_bytes_for(size) if max_bytes is None else max_bytes
        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op) in newer torch, needed in older
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)

    def rendezvous(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank, same point

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in DTYPES and x.is_contiguous() and nbytes <= self.max_bytes and nbytes % 4 == 0

    def buffer_for(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The start of the peer-addressable buffer as a tensor of this shape, for a layer to write
        its partial sums into (then `__call__` skips the copy), or None if such a tensor won't fit."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if dtype not in DTYPES or nbytes > self.max_bytes or nbytes % 4:
            return None
        return self.buffer[:nbytes].view(dtype).view(shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x must `fit`). x already in the buffer (`buffer_for`): summed
        where it is (`in_place_kernel`), the result there or (one-shot) a new tensor; else copied in
        by the one-shot kernel, a new tensor. The kernels' closing barriers keep the buffer unwritten
        until every rank has read it."""
        if x.data_ptr() == self.buffer.data_ptr():
            if self.two_shot:
                torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", self.group_name)
                return x
            return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", self.group_name)
        nbytes = x.numel() * x.element_size()
        symm = self.buffer[:nbytes].view(x.dtype)
        flat = torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x.reshape(-1), "sum", self.group_name)
        return flat.view(x.shape)


# set once this process has registered a group for symmetric memory (see the module's docstring)
_registered = False


def try_one_shot(device: torch.device, size: int) -> OneShotAllReduce | None:
    """The one-shot path if it can run here and sums as NCCL does, else None (NCCL only).
    Collective: every rank calls it at the same point and all get the same answer; no rank starts
    a collective its peers would not join, whatever fails where."""
    global _registered
    if device.type != "cuda" or size < 2:
        return None
    if not _everywhere(not _registered, device):
        log.warning("one-shot all-reduce: a process's second tensor-parallel group sums through NCCL alone")
        return None
    _registered = True
    one_shot = _local(lambda: OneShotAllReduce(device, size))
    if not _everywhere(one_shot is not None, device) or one_shot is None:
        return None
    joined = _local(lambda: one_shot.rendezvous() or True)  # every rank is here: a failure is its own
    if not _everywhere(joined is not None, device):
        return None
    return one_shot if _everywhere(_agrees_with_nccl(one_shot, device), device) else None


def _local(make):
    """make()'s value, or None (logged) if it raises on this rank."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - any failure means NCCL alone, never a broken engine
        log.warning("one-shot all-reduce unavailable, NCCL only: %s", e)
        return None


def _everywhere(ok: bool, device: torch.device) -> bool:
    verdict = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return int(verdict.item()) == 1


def _agrees_with_nccl(one_shot: OneShotAllReduce, device: torch.device) -> bool:
    """Both paths sum bf16 and fp32 tensors (a small one and the largest that fits) alike: to the bit
    at two ranks (one addition either way), within rounding at more; and every rank got the same.
    Every rank makes every collective of every case, whatever happens to the one-shot sum (a rank
    whose sum raised contributes zeros and says no)."""
    size, rank, ok = dist.get_world_size(), dist.get_rank(), True
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for dtype in DTYPES:
        for numel in (64 * 512, one_shot.max_bytes // torch.empty(0, dtype=dtype).element_size()):
            x = torch.randn(numel, generator=gen, device=device).to(dtype)
            want = x.clone()
            got = _local(lambda x=x: one_shot(x))
            if got is None:
                ok, got = False, torch.zeros_like(x)
            in_place = _local(lambda x=x: _sum_in_buffer(one_shot, x))  # as a row-parallel layer sums
            if in_place is None or not torch.equal(in_place, got):
                ok = False
            dist.all_reduce(want)
            same = [torch.empty_like(got) for _ in range(size)]
            dist.all_gather(same, got)
            close = torch.equal(got, want) if size == 2 else torch.allclose(got, want, rtol=1e-2, atol=1e-2)
            if not close or not all(torch.equal(s, got) for s in same):
                log.warning("one-shot all-reduce differs from NCCL (%s, %d elements): NCCL only", dtype, numel)
                ok = False
    return ok


def _sum_in_buffer(one_shot: OneShotAllReduce, x: torch.Tensor) -> torch.Tensor:
    view = one_shot.buffer_for(tuple(x.shape), x.dtype)
    assert view is not None
    view.copy_(x)
    return one_shot(view)
