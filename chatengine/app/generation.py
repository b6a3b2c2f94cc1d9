"""Generation: one reply being generated on the server, owned by no tab.

Its task runs the engine request and writes the reply to the store as it goes. It ends only at the
reply's own end (end of turn, max tokens, the context), at Stop, at an engine error or when the
server shuts down. Any number of followers (tabs or clients of its user) watch its latest snapshot:
a follower that leaves (a tab that reloads, closes or opens another chat) only stops watching, and a
follower that comes later starts from where the reply is.

    gen.start()                       # on the server's event loop; once (later calls do nothing)
    async for update in gen: ...      # ReplyUpdates (cumulative) from where it is to the end
    await gen.changed(seen, timeout)  # until gen.version moves past `seen` (or a wake, or timeout)
    gen.wake()                        # from any thread: followers look again (one may have left)

Updates are coalesced: a slow follower skips to the latest snapshot instead of queueing every token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

__all__ = ["Generation"]


class Generation:
    def __init__(self, request_id: str, update: Any, run: Callable[[Generation], Coroutine[Any, Any, None]]):
        """update: the ReplyUpdate that ``run(self)`` keeps current and publishes; run: the coroutine
        function that generates (it calls ``publish`` on every change and ``end`` once, last)."""
        self.request_id = request_id
        self.update = update
        self.version = 0  # 0: nothing published yet (the reply rows are not written)
        self.stop_requested = False
        self.finished = False  # set by end(), after the reply's final state is stored
        self.created = time.monotonic()
        self.task: asyncio.Task | None = None
        self._run = run
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # replaced at every wake: one Event per round of followers
        self.done = asyncio.Event()

    # ---- the generating side ------------------------------------------------------------------
    def start(self) -> None:
        """Run the generation as a task of the running loop; it outlives whoever started it."""
        if self.task is None:
            self._loop = asyncio.get_running_loop()
            self.task = self._loop.create_task(self._run(self), name=f"generation {self.request_id}")

    def publish(self) -> None:
        """The update changed (call on the loop): every follower takes the new snapshot."""
        self.version += 1
        self._wake()

    def end(self) -> None:
        """The final state is stored (call on the loop, last): followers get it and stop."""
        self.finished = True
        self.publish()
        self.done.set()

    # ---- the following side -------------------------------------------------------------------
    def snapshot(self):
        """A copy of the update, safe to keep while the generation goes on; "streaming" until the
        final state is stored."""
        up = self.update
        return dataclasses.replace(
            up,
            message_ids=list(up.message_ids),
            texts=list(up.texts),
            num_tokens=list(up.num_tokens),
            finish_reasons=list(up.finish_reasons),
            stats=[dict(st) for st in up.stats],
            status=up.status if self.finished else "streaming",
        )

    async def changed(self, seen: int, timeout: float | None = None) -> None:
        """Return once ``version`` differs from ``seen``, at a wake, or after ``timeout`` seconds."""
        if self.version != seen:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def wake(self) -> None:
        """Wake the followers without a change, from any thread (a tab left this chat)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def __aiter__(self) -> AsyncIterator:
        return self.follow()

    async def follow(self) -> AsyncIterator:
        """Snapshots from the latest to the final one; starts the generation if nobody has."""
        self.start()
        seen = 0
        while True:
            if self.version != seen:
                seen = self.version
                yield self.snapshot()
            if self.finished and self.version == seen:
                return
            await self.changed(seen)
