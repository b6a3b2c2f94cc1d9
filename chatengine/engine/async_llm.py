"""AsyncLLM: the engine on a background thread, streaming to many asyncio callers at once."""

import asyncio
import contextlib
import logging
import threading
import time

from chatengine.engine.engine_loop import EngineLoop
from chatengine.engine.facade import EngineFacade
from chatengine.engine.output_queue import Mailbox, follow, make_request
from chatengine.outputs import RequestOutput

log = logging.getLogger("chatengine")


class AsyncLLM(EngineFacade, EngineLoop):
    """The engine on a background thread; many asyncio callers stream from it at once.

    Callers validate in their own thread (ValueError raised at once), then hand the request to the
    engine thread through an inbox; outputs come back through per-request mailboxes (the newest cumulative output).
    """

    def __init__(self, model: str | None = None, **kwargs):
        EngineFacade.__init__(self, model, **kwargs)
        EngineLoop.__init__(self, self.engine)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, Mailbox]] = {}
        self._stopped = False
        self._stats, self._stats_time = self.engine.stats(), time.monotonic()
        self._thread = threading.Thread(target=self.run, name="chatengine-loop", daemon=True)
        self._thread.start()

    async def generate(self, prompt, sampling_params=None, *, request_id: str | None = None, user: str | None = None):
        """Yield cumulative RequestOutputs until finished. Closing the generator aborts the request.
        A caller slower than the engine gets the newest output only (each holds everything so far):
        under load a stream sends fewer, longer chunks instead of falling further behind."""
        req = await make_request(self.engine.make_request, prompt, sampling_params, request_id, user)
        if not self.is_running:  # shut down, or its thread died: nobody would ever answer
            raise RuntimeError("the engine has shut down" if self._stopped else "the engine's thread has stopped")
        queue = Mailbox()
        self.post(("add", req, (asyncio.get_running_loop(), queue)))
        async with contextlib.aclosing(follow(queue, lambda: self.post(("abort", req.request_id)))) as outputs:
            async for item in outputs:
                yield item

    async def chat(self, messages, sampling_params=None, *, request_id=None, user=None):
        ids = self.apply_chat_template(messages)
        generation = self.generate(ids, sampling_params, request_id=request_id, user=user)
        async with contextlib.aclosing(generation) as outputs:  # closing chat aborts at once
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        self.post(("abort", request_id))

    @property
    def is_running(self) -> bool:
        """True while the engine loop is alive and accepting requests."""
        return not self._stopped and self._thread.is_alive()

    def stats(self) -> dict:
        """A snapshot the engine thread publishes (at most every 0.2 s): safe from any thread."""
        return dict(self._stats)

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= 0.2:
            self._stats, self._stats_time = self.engine.stats(), now

    def forget_user(self, user: str) -> None:
        self.front.check_forget(user)  # here: on the engine's thread a ValueError reaches no caller
        self.post(("forget", user))

    def forget_prompts(self, user: str, prompts: list[list[int]]) -> None:
        """Drop the user's private KV pages of these token sequences (a deleted conversation's
        branches) from every tier, on the engine's thread, soon."""
        self.post(("forget_prompts", user, self.front.check_forget_prompts(user, prompts)))

    def _drop_public_prefix(self, prefix_ids: list[int]) -> None:
        # the block manager belongs to the engine thread; the persona itself is unregistered already
        self.post(("drop_public_prefix", list(prefix_ids)))

    def shutdown(self) -> None:
        """Abort what runs, stop the loop and flush the KV cache to the disk store (if any)."""
        if self._stopped:
            return
        self._stopped = True
        self.post(("stop",))
        self._thread.join(timeout=60)
        self.engine.close()

    def _deliver_many(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Hand outputs to their callers' queues with one wake-up per event loop, not one per
        output: each wake-up is a syscall, and a step streams to up to max_num_seqs callers."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}  # loop -> [(request_id, queue, out)]
        for request_id, out in items:
            target = self._queues.get(request_id)
            if target is None:
                continue
            loop, queue = target
            if isinstance(out, Exception) or out.finished:
                del self._queues[request_id]
            batches.setdefault(loop, []).append((request_id, queue, out))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop has closed: nobody is listening any more
                for request_id, _, out in batch:
                    if not isinstance(out, Exception) and not out.finished:
                        self.engine.abort(request_id)
                    self._queues.pop(request_id, None)  # its id may run again

    def _accept(self, req, target) -> bool:
        loop, queue = target
        if req.request_id in self._queues:  # a duplicate id must not take over the running stream
            try:
                loop.call_soon_threadsafe(
                    queue.put_nowait, ValueError(f"request id {req.request_id!r} is already running")
                )
            except RuntimeError:  # that caller's loop has closed
                pass
            return False
        self._queues[req.request_id] = target
        return True


def _put_all(batch: list[tuple[str, Mailbox, object]]) -> None:
    """Runs on a caller's event loop: one step's outputs for the requests of that loop, in order."""
    for _, queue, out in batch:
        queue.put_nowait(out)
