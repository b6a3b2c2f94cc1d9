"""What an asyncio caller of the engine does on its side of the engine's thread or process, shared by
AsyncLLM and DataParallelLLM: make the request (off the event loop when it compiles a grammar) and
follow the queue its cumulative outputs arrive on."""

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


async def follow(queue: asyncio.Queue, abandon: Callable[[], None]) -> AsyncGenerator[RequestOutput, None]:
    """The outputs put on `queue` until a finished one; an exception put there is raised. A caller
    slower than the engine gets the newest output only (each holds everything so far): under load a
    stream sends fewer, longer chunks instead of falling further behind. Leaving before the end
    (closing the generator) calls `abandon()`: the request is aborted."""
    finished = False
    try:
        while True:
            item = await queue.get()
            while not queue.empty() and not isinstance(item, Exception) and not item.finished:
                item = queue.get_nowait()
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
