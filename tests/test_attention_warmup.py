"""The warm-up compiles every variant a step can reach: its plans cover every shape's plan."""

import random

import pytest
import torch

from chatengine.kernels import attention_warmup
from chatengine.kernels import paged_attention as pa

pytest.importorskip("triton")  # the rules pad with triton.next_power_of_2

CONFIGS = [  # (H_q, H_kv, head_dim, max_num_seqs, max_model_len, max_num_tokens, sms)
    (32, 8, 64, 64, 4096, 2048, 132),  # Llama-3.2-1B
    (14, 2, 64, 96, 8192, 1024, 132),  # Qwen2.5-0.5B
    (9, 3, 64, 48, 2048, 512, 16),  # SmolLM2-135M on a small GPU
    (32, 8, 128, 40, 16384, 4096, 132),  # Llama-3.1-8B
]


def variant(plan: pa.LaunchPlan) -> tuple:
    return plan.attention_variant(), plan.merge_variant()


@pytest.mark.parametrize("config", CONFIGS)
def test_every_decode_shape_is_covered(config):
    H_q, H_kv, D, max_seqs, max_len, max_tokens, sms = config
    covered = set(attention_warmup.reachable_plans(*config))
    for B in range(1, max_seqs + 1):
        for k in range(1 + B % 5, max_len + 1, 29):  # the offsets vary with B: each side of each boundary
            plan = pa.launch_plan(B, B, H_q, H_kv, D, 1, k, None, sms)
            assert variant(plan) in covered, (B, k)


@pytest.mark.parametrize("config", CONFIGS)
def test_random_prefill_steps_are_covered(config):
    H_q, H_kv, D, max_seqs, max_len, max_tokens, sms = config
    covered = set(attention_warmup.reachable_plans(*config))
    rng = random.Random(0)
    for _ in range(1000):
        T = rng.randint(2, max_tokens)
        B = rng.randint(1, min(max_seqs, T - 1))
        q = rng.randint(max(2, -(-T // B)), min(T, max_len))  # the longest chunk: at least T / B
        k = rng.randint(q, max_len)
        plan = pa.launch_plan(T, B, H_q, H_kv, D, q, k, None, sms)
        assert variant(plan) in covered, (T, B, q, k)


def test_examples_plan_their_own_variant():
    """Each example, launched as recorded, makes the variant it stands for."""
    H_q, H_kv, D, *_, sms = CONFIGS[0]
    for key, (T, B, q, k, plan) in attention_warmup.reachable_plans(*CONFIGS[0]).items():
        again = pa.launch_plan(T, B, H_q, H_kv, D, q, k, plan.num_splits, sms)
        assert variant(again) == key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles CUDA kernels")
def test_after_the_warm_up_no_shape_compiles_anything():
    H_q, H_kv, D = 32, 8, 64
    max_seqs, max_len, max_tokens, block = 32, 2048, 512, 16
    cache = torch.zeros(max_len // block * max_seqs, 2, block, H_kv, D, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    width = max_len // block  # the engine's block tables: one row stride for every step
    attention_warmup.warm_up(k_cache, v_cache, H_q, {0}, max_seqs, max_len, max_tokens, width)
    before = compiled()
    rng = random.Random(1)
    for _ in range(200):
        B = rng.randint(1, max_seqs)
        q_lens = [1 if rng.random() < 0.7 else rng.randint(2, max_tokens // max_seqs) for _ in range(B)]
        seq_lens = [rng.randint(ql, max_len) for ql in q_lens]
        tables = torch.arange(B * width, dtype=torch.int32, device="cuda").view(B, width)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), H_q, D, dtype=torch.bfloat16, device="cuda")
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        pa.paged_attention_triton(q, k_cache, v_cache, cu, lens, tables, 0.125, max(q_lens), max(seq_lens))
    assert compiled() == before


def compiled() -> int:
    n = 0
    for fn in (pa._paged_attention_kernel, pa._merge_splits_kernel):
        for cache in fn.device_caches.values():
            n += len(cache[0] if isinstance(cache, tuple) else cache)
    return n


def test_invariant_mode_has_four_variants_of_one_tile():
    """split_keys (deterministic engines): decodes, prefill chunks and mixed steps of any size launch
    the same tiles (BLOCK_M x BLOCK_N, warps); a decode puts one query in a program, a chunk several;
    a launch whose keys all fall in the first split writes in place (no merge), a longer one splits
    and merges: four variants, and the warm-up compiles each."""
    shapes = [(1, 1, 1, 5), (256, 256, 1, 4000), (2048, 3, 900, 3000), (16, 1, 16, 20), (300, 2, 299, 1024)]
    for H_q, H_kv, key_tile, launch in [(32, 8, 0, pa.PREFILL_LAUNCH[64]), (14, 2, 128, pa.INVARIANT_FEW_HEADS_LAUNCH)]:
        plans = [pa.launch_plan(T, B, H_q, H_kv, 64, q, k, None, 132, 1024, key_tile) for T, B, q, k in shapes]
        assert [p.num_splits for p in plans] == [1, 4, 3, 1, 1]
        assert [p.block_q for p in plans] == [1, 1] + [16 // (H_q // H_kv)] * 3
        assert {(p.launch, p.block_m) for p in plans} == {(launch, 16)}
        variants = {(p.attention_variant(), p.merge_variant()) for p in plans}
        assert len(variants) == 4
        assert {m for _, m in variants} == {None, ("in order", 64)}
        cache = torch.zeros(4, 16, H_kv, 64)
        warmed = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pa, "paged_attention_triton", lambda *a, **kw: warmed.append((a[7], a[9], kw["split_keys"])))
            attention_warmup.warm_up(cache, cache, H_q, {0}, 8, 4096, 64, 4, 1024, key_tile)
        assert warmed == [(1, 1, 1024), (1, 4, 1024), (2, 1, 1024), (2, 4, 1024)]  # (max_q, splits, split_keys)


def test_the_invariant_key_tile_is_the_whole_models():
    """Qwen-0.5B's 2 KV heads at head_dim 64 take 128-key tiles, Llama-1B's 8 the table's; a rank's
    share of the heads never enters (TP=2 gives each rank 1 of Qwen's 2), nor the device."""
    from chatengine.engine.attention import get_backend

    assert pa.invariant_key_tile(2, 64) == 128 and pa.invariant_key_tile(8, 64) == 0
    assert pa.invariant_key_tile(2, 128) == 0  # 128 keys at head_dim 128 spill (DECODE_LAUNCH)
    assert get_backend("triton", "cuda", True, 2, 64).key_tile == 128
    assert get_backend("triton", "cuda", False, 2, 64).key_tile == 0
