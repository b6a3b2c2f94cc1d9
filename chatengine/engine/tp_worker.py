"""The processes of tensor-parallel ranks 1..N-1: each loads its slice of the weights, holds its slice
of the KV pages, and runs what rank 0 (the engine's process) tells it, step by step.

`start_ranks` is rank 0's side: it spawns the workers, joins the group with them and returns the
group; `stop_ranks` tells them to exit and waits for them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import torch

from chatengine.config import EngineConfig
from chatengine.engine.distributed import Op, TPGroup, free_address
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import ModelRunner, resolve_device_dtype

log = logging.getLogger("chatengine.tp")


def start_ranks(config: EngineConfig) -> tuple[TPGroup, list]:
    """Spawn ranks 1..N-1 and join the group as rank 0. Returns (rank 0's group, the processes)."""
    size = config.tensor_parallel_size
    device, _ = resolve_device_dtype(config.device, config.dtype)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has {torch.cuda.device_count()}")
    address = free_address()
    spawn = mp.get_context("spawn")  # never fork a process that has CUDA or torch threads
    procs = [spawn.Process(target=_run, args=(config, rank, address), daemon=True) for rank in range(1, size)]
    for p in procs:
        p.start()
    _share_cpu(size, device.type)
    try:
        group = TPGroup.join(0, size, address, device.type)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return group, procs


def stop_ranks(group: TPGroup, procs: list, timeout: float = 30.0) -> None:
    try:
        group.send_op(Op.STOP)
    except Exception:  # a rank that died already: the others still get killed below
        log.exception("could not tell the tensor-parallel ranks to stop")
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    group.leave()


def _share_cpu(size: int, device_type: str) -> None:
    """On CPU the ranks split the cores between them instead of each taking them all."""
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _run(config: EngineConfig, rank: int, address: str) -> None:
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    _share_cpu(config.tensor_parallel_size, device.type)
    group = TPGroup.join(rank, config.tensor_parallel_size, address, device.type)
    try:
        loaded = load_model(config.model, seed=config.seed, dtype=dtype, device=str(group.device))
        runner = ModelRunner(config, loaded, group.device, dtype, max_model_len_of(config, loaded.config), group)
        del loaded
        follow(runner)
    finally:
        group.leave()


def max_model_len_of(config: EngineConfig, mc) -> int:
    """The context every rank sizes for: the setting, or the model's capped at 8192."""
    return config.max_model_len or min(mc.max_position_embeddings, 8192)


def follow(runner: ModelRunner) -> None:
    """Run rank 0's ops on this rank's slices until it says stop."""
    while True:
        op, *args = runner.group.recv_op()
        if op == Op.STOP:
            return
        if op == Op.FORWARD:
            runner.follow_forward(*args[:8])
        elif op == Op.COPY_BLOCKS:
            runner.follow_copy_blocks(args[0])
        elif op in (Op.SAVE_BLOCKS, Op.RESTORE_BLOCKS):
            runner.follow_copy(op, args[0])
        elif op == Op.HOST_POOL:
            runner.follow_host_pool(args[0])
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")
