"""Ranks 1..N-1 as rank 0 (the engine's process) sees them: it spawns their processes, joins the
group with them, sends them ops through `plan`, watches for a rank that dies, and stops them.

A rank that dies is reported at once with its exit code and its error (a watchdog thread waits on
the processes): the next op, or the collective that was waiting on it, raises TensorParallelError
instead of hanging. On CUDA the watchdog also aborts the NCCL group, since NCCL would wait for the
dead rank until its timeout. With the one-shot sums on, a step in flight may instead be stuck in a
sum that waits on the device for the dead rank, which nothing cancels: unless every launched
step's device work finishes and is collected within STUCK_S, the process ends (exit code 1, every
thread's traceback on stderr after the reason), as torch's NCCL watchdog ends a process whose
collective timed out.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from chatengine.config import EngineConfig
from chatengine.engine.parallel import worker
from chatengine.engine.parallel.group import TPGroup, all_reduce_mode, host_store, no_nvlink_multicast
from chatengine.engine.parallel.plan import Op, PlanSender, TensorParallelError

log = logging.getLogger("chatengine.tp")
START_TIMEOUT_S = 120.0  # for a spawned rank to import torch and reach the rendezvous
STUCK_S = 30.0  # one-shot sums, a rank dead: how long rank 0's steps in flight may take to finish


class WorkerRanks:
    def __init__(self, config: EngineConfig, device: torch.device):
        """Start ranks 1..N-1 and join the group as rank 0 (N = config.tensor_parallel_size)."""
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            have = torch.cuda.device_count()
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has {have}")
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("one tensor-parallel engine per process: shut the other one down first")
        all_reduce_mode()  # a bad CHATENGINE_ALL_REDUCE fails here, before any rank starts
        no_nvlink_multicast()  # before the spawn: the ranks inherit it
        self.device, self.stopping = device, False
        self.threads_before = worker.share_cpu(size, device.type)
        store, address = host_store(size)
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or torch's threads
        self.procs: list = []
        self.reports: list[Connection] = []
        plans = []
        try:
            for rank in range(1, size):
                plan_out, plan_in = ctx.Pipe(duplex=False)
                report_out, report_in = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=worker.main,
                    args=(config, rank, address, plan_out, report_in),
                    name=f"chatengine-tp{rank}",
                    daemon=True,  # the interpreter's exit takes them along
                )
                p.start()
                plan_out.close()  # theirs now: end-of-file when they exit
                report_in.close()
                self.procs.append(p)
                self.reports.append(report_out)
                plans.append(plan_in)
            self.plan = PlanSender(plans)
            self._await_joining()
            self.group = TPGroup.join(0, size, store, device.type)
        except BaseException:
            self._kill()
            torch.set_num_threads(self.threads_before)
            raise
        self._watchdog = threading.Thread(target=self._watch, name="chatengine-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _await_joining(self) -> None:
        """Wait until every rank reaches the rendezvous; one that dies before says why at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (p, report) in enumerate(zip(self.procs, self.reports), 1):
            while not report.poll(0.1):
                if not p.is_alive() or time.monotonic() > deadline:
                    raise TensorParallelError(self._why(rank, "did not start"))
            try:
                message = report.recv()
            except EOFError:  # it exited without a word (e.g. killed, or its interpreter failed to start)
                raise TensorParallelError(self._why(rank, "did not start")) from None
            if message[0] != "joining":
                raise TensorParallelError(self._why(rank, "failed at start", message))

    def _why(self, rank: int, what: str, message=None) -> str:
        """'tensor-parallel rank r <what> (exit code c): <its last error lines>'."""
        p, report = self.procs[rank - 1], self.reports[rank - 1]
        deadline = time.monotonic() + 2.0
        p.join(1.0)
        # another thread joining it at the same moment may reap it first: its exit code lands on
        # the shared handle a moment later
        while p.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            while message is None and report.poll(0.5):
                message = report.recv()
        except (EOFError, OSError):
            pass
        error = message[1].strip().splitlines()[-1] if message and message[0] == "error" else "no error reported"
        return f"tensor-parallel rank {rank} {what} (exit code {p.exitcode}): {error}"

    def _watch(self) -> None:
        """Until stop: a rank's exit fails the engine with its reason (and aborts NCCL's waits)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        while sentinels:
            for s in wait(list(sentinels)):
                rank = sentinels.pop(s)
                if self.stopping:
                    continue
                reason = self._why(rank, "died")
                log.error("%s; the engine cannot go on: restart it", reason)
                self.plan.fail(reason)
                if self.device.type == "cuda":
                    # before the abort, which can itself block behind a step stuck in a one-shot sum
                    if self.group.one_shot is not None and self.plan.exit_if_stuck(STUCK_S):
                        log.error(
                            "a step is unfinished and one-shot sums wait on the device: unless it finishes "
                            "within %.0f s, this process ends (exit code 1)",
                            STUCK_S,
                        )
                    self._abort()

    def _abort(self) -> None:
        """Make rank 0's NCCL waits on a dead rank fail now instead of at the timeout."""
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if abort is not None and dist.is_initialized():
                abort()
        except Exception:
            log.exception("could not abort the NCCL group")

    def stop(self, runner=None, timeout: float = 30.0) -> None:
        """Tell the ranks to stop, tear the group down with them, wait for their processes.
        `runner`: rank 0's, whose CUDA graphs go before the NCCL communicator does."""
        self.stopping = True
        healthy = self.plan.failure is None
        try:
            if healthy:  # (its synchronize could wait forever on a step stuck on a dead rank)
                if runner is not None:
                    runner.close()
                self.plan.send(Op.STOP)
                self.group.leave()  # NCCL: with every rank
        except Exception:
            log.exception("the tensor-parallel ranks did not stop cleanly")
        finally:
            deadline = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            self._kill()
            if self.device.type != "cuda":
                self.group.leave()  # if not left yet: gloo's teardown is local (NCCL's waits for every rank)
            torch.set_num_threads(self.threads_before)

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for conn in self.reports:
            conn.close()
        if hasattr(self, "plan"):
            self.plan.close()
