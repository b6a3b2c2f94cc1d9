"""The torch.distributed group of one tensor-parallel engine, and the collectives its model runs.

NCCL on CUDA (rank r on cuda:r), gloo on CPU. Rank 0 (the engine's process) hosts the rendezvous
store; ranks 1..N-1 connect to it. With one rank (`TPGroup.single`) no method runs a collective:
the model's layers call them unconditionally and pay nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from chatengine.engine.parallel.one_shot import OneShotAllReduce, in_place_kernel, try_one_shot

# How long one collective may wait for the other ranks (a stuck rank fails the others instead of
# hanging them). Idle ranks wait on their plan pipe, not in a collective, so idling never times out;
# the longest honest wait is a rank still loading its weights while another is done.
TIMEOUT = timedelta(seconds=float(os.environ.get("CHATENGINE_TP_TIMEOUT_S", 600)))


def no_nvlink_multicast() -> None:
    """NVLink multicast stays off in NCCL (NVLS), torch's symmetric memory and NVSHMEM: the GPU
    machines we run on require it (set before any of them starts; spawned ranks inherit it)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def all_reduce_mode() -> str:
    """CHATENGINE_ALL_REDUCE: "one-shot" (the default: small CUDA sums in one NVLink hop, one_shot.py)
    or "nccl" (every sum through NCCL's ring)."""
    mode = os.environ.get("CHATENGINE_ALL_REDUCE", "one-shot")
    if mode not in ("one-shot", "nccl"):
        raise ValueError(f"CHATENGINE_ALL_REDUCE must be one-shot or nccl, got {mode!r}")
    return mode


def host_store(size: int) -> tuple[dist.TCPStore, str]:
    """Rank 0: the rendezvous store on a free loopback port; returns (store, "host:port")."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def connect_store(address: str, size: int) -> dist.TCPStore:
    """Ranks 1..N-1: the store rank 0 hosts at `address`."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), size, is_master=False, timeout=TIMEOUT)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    # CUDA: small sums in one NVLink hop instead of NCCL's ring (None: NCCL for every sum)
    one_shot: OneShotAllReduce | None = field(default=None, repr=False)

    @classmethod
    def single(cls, device: torch.device) -> TPGroup:
        return cls(0, 1, device)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device_type: str) -> TPGroup:
        """Join the group of `size` ranks through `store` as `rank` (blocks until all have joined)."""
        no_nvlink_multicast()
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=TIMEOUT,
            device_id=device if device.type == "cuda" else None,  # NCCL: connect now, not at the first op
        )
        group = cls(rank, size, device)
        if all_reduce_mode() == "one-shot":
            in_place_kernel(size)  # a bad CHATENGINE_IN_PLACE_SUM is an error here, not NCCL alone
            group.one_shot = try_one_shot(device, size)
        return group

    def leave(self) -> None:
        """Tear the group down (NCCL: with every rank; drop CUDA graphs that hold its work first)."""
        self.one_shot = None  # its peer mappings go before the group that made them
        if self.is_parallel and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the model's collectives (no-ops on one rank) -----------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks: x itself, summed in place, or (one shot) a new tensor."""
        if self.is_parallel:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x)
        return x

    def sum_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a layer may write a tensor it will `all_reduce` next, so that the one-shot sum reads it
        in place (no copy); None: anywhere (NCCL, or too big for one shot)."""
        return self.one_shot.buffer_for(shape, dtype) if self.one_shot is not None else None

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on every rank -> (..., size * n): the ranks' pieces side by side, rank 0's first."""
        if not self.is_parallel:
            return x
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (m, n)
        parts = torch.empty((self.size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, rows)  # rank r's rows at [r * m, (r + 1) * m)
        out = parts.view(self.size, *rows.shape).permute(1, 0, 2)  # (m, size, n)
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (e.g. the KV blocks that fit: every rank's pool is the same)."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into `x` on every rank (same shape and dtype everywhere), on the device: on
        CUDA the other ranks queue it without waiting on the host."""
        if self.is_parallel:
            dist.broadcast(x, src=0)
        return x


# torch 2.13 has all_gather_single; older releases (the GPU machines') only all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
