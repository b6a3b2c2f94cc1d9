"""Tensor parallelism on CPU with gloo: the split layers equal the whole ones (two ranks, two
processes), every rank loads the same weights and keeps its slice, and an engine over two ranks gives
TP=1's greedy tokens with prefix-cache hits, n > 1 samples and pages back from the host tier. A rank
that dies is a clear error at once, an idle engine outlives the collective timeout, and shutdown
stops the ranks."""

import asyncio
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn import functional as F

from chatengine import LLM, AsyncLLM, SamplingParams
from chatengine.engine.loader import load_model
from chatengine.engine.models.llama import LlamaModel
from chatengine.engine.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from chatengine.engine.parallel import group as group_module
from chatengine.engine.parallel import one_shot, vocab_sampling
from chatengine.engine.parallel.group import TPGroup, connect_store, host_store
from chatengine.engine.parallel.vocab_sampling import Finish

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [list(range(1, 40)), list(range(50, 70)), list(range(3, 100)), [7] * 33]


# ---- the layers over two ranks (two processes) ----------------------------------------------------
def _check_layers(group: TPGroup) -> None:
    rank, g = group.rank, torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g)

    col = ColumnParallelLinear(12, 4, True, group)  # 8 outputs over 2 ranks
    w, b = torch.randn(8, 12, generator=g), torch.randn(8, generator=g)
    col.load_parts([(w, 4)])
    col.load_parts([(b, 4)], "bias")
    torch.testing.assert_close(col(x), F.linear(x, w, b)[:, rank * 4 : (rank + 1) * 4])

    # q: 4 heads of 2 dims (2 a rank); k, v: 1 head, replicated on both ranks
    qkv = QKVParallelLinear(12, 2, num_heads=2, num_kv_heads=1, bias=False, group=group)
    q, k, v = torch.randn(8, 12, generator=g), torch.randn(2, 12, generator=g), torch.randn(2, 12, generator=g)
    qkv.load(q, k, v)
    out = qkv(x)
    torch.testing.assert_close(out[:, :4], F.linear(x, q)[:, rank * 4 : (rank + 1) * 4])
    torch.testing.assert_close(out[:, 4:], torch.cat([F.linear(x, k), F.linear(x, v)], -1))

    gate_up = MergedColumnParallelLinear(12, 3, group)  # intermediate 6 over 2 ranks
    gate, up = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
    gate_up.load(gate, up)
    mine = slice(rank * 3, (rank + 1) * 3)
    torch.testing.assert_close(gate_up(x), torch.cat([F.linear(x, gate)[:, mine], F.linear(x, up)[:, mine]], -1))

    row = RowParallelLinear(4, 12, group)  # 8 inputs over 2 ranks, partial sums all-reduced
    w_row, h = torch.randn(12, 8, generator=g), torch.randn(5, 8, generator=g)
    row.load(w_row)
    torch.testing.assert_close(row(h[:, rank * 4 : (rank + 1) * 4]), F.linear(h, w_row), rtol=1e-5, atol=1e-5)

    ids = torch.tensor([0, 4, 9, 10, 3, 5])
    emb, head = torch.randn(11, 12, generator=g), torch.randn(11, 12, generator=g)  # vocab 11: padded to 12
    embedding = VocabParallelEmbedding(11, 12, group)
    embedding.load(emb)
    torch.testing.assert_close(embedding(ids), emb[ids])
    lm_head = ParallelLMHead(12, 11, group)  # each rank its 6 columns; rank 1's last one is padding
    lm_head.load(head)
    whole, mine = F.linear(x, head), lm_head(x)
    assert mine.shape == (5, 6)
    torch.testing.assert_close(mine[:, : 6 - rank], whole[:, rank * 6 : 11 if rank else 6])
    torch.testing.assert_close(group.all_gather_last(mine)[:, :11], whole)
    _check_draw_from_slices(group)


def _check_draw_from_slices(group: TPGroup) -> None:
    """Greedy tokens drawn from the ranks' slices of a vocabulary of 11 are the whole rows' argmax:
    the padding column is never drawn, and a tie goes to the lowest column."""
    rows = torch.tensor(
        [
            [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # the best in rank 1's slice
            [9.0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1],  # a tie across the ranks: column 0
            [-5.0, -4, -3, -2, -1, -9, -9, -9, -9, -9, -9],  # all negative: rank 1's padding (0) must lose
            [1.0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # all equal: column 0
            [0.0, 0, 0, 0, 0, 0, 0, 3, 0, 3, 0],  # a tie inside rank 1's slice: its first
        ]
    )
    mine = torch.zeros(5, 6)  # the last rank's slice padded past the vocabulary with zeros
    mine[:, : 6 - group.rank] = rows[:, group.rank * 6 : 11 if group.rank else 6]
    finish = Finish(rows=None, slices=True, greedy=True)
    drawn = vocab_sampling.draw(mine, torch.zeros(5), finish, group, vocab_size=11)
    assert drawn.tolist() == rows.argmax(-1).tolist() == [10, 0, 4, 0, 7]


def _layers_on_rank(rank: int, address: str, out: dict) -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # inference layers
    group = TPGroup.join(rank, 2, connect_store(address, 2), "cpu")
    try:
        _check_layers(group)
        out[rank] = "ok"
    finally:
        group.leave()


def test_split_layers_equal_the_whole_ones():
    ctx = mp.get_context("spawn")
    store, address = host_store(2)  # both ranks connect to it: neither has to start first
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_layers_on_rank, args=(r, address, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert dict(out) == {0: "ok", 1: "ok"}, [p.exitcode for p in procs]


def test_one_rank_is_the_plain_layers_without_collectives(monkeypatch):
    def no_collectives(*args, **kwargs):
        raise AssertionError("a collective on one rank")

    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, no_collectives, raising=False)
    one, g = TPGroup.single(torch.device("cpu")), torch.Generator().manual_seed(1)
    x, h = torch.randn(5, 12, generator=g), torch.randn(5, 8, generator=g)
    q, k, v, b = (torch.randn(n, *rest, generator=g) for n, *rest in ((8, 12), (2, 12), (2, 12), (12,)))
    qkv = QKVParallelLinear(12, 2, num_heads=4, num_kv_heads=1, bias=True, group=one)
    qkv.load(q, k, v)
    qkv.load(b[:8], b[8:10], b[10:], "bias")
    assert torch.equal(qkv(x), F.linear(x, torch.cat([q, k, v]), b))  # the plain matmul, no collective
    row, w_row = RowParallelLinear(8, 12, one), torch.randn(12, 8, generator=g)
    row.load(w_row)
    assert torch.equal(row(h), F.linear(h, w_row))
    embedding, lm_head = VocabParallelEmbedding(8, 12, one), ParallelLMHead(12, 8, one)
    embedding.load(q)
    lm_head.load(q)
    ids = torch.tensor([0, 7, 3])
    assert embedding.weight.shape == (8, 12) and torch.equal(embedding(ids), q[ids])
    assert torch.equal(lm_head(x), F.linear(x, q))
    llm = LLM("dummy:tiny", num_kv_blocks=16)
    assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    llm.shutdown()


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen"])  # KV heads split; one KV head replicated
def test_each_rank_keeps_its_slice_of_the_same_weights(shape):
    """Loading needs no collective: the two ranks' models, built in one process, put back together
    are the one-rank model (the dummy loader makes the same full weights from the seed each time)."""
    torch.set_grad_enabled(False)
    whole, halves = _model(shape, TPGroup()), [_model(shape, TPGroup(r, 2)) for r in range(2)]
    cfg = whole.config
    D, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for name, w in whole.named_parameters():
        parts = [dict(h.named_parameters())[name] for h in halves]
        if "qkv_proj" in name:  # rank r: [its half of the q heads | its KV heads' k | their v]
            q, k, v = w.split([H * D, KV * D, KV * D])
            for r, part in enumerate(parts):
                n_kv, first = kv_heads_per_rank(KV, TPGroup(r, 2)), r * KV // 2  # one KV head: on both
                kv = slice(first * D, (first + n_kv) * D)
                assert torch.equal(part, torch.cat([q[r * H * D // 2 : (r + 1) * H * D // 2], k[kv], v[kv]]))
        elif "gate_up" in name:
            n = parts[0].shape[0] // 2
            assert torch.equal(torch.cat([p[:n] for p in parts] + [p[n:] for p in parts]), w)
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), w)
        elif "embed_tokens" in name or "lm_head" in name:
            assert torch.equal(torch.cat(parts)[: w.shape[0]], w)
        else:  # norms: replicated
            assert torch.equal(parts[0], w) and torch.equal(parts[1], w)


def _model(shape: str, group: TPGroup) -> LlamaModel:
    loaded = load_model(f"dummy:{shape}", seed=5)
    model = LlamaModel(loaded.config, None, 64, group)
    model.load_hf_state_dict(loaded.state_dict)
    return model


def test_kv_heads_are_split_or_replicated():
    two = TPGroup(0, 2)
    assert kv_heads_per_rank(8, two) == 4 and kv_heads_per_rank(1, two) == 1
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kv_heads_per_rank(2, TPGroup(0, 3))


def test_the_one_shot_sum_takes_what_fits_and_nccl_the_rest(monkeypatch):
    """Small sums go through the one-shot path (a new tensor), bigger ones through the ring in place;
    its size limit shrinks as ranks (peer copies to read) grow; no one-shot without CUDA."""
    assert [one_shot.max_bytes_for(n) for n in (2, 4, 8)] == [2 << 20, 512 << 10, 256 << 10]
    assert one_shot.try_one_shot(torch.device("cpu"), 2) is None
    real = one_shot.OneShotAllReduce.__new__(one_shot.OneShotAllReduce)  # its buffer needs CUDA
    real.max_bytes = 64
    assert real.fits(torch.ones(16)) and real.fits(torch.ones(32, dtype=torch.bfloat16))
    assert not real.fits(torch.ones(17))  # too big
    assert not real.fits(torch.ones(8, dtype=torch.float16))  # torch's kernel sums bf16 and fp32 only
    assert not real.fits(torch.ones(3, dtype=torch.bfloat16))  # 6 bytes: not whole 4-byte words
    assert not real.fits(torch.ones(4, 4).t())  # not contiguous
    real.buffer = torch.zeros(64, dtype=torch.uint8)  # (a CPU stand-in for the peer-mapped buffer)
    view = real.buffer_for((2, 8), torch.float32)
    assert view.shape == (2, 8) and view.data_ptr() == real.buffer.data_ptr()
    assert real.buffer_for((2, 9), torch.float32) is None and real.buffer_for((4,), torch.float16) is None

    class FakeOneShot:
        max_bytes = 64

        def fits(self, x):
            return x.numel() * x.element_size() <= self.max_bytes

        def __call__(self, x):
            return x * 2

    rings = []
    monkeypatch.setattr(group_module.dist, "all_reduce", lambda x: rings.append(x.numel()))
    g = TPGroup(0, 2, one_shot=FakeOneShot())
    small, big = torch.ones(16), torch.ones(17)
    assert torch.equal(g.all_reduce(small), torch.full((16,), 2.0)) and rings == []
    assert g.all_reduce(big) is big and rings == [17]


def test_in_place_sums_take_two_shot_at_two_ranks_unless_told(monkeypatch):
    monkeypatch.delenv("CHATENGINE_IN_PLACE_SUM", raising=False)
    assert [one_shot.in_place_kernel(n) for n in (2, 4, 8)] == ["two-shot", "one-shot", "one-shot"]
    monkeypatch.setenv("CHATENGINE_IN_PLACE_SUM", "one-shot")
    assert one_shot.in_place_kernel(2) == "one-shot"
    monkeypatch.setenv("CHATENGINE_IN_PLACE_SUM", "three-shot")
    with pytest.raises(ValueError, match="one-shot or two-shot"):
        one_shot.in_place_kernel(2)


def test_a_row_parallel_layer_writes_its_partial_sums_where_the_one_shot_sum_reads_them():
    """With a sum buffer on offer the matmul's output goes there and is what gets all-reduced (no
    copy); the result is the plain layer's."""
    buffer, summed = torch.empty(3, 5), []

    class Group(TPGroup):
        def sum_buffer(self, shape, dtype):
            return buffer if shape == (3, 5) else None

        def all_reduce(self, x):
            summed.append(x)
            return x.clone()

    torch.manual_seed(0)
    layer = RowParallelLinear(4, 5, Group(0, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():  # (as the engine runs)
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and summed[-1] is buffer
        layer(torch.randn(2, 4))  # no buffer for this shape: an ordinary tensor
    assert summed[-1] is not buffer


def test_a_split_layer_picks_the_invariant_tiles_of_the_whole_layer():
    """Deterministic mode's tile configuration is chosen by the whole layer's width on every rank,
    replicated KV heads counted once (e.g. 2 query heads + 2 x 1 KV head of 64 at TP=2: 256)."""
    g = TPGroup(0, 2)
    qkv = QKVParallelLinear(32, 64, 1, 1, False, g, all_kv_heads=1)  # one KV head, on both ranks
    assert qkv.width == (2 + 2 * 1) * 64 == QKVParallelLinear(32, 64, 2, 1, False, TPGroup()).width  # TP=1's
    assert MergedColumnParallelLinear(32, 48, g).width == 2 * 48 * 2
    assert RowParallelLinear(48, 32, g).width == 32 and ParallelLMHead(32, 100, g).width == 100


def test_a_split_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_heads \(9\) must be divisible by tensor_parallel_size \(2\)"):
        LLM("dummy:smollm2-135m", tensor_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        LLM("dummy:tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="kv_store_dir"):
        LLM("dummy:tiny", tensor_parallel_size=2, kv_store_dir="/tmp/x")


def test_serve_has_the_flag():
    from chatengine.app.server import ENGINE_FLAGS, build_parser

    assert "tensor_parallel_size" in ENGINE_FLAGS
    assert build_parser().parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2


# ---- an engine over two ranks ---------------------------------------------------------------------
def _tokens(outs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen"])  # KV heads split; one KV head replicated
def test_tp2_gives_tp1_greedy_tokens_with_cache_hits_samples_and_host_restores(shape):
    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    others = [list(range(100 + 7 * i, 200 + 7 * i)) for i in range(3)]  # 3 x 7 blocks: the pool is 24
    opts = dict(num_kv_blocks=24, cpu_offload_gib=0.01, seed=3, debug_checks=True)
    results = []
    for tp in (1, 2):
        llm = LLM(f"dummy:{shape}", tensor_parallel_size=tp, **opts)
        try:
            first = llm.generate(PROMPTS, GREEDY)
            again = llm.generate(PROMPTS[:1], GREEDY)[0]  # the same prompt: its full blocks hit
            samples = llm.generate([PROMPTS[2]], seeded)  # n=3 forks share the prompt's pages
            moved = llm.engine.offload_cached_blocks()  # every idle page to host memory ...
            restored = llm.generate(PROMPTS[:2], GREEDY)  # ... and back from it
            pressed = llm.generate(others, GREEDY)  # evicts PROMPTS[0]'s pages: written back to host
            evicted = llm.stats()["cpu_blocks_used"]
            back = llm.generate(PROMPTS[:1], GREEDY)[0]  # restored from host memory
            stats = llm.stats()
            results.append(
                (_tokens(first), again.outputs[0].token_ids, _tokens(samples), _tokens(restored), _tokens(pressed))
            )
            results[-1] += (back.outputs[0].token_ids,)
            assert again.num_cached_tokens == 32  # two full blocks of 16
            assert moved > 0 and restored[0].num_cached_tokens == 32
            assert evicted > 0 and back.num_cached_tokens == 32 and stats["kv_blocks_used"] == 0
        finally:
            llm.shutdown()
    assert results[0] == results[1]
    assert results[0][1] == results[0][0][0][0] == results[0][5]  # the cache changed nothing
    assert len(set(map(tuple, results[0][2][0]))) > 1  # three samples, not one copied


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_tp2_gives_tp1_logprobs_bit_for_bit(dtype):
    """Deterministic mode: every prompt and generated token's logprobs (so the logits they come from)
    equal at TP=1 and TP=2 -- the row-parallel sums reduced as the same two halves on one rank and on
    two -- where the default mode differs by fp32's reordering noise."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5)
    tp1, tp2 = _answers_at_tp1_and_tp2("dummy:tiny", [PROMPTS[0], PROMPTS[2]], params, dtype=dtype, num_kv_blocks=24)
    assert tp1 == tp2


def _answers_at_tp1_and_tp2(model: str, prompts, params, **opts) -> list:
    """Deterministic mode: (prompt logprobs, tokens, token logprobs) of each prompt at TP=1, then TP=2."""
    got = []
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, deterministic=True, seed=5, **opts)
        try:
            outs = llm.generate(prompts, params)
            got.append([(o.prompt_logprobs, o.outputs[0].token_ids, list(o.outputs[0].logprobs or [])) for o in outs])
        finally:
            llm.shutdown()
    return got


def test_tp2_runs_in_an_async_engine_and_shuts_down():
    engine = AsyncLLM("dummy:tiny", tensor_parallel_size=2, num_kv_blocks=32)
    procs = engine.engine.ranks.procs
    with pytest.raises(ValueError, match="one tensor-parallel engine per process"):
        LLM("dummy:tiny", tensor_parallel_size=2, num_kv_blocks=32)

    async def one():
        async for out in engine.generate(PROMPTS[0], GREEDY):
            pass
        return out.outputs[0].token_ids

    try:
        got = asyncio.run(one())
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in procs) and engine.engine.ranks is None
    ref = LLM("dummy:tiny", num_kv_blocks=32)
    assert got == ref.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    ref.shutdown()
    # NVLink multicast off, for every rank: NCCL, torch's symmetric memory, NVSHMEM
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_a_rank_that_exits_before_joining_is_a_clear_error():
    """Its report pipe ends without a word (e.g. its interpreter could not start): a
    TensorParallelError naming the rank and its exit code, not an EOFError."""
    import multiprocessing

    from chatengine.engine.parallel.plan import TensorParallelError
    from chatengine.engine.parallel.ranks import WorkerRanks

    ctx = multiprocessing.get_context("spawn")
    report_out, report_in = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=os._exit, args=(3,))
    proc.start()
    report_in.close()  # nobody writes: end of file once the process is gone
    proc.join(30)
    ranks = WorkerRanks.__new__(WorkerRanks)
    ranks.procs, ranks.reports = [proc], [report_out]
    with pytest.raises(TensorParallelError, match=r"rank 1 did not start \(exit code 3\)"):
        ranks._await_joining()


def test_a_dead_rank_with_unfinished_steps_arms_the_exit_timer_until_they_finish(monkeypatch):
    """exit_if_stuck arms faulthandler's exit timer only while a launched step's device work is
    unfinished (its event), and a collect once all of it has finished calls the timer off."""
    from chatengine.engine.parallel import plan as plan_module
    from chatengine.engine.parallel.plan import PlanSender

    class Done:  # a CUDA event's stand-in
        def __init__(self):
            self.finished = False

        def query(self):
            return self.finished

    timer = []
    monkeypatch.setattr(
        plan_module.faulthandler, "dump_traceback_later", lambda s, exit, file: timer.append((s, exit, file))
    )
    monkeypatch.setattr(plan_module.faulthandler, "cancel_dump_traceback_later", lambda: timer.append("off"))
    plan = PlanSender([])
    assert not plan.exit_if_stuck(30.0) and timer == []  # nothing launched
    first, second = Done(), Done()
    plan.track(first)
    plan.track(second)
    first.finished = True
    plan.collected()
    assert plan.exit_if_stuck(30.0) and timer == [(30.0, True, 2)]  # `second` still runs
    plan.collected()
    assert timer == [(30.0, True, 2)]  # still unfinished: the timer stays
    second.finished = True
    plan.collected()
    assert timer == [(30.0, True, 2), "off"]
    done = Done()
    done.finished = True
    plan.track(done)  # a finished step (e.g. a mid-prefill chunk nobody waits for) counts for nothing
    assert not plan.exit_if_stuck(30.0)


def test_a_rank_that_dies_is_a_clear_error_not_a_hang():
    llm = LLM("dummy:tiny", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        llm.generate([PROMPTS[0]], GREEDY)
        (worker,) = llm.engine.ranks.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        t = time.monotonic()
        for _ in range(2):  # this request fails with the reason, and every later one at once
            (out,) = llm.generate([PROMPTS[1]], GREEDY)
            assert out.outputs[0].finish_reason == "error"
            assert out.error.startswith("TensorParallelError: tensor-parallel rank 1 died (exit code -9)")
        assert time.monotonic() - t < 15
        assert llm.stats()["kv_blocks_used"] == 0  # the failed requests gave their blocks back
    finally:
        t = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t < 15


@pytest.mark.slow  # idles past a collective timeout: left out of CI, run with the whole suite (README)
def test_an_idle_engine_outlives_the_collective_timeout(monkeypatch):
    """Idle ranks wait on their plan pipe, not in a collective that would time out."""
    monkeypatch.setenv("CHATENGINE_TP_TIMEOUT_S", "3")  # the spawned rank reads it at import
    monkeypatch.setattr(group_module, "TIMEOUT", timedelta(seconds=3))
    llm = LLM("dummy:tiny", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        first = llm.generate([PROMPTS[1]], GREEDY)
        time.sleep(4)
        assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    finally:
        llm.shutdown()


# ---- on GPUs (skipped without two) ----------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(
    "variant",
    [
        dict(async_scheduling=True),  # the default on CUDA; first: it gets the one-shot sums (below)
        dict(enforce_eager=True, async_scheduling=False, attention_backend="torch"),
        dict(enforce_eager=True, async_scheduling=True),
        dict(async_scheduling=False),  # CUDA graphs: decode and one-sequence prefill, all-reduces inside
    ],
    ids=["graphs-async", "eager-torch-sync", "eager-async", "graphs-sync"],
)
def test_cuda_tp2_gives_tp1_greedy_tokens(variant, monkeypatch):
    """fp32: the same greedy tokens as one GPU, in each way a step can run, with host restores; the
    process's first TP=2 engine sums through the one-shot path (the default), the later ones through NCCL."""
    monkeypatch.setenv("CHATENGINE_ALL_REDUCE", "one-shot")
    opts = dict(device="cuda", dtype="float32", num_kv_blocks=64, cpu_offload_gib=0.05, register_personas=False)
    prompts = [list(range(1, 40)), list(range(50, 70)), [7] * 33, list(range(3, 300))]
    results = []
    for tp in (1, 2):
        first_group = not one_shot._registered  # a process's first group sums in one shot, later ones NCCL
        llm = LLM("dummy:llama-3.2-1b", tensor_parallel_size=tp, **opts, **variant)
        try:
            if tp == 2:  # the one-shot NVLink path passed its self-test and is on
                assert (llm.engine.ranks.group.one_shot is not None) == first_group
            first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
            llm.engine.offload_cached_blocks()
            again = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16))[0]
            assert again.num_cached_tokens == 32
            results.append((_tokens(first), again.outputs[0].token_ids))
        finally:
            t = time.monotonic()
            llm.shutdown()
            assert time.monotonic() - t < 60
    assert results[0] == results[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_deterministic_tp2_gives_tp1_logprobs_bit_for_bit(dtype):
    """Deterministic mode on GPUs, CUDA graphs on: TP=2's prompt and token logprobs are TP=1's."""
    opts = dict(device="cuda", dtype=dtype, num_kv_blocks=64, register_personas=False)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, prompt_logprobs=5)
    prompts = [list(range(1, 40)), list(range(3, 300)), [7] * 33]
    tp1, tp2 = _answers_at_tp1_and_tp2("dummy:llama-3.2-1b", prompts, params, **opts)
    assert tp1 == tp2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_tp2_draws_tp1_sampled_tokens_from_the_vocabulary_slices(monkeypatch):
    """Deterministic mode (TP=2's logits are TP=1's bit for bit): temperature draws, unseeded and
    seeded, which each rank takes from its slice of the vocabulary, are TP=1's tokens; so are those
    of steps that gather whole rows (a top-p row beside them)."""
    draws = []  # rank 0's draws from slices (this process)
    real_draw = vocab_sampling.draw
    monkeypatch.setattr(vocab_sampling, "draw", lambda *a, **k: draws.append(1) or real_draw(*a, **k))
    opts = dict(device="cuda", dtype="bfloat16", num_kv_blocks=64, register_personas=False)
    prompts = [list(range(1, 40)), list(range(3, 300)), [7] * 33]
    plain = [
        SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    gathered = [*plain[:2], SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=24, ignore_eos=True)]
    for params, sliced in ((plain, True), (gathered, False)):
        draws.clear()
        tp1, tp2 = _answers_at_tp1_and_tp2("dummy:llama-3.2-1b", prompts, params, **opts)
        assert tp1 == tp2
        assert len({tuple(tokens) for _, tokens, _ in tp1}) == 3
        assert (len(draws) >= 20) == sliced  # TP=2's steps of plain rows drew from the slices


_DIES_MID_STEP = """
import os, signal, threading
from chatengine import LLM, SamplingParams
from chatengine.engine.parallel.plan import TensorParallelError
llm = LLM("dummy:llama-3.2-1b", device="cuda", tensor_parallel_size=2, register_personas=False, max_model_len=4096)
assert llm.engine.ranks.group.one_shot is not None, "the one-shot sums are off"
(worker,) = llm.engine.ranks.procs
threading.Timer(5.0, os.kill, (worker.pid, signal.SIGKILL)).start()
try:
    llm.generate([[1 + i] * 200 for i in range(64)], SamplingParams(max_tokens=3000, ignore_eos=True))
except TensorParallelError as e:
    print("raised:", e, flush=True)
    os._exit(3)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_a_rank_that_dies_mid_step_is_an_error_or_an_exit_never_a_hang():
    """One-shot sums on (the default): a rank killed while steps run either fails the engine (its
    steps had finished) or ends the process after saying why: rank 0's GPU stuck in a sum waiting
    for it (our timer: exit code 1), or NCCL's watchdog aborting it (SIGABRT) once its communicator
    was aborted under pending work -- what the H200s showed at a4e5e3a (within ~60 s of the start,
    the reason logged first)."""
    import subprocess
    import sys

    t = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _DIES_MID_STEP], capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode in (1, 3, -signal.SIGABRT), out[-3000:]
    assert "tensor-parallel rank 1 died" in out, out[-3000:]
    if run.returncode != 3:
        assert "unless it finishes within 30 s, this process ends" in out, out[-3000:]
    print(f"exit {run.returncode} after {time.monotonic() - t:.0f} s")
