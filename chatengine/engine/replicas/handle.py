"""ReplicaHandle: a replica's process as the API process sees it: started, sent to, listened to
(on a thread of its own), stopped. What arrives goes to the callbacks the owner gives.

Messages go out through a sender thread: a pipe holds ~64 KB, a chat turn's prompt ids ~10 KB, and
a replica whose engine keeps its GIL busy reads them only now and then, so a send from the event
loop could block every stream of the API process until the replica reads. A message is pickled
by the caller (a value that does not pickle fails there) and queued; the thread writes it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from chatengine.engine.replicas import replica
from chatengine.engine.replicas.replica import ReplicaSpec

log = logging.getLogger("chatengine.replicas")
START_TIMEOUT_S = float(600)  # loading a large model's weights from a slow disk


class ReplicaError(RuntimeError):
    """A replica failed to start or died."""


class ReplicaHandle:
    def __init__(self, spec: ReplicaSpec):
        """Spawn the replica's process (its engine loads meanwhile: see wait_ready)."""
        self.index = spec.index
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or torch's threads
        self.conn, child = ctx.Pipe(duplex=True)
        # not a daemon: a tensor-parallel replica starts processes of its own; it stops when
        # its pipe closes (this process gone) and shutdown() waits for it
        self.process = ctx.Process(target=replica.main, args=(spec, child), name=f"chatengine-replica{spec.index}")
        self.process.start()
        child.close()  # the replica's now: end of file here when it exits
        self.facts: dict = {}
        self.stats: dict = {}
        self.alive = True
        self._start_sender()

    def _start_sender(self) -> None:
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # pickled messages; None: stop
        self._sender = threading.Thread(target=self._send_all, name=f"chatengine-replica{self.index}-in", daemon=True)
        self._sender.start()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict:
        """Block until the replica's engine is up; its facts (num_blocks, model_id, stats)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.kill()
                raise ReplicaError(f"replica {self.index} did not start (exit code {self.process.exitcode})")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            message = ("error", "it exited without a word")
        if message[0] != "ready":
            self.kill()
            raise ReplicaError(f"replica {self.index} failed at start: {_last_line(message)}")
        self.facts = message[1]
        self.stats = self.facts["stats"]  # the figures at start, until the replica publishes its own
        return self.facts

    def listen(self, on_out: Callable, on_exit: Callable[[int, str], None]) -> None:
        """Start the listener thread: on_out(index, deltas, refused) for each step's outputs;
        on_exit(index, reason) once, when the replica has gone (reason "" after a clean stop)."""
        threading.Thread(
            target=self._listen, args=(on_out, on_exit), name=f"chatengine-replica{self.index}-out", daemon=True
        ).start()

    def _listen(self, on_out: Callable, on_exit: Callable[[int, str], None]) -> None:
        reason = ""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(5.0)
                reason = f"replica {self.index} died (exit code {self.process.exitcode})"
                break
            kind = message[0]
            if kind == "out":
                try:
                    on_out(self.index, message[1], message[2])
                except Exception:  # a bug there must not silence this replica for good
                    log.exception("replica %d: its outputs could not be delivered", self.index)
            elif kind == "stats":
                self.stats = message[1]
            elif kind == "stopped":
                break
            elif kind == "error":
                reason = f"replica {self.index} failed: {_last_line(message)}"
                break
        self.alive = False
        if reason:
            log.error("%s; its requests failed, the other replicas serve on", reason)
        on_exit(self.index, reason)

    def send(self, message: tuple) -> bool:
        """Queue a message for the replica, pickled here; never blocks on the pipe. False if the
        replica is gone (its listener reports why, and fails what it was running)."""
        if not self.alive:
            return False
        self._outbox.put(bytes(ForkingPickler.dumps(message)))
        return True

    def _send_all(self) -> None:
        """The sender thread: the queued messages in order, until stopped or the pipe breaks."""
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the replica is gone: nothing more is queued; the listener says why
                self.alive = False
                return

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the replica to stop (it aborts what runs and flushes its KV store); wait for it."""
        self.send(("stop",))
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        self._outbox.put(None)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


def _last_line(message: tuple) -> str:
    text = message[1] if len(message) > 1 and isinstance(message[1], str) else repr(message)
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no error reported"
