"""What rank 0 tells ranks 1..N-1 to run: one op at a time, a small pickled tuple down a pipe to each.

A pipe rather than a collective: a rank waiting for work waits on its pipe for as long as the
engine idles (a collective would time out), it learns of rank 0's death by end-of-file, and on CUDA
it never syncs its GPU to read an op. The step's bulk (its staging buffer of index arrays) follows
as a device broadcast (see ModelRunner), so it carries the token ids that rank 0 sampled on the
device one step before.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import threading
from collections import deque
from enum import IntEnum
from multiprocessing.connection import Connection


class Op(IntEnum):
    STOP = 0
    FORWARD = 1  # (mode, key, max_seqlen_q, max_seqlen_k, T, B, S, W, Finish); the staging buffer follows
    COPY_BLOCKS = 2  # (src ids, dst ids)
    SAVE_BLOCKS = 3  # (block ids, host slots): device pages -> this rank's host pool
    RESTORE_BLOCKS = 4  # (block ids, host slots): this rank's host pool -> device pages
    HOST_POOL = 5  # (num_blocks,): allocate this rank's slices of the host tier


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed: the engine cannot go on (restart it)."""


class PlanSender:
    """Rank 0's end: sends each op to every other rank; remembers the first failure of any rank, after
    which every op fails at once with its reason instead of waiting on a rank that is gone."""

    def __init__(self, conns: list[Connection]):
        self.conns = conns  # conns[i]: rank i + 1's pipe
        self.failure: str | None = None
        self._failed = threading.Event()
        # rank 0's launched steps whose device work may not have finished (an event recorded after
        # each: CUDA), oldest first; under _lock with _exit_armed (engine thread vs watchdog)
        self._steps: deque = deque()
        self._lock = threading.Lock()
        self._exit_armed = False

    def send(self, op: Op, *args) -> None:
        self.check()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send((int(op), args))
            except OSError as e:  # BrokenPipeError: that rank's process is gone
                raise self.explain(f"tensor-parallel rank {rank} is gone ({e})") from e

    def track(self, done) -> None:
        """A launched step's device work ends at `done` (an event: .query() says if it has)."""
        with self._lock:
            self._steps.append(done)
            self._prune()

    def collected(self) -> None:
        """Rank 0 waited for a step: once no step's device work is left unfinished, a failure's exit
        timer (`exit_if_stuck`) is called off."""
        with self._lock:
            self._prune()
            if self._exit_armed and not self._steps:
                faulthandler.cancel_dump_traceback_later()
                self._exit_armed = False

    def exit_if_stuck(self, seconds: float) -> bool:
        """After a rank died: if a step's device work is unfinished, end the process unless it all
        finishes and is collected within `seconds` -- faulthandler's timer, a C thread that fires
        whatever the stuck threads hold (every thread's traceback on fd 2, then exit code 1). One
        timer a process: it replaces any other armed with dump_traceback_later. For device waits
        nothing can cancel (one_shot.py)."""
        with self._lock:
            self._prune()
            if not self._steps:
                return False
            try:
                faulthandler.dump_traceback_later(seconds, exit=True, file=2)
            except (RuntimeError, ValueError, OSError) as e:  # no fd 2: the abort still runs
                logging.getLogger("chatengine.tp").error("cannot arm the exit timer: %s", e)
                return False
            self._exit_armed = True
            return True

    def _prune(self) -> None:
        while self._steps and self._steps[0].query():  # one stream: they finish in order
            self._steps.popleft()

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def fail(self, reason: str) -> TensorParallelError:
        """Record a rank's failure (the first reason wins); the error to raise."""
        if self.failure is None:
            self.failure = reason
            self._failed.set()
        return TensorParallelError(self.failure)

    def explain(self, fallback: str, wait_s: float = 5.0) -> TensorParallelError:
        """The error for a failure seen here first (a broken pipe, a collective's error): the
        watchdog's reason (which rank, its exit code and error) once it has it, else `fallback`."""
        self._failed.wait(wait_s)
        return self.fail(fallback)

    @contextlib.contextmanager
    def guard(self):
        """Around rank 0's collectives: one that fails because another rank died (gloo: the peer
        closed the connection) raises a TensorParallelError that says which rank and why."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as e:
            raise self.explain(f"a tensor-parallel collective failed: {e}") from e
        self.check()  # NCCL: the watchdog aborted the group under a step that then "finished"

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def receive(conn: Connection) -> tuple[Op, tuple]:
    """Ranks 1..N-1: the next op (blocks while the engine idles). Rank 0 gone (end of file): STOP."""
    try:
        op, args = conn.recv()
    except (EOFError, OSError):
        return Op.STOP, ("orphaned",)
    return Op(op), args
