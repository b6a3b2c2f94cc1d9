"""The ranks of one tensor-parallel engine: a torch.distributed group (NCCL on CUDA, gloo on CPU).

Rank 0 is the engine's own process: it owns the scheduler and the block manager and tells the other
ranks what to run, one `Op` at a time (a small int64 header, then its tensors, by broadcast from
rank 0). Every rank holds its slice of the same KV pages (its share of the KV heads), so a block id
means the same page on every rank, and prefix caching and copy-on-write need no change.

With one rank nothing here runs a collective: `TPGroup.single()` is a no-op group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = 10  # int64 fields of an op's header: the op code and its arguments
TIMEOUT = timedelta(minutes=10)  # a rank that stops answering fails the others instead of hanging them


class Op:
    STOP, FORWARD, COPY_BLOCKS, SAVE_BLOCKS, RESTORE_BLOCKS, HOST_POOL = range(6)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def single(cls, device: torch.device) -> TPGroup:
        return cls(0, 1, device)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    # ---- set-up -----------------------------------------------------------------------------------
    @classmethod
    def join(cls, rank: int, size: int, address: str, device_type: str) -> TPGroup:
        """Join the group of `size` ranks at `address` ("host:port") as `rank`."""
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (the machines require it)
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=size,
            timeout=TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        return cls(rank, size, device)

    def leave(self) -> None:
        if self.is_parallel and dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives of the model (no-ops on one rank) ---------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_parallel:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on every rank -> (..., size * n), rank 0's slice first."""
        if not self.is_parallel:
            return x
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (m, n)
        parts = torch.empty((self.size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, rows)  # rank r's rows at [r * m, (r + 1) * m)
        out = parts.view(self.size, *rows.shape).permute(1, 0, 2)  # (m, size, n)
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (e.g. KV blocks that fit: the pool must match)."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- rank 0 tells the others what to run ------------------------------------------------------
    def send_op(self, op: int, *args: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1 : 1 + len(args)] = op, torch.tensor(args, dtype=torch.int64)
        dist.broadcast(header.to(self.device), src=0)

    def recv_op(self) -> list[int]:
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        return header.tolist()

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast `x` from rank 0 into `x` on every other rank (same shape and dtype there)."""
        dist.broadcast(x, src=0)
        return x

    def share_ints(self, values: list[int] | None, n: int) -> list[int]:
        """A list of n ints from rank 0 (None on the other ranks)."""
        t = (
            torch.tensor(values, dtype=torch.int64, device=self.device)
            if self.rank == 0
            else torch.empty(n, dtype=torch.int64, device=self.device)
        )
        dist.broadcast(t, src=0)
        return values if values is not None else t.tolist()


# torch 2.13 renamed all_gather_into_tensor; the GPU machines run 2.11
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def free_address() -> str:
    """A loopback address with a free port for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
