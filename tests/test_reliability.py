"""Reliability (RELIABILITY.md): faults survived, abort storms, KV pool exhaustion, a
full or foreign KV store, SIGKILL of the real server, and bad inputs through the engine, the API and
the chat service. Every engine here runs the invariant checker after every step (debug_checks),
and every test ends with no request left and no KV block in use.

Most engine tests use `dummy:tiny` with its weights re-drawn larger ("sharp"): the stock tiny model
mostly repeats its last token, which would hide corrupted KV; the sharp one's greedy output depends
on the whole context, so "equal to an unpressured run" is a real KV-corruption oracle.
"""

import asyncio
import errno
import json
import logging
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from chatengine import LLM, AsyncLLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
BS = 16  # block size everywhere here


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on 2 shared cores, torch's spinning OpenMP pool makes tiny models ~10x
    slower when another process is busy (measured: 0.08 s vs 1.4 s for the same batch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- helpers ----------------------------------------------------------------------------------------
def sharpen(engine, seed: int = 7) -> None:
    """Re-draw the tiny model's matrices with a large std, deterministically (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.runner.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[1] ** 0.5)


def sharp_tiny(**kw) -> LLM:
    kw.setdefault("cpu_offload_gib", 0.01)
    llm = LLM("dummy:tiny", debug_checks=True, **kw)
    sharpen(llm.engine)
    return llm


def make_prompts(n: int, seed: int, min_tail: int = 3, max_tail: int = 30) -> list[list[int]]:
    """Token-id prompts: 3 shared 37-token "persona" prefixes plus a private tail each."""
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(37)] for _ in range(3)]
    return [heads[i % 3] + [rng.randrange(256) for _ in range(rng.randint(min_tail, max_tail))] for i in range(n)]


def reference(prompts, max_tokens: int) -> list[list[int]]:
    """Greedy outputs of an unpressured engine without prefix caching (the oracle)."""
    ref = sharp_tiny(num_kv_blocks=2048, max_num_batched_tokens=8192, enable_prefix_caching=False)
    outs = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_drained(engine) -> None:
    """No request, no sequence, no used block, invariants hold (I1-I3, I5, I9)."""
    assert not engine.requests, f"requests left: {list(engine.requests)[:5]}"
    stats = engine.stats()
    assert (stats["kv_blocks_used"], stats["num_running"], stats["num_waiting"]) == (0, 0, 0), stats
    assert not engine.block_manager.pending_restores and not engine.block_manager.pending_evictions
    assert engine.scheduler.num_reserved == 0, "places kept for forks that never came"
    if engine.tiers is not None and engine.tiers.host is not None:
        assert engine.tiers.host.pinned == {}, "host pages left pinned"
    engine.check_invariants()


def wait_drained(async_engine, timeout: float = 10.0) -> None:
    engine = async_engine.engine
    deadline = time.monotonic() + timeout
    while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.monotonic() < deadline, f"not drained: {list(engine.requests)[:5]}"
        time.sleep(0.02)
    assert_drained(engine)


class FailOn:
    """Wraps a runner method: raises on the calls numbered in `fail_on` (1-based)."""

    def __init__(self, real, fail_on, message="injected failure"):
        self.real, self.fail_on, self.message, self.calls = real, set(fail_on), message, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(self.message)
        return self.real(*args, **kwargs)


GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# ---- F8: a forward pass that raises -------------------------------------------------------------------
def test_forward_failure_fails_exactly_that_steps_requests():
    """max_num_seqs=3: r0 and r1 (n=2, admitted with room for its fork) fill it, and the 3rd forward
    runs them only; they end with finish_reason "error" and a clean message, r2 and r3 (still
    waiting) finish exactly as in an unfailed run."""
    prompts = make_prompts(4, seed=1)
    ref = reference(prompts, 8)
    llm = sharp_tiny(num_kv_blocks=64, max_num_seqs=3)
    runner = llm.engine.runner
    runner.launch = FailOn(runner.launch, {3}, "injected forward failure")
    params = [GREEDY8, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), GREEDY8, GREEDY8]
    outs = llm.generate(prompts, params)
    assert runner.launch.calls > 3
    assert [[c.finish_reason for c in o.outputs] for o in outs] == [
        ["error"],
        ["error", "error"],
        ["length"],
        ["length"],
    ]
    # steps 1-2 ran: the parents have 2 tokens, r1's forked sample (first token in step 2) has 1
    assert [[len(c.token_ids) for c in o.outputs] for o in outs[:2]] == [[2], [2, 1]]
    for i, o in enumerate(outs[:2]):
        assert o.finished and o.error == "RuntimeError: injected forward failure"
        for c in o.outputs:  # what was streamed before the failure is correct
            assert c.token_ids == ref[i][: len(c.token_ids)]
    assert [o.outputs[0].token_ids for o in outs[2:]] == ref[2:]
    assert outs[2].error is None and outs[3].error is None
    assert_drained(llm.engine)
    # the engine keeps serving, correctly
    assert llm.generate([prompts[0]], GREEDY8)[0].outputs[0].token_ids == ref[0]
    assert_drained(llm.engine)


def test_failure_collecting_an_in_flight_step_fails_only_its_requests():
    """Async scheduling: the 3rd step's tokens fail to come back while the 4th is in flight. The
    3rd step's requests (r0, r1 and r1's fork) fail with a clean message, the queued ones finish as
    in an unfailed run, the wasted lanes of the 4th step change nothing, and every block drains."""
    prompts = make_prompts(4, seed=1)
    ref = reference(prompts, 8)
    llm = sharp_tiny(num_kv_blocks=64, max_num_seqs=3, async_scheduling=True)  # r0, r1 and its fork
    runner = llm.engine.runner
    runner.collect = FailOn(runner.collect, {3}, "injected copy failure")
    params = [GREEDY8, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), GREEDY8, GREEDY8]
    outs = llm.generate(prompts, params)
    assert [[c.finish_reason for c in o.outputs] for o in outs] == [
        ["error"],
        ["error", "error"],
        ["length"],
        ["length"],
    ]
    for i, o in enumerate(outs[:2]):
        assert o.error == "RuntimeError: injected copy failure"
        for c in o.outputs:
            assert -1 not in c.token_ids and c.token_ids == ref[i][: len(c.token_ids)]
    assert [o.outputs[0].token_ids for o in outs[2:]] == ref[2:]
    assert_drained(llm.engine)
    assert llm.generate([prompts[0]], GREEDY8)[0].outputs[0].token_ids == ref[0]
    assert_drained(llm.engine)


def test_forward_failure_mid_stream_in_async_engine():
    prompts = make_prompts(5, seed=2)
    ref = reference(prompts, 24)
    engine = AsyncLLM("dummy:tiny", num_kv_blocks=64, debug_checks=True)
    sharpen(engine.engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runner = engine.engine.runner
    real = runner.launch

    async def stream(i, started=None):
        outs = []
        async for out in engine.generate(prompts[i], params, request_id=f"s{i}"):
            outs.append(out)
            if started is not None and len(outs) == 2:
                started.set()
        return outs

    async def main():
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.ensure_future(stream(i, events[i])) for i in range(3)]
        await asyncio.gather(*(e.wait() for e in events))
        runner.launch = FailOn(real, {1}, "injected forward failure")  # the very next forward
        failed = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        later = await asyncio.wait_for(asyncio.gather(stream(3), stream(4)), 30)
        return failed, later

    try:
        failed, later = asyncio.run(main())
        for i, outs in enumerate(failed):
            final = outs[-1]
            assert final.finished and final.outputs[0].finish_reason == "error"
            assert final.error == "RuntimeError: injected forward failure"
            got = final.outputs[0].token_ids
            assert 2 <= len(got) < 24 and got == ref[i][: len(got)]
        for i, outs in zip((3, 4), later):
            assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].outputs[0].token_ids == ref[i]
        wait_drained(engine)
    finally:
        runner.launch = real
        engine.shutdown()


@pytest.mark.parametrize("failing", ["queue_save_blocks", "restore_blocks"])
def test_failed_offload_copy_leaves_no_published_garbage(failing):
    """The swap copies before a forward fail (device->host write-back, or host->device restore):
    the request fails cleanly, no restore stays pending, no host page stays pinned, and no block is
    left in the prefix index without its data (I9, I10): the retry's output is the oracle's."""
    a, b = list(range(1, 50)), list(range(100, 149))
    ref = reference([a, b], 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = sharp_tiny(num_kv_blocks=5, cpu_offload_gib=0.0001, max_num_batched_tokens=256)
    engine = llm.engine
    assert llm.generate([a], params)[0].outputs[0].token_ids == ref[0]
    assert engine.offload_cached_blocks() == 3  # a's 3 full blocks now live in host memory
    assert llm.generate([b], params)[0].outputs[0].token_ids == ref[1]  # b's blocks fill the device LRU
    # a again: restores 3 blocks from host memory, and must evict b's cached blocks to make room
    real = getattr(engine.runner, failing)
    setattr(engine.runner, failing, FailOn(real, {1}, f"injected {failing} failure"))
    try:
        out = llm.generate([a], params)[0]
        assert getattr(engine.runner, failing).calls >= 1
    finally:
        setattr(engine.runner, failing, real)
    assert out.outputs[0].finish_reason == "error" and out.error == f"RuntimeError: injected {failing} failure"
    assert_drained(engine)
    again = llm.generate([a], params)[0]
    assert again.outputs[0].token_ids == ref[0]
    assert llm.generate([b], params)[0].outputs[0].token_ids == ref[1]  # b's pages: never half-written to host
    assert_drained(engine)


def test_fork_tail_on_an_evicted_block_keeps_its_page():
    """A fork (n>1) copies the prompt's partial tail into a free block at once; when that block was
    a cached page just evicted (queued for write-back), its page must reach host memory before the
    copy overwrites it, or a later restore brings back the other prompt's data under its hash."""
    x, y = list(range(1, 50)), list(range(200, 234))  # x: 3 full blocks; y: 2 full + a tail
    ref = reference([x, y], 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = sharp_tiny(num_kv_blocks=4, cpu_offload_gib=0.0001)
    assert llm.generate([x], params)[0].outputs[0].token_ids == ref[0]
    before = llm.stats()["evictions"]
    out = llm.generate([y], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [ref[1], ref[1]]
    assert llm.stats()["evictions"] - before == 3 and llm.stats()["cpu_blocks_used"] == 3  # all of x's pages
    again = llm.generate([x], params)[0]  # restored from host memory
    assert again.num_cached_tokens == 48 and llm.stats()["blocks_restored"] == 3
    assert again.outputs[0].token_ids == ref[0]
    assert_drained(llm.engine)


# ---- F2/F4: an abort storm ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_storm_with_pressure(async_scheduling):
    """300 requests aborted at random points (before their first token, after k tokens, by closing
    the stream, by cancelling the task, twice, plus aborts of unknown ids) while 60 others (n=1..3)
    run on a pool small enough to preempt: the others are exactly the oracle's, every aborted partial
    output is a prefix of it, and afterwards no request, queue or block is left."""
    rng = random.Random(1234)
    prompts = make_prompts(24, seed=3)
    ref = reference(prompts, 24)
    engine = AsyncLLM(
        "dummy:tiny",
        num_kv_blocks=40,
        max_num_batched_tokens=128,
        cpu_offload_gib=0.0005,
        debug_checks=True,
        async_scheduling=async_scheduling,
    )
    sharpen(engine.engine)

    async def normal(i):
        p = rng.randrange(len(prompts))
        n, max_tokens = rng.randint(1, 3), rng.randint(4, 24)
        last = None
        async for last in engine.generate(
            prompts[p],
            SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True),
            request_id=f"keep{i}",
        ):
            pass
        assert last.finished and len(last.outputs) == n
        assert all(c.finish_reason == "length" and c.token_ids == ref[p][:max_tokens] for c in last.outputs), i
        return "ok"

    async def victim(i):
        p, mode, k = rng.randrange(len(prompts)), rng.choice(MODES), rng.randint(0, 12)
        params = SamplingParams(n=rng.randint(1, 3), temperature=0, max_tokens=rng.randint(8, 24), ignore_eos=True)
        rid = f"victim{i}"
        agen = engine.generate(prompts[p], params, request_id=rid)
        outs = []
        if mode == "cancel":

            async def consume():
                async for out in agen:
                    outs.append(out)

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        elif mode == "close":
            async for out in agen:
                outs.append(out)
                if len(outs) > k:
                    break
            await agen.aclose()
        else:  # "abort" / "abort-first" / "abort-twice"
            first = asyncio.ensure_future(agen.__anext__())  # posts the request
            await asyncio.sleep(0)
            if mode != "abort":
                await engine.abort(rid)
            if mode == "abort-twice":
                await engine.abort(rid)
                await engine.abort(f"no-such-request-{i}")
            try:
                outs.append(await first)
                async for out in agen:
                    outs.append(out)
                    if mode == "abort" and len(outs) == k + 1:
                        await engine.abort(rid)
            except StopAsyncIteration:
                pass
            final = outs[-1]
            assert final.finished
            reasons = {c.finish_reason for c in final.outputs}
            assert reasons <= {"abort", "length"}, reasons
        for out in outs:  # partial outputs are still correct
            for c in out.outputs:
                assert c.token_ids == ref[p][: len(c.token_ids)], (i, mode)
        return mode

    MODES = ["abort", "abort-first", "abort-twice", "close", "cancel"]

    async def main():
        jobs = [normal(i) for i in range(60)] + [victim(i) for i in range(300)]
        rng.shuffle(jobs)
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    try:
        results = asyncio.run(main())
        assert results.count("ok") == 60 and len(results) == 360
        wait_drained(engine)
        assert engine._queues == {}, "per-request output queues leaked"
        stats = engine.stats()
        assert stats["num_preemptions"] > 0, "the pool was not under pressure: the test proves less"

        # the engine still serves, exactly
        async def one():
            async for out in engine.generate(prompts[0], GREEDY8):
                pass
            return out

        assert asyncio.run(one()).outputs[0].token_ids == ref[0][:8]
        wait_drained(engine)
    finally:
        engine.shutdown()


def test_duplicate_request_id_is_refused_without_harming_the_first():
    engine = AsyncLLM("dummy:tiny", num_kv_blocks=64, debug_checks=True)
    # long enough (~1 s here) that the twin arrives while the first runs, on a slow machine too
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def main():
        stream = engine.generate(list(range(40)), params, request_id="same")
        last = await asyncio.wait_for(stream.__anext__(), 10)  # running: it has answered
        with pytest.raises(ValueError, match="already running"):
            await asyncio.wait_for(anext(engine.generate([1, 2, 3], params, request_id="same")), 10)
        async for last in stream:  # not hung, not aborted by the refused twin
            pass
        return last

    try:
        out = asyncio.run(asyncio.wait_for(main(), 60))
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 900
        wait_drained(engine)
        assert engine._queues == {}
    finally:
        engine.shutdown()


def test_a_request_posted_behind_the_stop_is_refused_not_left_waiting():
    """A request that reaches the engine's thread in the same take as its stop, or after it, gets
    an error instead of a stream that never ends."""
    from chatengine.engine.output_queue import Mailbox

    engine = AsyncLLM("dummy:tiny", num_kv_blocks=32)

    async def main():
        box = Mailbox()
        req = engine.engine.make_request([1, 2, 3], SamplingParams(max_tokens=2))
        with engine._wake:  # one take: the stop, then the request
            engine._inbox.extend([("stop",), ("add", req, (asyncio.get_running_loop(), box))])
            engine._wake.notify()
        return await asyncio.wait_for(box.get(), 10)

    try:
        got = asyncio.run(main())
        assert isinstance(got, RuntimeError) and "shut down" in str(got)
        engine._thread.join(10)
        with pytest.raises(RuntimeError, match="shut down"):
            engine.post(("add", engine.engine.make_request([1, 2], SamplingParams(max_tokens=1)), None))

        async def later():
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                pass

        with pytest.raises(RuntimeError, match="thread has stopped"):
            asyncio.run(later())
    finally:
        engine.shutdown()


def test_stats_can_be_polled_from_another_thread_under_load(tmp_path):
    """A metrics poller reads stats while the engine thread evicts, restores and writes KV files:
    AsyncLLM.stats() (a snapshot the engine thread publishes) and LLMEngine.stats() itself, which
    iterates the free LRU and the disk index that the engine and writer threads are changing."""
    engine = AsyncLLM(
        "dummy:tiny",
        num_kv_blocks=24,
        max_num_batched_tokens=64,
        cpu_offload_gib=0.0002,
        kv_store_dir=str(tmp_path / "kv"),
        max_model_len=256,
        debug_checks=True,
    )
    errors, polls, stop = [], [0], threading.Event()

    def poll():
        # as fast as it can, but for 3 s at most: a tight loop holds the GIL so much that it can
        # slow the engine thread down many times over on a loaded machine
        deadline = time.monotonic() + 3.0
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                for stats in (engine.stats(), engine.engine.stats()):
                    assert 0 <= stats["kv_blocks_used"] <= stats["kv_blocks_total"] == 24
                polls[0] += 1
            except Exception as e:  # noqa: BLE001 - any exception is the failure
                errors.append(repr(e))

    async def one(i):
        async for _ in engine.generate([(i * 7 + j) % 256 for j in range(40)], GREEDY8):
            pass

    async def main():
        await asyncio.gather(*[one(i) for i in range(300)])

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        poller.join()
        engine.shutdown()
    assert polls[0] > 100 and errors == [], errors[:3]


# ---- F5: KV pool exhaustion ---------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pool_exhaustion_preempts_offloads_and_stays_exact(tmp_path, async_scheduling):
    """36 prompts (n=1..3) on 12 device blocks and a 17-page host tier spilling to disk: preemption,
    eviction, host and disk restores all happen; every sample equals the oracle; twice over (the
    second pass restores the first pass's pages); a request that can never fit is refused at once."""
    prompts = make_prompts(36, seed=4)
    ref = reference(prompts, 12)
    llm = sharp_tiny(
        num_kv_blocks=12,
        max_num_batched_tokens=64,
        cpu_offload_gib=0.0001,
        kv_store_dir=str(tmp_path / "kv"),
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    rng = random.Random(5)
    params = [SamplingParams(n=rng.randint(1, 3), temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for o, r in zip(outs, ref):
            assert [c.token_ids for c in o.outputs] == [r] * len(o.outputs)
            assert all(c.finish_reason == "length" for c in o.outputs)
        assert_drained(llm.engine)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["evictions"] > 0 and stats["blocks_restored"] > 0, stats
    assert stats["disk_blocks"] > 0 and llm.engine.tiers.num_promoted > 0, stats  # disk -> host -> device
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(150))], SamplingParams(max_tokens=100))  # 16 blocks > 12
    assert_drained(llm.engine)
    llm.shutdown()


# ---- F10: a full disk ---------------------------------------------------------------------------------
class FullDiskOS:
    """What chatengine.engine.kv.disk_store sees of `os` on a full disk: `failing` raises ENOSPC."""

    def __init__(self, failing: str):
        self.failing, self.calls = failing, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name != self.failing:
            return real

        def fail(*args, **kwargs):
            self.calls += 1
            raise OSError(errno.ENOSPC, "No space left on device")

        return fail


@pytest.mark.parametrize("failing", ["open", "replace"])
def test_full_disk_degrades_to_recompute(tmp_path, monkeypatch, caplog, failing):
    import chatengine.engine.kv.disk_store as offload

    prompts = make_prompts(16, seed=6)
    ref = reference(prompts, 8)
    kv = tmp_path / "kv"
    llm = sharp_tiny(
        num_kv_blocks=12, max_num_batched_tokens=64, cpu_offload_gib=0.0001, kv_store_dir=str(kv), max_model_len=128
    )
    full = FullDiskOS(failing)
    monkeypatch.setattr(offload, "os", full)
    with caplog.at_level(logging.WARNING, logger="chatengine.kv.disk"):
        for _ in range(2):  # the second pass would need spilled pages back
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY8)] == ref
        llm.engine.flush_kv()  # a flush on a full disk does not raise either
    stats = llm.stats()
    assert full.calls > 0 and stats["disk_write_errors"] == full.calls and stats["disk_blocks"] == 0, stats
    assert stats["evictions"] > 0
    assert any("KV disk store write failed" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert list(kv.rglob("*.kv")) == [] and list(kv.rglob("*.tmp")) == []  # no half-written file
    assert_drained(llm.engine)
    # space returns: new pages reach the disk again and a restart hits them
    monkeypatch.setattr(offload, "os", os)
    more = make_prompts(4, seed=7)
    llm.generate(more, GREEDY8)
    llm.shutdown()
    assert llm.stats()["disk_blocks"] > 0 and llm.stats()["disk_write_errors"] == full.calls
    again = sharp_tiny(num_kv_blocks=12, max_num_batched_tokens=64, kv_store_dir=str(kv), max_model_len=128)
    out = again.generate([more[0]], GREEDY8)[0]
    assert out.num_cached_tokens == (len(more[0]) - 1) // BS * BS and out.num_cached_tokens > 0
    assert out.outputs[0].token_ids == reference([more[0]], 8)[0]
    again.shutdown()


# ---- F9: a data directory of another model -----------------------------------------------------------
def test_kv_store_of_another_model_is_ignored(tmp_path):
    kv = tmp_path / "kv"
    prompt, params = list(range(40)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM("dummy:tiny", kv_store_dir=str(kv), num_kv_blocks=32, cpu_offload_gib=0.001, seed=1, debug_checks=True)
    first = one.generate([prompt], params)[0]
    one.shutdown()
    ones = sorted(kv.rglob("*.kv"))
    assert len(ones) == 2  # 2 full blocks of 40 tokens
    cold = LLM("dummy:tiny", num_kv_blocks=32, cpu_offload_gib=0, seed=2).generate([prompt], params)[0]
    two = LLM("dummy:tiny", kv_store_dir=str(kv), num_kv_blocks=32, cpu_offload_gib=0.001, seed=2, debug_checks=True)
    # a file of model 1 planted in model 2's own directory is rejected (other root) and deleted
    own_dir = kv / two.engine.tiers.disk.root.hex()
    planted = own_dir / ones[0].parent.name / ones[0].name
    two.shutdown()
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(ones[0].read_bytes())
    two = LLM("dummy:tiny", kv_store_dir=str(kv), num_kv_blocks=32, cpu_offload_gib=0.001, seed=2, debug_checks=True)
    assert not planted.exists() and two.stats()["disk_blocks"] == 0
    out = two.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_drained(two.engine)
    two.shutdown()
    assert all(f.exists() for f in ones)  # model 1's files are untouched
    back = LLM("dummy:tiny", kv_store_dir=str(kv), num_kv_blocks=32, cpu_offload_gib=0.001, seed=1, debug_checks=True)
    hit = back.generate([prompt], params)[0]
    assert hit.num_cached_tokens == 32 and hit.outputs[0].token_ids == first.outputs[0].token_ids
    back.shutdown()


# ---- F6: SIGKILL of the real server mid-generation, then a restart -------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(db: Path) -> dict:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        conn.row_factory = sqlite3.Row
        return {r["id"]: dict(r) for r in conn.execute("SELECT * FROM messages")}
    finally:
        conn.close()


def _header(path: Path) -> dict:
    from chatengine.engine.kv.disk_store import PREFIX

    data = path.read_bytes()
    _, _, n, _ = PREFIX.unpack(data[: PREFIX.size])
    return json.loads(data[PREFIX.size : PREFIX.size + n])


@pytest.mark.slow  # restarts or loads a whole server: left out of CI, run with the whole suite (README)
def test_sigkill_mid_generation_then_restart(tmp_path):
    """`python app.py` is killed with SIGKILL while it streams a reply. The restart finds every
    finished message as it was, marks the streaming one interrupted, checks the database, drops a
    temp file and a bad-magic file, reads every KV file with its checksum (a truncated one is a
    miss and is deleted), and a follow-up to the finished history hits its KV from disk."""
    Client = pytest.importorskip("gradio_client").Client
    pytest.importorskip("gradio")
    data, port = tmp_path / "data", _free_port()
    url = f"http://127.0.0.1:{port}/"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "app.py"),
            "--port",
            str(port),
            "--data-dir",
            str(data),
            "--kv-cache-gib",
            "0.1",
            "--max-num-batched-tokens",
            "256",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1", GRADIO_ANALYTICS_ENABLED="False"),
    )
    client = None
    try:
        import httpx

        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "app.py did not start"
            try:
                if httpx.get(url + "health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = Client(url, verbose=False, analytics_enabled=False)
        for text in ("Name a colour.", "Name another colour."):
            out = client.predict(text, "assistant", 0, 1, 8, -1, 1, api_name="/send")
        cid = out[3]["value"]
        client.submit(
            "Write a very long story about a dragon, at least 1000 words.",
            "assistant",
            0,
            1,
            400,
            -1,
            1,
            api_name="/send",
        )
        db = data / "chat.db"
        deadline = time.monotonic() + 60
        while True:  # the partial reply has been saved at least once (every 1 s)
            rows = _rows(db)
            if any(r["status"] == "streaming" and len(r["content"]) > 100 for r in rows.values()):
                break
            assert time.monotonic() < deadline, "no partial reply was saved"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the server is gone; nothing to close cleanly
                pass
    before = _rows(db)
    assert [r["status"] for r in before.values()].count("streaming") == 1

    # the disk tier: plant a temp file (a crash mid-write) and a bad-magic file; truncate one page
    root_dir = next(d for d in (data / "kv").iterdir() if d.is_dir())
    files = sorted(root_dir.glob("*/*.kv"))
    assert len(files) >= 4
    from chatengine.app.server import engine_kwargs
    from chatengine.app.store import ChatStore

    store = ChatStore(db)
    user = store.db.execute("SELECT user_id FROM conversations WHERE id = ?", [cid]).fetchone()[0]
    path = store.active_path(user, cid)
    assert [(m["role"], m["status"]) for m in path] == [
        ("system", "done"),
        ("user", "done"),
        ("assistant", "done"),
        ("user", "done"),
        ("assistant", "done"),
        ("user", "done"),
        ("assistant", "streaming"),
    ]
    history = store.prompt_token_ids(user, path[4]["id"])
    # pages only the killed request used: not a block of the history, nor the block that straddles
    # its end (the follow-up's next turn starts with the same "<|im_start|>user" tokens)
    windows = {tuple(history[i : i + BS]) for i in range(0, len(history) - BS + 1, BS)}
    long_prompt = history + path[5]["token_ids"]
    edge = len(history) // BS * BS
    windows.add(tuple(long_prompt[edge : edge + BS]))
    from chatengine.engine.kv.hashing import tokens_digest

    def spells(f, window) -> bool:  # a file keeps a digest of its tokens, keyed by its hash
        h = _header(f)
        return tokens_digest(bytes.fromhex(h["hash"]), window) == bytes.fromhex(h["digest"])

    outside = [f for f in files if not any(spells(f, w) for w in windows)]
    assert len(outside) >= 2, (len(files), len(outside))
    damaged, bad_magic = outside[-1], outside[0]
    damaged.write_bytes(damaged.read_bytes()[:-100])
    bad_magic.write_bytes(b"XXXX" + bad_magic.read_bytes()[4:])
    tmp = damaged.parent / f".{damaged.name}.1234.tmp"
    tmp.write_bytes(b"half a page")

    assert store.recover_interrupted() == 1  # quick_check passed, too
    after = _rows(db)
    assert set(after) == set(before)  # nothing lost, nothing duplicated
    for mid, row in before.items():
        if row["status"] == "streaming":
            assert after[mid]["status"] == "interrupted" and after[mid]["content"] == row["content"]
        else:
            assert after[mid] == row

    # app.py's own engine settings (its default --quantization gguf: the KV files of those numerics)
    engine = AsyncLLM(
        **engine_kwargs(data, kv_cache_gib=0.1, max_num_batched_tokens=256, debug_checks=True, quantization="gguf")
    )
    try:
        disk = engine.engine.tiers.disk
        assert not tmp.exists() and not bad_magic.exists()
        assert engine.engine.stats()["disk_blocks"] == len(files) - 1
        from chatengine.app.chat import ChatService
        from chatengine.personas import load_personas

        svc = ChatService(engine, store, load_personas())

        async def follow_up():
            last = None
            async for last in svc.edit(
                user, cid, path[5]["id"], "And a third colour?", dict(temperature=0, max_tokens=4)
            ):
                pass
            return last

        up = asyncio.run(follow_up())
        assert up.status == "done" and up.error is None
        assert up.num_cached_tokens >= len(history) // BS * BS > 0  # the history came from disk
        assert engine.engine.stats()["blocks_restored"] > 0  # (the engine is idle: read it directly)
        for h in list(disk.index):  # every file, verified
            assert (disk.read(h) is None) == (disk.path(h) == damaged), disk.path(h)
        # damaged: the bad-magic file (found at the start-up scan) and the truncated one (at its read)
        assert not damaged.exists() and engine.engine.stats()["disk_damaged_files"] == 2
        wait_drained(engine)
    finally:
        engine.shutdown()
        store.close()


# ---- B1-B3: bad inputs through the engine, the API and the chat service ------------------------------
@pytest.fixture(scope="module")
def default_engine():
    engine = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1, debug_checks=True)
    yield engine
    engine.shutdown()


BAD_ENGINE_INPUTS = [
    ("hello " * 9000, {}, "context"),
    ([1] * 8192, {}, "context"),
    ("", {}, "empty"),
    ([], {}, "empty"),
    ("lone \ud800 surrogate", {}, "Unicode"),
    (b"bytes", {}, "prompt"),
    (None, {}, "prompt"),
    ([1, -1], {}, "token ids"),
    ([1, 10**9], {}, "token ids"),
    ([1, True], {}, "token ids"),
    ("hi", dict(n=10**6), "n must"),
    ("hi", dict(n=0), "n must"),
    ("hi", dict(n=2.0), "n must"),
    ("hi", dict(n=True), "n must"),
    ("hi", dict(max_tokens=10**12), "max_tokens"),
    ("hi", dict(max_tokens=0), "max_tokens"),
    ("hi", dict(max_tokens=None), "max_tokens"),
    ("hi", dict(max_tokens=8000), "KV blocks"),
    ("hi", dict(temperature=float("nan")), "temperature"),
    ("hi", dict(temperature=float("inf")), "temperature"),
    ("hi", dict(temperature=-0.5), "temperature"),
    ("hi", dict(temperature=1e6), "temperature"),
    ("hi", dict(temperature="1"), "temperature"),
    ("hi", dict(top_p=float("nan")), "top_p"),
    ("hi", dict(top_p=0.0), "top_p"),
    ("hi", dict(top_p=float("-inf")), "top_p"),
    ("hi", dict(top_k=-1), "top_k"),
    ("hi", dict(top_k=1.5), "top_k"),
    ("hi", dict(seed=-1), "seed"),
    ("hi", dict(seed=2**64), "seed"),
    ("hi", dict(stop=[""]), "stop"),
    ("hi", dict(stop=["x" * 300]), "stop"),
    ("hi", dict(stop=[None]), "stop"),
    ("hi", dict(stop=[str(i) for i in range(17)]), "stop"),
    ("hi", dict(stop_token_ids=[-1]), "stop_token_ids"),
]


def test_bad_inputs_through_the_engine(default_engine):
    """Each is refused with a ValueError naming the problem before anything runs."""
    engine = default_engine.engine
    steps = engine.stats()["num_steps"]
    for prompt, kw, needle in BAD_ENGINE_INPUTS:

        async def go():
            async for _ in default_engine.generate(prompt, SamplingParams(**kw)):
                pass

        with pytest.raises(ValueError) as e:
            asyncio.run(go())
        shown = prompt[:20] if isinstance(prompt, str) else prompt
        assert needle.lower() in str(e.value).lower(), (shown, kw, e.value)
    assert engine.stats()["num_steps"] == steps  # nothing ran
    assert_drained(engine)


def test_extreme_but_valid_values_are_served_correctly():
    """Values at the edges of the valid ranges: denormal temperatures, top_k beyond the vocabulary,
    a vanishing top_p are greedy in effect; n at its limit on a pool that holds one sample at a time."""
    prompt = list(range(3, 43))
    ref = reference([prompt], 40)[0]
    llm = sharp_tiny(num_kv_blocks=8, max_num_batched_tokens=64)
    for kw in (
        dict(temperature=5e-324),
        dict(temperature=1e-45),
        dict(temperature=1e-8, seed=3),
        dict(temperature=0, top_k=10**9),
        dict(temperature=1.0, top_p=1e-30, seed=5),
        dict(temperature=1.0, top_k=1),
    ):
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, **kw))[0].outputs[0]
        assert out.token_ids == ref[:8], kw
    hot = llm.generate([prompt], SamplingParams(temperature=100.0, max_tokens=8, seed=1, ignore_eos=True))[0]
    assert len(hot.outputs[0].token_ids) == 8 and all(0 <= t < 256 for t in hot.outputs[0].token_ids)
    many = llm.generate([prompt], SamplingParams(n=16, temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert [c.token_ids for c in many.outputs] == [ref] * 16
    assert llm.stats()["num_preemptions"] > 0
    assert_drained(llm.engine)


def test_odd_unicode_and_control_characters_are_served(default_engine):
    params = SamplingParams(temperature=0, max_tokens=2)
    for text in (
        "NUL \x00 BEL \x07 ESC \x1b[31m DEL \x7f",
        "\u202eRTL override\u202c",
        "👩‍👩‍👧‍👦 family",
        "e\u0301\u0301\u0301 combining",
        "日本語とعربي",
        "\r\n\t\x0b\x0c",
        "<script>alert(1)</script>",
    ):

        async def go():
            async for out in default_engine.chat([{"role": "user", "content": text}], params):
                pass
            return out

        out = asyncio.run(go())
        assert out.finished and out.outputs[0].finish_reason in ("stop", "length") and out.error is None
    wait_drained(default_engine)


@pytest.fixture(scope="module")
def api_url(default_engine, serve):
    from chatengine.app.api.routes import build_api

    yield serve(build_api(default_engine, None, model_name="m")).url


MSG = '"messages": [{"role": "user", "content": "hi"}]'
BAD_API_BODIES = [
    # raw body, expected status, text in the error message (cases beyond tests/test_api.py)
    ("{" + MSG + ', "temperature": Infinity}', 400, "Infinity"),
    ("{" + MSG + ', "top_p": -Infinity}', 400, "Infinity"),
    ('{"messages": [{"role": "user", "content": "a\x01b"}]}', 400, "invalid JSON"),  # raw control char
    ('{"messages": [{"role": "user", "content": "x"}], "\\udc00": 1}', 400, "surrogate"),
    ("{" + MSG + ', "seed": -9223372036854775809}', 400, "seed"),  # below int64 (any int64 is served)
    ("{" + MSG + ', "seed": 18446744073709551616}', 400, "seed"),
    ("{" + MSG + ', "n": 1180591620717411303424}', 400, "'n'"),
    ("{" + MSG + ', "max_tokens": 1e308}', 400, "max_tokens"),
    ("{" + MSG + ', "max_tokens": 1e999}', 400, "max_tokens"),
    ("{" + MSG + ', "top_k": "all"}', 400, "top_k"),
    ("{" + MSG + ', "stop_token_ids": [-5]}', 400, "stop_token_ids"),
    ('{"messages": [{"role": "<script>alert(1)</script>", "content": "x"}]}', 400, "<script>alert(1)</script>"),
    ('{"messages": [{"role": "user", "content": "' + "hello " * 9000 + '"}]}', 400, "context"),
]


def test_bad_api_bodies_are_clear_json_errors(api_url, default_engine):
    import httpx

    for body, status, needle in BAD_API_BODIES:
        r = httpx.post(
            api_url + "/v1/chat/completions",
            content=body.encode("utf-8", "surrogatepass"),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == status, (body[:80], r.text[:300])
        assert r.headers["content-type"].startswith("application/json")  # data, never a page
        assert needle.lower() in r.json()["error"]["message"].lower(), (body[:80], r.json())
    r = httpx.get(api_url + "/v1/<script>alert(1)</script>")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    assert httpx.get(api_url + "/health").json() == {"status": "ok"}
    wait_drained(default_engine)


def test_odd_but_valid_api_values_are_served(api_url, default_engine):
    """Escaped control characters and NUL in content, a denormal temperature (greedy in effect),
    top_k beyond the vocabulary: 200, and the denormal one gives exactly the greedy text."""
    import httpx

    base = {"messages": [{"role": "user", "content": "Say hi.\u0000\u0007\u001b[0m"}], "max_tokens": 6}
    greedy = httpx.post(api_url + "/v1/chat/completions", json={**base, "temperature": 0}, timeout=60)
    assert greedy.status_code == 200, greedy.text
    for extra in ({"temperature": 5e-324}, {"temperature": 0, "top_k": 10**9}, {"temperature": 1e-30, "seed": 1}):
        r = httpx.post(api_url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"], extra
    wait_drained(default_engine)


def test_html_in_model_output_is_returned_verbatim_as_json(api_url, default_engine):
    """The model's output (here it contains an <img> tag) comes back as JSON string data, exactly the
    engine's text: not escaped, not stripped, not served as HTML."""
    import httpx

    messages = [{"role": "user", "content": "Echo this back: <img src=x onerror=alert(1)>"}]
    params = SamplingParams(temperature=0, max_tokens=24)

    async def direct():
        async for out in default_engine.chat(messages, params):
            pass
        return out.outputs[0].text

    text = asyncio.run(direct())
    assert "<img" in text, f"pick a prompt whose greedy reply contains a tag; got {text!r}"
    r = httpx.post(
        api_url + "/v1/chat/completions", timeout=60, json={"messages": messages, "temperature": 0, "max_tokens": 24}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()["choices"][0]["message"]["content"] == text
    chunks = []
    with httpx.stream(
        "POST",
        api_url + "/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "temperature": 0, "max_tokens": 24, "stream": True},
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                chunks.append(delta.get("content") or "")
    assert "".join(chunks) == text
    wait_drained(default_engine)


def test_chat_service_stores_hostile_text_verbatim_and_hides_other_users(default_engine, tmp_path):
    from chatengine.app.chat import ChatService
    from chatengine.app.store import ChatStore, NotFound
    from chatengine.personas import load_personas

    store = ChatStore(tmp_path / "chat.db")
    svc = ChatService(default_engine, store, load_personas())
    texts = [
        "<script>alert('x')</script>",
        "<img src=x onerror=alert(1)>",
        "[link](javascript:alert(1))",
        "NUL\x00 and ESC\x1b[2J",
        "\u202eevil.exe",
        "👩‍👩‍👧‍👦 e\u0301",
        "line\r\nbreak\ttab",
    ]
    settings = dict(temperature=0, max_tokens=2)

    async def send(user, cid, text):
        last = None
        async for last in svc.send(user, cid, text, settings):
            pass
        return last

    try:
        cid = svc.new_conversation("alice")
        for text in texts:
            up = asyncio.run(send("alice", cid, text))
            assert up.status == "done", up.error
            assert store.get_message("alice", up.user_message_id)["content"] == text
            reply = store.get_message("alice", up.message_ids[0])
            assert reply["content"] == up.texts[0] and reply["status"] == "done"
        assert [m["content"] for m in svc.view("alice", cid) if m["role"] == "user"] == texts
        with pytest.raises(ValueError, match="Unicode"):
            asyncio.run(send("alice", cid, "lone \udfff"))
        assert len(svc.view("alice", cid)) == 2 * len(texts)  # nothing half-written
        # bob with alice's ids: NotFound, the same as an id that does not exist, and no text of alice's
        secret_mid = svc.view("alice", cid)[0]["id"]
        for call in (
            lambda: svc.view("bob", cid),
            lambda: svc.send("bob", cid, "hi", settings),
            lambda: svc.regenerate("bob", cid, secret_mid, settings),
            lambda: svc.edit("bob", cid, secret_mid, "x", settings),
        ):
            with pytest.raises(NotFound) as e:
                call()
            assert "script" not in str(e.value) and "alert" not in str(e.value)
        with pytest.raises(NotFound):
            svc.view("alice", "no-such-conversation")
        assert svc.list_conversations("bob") == []
        wait_drained(default_engine)
    finally:
        store.close()
