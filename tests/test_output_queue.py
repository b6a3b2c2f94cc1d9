"""engine/output_queue.py: following a request's mailbox of cumulative outputs."""

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from chatengine.engine.output_queue import Mailbox, follow, make_request


def out(n, finished=False):
    return SimpleNamespace(n=n, finished=finished)


def run(coro):
    return asyncio.run(coro)


def test_a_caller_that_fell_behind_takes_the_newest_output_and_the_finished_one():
    async def main():
        q = Mailbox()
        for item in (out(1), out(2), out(3), out(4, finished=True)):
            q.put_nowait(item)
        aborted = []
        got = [o.n async for o in follow(q, lambda: aborted.append(1))]
        return got, aborted

    got, aborted = run(main())
    assert got == [4] and aborted == []  # the finished output is never skipped; nothing to abort


def test_outputs_in_step_are_each_yielded():
    async def main():
        q = Mailbox()
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
        q = Mailbox()
        q.put_nowait(out(1))
        aborted = []
        async with contextlib.aclosing(follow(q, lambda: aborted.append(1))) as outputs:
            async for _ in outputs:
                break
        return aborted

    assert run(early()) == [1]

    async def failing():
        q = Mailbox()
        q.put_nowait(out(1))
        q.put_nowait(ValueError("refused"))
        aborted = []
        with pytest.raises(ValueError, match="refused"):
            async for _ in follow(q, lambda: aborted.append(1)):
                pass
        return aborted

    assert run(failing()) == []


def test_the_mailbox_keeps_the_newest_item_and_never_replaces_a_final_one():
    async def main():
        box = Mailbox()
        box.put_nowait(out(1))
        box.put_nowait(out(2))
        first = (await box.get()).n  # the newest; the older one is gone
        box.put_nowait(out(3, finished=True))
        box.put_nowait(out(4))  # nothing replaces a finished output
        second = await box.get()
        box.put_nowait(ValueError("failed"))
        box.put_nowait(out(5))  # nor an error
        third = await box.get()
        waiter = asyncio.ensure_future(box.get())  # an empty box: the caller waits for a put
        await asyncio.sleep(0)
        assert not waiter.done()
        box.put_nowait(out(6))
        return first, second.n, second.finished, type(third), (await waiter).n

    assert run(main()) == (2, 3, True, ValueError, 6)


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
