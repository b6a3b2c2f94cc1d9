"""What an asyncio caller of the engine does on its side of the engine's thread or process, shared by
AsyncLLM and DataParallelLLM: make the request (off the event loop when it compiles a grammar) and
follow the mailbox its cumulative outputs arrive in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from chatengine.outputs import RequestOutput


async def make_request(make: Callable, prompt, params, request_id: str | None, user: str | None):
    """make(prompt, params, request_id=, user=): validated and tokenized here; a structured output
    compiles its grammar (up to seconds for a large schema) on a worker thread instead of the loop."""
    if getattr(params, "structured_outputs", None) is not None:
        return await asyncio.to_thread(make, prompt, params, request_id=request_id, user=user)
    return make(prompt, params, request_id=request_id, user=user)


class Mailbox:
    """Where one request's outputs wait for its asyncio caller: the newest only. Outputs are
    cumulative, so a caller slower than the engine needs none of the ones it has not read yet, and
    under load a stream sends fewer, longer chunks instead of falling further behind. A final item
    (a finished output, or an exception) is never replaced. `put_nowait` runs on the caller's loop
    (the engine side hands it over with call_soon_threadsafe); it wakes the caller only when the
    caller waits, where a queue paid a put, a get and a wake-up for every output."""

    def __init__(self):
        self._item: object = _EMPTY
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        held = self._item
        if held is not _EMPTY and (isinstance(held, BaseException) or held.finished):  # type: ignore[attr-defined]
            return
        self._item = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        """The newest item, once there is one (taken: the next get waits for a newer one)."""
        while self._item is _EMPTY:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._item = self._item, _EMPTY
        return item


_EMPTY = object()


async def follow(box: Mailbox, abandon: Callable[[], None]) -> AsyncGenerator[RequestOutput, None]:
    """The outputs put in `box` until a finished one; an exception put there is raised. A caller
    slower than the engine gets the newest output only (each holds everything so far). Leaving
    before the end (closing the generator) calls `abandon()`: the request is aborted."""
    finished = False
    try:
        while True:
            item = await box.get()
            if isinstance(item, Exception):
                finished = True  # refused or failed: nothing of ours to abort (the id may be another's)
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abandon()
