"""The torch attention backend (chatengine/engine/attention.py) against the kernels' plain references:
store_kv and attention close to (rotary exactly equal to) the *_ref functions, and the per-step plans
reused only by the step they were built for."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_kernels import MIXED, make_batch, make_cache  # noqa: E402

from chatengine.engine.attention import TorchBackend  # noqa: E402
from chatengine.kernels import cache_ops, fused_ops  # noqa: E402
from chatengine.kernels import paged_attention as pa


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def meta_of(cu, seq_lens, tables, slot_mapping=None):
    return SimpleNamespace(
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slot_mapping,
        max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
        max_seqlen_k=int(seq_lens.max()),
    )


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("in_step", [False, True])
def test_store_kv_equals_ref(page_size, dtype, cache_dtype, in_step):
    H_q, H_kv, D, T = 6, 3, 64, 37
    kv = make_cache(8, page_size, H_kv, D, cache_dtype, "cpu")
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(dtype)
    key = qkv[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D)  # strided views
    value = qkv[:, (H_q + H_kv) * D :].view(T, H_kv, D)
    slots = torch.randperm(8 * page_size)[:T].to(torch.int32)
    slots[::5] = -1  # padding lanes
    expected = kv.clone()
    backend = TorchBackend()
    if in_step:
        backend.begin_step(SimpleNamespace(slot_mapping=slots))
    for layer in range(3):  # the step's rows, reused
        cache_ops.store_kv_ref(key + layer, value - layer, expected[:, layer, 0], expected[:, layer, 1], slots)
        backend.store_kv(key + layer, value - layer, kv[:, layer, 0], kv[:, layer, 1], slots)
    assert torch.equal(kv, expected)  # written slots and the rest


def test_store_kv_does_not_reuse_another_steps_slots():
    kv = make_cache(4, 16, 2, 8, torch.float32, "cpu")
    expected = kv.clone()
    backend = TorchBackend()
    slots = torch.tensor([3, 17], dtype=torch.int32)
    backend.begin_step(SimpleNamespace(slot_mapping=slots))
    k = torch.randn(2, 2, 8)
    backend.store_kv(k, k, kv[:, 0, 0], kv[:, 0, 1], slots)
    slots[:] = torch.tensor([40, 41])  # a staging buffer rewritten in place, no begin_step
    other = slots.clone()  # (a different tensor object: not the step's)
    backend.store_kv(k, k, kv[:, 1, 0], kv[:, 1, 1], other)
    cache_ops.store_kv_ref(k, k, expected[:, 0, 0], expected[:, 0, 1], torch.tensor([3, 17]))
    cache_ops.store_kv_ref(k, k, expected[:, 1, 0], expected[:, 1, 1], other)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("H_q, H_kv", [(9, 3), (8, 8)])
def test_attention_plan_per_step(H_q, H_kv):
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(*MIXED, H_q, H_kv, 64, 16, torch.float32, "cpu")
    backend = TorchBackend()
    meta = meta_of(cu, seq_lens, tables)
    backend.begin_step(meta)
    for kc, vc in ((k_cache, v_cache), (v_cache, k_cache)):  # two "layers", one plan
        torch.testing.assert_close(
            backend.attention(q, kc, vc, meta, 0.125),
            pa.paged_attention_ref(q, kc, vc, cu, seq_lens, tables, 0.125),
            atol=2e-6,
            rtol=2e-6,
        )
    plan = backend._plans[0]
    windowed = backend.attention(q, k_cache, v_cache, meta, 0.125, window=9)  # a sliding layer: its own plan
    expected = pa.paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, tables, 0.125, window=9)
    torch.testing.assert_close(windowed, expected, atol=2e-6, rtol=2e-6)
    assert backend._plans[0] is plan and backend._plans[9][1].window == 9
    # another metadata object (the next step) never sees this step's plan
    cu2, lens2 = torch.arange(7, dtype=torch.int32), seq_lens.clone()
    other = meta_of(cu2, lens2, tables)
    q2 = torch.randn(6, H_q, 64)
    torch.testing.assert_close(
        backend.attention(q2, k_cache, v_cache, other, 0.125),
        pa.paged_attention_ref(q2, k_cache, v_cache, cu2, lens2, tables, 0.125),
        atol=2e-6,
        rtol=2e-6,
    )
    assert backend._plans[0] is plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H_q, H_kv, D, T", [(9, 3, 64, 1), (9, 3, 64, 23), (4, 4, 128, 5), (14, 2, 64, 1)])
def test_rotary_equals_ref_exactly(dtype, H_q, H_kv, D, T):
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D).to(dtype)  # q, k: adjacent views of qkv
    q = qkv[:, : H_q * D].view(T, H_q, D)
    k = qkv[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D)
    freqs = torch.arange(512).float()[:, None] * (1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    positions = torch.randint(0, 512, (T,))
    expected = fused_ops.rotary_ref(positions, q, k, cos, sin)
    backend = TorchBackend()
    backend.begin_step(None, positions)
    for args in ((q, k), (q, k), (q.contiguous(), k.contiguous())):  # cached tables; separate q, k
        got = backend.rotary(positions, *args, cos, sin)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(q, qkv[:, : H_q * D].view(T, H_q, D))  # inputs untouched
    other = torch.randint(0, 512, (T,))  # not the step's positions
    got = backend.rotary(other, q, k, cos, sin)
    assert torch.equal(got[0], fused_ops.rotary_ref(other, q, k, cos, sin)[0])
    # rotary + store in one call: the same q, and the cache as the reference writes it
    v = qkv[:, (H_q + H_kv) * D :].view(T, H_kv, D)
    kv, kv_ref = torch.zeros(2, 4, 2, 16, H_kv, D, dtype=dtype).unbind(0)  # (blocks, K|V, slot, H, D)
    slots = torch.randperm(64)[:T]
    got_q = backend.rotary_store_kv(positions, q, k, v, cos, sin, kv[:, 0], kv[:, 1], slots)
    ref_q = fused_ops.rotary_store_kv_ref(positions, q, k, v, cos, sin, kv_ref[:, 0], kv_ref[:, 1], slots)
    assert torch.equal(got_q, ref_q) and torch.equal(kv, kv_ref)
