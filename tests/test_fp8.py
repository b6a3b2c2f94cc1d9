"""FP8 weights (models/fp8.py): exact quantization where values are exact, the reference matmul's
arithmetic, the CUDA path against it, and an engine whose linear layers hold e4m3 weights."""

import pytest
import torch

from chatengine import LLM, SamplingParams
from chatengine.engine.models.fp8 import E4M3_MAX, fp8_linear_cuda, fp8_linear_ref, quantize_rows
from chatengine.engine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0], [0.5, 0.25, -0.125, 0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == [1.0, torch.tensor(0.5 / E4M3_MAX, dtype=torch.float32).item()]
    assert q[0].float().tolist() == [448.0, -224.0, 1.0, 0.0]  # representable: kept exactly
    assert q[1].float().tolist() == [448.0, 224.0, -112.0, 0.0]


def test_an_all_zero_row_stays_zero():
    q, scale = quantize_rows(torch.zeros(2, 8))
    assert q.float().abs().sum() == 0 and (scale > 0).all()


def test_reference_is_the_dequantized_matmul():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(32, 64), torch.randn(32)
    wq, ws = quantize_rows(w)
    xq, xs = quantize_rows(x)
    expected = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).T + b
    assert torch.equal(fp8_linear_ref(x, wq, ws, b), expected)
    exact = x @ w.T + b
    assert (fp8_linear_ref(x, wq, ws, b) - exact).abs().max() < 0.1 * exact.abs().max()  # e4m3: 3 mantissa bits


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
)
def test_cuda_scaled_mm_matches_the_reference():
    torch.manual_seed(0)
    x = torch.randn(77, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_rows(w)
    ours, ref = fp8_linear_cuda(x, wq, ws), fp8_linear_ref(x, wq, ws)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_an_fp8_engine_holds_e4m3_weights_and_answers_close_to_fp32():
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    full = LLM("dummy:tiny", device="cpu", num_kv_blocks=32, max_num_batched_tokens=64)
    fp8 = LLM("dummy:tiny", device="cpu", num_kv_blocks=32, max_num_batched_tokens=64, quantization="fp8")
    try:
        linears = [
            m for m in fp8.engine.runner.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        ]
        assert len(linears) == 4 * 2 and all(m.weight_fp8.dtype == torch.float8_e4m3fn for m in linears)
        assert all("weight" not in dict(m.named_parameters()) for m in linears)
        assert fp8.engine.block_manager.root != full.engine.block_manager.root  # never each other's pages
        a, b = (llm.generate([prompt], params)[0] for llm in (full, fp8))
        errors = [abs(da[t] - db[t]) for da, db, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], prompt[1:])]
        assert 0 < max(errors) < 0.05, max(errors)
    finally:
        full.shutdown()
        fp8.shutdown()


def test_quantization_is_checked():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM("dummy:tiny", quantization="int4")
