"""Fused CPU decode ops (kernels/cpu_fused.py): the compiled kernel against the plain-torch references,
and the torch backend's decode step taking them."""

import shutil

import pytest
import torch

from chatengine.engine.attention import TorchBackend
from chatengine.engine.models.llama import AttentionMetadata
from chatengine.kernels import cpu_fused as cf
from chatengine.kernels import cpu_quant
from chatengine.kernels.cache_ops import store_kv_ref
from chatengine.kernels.fused_ops import rms_norm_ref, rotary_ref, silu_mul_ref
from chatengine.kernels.paged_attention import paged_attention_ref

needs_kernel = pytest.mark.skipif(
    not cpu_quant._cpu_has_avx2() or not (shutil.which("g++") or shutil.which("c++")),
    reason="the compiled kernel needs an AVX2/FMA CPU and a C++ compiler (g++)",
)
pytestmark = needs_kernel


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_kernel_builds():
    assert cf.available()


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=g)[:, 8:584]  # strided rows
    w = torch.randn(576, generator=g)
    res = torch.randn(3, 576, generator=g) if with_residual else None
    ours, theirs = cf.rms_norm(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        close(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])  # x + residual: one fp32 add either way
    else:
        close(ours, theirs)


def test_silu_mul_matches_reference():
    gate_up = torch.randn(4, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    close(cf.silu_mul(gate_up), silu_mul_ref(gate_up))
    many = torch.randn(40, 2 * 64, generator=torch.Generator().manual_seed(2))  # split over threads
    assert torch.equal(cf.silu_mul(many)[:3], cf.silu_mul(many[:3]))  # a row's value: not the row count's


def paged_setup(lens, H_kv=3, D=64, bs=16, seed=2):
    """Caches (N, bs, H_kv, D) views of a (N, layers, 2, ...) pool as the runner lays it out, filled
    with noise, and a block table giving each sequence pages in a scattered order."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // bs) for n in lens]
    N = sum(pages) + 3
    pool = torch.randn(N, 2, 2, bs, H_kv, D, generator=g)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    order = torch.randperm(N, generator=g)
    W = max(pages) + 1
    tables = torch.full((len(lens), W), -1, dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        tables[b, :p] = order[at : at + p].int()
        at += p
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_rope_store_matches_reference():
    T, H_q, H_kv, D = 3, 9, 3, 64
    k_cache, v_cache, tables, lens = paged_setup([5, 20, 33])
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D, generator=g)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([H_q * D, H_kv * D, H_kv * D], dim=-1))
    cos, sin = torch.randn(64, D, generator=g), torch.randn(64, D, generator=g)
    cos, sin = torch.cat([cos[:, : D // 2]] * 2, -1), torch.cat([sin[:, : D // 2]] * 2, -1)  # [c, c] rows
    positions = torch.tensor([4, 19, 32], dtype=torch.int32)
    slots = torch.stack([tables[b, int(p) // 16] * 16 + int(p) % 16 for b, p in enumerate(positions)]).int()
    slots[1] = -1  # not stored
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = rotary_ref(positions.long(), q, k, cos, sin)
    store_kv_ref(k_ref, v, kc2, vc2, slots)
    out = cf.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q, qkv[:, : H_q * D].view(T, H_q, D))  # q untouched (a new tensor returned)
    assert torch.equal(out, q_ref)  # each product rounded, as torch's: bit for bit
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)


@pytest.mark.parametrize("window", [0, 7])
def test_decode_attention_matches_reference(window):
    lens = [1, 16, 17, 40]
    k_cache, v_cache, tables, seq_lens = paged_setup(lens)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(4))
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, tables, 0.125, 1, max(lens), window)
    close(cf.decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.125, window), ref)


def test_torch_backend_decode_step_takes_the_kernels():
    lens = [3, 30]
    k_cache, v_cache, tables, seq_lens = paged_setup(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(2, dtype=torch.int32),
        cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        max_seqlen_q=1,
        max_seqlen_k=30,
    )
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5))
    fused, plain = TorchBackend(), TorchBackend()
    plain.fused = False
    assert fused.fused and not TorchBackend(deterministic=True).fused
    for b in (fused, plain):
        b.begin_step(meta)
    close(fused.attention(q, k_cache, v_cache, meta, 0.125), plain.attention(q, k_cache, v_cache, meta, 0.125))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_decode_layer_in_one_call_equals_the_layer_of_ops(fmt, monkeypatch):
    from chatengine import LLM, SamplingParams

    llm = LLM("dummy:tiny", quantization=fmt, device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    prompts = [list(range(3, 40)), list(range(7, 12)), list(range(20, 41))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    calls = []
    one_call = cf.decode_layer
    monkeypatch.setattr(cf, "decode_layer", lambda *a: calls.append(1) or one_call(*a))
    fused = llm.generate(prompts, params)
    assert len(calls) == 11 * len(model.layers)  # every decode step, every layer (batched)
    monkeypatch.setattr(model, "_cpu_decode_fusable", lambda *a: False)  # the modules' path, op by op
    plain = llm.generate(prompts, params)
    assert len(calls) == 11 * len(model.layers)  # none more
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-4)
    llm.shutdown()


def test_full_precision_decode_steps_build_no_fused_step(monkeypatch):
    """fp32 weights (no blocks) never run a layer in one call, so a decode step pays nothing for it."""
    from chatengine import LLM, SamplingParams

    llm = LLM("dummy:tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    built = []
    step = cf.decode_step
    monkeypatch.setattr(cf, "decode_step", lambda *a: built.append(1) or step(*a))
    out = llm.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6 and built == []
    llm.shutdown()
