"""Tiered KV: device -> host -> disk and back, bitwise; restores give the uncached answer; the disk
store survives restarts, ignores damage and other models; memory pressure completes correctly."""

import logging
import os
import threading
import time
import types

import pytest
import torch

from chatengine import LLM, SamplingParams
from chatengine.engine.kv.block_manager import owner_tag
from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.hashing import user_salt
from chatengine.engine.kv.tiers import TieredCache

GREEDY = SamplingParams(temperature=0, max_tokens=10)
SHAPE = (2, 2, 4, 2, 8)  # (layers, K/V, block_size, kv_heads, head_dim)


def chat(topic):
    return [
        {
            "role": "user",
            "content": f"{topic.capitalize()}! Write two careful sentences about {topic}, "
            f"for a curious child who asked about it at breakfast this morning.",
        }
    ]


def lookup_settled(tiers, hashes, token_lists) -> int:
    """TieredCache.lookup, again until no read from disk is under way: the host hits then."""
    n, loading = tiers.lookup(hashes, token_lists)
    while loading:
        tiers.wait_for_loads(5.0)
        n, loading = tiers.lookup(hashes, token_lists)
    return n


def put(tiers, meta, page) -> bool:
    """A write-back as the engine makes it, with the copy landed at once: claim a slot, fill it."""
    stored, slot = tiers.claim(meta)
    if slot is not None:
        tiers.host.data[slot].copy_(page)
    return stored


def metas(n, seed=0):
    return [BlockMeta(bytes([seed, i]) * 8, b"\0" * 16, tuple(range(i, i + 4))) for i in range(n)]


def test_host_disk_round_trip_is_bitwise(tmp_path):
    tiers = TieredCache(
        b"r" * 16, SHAPE, torch.bfloat16, cpu_blocks=2, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
    )
    pages = torch.randn(5, *SHAPE).to(torch.bfloat16)
    ms = metas(5)
    for m, p in zip(ms, pages):
        assert put(tiers, m, p)
    tiers.disk.flush()
    assert tiers.stats()["cpu_blocks_used"] == 2 and tiers.stats()["disk_blocks"] == 3  # 3 spilled
    hashes = [m.hash for m in ms]
    assert tiers.lookup(hashes[:2], [m.token_ids for m in ms[:2]]) == (0, True)  # reads from disk started
    assert lookup_settled(tiers, hashes[:2], [m.token_ids for m in ms[:2]]) == 2  # in host memory now
    tiers.pin(hashes[:2])
    got = tiers.host.data[tiers.host_slots(hashes[:2])]
    tiers.unpin(hashes[:2])
    assert torch.equal(got.view(torch.int16), pages[:2].view(torch.int16))
    # a token mismatch (a hash collision) is a miss
    assert tiers.lookup([hashes[0]], [(9, 9, 9, 9)]) == (0, False)
    tiers.close()
    files = list((tmp_path / (b"r" * 16).hex()).glob("*/*.kv"))
    assert all(os.stat(f).st_mode & 0o077 == 0 for f in files)  # private to the server


def test_device_copies_land_before_the_host_touches_their_slots(tmp_path):
    # the engine claims host slots and queues device copies into them (no host wait); a slot is read
    # (spill, flush) or overwritten (put) only after its copy has landed
    tiers = TieredCache(
        b"r" * 16, SHAPE, torch.float32, cpu_blocks=2, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
    )
    pages, ms = torch.randn(4, *SHAPE), metas(4)

    class Copy:  # a device copy that lands when waited for, not before
        def __init__(self, slot, page):
            self.slot, self.page = slot, page

        def synchronize(self):
            tiers.host.data[self.slot].copy_(self.page)

    def claim_and_queue(i):
        stored, slot = tiers.claim(ms[i])
        assert stored and slot is not None
        tiers.landing([slot], Copy(slot, pages[i]))
        return slot

    first = claim_and_queue(0)
    claim_and_queue(1)
    assert tiers.claim(ms[1]) == (True, None)  # here already: nothing to copy
    assert claim_and_queue(2) == first  # spills block 0 to disk, then reuses its slot
    tiers.disk.flush()
    assert torch.equal(tiers.disk.read(ms[0].hash)[1], pages[0])
    tiers.pin([ms[1].hash, ms[2].hash])
    assert tiers.claim(ms[3]) == (False, None)  # every slot pinned: not stored
    tiers.unpin([ms[1].hash, ms[2].hash])
    tiers.flush()  # writes every host block, each landed
    assert torch.equal(tiers.disk.read(ms[1].hash)[1], pages[1]) and not tiers.host.landing
    claim_and_queue(3)
    assert tiers.drop_owner(b"") == 5  # 2 in host memory, 3 on disk
    assert not tiers.host.landing  # landed before their slots were freed
    tiers.close()


def test_disk_store_index_rebuilt_damage_dropped_other_root_ignored(tmp_path):
    tiers = TieredCache(
        b"a" * 16, SHAPE, torch.float32, cpu_blocks=0, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
    )
    pages = torch.randn(3, *SHAPE)
    ms = metas(3)
    for m, p in zip(ms, pages):
        tiers.disk.write_behind(m, p, block=True)
    tiers.close()
    reopened = TieredCache(
        b"a" * 16, SHAPE, torch.float32, cpu_blocks=4, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
    )
    assert reopened.stats()["disk_blocks"] == 3
    victim = reopened.disk.path(ms[1].hash)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # flip a payload byte: the checksum fails
    victim.write_bytes(bytes(data))
    assert lookup_settled(reopened, [m.hash for m in ms], [m.token_ids for m in ms]) == 1  # stops at the damage
    assert not victim.exists() and reopened.stats()["disk_damaged_files"] == 1
    stub = reopened.disk.path(ms[2].hash)
    stub.write_bytes(stub.read_bytes()[:5])  # cut inside the fixed prefix (a crash, a full disk)
    assert (
        TieredCache(
            b"a" * 16, SHAPE, torch.float32, cpu_blocks=4, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
        ).stats()["disk_blocks"]
        == 1
    )  # dropped at the scan
    assert not stub.exists()
    other = TieredCache(
        b"b" * 16, SHAPE, torch.float32, cpu_blocks=4, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 20
    )
    assert other.stats()["disk_blocks"] == 0 and other.lookup([ms[0].hash], [ms[0].token_ids]) == (0, False)


def stall(disk) -> None:
    """The writer stops as if stuck on a slow disk (not closed): nothing leaves the queue."""
    disk.queue.put(None)
    disk.writer.join(10)
    assert not disk.writer.is_alive() and not disk.closed


def test_disk_reserve_takes_the_free_room_and_counts_the_rest_dropped(tmp_path):
    # the engine copies pages off the device only for writes the queue takes now
    tiers = TieredCache(
        b"r" * 16, SHAPE, torch.float32, cpu_blocks=0, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 30
    )
    disk = tiers.disk
    stall(disk)
    assert disk.reserve(0) == 0 and disk.num_dropped == 0
    assert disk.reserve(300) == 256 and disk.num_dropped == 44
    ms = metas(200) + metas(57, seed=1)
    for m in ms[:255]:
        assert disk.write_behind(m, torch.zeros(SHAPE))
    assert disk.reserve(3) == 1 and disk.num_dropped == 46
    assert disk.write_behind(ms[255], torch.zeros(SHAPE)) and disk.reserve(1) == 0
    assert not disk.write_behind(ms[256], torch.zeros(SHAPE))  # full: dropped, not blocked


def test_a_host_pool_spilling_never_waits_on_the_disk(tmp_path):
    """The host LRU spills to disk while the writer is behind (its queue full): the spilled pages are
    dropped, counted, and claim() returns at once; a page already on disk is not written again."""
    tiers = TieredCache(
        b"s" * 16, SHAPE, torch.float32, cpu_blocks=2, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=1 << 30
    )
    ms = metas(6)
    assert put(tiers, ms[0], torch.ones(SHAPE)) and put(tiers, ms[1], torch.ones(SHAPE))
    tiers.disk.write_behind(ms[0], torch.ones(SHAPE))
    tiers.disk.flush()  # ms[0] on disk already
    stall(tiers.disk)
    for m in metas(256, seed=9):
        assert tiers.disk.write_behind(m, torch.zeros(SHAPE))  # the queue full
    assert put(tiers, ms[2], torch.ones(SHAPE))  # spills ms[0]: on disk, nothing to write
    assert tiers.disk.num_dropped == 0
    spill = threading.Thread(target=put, args=(tiers, ms[3], torch.ones(SHAPE)), daemon=True)
    spill.start()  # spills ms[1]: the queue is full, dropped, not blocked
    spill.join(timeout=10)
    assert not spill.is_alive(), "the spill waited on the disk writer"
    assert tiers.disk.num_dropped == 1 and ms[1].hash not in tiers.host and ms[3].hash in tiers.host


def test_disk_budget_evicts_oldest(tmp_path):
    one = 4 * 2 * 2 * 4 * 2 * 8 + 600  # a page plus its header, roughly
    tiers = TieredCache(
        b"c" * 16, SHAPE, torch.float32, cpu_blocks=0, pin=False, disk_dir=str(tmp_path), disk_budget_bytes=3 * one
    )
    ms = metas(6)
    for m in ms:
        tiers.disk.write_behind(m, torch.randn(*SHAPE), block=True)
    tiers.disk.flush()
    assert 1 <= tiers.stats()["disk_blocks"] <= 3
    assert ms[-1].hash in tiers.disk and ms[0].hash not in tiers.disk
    tiers.close()


def test_idle_conversation_comes_back_from_host_memory(llm):
    # 12 device blocks: other users' chats push the first one's pages out to host memory
    small = LLM(
        num_kv_blocks=12, cpu_offload_gib=0.05, max_num_batched_tokens=256, debug_checks=True, quantization="none"
    )
    first = small.chat(chat("volcanoes"), GREEDY)[0]
    for topic in ("glaciers", "tides", "comets", "bees", "clouds", "maps", "moss"):
        small.chat(chat(topic), GREEDY)
    stats = small.stats()
    assert stats["evictions"] > 0 and stats["cpu_blocks_used"] > 0
    again = small.chat(chat("volcanoes"), GREEDY)[0]
    full_blocks = (len(first.prompt_token_ids) - 1) // 16 * 16
    assert again.num_cached_tokens == full_blocks
    assert small.stats()["blocks_restored"] > 0
    assert (
        again.outputs[0].token_ids
        == first.outputs[0].token_ids
        == llm.chat(chat("volcanoes"), GREEDY)[0].outputs[0].token_ids
    )
    assert small.stats()["kv_blocks_used"] == 0


def test_restart_restores_from_disk(tmp_path, llm):
    kv = str(tmp_path / "kv")
    convo = chat("the history of tea in three short parts")
    reference = llm.chat(convo, GREEDY)[0].outputs[0].token_ids
    a = LLM(kv_store_dir=kv, max_num_batched_tokens=256, kv_cache_gib=0.05, quantization="none")
    out_a = a.chat(convo, GREEDY, user="alice")[0]
    a.shutdown()  # flushes every cached block to disk
    b = LLM(kv_store_dir=kv, max_num_batched_tokens=256, kv_cache_gib=0.05, debug_checks=True, quantization="none")
    assert b.stats()["disk_blocks"] > 0
    assert b.chat(convo, GREEDY, user="bob")[0].num_cached_tokens == 0  # another user: no hit
    out_b = b.chat(convo, GREEDY, user="alice")[0]
    assert out_b.num_cached_tokens == (len(out_a.prompt_token_ids) - 1) // 16 * 16
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids == reference
    # damage every file: the next process treats them as misses and deletes them
    b.shutdown()
    root_dirs = [d for d in (tmp_path / "kv").iterdir() if d.is_dir()]
    files = [f for d in root_dirs for f in d.glob("*/*.kv")]
    for f in files:
        f.write_bytes(f.read_bytes()[:-7])
    c = LLM(kv_store_dir=kv, max_num_batched_tokens=256, kv_cache_gib=0.05, quantization="none")
    out_c = c.chat(convo, GREEDY, user="alice")[0]
    assert out_c.num_cached_tokens == 0 and out_c.outputs[0].token_ids == reference
    assert c.stats()["disk_damaged_files"] >= 1
    c.shutdown()


def test_a_prefix_coming_from_disk_does_not_hold_up_others(tmp_path, monkeypatch):
    """A returning conversation whose cached prefix is on disk waits for the reader thread; other
    requests keep running meanwhile (the engine never stalls on the read); then it restores."""
    import threading

    from chatengine.engine.kv.disk_store import DiskStore

    kv, params = str(tmp_path / "kv"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    returning, other = list(range(1, 60)), list(range(150, 180))
    first = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32)
    expect = first.generate([returning], params)[0].outputs[0].token_ids
    first.shutdown()  # its 3 full blocks now live on disk
    plain = LLM("dummy:tiny", num_kv_blocks=32)
    expect_other = plain.generate([other], params)[0].outputs[0].token_ids
    e = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32).engine
    gate, real = threading.Event(), DiskStore.read_into
    monkeypatch.setattr(DiskStore, "read_into", lambda self, h, out: gate.wait(30) and real(self, h, out))
    try:
        slow, fast = e.add_request(returning, params), e.add_request(other, params)
        done = {}
        for _ in range(8):  # the slow disk holds back only its own request
            done.update((o.request_id, o) for o in e.step() if o.finished)
        assert set(done) == {fast} and done[fast].outputs[0].token_ids == expect_other
        assert e.tiers.loads_in_flight() and e.scheduler.waiting
    finally:
        gate.set()
    while e.has_unfinished_requests():
        done.update((o.request_id, o) for o in e.step() if o.finished)
    assert done[slow].num_cached_tokens == 48 and done[slow].outputs[0].token_ids == expect
    assert e.tiers.stats()["blocks_restored"] == 3
    e.close()


def test_another_model_ignores_the_directory(tmp_path):
    kv = str(tmp_path / "kv")
    a = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32, seed=1)
    a.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4))
    a.shutdown()
    assert a.stats()["disk_blocks"] > 0
    b = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32, seed=2)  # other weights: other fingerprint
    assert b.stats()["disk_blocks"] == 0
    assert b.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4))[0].num_cached_tokens == 0
    same = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32, seed=1)
    assert same.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4))[0].num_cached_tokens == 32


@pytest.mark.slow  # a long run under memory pressure: left out of CI, run with the whole suite (README)
def test_memory_pressure_completes_correctly(llm):
    topics = ["owls", "deserts", "bridges", "pianos", "lighthouses", "coral reefs", "trains", "honey"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.chat([chat(t) for t in topics], params)]
    # 8 conversations of ~54 + 40 tokens share a ~2-block template prefix; 20 blocks cannot hold
    # them all as they grow: preemption + eviction + restore from host memory
    tight = LLM(
        num_kv_blocks=20, cpu_offload_gib=0.05, max_num_batched_tokens=128, debug_checks=True, quantization="none"
    )
    outs = tight.chat([chat(t) for t in topics], params)
    stats = tight.stats()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert stats["num_preemptions"] > 0 and stats["blocks_restored"] > 0
    assert stats["kv_blocks_used"] == 0
    tight.engine.check_invariants()


def test_forget_user_drops_their_blocks(tmp_path):
    kv = str(tmp_path / "kv")
    e = LLM("dummy:tiny", kv_store_dir=kv, num_kv_blocks=32)
    e.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4), user="zoe")
    e.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=4), user="yan")
    e.engine.flush_kv()
    before = e.stats()["disk_blocks"]
    assert e.forget_user("zoe") > 0
    assert e.stats()["disk_blocks"] == before - 2  # zoe's two full blocks are gone
    assert (
        e.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4), user="zoe")[0].num_cached_tokens == 0
    )
    assert (
        e.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=4), user="yan")[
            0
        ].num_cached_tokens
        == 32
    )
    e.shutdown()


def test_forget_prompts_drops_one_conversations_pages_from_every_tier(tmp_path):
    """A deleted conversation's private pages leave the device, host memory and disk; the same
    user's other conversation and a public persona prefix keep theirs."""
    p = SamplingParams(temperature=0, max_tokens=4)
    e = LLM("dummy:tiny", kv_store_dir=str(tmp_path / "kv"), num_kv_blocks=32, register_personas=False)
    e.engine.personas["p"] = list(range(200, 220))  # a public prefix: 20 tokens, its first block shared
    gone, kept = list(range(200, 220)) + list(range(40)), list(range(200, 220)) + list(range(100, 140))
    e.generate([gone], p, user="zoe")
    e.generate([kept], p, user="zoe")
    e.engine.offload_cached_blocks()  # some pages to host memory ...
    e.engine.flush_kv()  # ... and all of them to disk
    disk = e.engine.tiers.disk
    before = len(disk.index)
    dropped = e.forget_prompts("zoe", [gone + [7, 7, 7]])  # the stored branch runs past the cached blocks
    assert dropped > 0
    assert len(disk.index) == before - 2  # the private full blocks 16..31 and 32..47 of `gone`, on disk
    assert e.generate([gone], p, user="zoe")[0].num_cached_tokens == 16  # only the public persona block
    assert e.generate([kept], p, user="zoe")[0].num_cached_tokens == 48
    e.shutdown()


def test_forget_user_never_waits_for_the_disk_writer(tmp_path):
    """The engine's thread forgets: behind a stuck writer it must not wait, and the user's queued
    pages are never written."""
    e = LLM("dummy:tiny", kv_store_dir=str(tmp_path / "kv"), num_kv_blocks=32, register_personas=False)
    disk = e.engine.tiers.disk
    stall(disk)
    e.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=4), user="zoe")
    e.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=4), user="yan")
    assert len(disk.pending) == 4  # both users' two full blocks, written behind
    forgot = threading.Thread(target=e.forget_user, args=("zoe",), daemon=True)
    forgot.start()
    forgot.join(10)
    assert not forgot.is_alive()
    while not disk.queue.empty():  # the writer comes back
        disk._take(disk.queue.get_nowait())
    owner = {u: owner_tag(user_salt(e.engine.secret, u)) for u in ("zoe", "yan")}
    assert [meta.owner for _, _, meta in disk.index.values()] == [owner["yan"]] * 2
    e.shutdown()


def test_forget_refuses_a_missing_user_and_bad_ids_and_drops_nothing():
    """None names the pages every caller without a user shares: never one user's to drop."""
    e = LLM("dummy:tiny", num_kv_blocks=32, register_personas=False)
    e.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=1))  # single-tenant pages
    e.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=1), user="bob")
    cached = e.stats()["kv_blocks_cached"]
    for user in (None, "", 7):
        with pytest.raises(ValueError, match="user id"):
            e.forget_user(user)
    with pytest.raises(ValueError, match="token ids"):
        e.forget_prompts("bob", [[-1] * 40])
    for prompts in ("abc", [5, 6]):
        with pytest.raises(ValueError, match="list of token id lists"):
            e.forget_prompts("bob", prompts)
    assert e.stats()["kv_blocks_cached"] == cached == 4
    assert e.forget_prompts("bob", [[], list(range(100, 140))]) == 2  # an empty branch is no error
    e.shutdown()


def test_a_bad_forget_is_refused_to_its_caller_and_the_engine_thread_serves_on():
    """AsyncLLM checks forget's arguments in the caller's thread; an item that fails on the engine's
    thread anyway is logged there, and every other caller is served on."""
    import asyncio

    engine = __import__("chatengine").AsyncLLM("dummy:tiny", num_kv_blocks=32)

    async def one(rid):
        async for out in engine.generate(list(range(30)), SamplingParams(temperature=0, max_tokens=20), request_id=rid):
            pass
        return out

    async def main():
        running = asyncio.create_task(one("a"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="user id"):
            engine.forget_user("")
        with pytest.raises(ValueError, match="token ids"):
            engine.forget_prompts("bob", [[-1] * 40])
        engine.post(("forget", ""))  # past the check: fails on the engine's thread
        return await asyncio.wait_for(running, 30), await asyncio.wait_for(one("b"), 30)

    try:
        a, b = asyncio.run(main())
        assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 20
        assert engine.is_running
    finally:
        engine.shutdown()


def test_a_request_aborted_while_its_pages_come_from_disk_leaves_no_host_slot_taken(tmp_path):
    """Its reads finish after it has gone and no lookup comes back for them: the host pool takes
    their slots back when it needs room, and a later request still finds its pages on disk."""
    kw = dict(
        kv_store_dir=str(tmp_path), cpu_offload_gib=0.0, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=128
    )
    greedy = SamplingParams(temperature=0, max_tokens=1)
    prompts = [[(7 * i + 13 * j) % 256 for j in range(120)] for i in range(6)]
    first = LLM("dummy:tiny", **kw)
    first.generate(prompts, greedy)
    first.shutdown()
    e = LLM("dummy:tiny", **kw).engine
    host = e.tiers.host
    for i in range(3):
        e.add_request(prompts[i], greedy, request_id=f"x{i}")
        e.step()  # its pages are found on disk: the reads start and it waits for them
        assert host.loading
        e.abort(f"x{i}")
    deadline = time.monotonic() + 30  # their reads end; nothing comes back for them
    while not all(load.done() for _, load in host.loading.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    e.add_request(prompts[5], greedy, request_id="y")
    while e.has_unfinished_requests():
        for out in e.step():
            assert out.num_cached_tokens == 112  # 7 of its 7 full blocks, from disk
    assert len(host.free_slots) + len(host.index) == host.num_blocks
    e.check_invariants()
    e.close()


def test_idle_pages_move_to_host_memory_proactively():
    import asyncio
    import time

    engine = __import__("chatengine").AsyncLLM("dummy:tiny", num_kv_blocks=32, idle_offload_s=0.2)

    async def one():
        async for out in engine.generate(list(range(50)), SamplingParams(temperature=0, max_tokens=3)):
            pass
        return out

    try:
        first = asyncio.run(one())
        bm = engine.engine.block_manager
        assert bm.num_cached_free_blocks + engine.engine.tiers.stats()["cpu_blocks_used"] == 3
        deadline = time.monotonic() + 10  # the 3 full blocks, once idle, move out
        while engine.stats()["cpu_blocks_used"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["cpu_blocks_used"] == 3  # stats() is the loop's snapshot
        assert engine.stats()["kv_blocks_cached"] == 0
        again = asyncio.run(one())
        assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        engine.shutdown()


def test_a_slow_shutdown_says_where_its_time_went(tmp_path, monkeypatch, caplog):
    """An engine whose close takes long (a big flush to a slow disk) logs the flush's, the tiers'
    and the runner's shares; a quick one logs nothing."""
    from chatengine.engine import llm_engine

    llm = LLM("dummy:tiny", kv_store_dir=str(tmp_path), num_kv_blocks=64, register_personas=False)
    llm.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    clock = [0.0, 7.0, 8.5, 9.0]  # the close's four readings
    fake = types.SimpleNamespace(**vars(time))  # the engine module's clock only
    fake.perf_counter = lambda: clock.pop(0) if len(clock) > 1 else clock[0]
    monkeypatch.setattr(llm_engine, "time", fake)
    with caplog.at_level(logging.INFO, logger="chatengine"):
        llm.shutdown()
    assert "engine closed in 9.0 s: KV flush 7.0 s, tiers 1.5 s, runner 0.5 s" in caplog.text
