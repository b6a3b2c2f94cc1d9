"""engine/output_queue.py: following a request's queue of cumulative outputs."""

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from chatengine.engine.output_queue import follow, make_request


def out(n, finished=False):
    return SimpleNamespace(n=n, finished=finished)


def run(coro):
    return asyncio.run(coro)


def test_a_caller_that_fell_behind_takes_the_newest_output_and_the_finished_one():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for item in (out(1), out(2), out(3), out(4, finished=True)):
            q.put_nowait(item)
        aborted = []
        got = [o.n async for o in follow(q, lambda: aborted.append(1))]
        return got, aborted

    got, aborted = run(main())
    assert got == [4] and aborted == []  # the finished output is never skipped; nothing to abort


def test_outputs_in_step_are_each_yielded():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        got = []
        async with contextlib.aclosing(follow(q, lambda: None)) as outputs:
            q.put_nowait(out(1))
            async for o in outputs:
                got.append(o.n)
                if o.n < 3:
                    q.put_nowait(out(o.n + 1, finished=o.n + 1 == 3))
        return got

    assert run(main()) == [1, 2, 3]


def test_leaving_early_aborts_and_an_error_is_raised_without_abort():
    async def early():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(out(1))
        aborted = []
        async with contextlib.aclosing(follow(q, lambda: aborted.append(1))) as outputs:
            async for _ in outputs:
                break
        return aborted

    assert run(early()) == [1]

    async def failing():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(out(1))
        q.put_nowait(ValueError("refused"))
        aborted = []
        with pytest.raises(ValueError, match="refused"):
            async for _ in follow(q, lambda: aborted.append(1)):
                pass
        return aborted

    assert run(failing()) == []


def test_make_request_compiles_grammars_off_the_event_loop():
    import threading

    seen = []

    def make(prompt, params, request_id=None, user=None):
        seen.append((threading.current_thread() is threading.main_thread(), prompt, request_id, user))
        return "req"

    plain = SimpleNamespace(structured_outputs=None)
    grammar = SimpleNamespace(structured_outputs=object())
    assert run(make_request(make, "hi", plain, "r1", "u")) == "req"
    assert run(make_request(make, "hi", grammar, "r2", None)) == "req"
    assert seen == [(True, "hi", "r1", "u"), (False, "hi", "r2", None)]
