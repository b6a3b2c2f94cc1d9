"""EngineLoop: the thread that owns an LLMEngine. Callers post work to its inbox; it steps the
engine while anything runs and hands each step's outputs back.

AsyncLLM runs one on a thread of the caller's process (outputs go to asyncio queues); a
data-parallel replica runs one as its process's main loop (outputs go down a pipe). The engine,
its scheduler and its block manager are touched by this thread only.
"""

import logging
import threading
from collections import deque

from chatengine.engine.llm_engine import LLMEngine
from chatengine.engine.request import Request
from chatengine.outputs import RequestOutput

log = logging.getLogger("chatengine")

# inbox items: ("add", Request, target) | ("abort", request_id) | ("forget", user)
#   | ("forget_prompts", user, prompts) | ("drop_public_prefix", ids) | ("stop",) | a subclass's own
Delivery = list[tuple[str, RequestOutput | Exception]]


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._ended = False  # the loop took its stop: a request posted now would wait forever

    def post(self, item: tuple) -> None:
        """Hand an item to the loop. RuntimeError for a request once the loop has stopped."""
        with self._wake:
            if self._ended and item[0] == "add":
                raise RuntimeError("the engine has shut down")
            self._inbox.append(item)
            self._wake.notify()

    # ---- what a host of the loop decides ------------------------------------------------------------
    def _accept(self, req: Request, target) -> bool:
        """Before an added request reaches the engine: False drops it (the host has answered it)."""
        return True

    def _deliver_many(self, items: Delivery) -> None:
        """Hand one step's outputs (or a refused request's ValueError) to their callers."""
        raise NotImplementedError

    def _publish_stats(self, force: bool = False) -> None:
        """The engine's figures changed (force: the engine is at rest, the picture is exact)."""

    def _handle(self, item: tuple) -> None:
        """An inbox item of the host's own kind."""
        raise ValueError(f"unknown engine loop item {item[0]!r}")

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        """Until a ("stop",) item: wait for work, take the inbox, step, deliver."""
        engine = self.engine
        while True:
            inbox = self._wait_for_work()
            while inbox:
                item = inbox.popleft()
                if item[0] == "stop":
                    self._abort_all()
                    self._end(inbox)
                    return
                self._take(item)
            try:
                outputs = engine.step()
            except Exception as e:  # a bug outside the forward: fail everything in flight, keep serving
                log.exception("engine step failed")
                outputs = engine._fail(set(engine.requests), f"{type(e).__name__}: {e}")
            self._deliver_many([(out.request_id, out) for out in outputs])
            self._publish_stats()

    def _wait_for_work(self) -> deque:
        """The inbox, once there is something to do; idle pages move out meanwhile."""
        engine = self.engine
        idle_s = engine.config.idle_offload_s
        if not self._inbox and not engine.has_unfinished_requests():
            self._publish_stats(force=True)  # the picture at rest is exact
        with self._wake:
            while not self._inbox and not engine.has_unfinished_requests():
                if not self._wake.wait(timeout=idle_s) and idle_s is not None:
                    if engine.offload_cached_blocks(idle_for_s=idle_s):  # idle conversations move out
                        self._publish_stats(force=True)
            inbox, self._inbox = self._inbox, deque()
        return inbox

    def _take(self, item: tuple) -> None:
        """One inbox item. Whatever it raises stays here: the loop serves every other caller on."""
        if item[0] == "add":
            _, req, target = item
            if not self._accept(req, target):
                return
            try:
                self.engine.add(req)
            except Exception as e:  # a ValueError is the caller's to read; anything else a bug too
                if not isinstance(e, ValueError):
                    log.exception("adding request %s failed", req.request_id)
                self._deliver_many([(req.request_id, e)])
            return
        try:
            self._take_other(item)
        except Exception:
            log.exception("engine loop item %r failed", item[0])

    def _take_other(self, item: tuple) -> None:
        engine, kind = self.engine, item[0]
        if kind == "abort":
            out = engine.abort(item[1])
            if out is not None:
                self._deliver_many([(item[1], out)])
        elif kind == "forget":
            engine.forget_user(item[1])
        elif kind == "forget_prompts":
            engine.forget_prompts(item[1], item[2])
        elif kind == "drop_public_prefix":
            engine.drop_public_prefix(item[1])
        else:
            self._handle(item)

    def _end(self, after_stop: deque) -> None:
        """No request is taken from now on: those posted behind the stop are refused."""
        with self._wake:
            self._ended = True
            after_stop += self._inbox
            self._inbox.clear()
        for item in after_stop:
            if item[0] == "add" and self._accept(item[1], item[2]):
                self._deliver_many([(item[1].request_id, RuntimeError("the engine has shut down"))])

    def _abort_all(self) -> None:
        outputs = [self.engine.abort(request_id) for request_id in list(self.engine.requests)]
        self._deliver_many([(out.request_id, out) for out in outputs if out is not None])
