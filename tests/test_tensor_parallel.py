"""Tensor parallelism on CPU with gloo: the split layers equal the whole ones, and an engine over two
ranks (two processes) gives TP=1's greedy tokens, with prefix-cache hits, n > 1 samples and pages
restored from the host tier."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from chatengine import LLM, SamplingParams
from chatengine.engine.distributed import TPGroup, free_address
from chatengine.engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [list(range(1, 40)), list(range(50, 70)), list(range(3, 100)), [7] * 33]


# ---- the layers, two ranks ------------------------------------------------------------------------
def _layers_on_rank(rank: int, address: str, out: dict) -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # inference layers
    group = TPGroup.join(rank, 2, address, "cpu")
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 12, generator=g)
        ids = torch.tensor([0, 4, 9, 10, 3])
        w_col, b_col = torch.randn(8, 12, generator=g), torch.randn(8, generator=g)
        w_row = torch.randn(12, 8, generator=g)
        emb, head = torch.randn(11, 12, generator=g), torch.randn(11, 12, generator=g)  # vocab 11: padded to 12

        col = ColumnParallelLinear(12, 4, True, group)
        col.load_rows([(w_col, 4)])
        col.load_rows([(b_col, 4)], "bias")
        full = nn.functional.linear(x, w_col, b_col)
        torch.testing.assert_close(col(x), full[:, rank * 4 : (rank + 1) * 4])

        row = RowParallelLinear(4, 12, group)
        row.load_full(w_row)
        part = x[:, :8][:, rank * 4 : (rank + 1) * 4]
        torch.testing.assert_close(row(part), nn.functional.linear(x[:, :8], w_row), rtol=1e-5, atol=1e-5)

        embedding = VocabParallelEmbedding(11, 12, group)
        embedding.load_full(emb)
        torch.testing.assert_close(embedding(ids), emb[ids])

        lm_head = ParallelLMHead(12, 11, group)
        lm_head.load_full(head)
        torch.testing.assert_close(lm_head(x), nn.functional.linear(x, head))
        out[rank] = "ok"
    finally:
        group.leave()


def test_split_layers_equal_the_whole_ones():
    address, manager = free_address(), mp.get_context("spawn").Manager()
    out = manager.dict()
    procs = [mp.get_context("spawn").Process(target=_layers_on_rank, args=(r, address, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert dict(out) == {0: "ok", 1: "ok"}, [p.exitcode for p in procs]


def test_kv_heads_are_split_or_replicated():
    two = TPGroup(0, 2)
    assert kv_heads_per_rank(8, two) == 4 and kv_heads_per_rank(1, two) == 1
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kv_heads_per_rank(2, TPGroup(0, 3))


def test_a_split_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_heads \(9\) must be divisible by tensor_parallel_size \(2\)"):
        LLM("dummy:smollm2-135m", tensor_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        LLM("dummy:tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="kv_store_dir"):
        LLM("dummy:tiny", tensor_parallel_size=2, kv_store_dir="/tmp/x")


# ---- an engine over two ranks ---------------------------------------------------------------------
def _tokens(outs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen"])  # KV heads split; one KV head replicated
def test_tp2_gives_tp1_greedy_tokens_with_cache_hits_samples_and_host_restores(shape):
    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    opts = dict(num_kv_blocks=24, cpu_offload_gib=0.01, seed=3)
    results = []
    for tp in (1, 2):
        llm = LLM(f"dummy:{shape}", tensor_parallel_size=tp, **opts)
        try:
            first = llm.generate(PROMPTS, GREEDY)
            again = llm.generate(PROMPTS[:1], GREEDY)[0]  # the same prompt: its full blocks hit
            samples = llm.generate([PROMPTS[2]], seeded)  # n=3 forks share the prompt's pages
            moved = llm.engine.offload_cached_blocks()  # every idle page to host memory ...
            restored = llm.generate(PROMPTS[:2], GREEDY)  # ... and back from it
            stats = llm.stats()
            results.append((_tokens(first), again.outputs[0].token_ids, _tokens(samples), _tokens(restored)))
            assert again.num_cached_tokens == 32  # two full blocks of 16
            assert moved > 0 and restored[0].num_cached_tokens == 32 and stats["kv_blocks_used"] == 0
        finally:
            llm.shutdown()
    assert results[0] == results[1]
    assert results[0][1] == results[0][0][0][0]  # the cache changed nothing


def test_tp2_runs_in_an_async_engine_and_shuts_down():
    import asyncio

    from chatengine import AsyncLLM

    engine = AsyncLLM("dummy:tiny", tensor_parallel_size=2, num_kv_blocks=32)

    async def one():
        async for out in engine.generate(PROMPTS[0], GREEDY):
            pass
        return out.outputs[0].token_ids

    try:
        got = asyncio.run(one())
    finally:
        engine.shutdown()
    ref = LLM("dummy:tiny", num_kv_blocks=32)
    assert got == ref.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    ref.shutdown()
    assert os.environ.get("NCCL_NVLS_ENABLE", "0") == "0"
