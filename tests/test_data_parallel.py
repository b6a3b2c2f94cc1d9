"""DataParallelLLM on the CPU: two replica processes behind one API give the tokens one engine
gives, keep a conversation on the replica that holds its pages, spread new ones, warm public
personas on every replica, free every block, and survive a replica's death.

The tests share one DataParallelLLM (starting two processes costs seconds) and run in file order:
the last one kills a replica."""

import asyncio
import json
import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

from chatengine import LLM, DataParallelLLM, SamplingParams, StructuredOutputs
from chatengine.config import EngineConfig
from chatengine.engine.replicas.data_parallel import _Outputs, _placement, _Running
from chatengine.engine.replicas.deltas import OutputAssembler

SETTINGS = dict(num_kv_blocks=96, max_num_batched_tokens=128, register_personas=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dp(tiny_chat_model):
    engine = DataParallelLLM(str(tiny_chat_model), data_parallel_size=2, **SETTINGS)
    yield engine
    engine.shutdown()


def chat_ids(engine, user_text: str, system: str = "You are terse.") -> list[int]:
    return engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user_text}])


async def last(engine, prompt, params=GREEDY, **kw):
    out = None
    async for out in engine.generate(prompt, params, **kw):
        pass
    return out


def settled(dp, check, timeout=10.0):
    """Wait until nothing is in flight and every replica's figures (published at rest) satisfy `check`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = dp.stats()
        if not any(stats["router"]["load"]) and all(s and check(s) for s in stats["replicas"]):
            return stats["replicas"]
        time.sleep(0.05)
    raise AssertionError(f"replicas never settled: {dp.stats()['replicas']}")


def test_greedy_tokens_equal_one_engine_and_new_conversations_spread(dp, tiny_chat_model):
    prompts = [chat_ids(dp, f"Question number {i} about the sea?") for i in range(6)]
    sampled = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    # logprobs, prompt logprobs and a stop string (whose text is held back while it may be one)
    # travel as deltas too
    scored = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1, stop=[" the", "."])

    async def run():
        return await asyncio.gather(
            *[last(dp, p, user=f"u{i}") for i, p in enumerate(prompts)],
            last(dp, prompts[0], sampled, user="s"),
            last(dp, prompts[1], scored, user="s"),
        )

    outs = asyncio.run(run())
    one = LLM(str(tiny_chat_model), **SETTINGS)
    try:
        want = [one.generate(p, GREEDY, user=f"u{i}")[0] for i, p in enumerate(prompts)]
        want.append(one.generate(prompts[0], sampled, user="s")[0])
        want.append(one.generate(prompts[1], scored, user="s")[0])
    finally:
        one.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in w.outputs] for w in want]
    assert [o.outputs[0].text for o in outs] == [w.outputs[0].text for w in want]
    got, expected = outs[-1], want[-1]  # fp32 sums of other batch shapes: equal to ~1e-6
    assert len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids) > 0
    for a, b in zip(
        got.outputs[0].logprobs + got.prompt_logprobs[1:], expected.outputs[0].logprobs + expected.prompt_logprobs[1:]
    ):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    assert len(got.prompt_logprobs) == len(prompts[1]) and got.prompt_logprobs[0] is None
    assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == (
        expected.outputs[0].finish_reason,
        expected.outputs[0].stop_reason,
    )
    each = settled(dp, lambda s: s["kv_blocks_used"] == 0)
    assert all(s["num_generated_tokens"] > 0 for s in each)  # both replicas served some
    assert dp.stats()["router"]["load"] == [0, 0]


def test_a_conversations_next_turn_lands_where_its_pages_are(dp):
    firsts = [chat_ids(dp, f"Tell me about ship {i} and its long voyage across the ocean.") for i in range(4)]

    async def run():
        outs = await asyncio.gather(*[last(dp, p, user="alice") for p in firsts])
        seconds = [p + o.outputs[0].token_ids + dp.encode("\nAnd then?") for p, o in zip(firsts, outs)]
        return await asyncio.gather(*[last(dp, p, user="alice") for p in seconds])

    before = dict(dp.stats()["router"])
    outs = asyncio.run(run())
    after = dp.stats()["router"]
    assert after["affinity"] - before["affinity"] == 4
    # every second turn read its first turn's full blocks from its replica's cache
    assert all(o.num_cached_tokens >= 16 * (len(p) // 16) for o, p in zip(outs, firsts))


def test_the_router_learns_an_answers_blocks_under_its_users_salt(dp):
    """When a reply of several blocks ends, the router holds every private block of prompt + answer
    on the replica that made it, keyed as a fresh chain salted for that user hashes them; another
    user's keys for the same tokens are none of them."""
    from chatengine.engine.kv.hashing import salt_start_block
    from chatengine.engine.replicas.chains import RouterChains

    prompt = chat_ids(dp, "Describe the harbour at dawn in many words.")
    out = asyncio.run(last(dp, prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), user="carol"))
    ids, bs = prompt + list(out.outputs[0].token_ids), dp.front.config.block_size
    first = salt_start_block(dp.front.public_prefix_len(ids), bs)
    assert len(ids) // bs - len(prompt) // bs >= 3  # the answer fills blocks of its own
    owners = dp.router._owner
    fresh = RouterChains(dp.chains.secret, bs)  # no memory of carol's turns: every block hashed anew
    mine = fresh.of_prompt(ids, "carol", first).hashes[first:]
    assert len({owners.get(h) for h in mine}) == 1 and owners.get(mine[-1]) is not None
    assert not any(h in owners for h in fresh.of_prompt(ids, "dave", first).hashes[first:])


def test_another_user_never_hits_a_private_conversation(dp):
    ids = chat_ids(dp, "A secret plan with many words in it for nobody else to read.")

    async def run():
        await last(dp, ids, user="mallory-victim")
        return await last(dp, ids, user="mallory")

    assert asyncio.run(run()).num_cached_tokens == 0


def test_public_personas_are_warm_on_every_replica(dp):
    system = "You are the harbour master. " * 12
    settled(dp, lambda s: s["num_running"] == 0)
    time.sleep(0.3)  # the figures each replica publishes at rest, after its last outputs, are in
    before = [s["num_generated_tokens"] for s in dp.stats()["replicas"]]
    dp.register_persona("harbour", system)
    prefix = dp.front.personas["harbour"]
    full = 16 * (len(prefix) // 16)
    # each replica's warm-up (one token over the persona's prefix) has run
    deadline = time.monotonic() + 10
    while not all(
        s["num_generated_tokens"] > b and s["num_running"] == 0 for s, b in zip(dp.stats()["replicas"], before)
    ):
        assert time.monotonic() < deadline, dp.stats()["replicas"]
        time.sleep(0.05)

    async def run():  # two conversations at once: one on each replica
        return await asyncio.gather(
            *[last(dp, chat_ids(dp, f"Ship {i} arriving?", system), user=f"p{i}") for i in (1, 2)]
        )

    outs = asyncio.run(run())
    assert [o.num_cached_tokens >= full for o in outs] == [True, True]
    dp.unregister_persona("harbour")
    assert "harbour" not in dp.front.personas


def test_bad_requests_raise_at_once_and_leave_nothing(dp):
    async def run(prompt, params=GREEDY, **kw):
        return await last(dp, prompt, params, **kw)

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(run([1] * dp.max_model_len))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(run([]))

    async def duplicate():
        slow = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = dp.generate([5, 6, 7], slow, request_id="same")
        await stream.__anext__()
        try:
            await last(dp, [8, 9], request_id="same")
        finally:
            await stream.aclose()  # closing the stream aborts it

    with pytest.raises(ValueError, match="already running"):
        asyncio.run(duplicate())
    # forgetting is checked here too: in a replica's loop a ValueError would reach no caller
    with pytest.raises(ValueError, match="user id"):
        dp.forget_user("")
    with pytest.raises(ValueError, match="token ids"):
        dp.forget_prompts("bob", [[-1]])
    settled(dp, lambda s: s["kv_blocks_used"] == 0 and s["num_running"] == 0)
    assert asyncio.run(run([5, 6, 7])).outputs[0].token_ids  # and they serve on


def test_structured_requests_compile_off_the_pipe_and_abort_while_compiling(dp):
    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(choice=["yes", "no"]))

    async def run():
        aborted = dp.generate(chat_ids(dp, "Yes or no?"), choice, request_id="early-abort", user="q")
        task = asyncio.create_task(aborted.__anext__())
        await asyncio.sleep(0)  # sent; its grammar may still be compiling on the replica
        await dp.abort("early-abort")
        first = await task
        rest = [o async for o in aborted]
        plain = await last(dp, chat_ids(dp, "Plain one."), user="q")
        answered = await last(dp, chat_ids(dp, "Yes or no?"), choice, user="q")
        return (rest[-1] if rest else first), plain, answered

    aborted, plain, answered = asyncio.run(run())
    assert aborted.finished and aborted.outputs[0].finish_reason in ("abort", "stop", "length")
    assert len(plain.outputs[0].token_ids) == GREEDY.max_tokens
    assert answered.outputs[0].text in ("yes", "no")
    settled(dp, lambda s: s["kv_blocks_used"] == 0)


def test_replicas_leave_ctrl_c_to_the_api_process(dp):
    for r in dp.replicas:
        os.kill(r.process.pid, signal.SIGINT)
    time.sleep(0.3)

    async def run():
        return await asyncio.gather(*[last(dp, chat_ids(dp, f"Still there {i}?"), user=f"c{i}") for i in range(2)])

    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in asyncio.run(run()))
    assert all(r.alive and r.process.is_alive() for r in dp.replicas)


def test_the_api_serves_it(dp, tmp_path):
    from chatengine.app.server import close_app, create_app

    app = create_app(data_dir=tmp_path, engine=dp)
    try:
        with TestClient(app) as client:
            r = client.post(
                "/v1/completions",
                json={"model": dp.model_id, "prompt": "The sea is", "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        close_app(app)


def test_the_api_streams_logprobs_and_echo_as_it_answers_them_whole(dp, tmp_path):
    """Streamed through the replicas' deltas, a completion with echo and logprobs gives the text,
    tokens, logprobs and usage of the same request answered whole."""
    from chatengine.app.server import close_app, create_app

    app = create_app(data_dir=tmp_path, engine=dp)
    body = {"model": dp.model_id, "prompt": "The sea is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 2, "echo": True}
    try:
        with TestClient(app) as client:
            whole = client.post("/v1/completions", json=body).json()
            r = client.post("/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
    finally:
        close_app(app)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    choices = [c for e in events for c in e["choices"]]
    expected = whole["choices"][0]
    assert "".join(c["text"] for c in choices) == expected["text"]
    assert choices[-1]["finish_reason"] == expected["finish_reason"] == "length"
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][key]] == expected["logprobs"][key], key
    assert events[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 6


def test_a_closed_stream_is_counted_done_even_if_its_loop_closes_before_the_end_arrives(dp):
    """A caller that closes its stream and then its event loop (asyncio.run returning) must not
    leave its request counted: the final delta its abort brings back is finished on the listener
    thread, not queued to a loop that will never run it."""
    loop = asyncio.new_event_loop()  # never run after the stream closes: what is queued to it is lost
    try:
        stream = dp.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), request_id="closed")
        loop.run_until_complete(stream.__anext__())
        loop.run_until_complete(stream.aclose())  # the abort goes out; its answer comes to no one
        settled(dp, lambda s: s["num_running"] == 0)  # counted done with the loop left idle
    finally:
        dp._finish("closed")
        loop.close()


def test_an_end_that_crosses_the_stream_closing_is_counted_once(dp):
    """The listener read the mark, then the caller closed the stream (the abort finds the request
    done) and its loop is closing: the end queued to that loop is counted on the listener thread,
    once; deltas after the mark go nowhere, and a second close sends nothing."""
    sent = []
    running = _Running(0, None, _Outputs(), OutputAssembler("gone", None, [1]), None)  # type: ignore[arg-type]

    class Closing:  # the caller's loop: abandons the request as the end is queued, then never runs
        def call_soon_threadsafe(self, *_):
            running.abandoned = True

    running.loop = Closing()  # type: ignore[assignment]
    dp._running["gone"] = running
    dp.router.load[0] += 1
    replica = dp.replicas[0]
    real_send, replica.send = replica.send, lambda m: sent.append(m) or True
    end = ("gone", True, None, 0, 0.0, 0.0, [(0, [], 0, "", "length", None, None, None)], None)
    try:
        dp._on_out(0, [end], [])
        assert "gone" not in dp._running and dp.router.load == [0, 0]
        dp._on_out(0, [end], [])  # (a stale copy finds nothing to finish)
        assert dp.router.load == [0, 0]
        dp._abandon(running)  # the request is done: no abort
        assert sent == []
        later = _Running(0, None, _Outputs(), OutputAssembler("gone", None, [1]), None)  # type: ignore[arg-type]
        later.abandoned = True
        dp._running["gone"] = later
        dp.router.load[0] += 1
        dp._abandon(later)
        assert sent == [("abort", "gone")]
        dp._on_out(0, [("gone", False, None, 0, 0.0, 0.0, [(0, [7], 0, "x", None, None, None, None)], None)], [])
        assert dp._running["gone"] is later  # a delta before the end: dropped, still counted
        dp._on_out(0, [end], [])
        assert "gone" not in dp._running and dp.router.load == [0, 0]
    finally:
        replica.send = real_send
        dp._finish("gone")  # (after a failed assert: the fixture's figures as they were)


def test_a_delta_that_cannot_be_applied_fails_its_request_only(dp):
    """_deliver on the caller's loop: a bad delta fails its own request (no hang), the batch's next
    delta is still delivered, and a stale delta never finishes a later request of the same id."""

    async def run():
        loop = asyncio.get_running_loop()
        bad, good = (_Running(0, loop, _Outputs(), OutputAssembler(rid, None, [1]), None) for rid in ("bad", "good"))
        dp._running.update(bad=bad, good=good)
        dp.router.load[0] += 2
        done = ("good", True, None, 0, 0.0, 0.0, [(0, [7], 0, "x", "length", None, None, None)], None)
        dp._deliver([(bad, ("bad", True, None)), (good, done)])
        failed = await bad.queue.get()  # follow() raises what it finds there
        assert isinstance(failed, RuntimeError) and "could not be put together" in str(failed)
        out = await good.queue.get()
        assert out.finished and out.outputs[0].token_ids == [7]
        later = _Running(0, loop, _Outputs(), OutputAssembler("good", None, [1]), None)
        dp._running["good"] = later  # the id used again: the old request's end must not finish it
        dp.router.load[0] += 1
        assert dp._finish("good", expected=good) is None and dp._running["good"] is later
        assert dp._finish("good", expected=later) is later

    asyncio.run(run())
    assert "bad" not in dp._running and "good" not in dp._running and dp.router.load == [0, 0]


def test_a_dead_replica_fails_only_its_own_requests(dp):
    victim = dp.replicas[1]
    # a request on the victim whose caller's event loop has closed: failing it must not stop the
    # others from being failed
    closed = asyncio.new_event_loop()
    closed.close()
    dp._running["ghost"] = _Running(1, closed, asyncio.Queue(), OutputAssembler("ghost", None, [1]), None)

    async def run():
        slow = SamplingParams(max_tokens=400, ignore_eos=True)
        doomed = [dp.generate(chat_ids(dp, f"Long story {i}"), slow, user=f"v{i}") for i in range(2)]
        firsts = [await g.__anext__() for g in doomed]  # both running: one on each replica
        on_victim = [g for g, o in zip(doomed, firsts) if dp._running[o.request_id].replica == 1]
        survivor = [g for g in doomed if g not in on_victim]
        dp.router.load[1] += 1  # the ghost's (counted only now: the two above had to spread)
        victim.process.kill()
        with pytest.raises(RuntimeError, match="replica 1"):  # within seconds, not never
            await asyncio.wait_for(_drain(on_victim[0]), timeout=30)
        for g in survivor:
            await g.aclose()
        return await asyncio.gather(*[last(dp, chat_ids(dp, f"After {i}"), user="w") for i in range(3)])

    outs = asyncio.run(run())
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert dp.is_running and not victim.alive
    assert dp.router.alive == [True, False]
    assert "ghost" not in dp._running and dp.router.load == [0, 0]


def test_settings_are_checked_before_any_process_starts():
    from chatengine.app.server import ENGINE_FLAGS, build_parser

    with pytest.raises(ValueError, match="data_parallel_size must be an integer"):
        DataParallelLLM("dummy:tiny", data_parallel_size=0)
    with pytest.raises(ValueError, match="unknown engine settings"):
        DataParallelLLM("dummy:tiny", data_parallel_size=2, no_such_setting=1)
    args = build_parser().parse_args(["--data-parallel-size", "2", "--engine-process"])
    assert (args.data_parallel_size, args.engine_process) == (2, True)
    assert {"data_parallel_size", "engine_process"} <= set(ENGINE_FLAGS)


def test_a_send_to_a_replica_that_does_not_read_never_blocks_and_keeps_order():
    """The event loop sends a chat turn's prompt ids to a replica whose engine reads its pipe only now
    and then: 2 MB queued while nothing reads (a pipe holds ~64 KB) returns at once, in order; a
    value that does not pickle fails in the caller; after kill the sender stops; a broken pipe
    marks the replica gone."""
    import multiprocessing as mp

    from chatengine.engine.replicas.handle import ReplicaHandle

    ours, theirs = mp.Pipe(duplex=True)
    handle = ReplicaHandle.__new__(ReplicaHandle)
    handle.index, handle.conn, handle.alive = 0, ours, True
    handle.process = type("Gone", (), {"is_alive": lambda self: False})()
    handle._start_sender()
    queued = threading.Event()

    def fill() -> None:  # on a thread: a send that blocked would hang it, not the test
        if all(handle.send(("add", f"r{i}", None, list(range(5000)), None, None)) for i in range(100)):
            queued.set()

    threading.Thread(target=fill, daemon=True).start()
    assert queued.wait(5.0)
    with pytest.raises(TypeError):  # a lock does not pickle
        handle.send(("add", "bad", threading.Lock()))
    got = [theirs.recv()[1] for _ in range(100)]
    assert got == [f"r{i}" for i in range(100)]
    handle.kill()
    handle._sender.join(5.0)
    assert not handle._sender.is_alive()
    # a pipe that breaks: the sender marks the replica gone, and later sends say so
    ours2, theirs2 = mp.Pipe(duplex=True)
    handle.conn, handle.alive = ours2, True
    handle._start_sender()
    theirs2.close()
    handle.send(("abort", "r0"))
    handle._sender.join(5.0)
    assert not handle.alive and not handle.send(("abort", "r1"))


def test_a_mailbox_makes_the_newest_output_once_per_read():
    """A caller behind by several steps gets one output of all of them; a hand-over whose deltas an
    earlier output already held gives none (the caller waits for the next)."""

    def delta(n, finished=False):
        ids = list(range(1, n + 1))
        return ("r", finished, None, 0, 1.0, 2.0, [(0, ids[-1:], n - 1, "x", "length" if finished else None, None,
                None, None)], None)  # fmt: skip

    async def run():
        box, asm = _Outputs(), OutputAssembler("r", None, [9])
        for n in (1, 2):
            asm.add(delta(n))
            box.put_nowait(asm)  # two steps' hand-overs, not read yet
        first = await box.get()
        asm.add(delta(3))
        box.put_nowait(asm)
        box.put_nowait(asm)  # a second hand-over of the same deltas
        second = await box.get()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(box.get(), 0.05)
        asm.add(delta(4, finished=True))
        box.put_nowait(asm)
        return first, second, await box.get()

    first, second, last_one = asyncio.run(run())
    assert (first.outputs[0].token_ids, first.outputs[0].text, first.finished) == ([1, 2], "xx", False)
    assert (second.outputs[0].token_ids, second.outputs[0].text) == ([1, 2, 3], "xxx")
    assert (last_one.outputs[0].token_ids, last_one.outputs[0].finish_reason, last_one.finished) == (
        [1, 2, 3, 4],
        "length",
        True,
    )


@pytest.mark.slow  # six processes (two replicas of two gloo ranks): run with the whole suite (README)
def test_replicas_of_tensor_parallel_engines_give_one_engines_tokens():
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6], [4] * 20]
    settings = dict(num_kv_blocks=64, max_num_batched_tokens=64)
    dp = DataParallelLLM("dummy:tiny", data_parallel_size=2, tensor_parallel_size=2, **settings)
    try:
        got = asyncio.run(_all(dp, prompts))
        # (the figures a replica had at start also show no blocks used: wait for those after the run)
        rest = settled(dp, lambda s: s["kv_blocks_used"] == 0 and s["num_generated_tokens"] > 0)
        assert len(rest) == 2
    finally:
        dp.shutdown()
    one = LLM("dummy:tiny", **settings)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    finally:
        one.shutdown()
    assert got == want


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _all(engine, prompts):
    outs = await asyncio.gather(*[last(engine, p, user=f"t{i}") for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in outs]


def test_a_replicas_engine_chunks_for_its_relay():
    from chatengine.engine.replicas.replica import ReplicaSpec, start_engine

    engine = start_engine(ReplicaSpec(0, EngineConfig(model="dummy:tiny", device="cpu"), replicas=2))
    try:
        assert engine.relay_interval is not None
        assert [engine.relay_interval(n) for n in (64, 65, 300)] == [1, 2, 4]
    finally:
        engine.close()


def test_replicas_chunk_their_streams_as_more_run_unless_told():
    """Their one API process relays every replica's tokens: a token a chunk while all replicas
    together run up to 128 streams, then longer chunks (up to 4 steps); what the caller set wins."""
    from chatengine.engine.replicas.replica import relay_interval

    cpu = __import__("torch").device("cpu")
    specs = lambda config, size: _placement(config, cpu, size)  # noqa: E731
    assert [(s.config.stream_interval, s.replicas) for s in specs(EngineConfig(), 2)] == [(None, 2), (None, 2)]
    assert [s.config.stream_interval for s in specs(EngineConfig(stream_interval=3), 3)] == [3, 3, 3]
    two, one = relay_interval(2), relay_interval(1)
    assert [two(n) for n in (0, 1, 64, 65, 128, 129, 192, 193, 256, 1000)] == [1, 1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert [one(n) for n in (1, 128, 129, 256, 512)] == [1, 1, 2, 2, 4]
