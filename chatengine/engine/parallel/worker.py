"""The process of a tensor-parallel rank other than 0: it joins the group, loads its slice of the
weights, holds its slice of every KV page (and of the host tier) and runs what rank 0 sends, op by
op, until rank 0 says stop or goes away.

Its errors go back to rank 0 through the report pipe before it exits, so rank 0 can say what broke.
"""

from __future__ import annotations

import os
import signal
import traceback
from multiprocessing.connection import Connection

import torch

from chatengine.config import EngineConfig
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import ModelRunner, context_len, resolve_device_dtype
from chatengine.engine.parallel.group import TPGroup, connect_store
from chatengine.engine.parallel.plan import Op, receive


def share_cpu(size: int, device_type: str) -> int:
    """On CPU the ranks split the cores instead of each taking them all; returns the old thread count."""
    before = torch.get_num_threads()
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return before


def main(config: EngineConfig, rank: int, address: str, plans: Connection, reports: Connection) -> None:
    """Rank `rank`'s process (spawned by rank 0; `address`: its rendezvous store)."""
    # a Ctrl-C or SIGTERM to the process group is rank 0's to handle: it stops this rank through
    # the plan pipe (or its end of file) once its own streams have drained
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        reports.send(("joining",))
        device, dtype = resolve_device_dtype(config.device, config.dtype)
        size = config.tensor_parallel_size
        share_cpu(size, device.type)
        group = TPGroup.join(rank, size, connect_store(address, size), device.type)
        loaded = load_model(config.model, seed=config.seed, dtype=dtype, device=str(group.device))
        runner = ModelRunner(config, loaded, group.device, dtype, context_len(config, loaded.config), group)
        del loaded
        if not follow(runner, plans):
            os._exit(0)  # rank 0 is gone: its half of a teardown would never come
        runner.close()  # CUDA graphs hold NCCL work: gone before the communicator is
        group.leave()
    except BaseException:
        try:
            reports.send(("error", traceback.format_exc(limit=-8)))
        finally:
            os._exit(1)


def follow(runner: ModelRunner, plans: Connection) -> bool:
    """Run rank 0's ops on this rank's slices until STOP (True) or until rank 0 is gone (False)."""
    while True:
        op, args = receive(plans)
        if op == Op.STOP:
            return args != ("orphaned",)
        if op == Op.FORWARD:
            runner.follow_forward(*args)
        elif op == Op.COPY_BLOCKS:
            runner.copy_pages(*args)
        elif op == Op.SAVE_BLOCKS:
            runner.save_to_host_slice(*args)
        elif op == Op.RESTORE_BLOCKS:
            runner.restore_from_host_slice(*args)
        elif op == Op.HOST_POOL:
            runner.make_host_slice(*args)
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op!r}")
