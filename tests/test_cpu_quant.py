"""Weight-only quantized CPU linear layers (kernels/cpu_quant.py): the quantizers against gguf-py's
reference (GGML's rounding), the compiled kernel against the plain-torch reference, and engines
whose linear layers hold blocks."""

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from chatengine import LLM, SamplingParams
from chatengine.config import EngineConfig
from chatengine.engine.model_runner import lazy_zeros
from chatengine.engine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from chatengine.engine.parallel.group import TPGroup
from chatengine.kernels import cpu_quant as cq

GGML_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}

needs_kernel = pytest.mark.skipif(
    not cq._cpu_has_avx2() or not (shutil.which("g++") or shutil.which("c++")),
    reason="the compiled kernel needs an AVX2/FMA/F16C CPU and a C++ compiler (g++)",
)


def weights(n=96, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, 32:64] = 0.01  # a constant block: q4_1's d = 0
    w[2, 32:64] = torch.linspace(-1, 1, 32)
    return w


@pytest.mark.parametrize("fmt", cq.FORMATS)
def test_quantize_matches_ggml_reference_rounding(fmt):
    w = weights()
    ours = cq.dequantize_ref(cq.quantize(w, fmt))
    raw = gguf_quantize(w.numpy(), GGML_TYPES[fmt])
    theirs = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGML_TYPES[fmt])))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fmt", cq.FORMATS)
def test_requantizing_dequantized_blocks_gives_them_back(fmt):
    # what lets the engine keep a GGUF's own blocks: its de-quantized weights re-quantize to themselves
    qw = cq.quantize(weights(seed=1), fmt)
    again = cq.quantize(cq.dequantize_ref(qw), fmt)
    assert torch.equal(again.qs, qw.qs) and torch.equal(again.d, qw.d)
    assert (again.m is None) == (qw.m is None) and (qw.m is None or torch.equal(again.m, qw.m))


@pytest.mark.parametrize("fmt", cq.FORMATS)
def test_quantization_error_is_within_half_a_step(fmt):
    w = weights(seed=2)
    qw = cq.quantize(w, fmt)
    blocks = w.reshape(96, -1, 32)
    err = (cq.dequantize_ref(qw).reshape(96, -1, 32) - blocks).abs().amax(-1)
    step = qw.d.float().abs()
    # half a step (q4_0: a whole one at -max, clamped from level 16 to 15), plus fp16's rounding of d
    # (up to 127 levels of 2^-11 d) and of q4_1's minimum
    half = 1.0 if fmt == "q4_0" else 0.5
    assert (err <= step * (half + 127 / 2048) + blocks.abs().amax(-1) / 2048 + 1e-7).all()


def test_quantize_checks_its_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        cq.quantize(torch.zeros(4, 40), "q8_0")
    with pytest.raises(ValueError, match="unknown quantization format"):
        cq.quantize(torch.zeros(4, 32), "q3_k")


@needs_kernel
@pytest.mark.parametrize("fmt", cq.FORMATS)
def test_kernel_dequantize_is_the_reference_bit_for_bit(fmt):
    assert cq.library() is not None
    qw = cq.quantize(weights(seed=3), fmt)
    assert torch.equal(cq.dequantize(qw), cq.dequantize_ref(qw))


def exact_weights(fmt, n=40, k=320, seed=7):
    """Weights whose blocks have power-of-two scales (q4_1: d 2^-4, m -0.5; q4_0: d 2^-4; q8_0: d 2^-6):
    every product and partial sum of the GEMV is then exact in fp32, in any order."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "q8_0":
        w = torch.randint(-127, 128, (n, k), generator=g).float()
        w[:, ::32] = 127
        return w / 64
    w = torch.randint(-8, 8, (n, k), generator=g).float()
    w[:, ::32] = -8  # the block's extreme: q4_0's d = -8 d / -8, q4_1's minimum
    if fmt == "q4_1":
        w[:, 1::32] = 7  # and q4_1's maximum: d = 15 / 15
    return w / 16


def exact_rows(m, k=320, seed=8):
    """x whose q8 blocks are exact: integer levels times 2^-3, each block's amax 127 * 2^-3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, 5::32] = -127
    return x / 8


@needs_kernel
def test_kernel_quantizes_activation_rows_bit_for_bit():
    x = torch.randn(5, 320) * torch.logspace(-3, 2, 320)
    x[1, :64] = 0  # zero blocks: d = 0, levels 0
    x[2, 32:64] = 0.5  # a block of equal values (round-half-even of 127.0)
    x[3, 64:96] = torch.linspace(-1, 1, 32)  # ties at x * 127 = k + 0.5
    ours, ref = cq.quantize_rows(x), cq.quantize_rows_ref(x)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    q, d, s = ref
    assert q.abs().max() == 127 and torch.equal(s, d * q.reshape(5, -1, 32).float().sum(-1))


@needs_kernel
def test_q16_rounding_matches_its_reference_bit_for_bit():
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(9)) * torch.logspace(-3, 2, 320)
    x[1, :64] = 0  # zero blocks: d = 0, levels 0
    q, d, s = cq.quantize_rows16_ref(x)
    assert q.abs().max() == 32767
    # each input moves by at most half a step (plus the fp32 rounding of q d, <= 32767 d 2^-24)
    assert (x.reshape(3, -1, 32) - q.reshape(3, -1, 32).float() * d[..., None]).abs().amax(-1).le(d * 0.51).all()
    # the kernel's own blocks: a GEMV against q8_0 weights c I (c = 127/64: d = 1/64, exact) reads them
    # back, scaled (a level off would be an error of d, ~1e-5 relative)
    c = 127 / 64
    qw = cq.quantize(torch.eye(320)[:64] * c, "q8_0")
    y = cq.linear(x, qw, activations="q16")
    ref = (q.float().reshape(3, -1, 32) * d[..., None]).reshape(3, 320)[:, :64] * c
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("fmt", cq.FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_kernel_gemv_is_exact_where_the_values_are(fmt, rows):
    qw = cq.quantize(exact_weights(fmt), fmt)
    x, b = exact_rows(rows), torch.arange(40.0)
    assert torch.equal(cq.dequantize_ref(qw), exact_weights(fmt))  # the scales are the ones meant
    ours, ours_q8 = cq.linear(x, qw, b, "fp32"), cq.linear(x, qw, b, "q8")
    assert torch.equal(ours_q8, cq.linear_q8_ref(x, qw, b))
    assert torch.equal(ours_q8, cq.linear_ref(x, qw, b))  # x's q8 blocks are x itself
    assert torch.equal(ours, cq.linear_ref(x, qw, b))


@needs_kernel
@pytest.mark.parametrize("fmt", cq.FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16, 17, 40])
def test_kernel_linear_matches_the_reference(fmt, rows):
    # 74 output rows: tiles of 8 weight rows plus a remainder of 2; 320 inputs: 10 blocks (8 + 2)
    qw = cq.quantize(weights(n=74, k=320, seed=4), fmt)
    x, b = torch.randn(rows, 320), torch.randn(74)
    ref = cq.linear_ref(x, qw, b)
    if rows > cq.GEMV_MAX_ROWS:  # dequantize (bit-exact) + the same F.linear, in fp32 or bf16
        assert torch.equal(cq.linear(x, qw, b, prefill="fp32"), ref)
        assert torch.equal(cq.linear(x, qw, b, prefill="bf16"), cq.linear_bf16_ref(x, qw, b))
        return
    # the kernels sum in another order: fp32 rounding apart
    torch.testing.assert_close(cq.linear(x, qw, b, "fp32"), ref, rtol=1e-5, atol=1e-5)
    ours = cq.linear(x, qw, b, "q8")
    torch.testing.assert_close(ours, cq.linear_q8_ref(x, qw, b), rtol=1e-5, atol=1e-5)
    # and x's q8 rounding moves each input by at most half its block's step d
    _, d, _ = cq.quantize_rows_ref(x)
    bound = cq.dequantize_ref(qw).abs() @ (d.repeat_interleave(32, dim=1) / 2).T
    assert ((ours - ref).abs() <= bound.T + 1e-4).all()
    ours = cq.linear(x, qw, b, "q16")
    torch.testing.assert_close(ours, cq.linear_q16_ref(x, qw, b), rtol=1e-5, atol=1e-5)
    _, d, _ = cq.quantize_rows16_ref(x)  # q16: the same bound with its step
    bound = cq.dequantize_ref(qw).abs() @ (d.repeat_interleave(32, dim=1) / 2).T
    assert ((ours - ref).abs() <= bound.T + 1e-4).all()
    assert torch.equal(cq.linear(x, qw, b, "auto"), cq.linear(x, qw, b, "q16"))  # the default


@needs_kernel
def test_kernel_linear_takes_strided_and_batched_inputs():
    qw = cq.quantize(weights(n=40, k=64, seed=5), "q4_1")
    x = torch.randn(3, 2, 128)[..., ::2]  # (3, 2, 64), a non-unit inner stride
    torch.testing.assert_close(cq.linear(x, qw, activations="fp32"), cq.linear_ref(x, qw), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cq.linear(x, qw, activations="q8"), cq.linear_q8_ref(x, qw), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cq.linear(x, qw, activations="q16"), cq.linear_q16_ref(x, qw), rtol=1e-5, atol=1e-5)
    assert cq.linear(x, qw).shape == (3, 2, 40)


def test_embedding_looks_up_dequantized_rows():
    qw = cq.quantize(weights(seed=6), "q8_0")
    ids = torch.tensor([[5, 0], [95, 5]])
    assert torch.equal(cq.embedding(ids, qw), cq.dequantize_ref(qw)[ids])


def test_lazy_zeros_reads_zeros_and_writes():
    t = lazy_zeros((64, 3, 16), torch.float32)
    assert t.shape == (64, 3, 16) and t.is_contiguous() and not t.any()
    t[7] = 1.5
    assert t.sum().item() == 1.5 * 48


def test_quantization_is_opt_in_and_gguf_picks_the_files_own_format():
    assert EngineConfig().quantization_on("cpu", "q4_1") == "none"  # the library's default: fp32 (tests)
    gguf = EngineConfig(quantization="gguf")
    assert gguf.quantization_on("cpu", "q4_1") == "q4_1"
    assert gguf.quantization_on("cpu", None) == "none"  # HF directories, dummy weights: fp32
    assert gguf.quantization_on("cuda", "q4_1") == "none"
    assert EngineConfig(quantization="q8_0").quantization_on("cpu", "q4_1") == "q8_0"
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="q4_0").quantization_on("cuda")


def test_the_server_serves_a_gguf_in_its_own_blocks_by_default():
    from chatengine.app.server import build_parser

    default = EngineConfig(quantization=build_parser().parse_args([]).quantization)
    assert default.quantization_on("cpu", "q4_1") == "q4_1"  # the embedded model, on a laptop
    assert default.quantization_on("cuda", "q4_1") == default.quantization_on("cpu", None) == "none"
    # --deterministic keeps working with the default: full-precision weights
    assert EngineConfig(quantization="gguf", deterministic=True).quantization_on("cpu", "q4_1") == "none"


def test_quantization_is_checked():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM("dummy:tiny", quantization="int4")


@pytest.mark.parametrize("fmt", cq.FORMATS)
def test_a_quantized_engine_holds_blocks_and_answers_close_to_fp32(fmt, monkeypatch):
    monkeypatch.setattr(cq, "PREFILL", "fp32")  # the same arithmetic on every host (bf16: below)
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    kw = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=64)
    full, quant = LLM("dummy:tiny", **kw), LLM("dummy:tiny", quantization=fmt, **kw)
    try:
        model = quant.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        assert linears and all(m.qweight is not None and m.qweight.fmt == fmt for m in linears)
        assert all("weight" not in dict(m.named_parameters()) for m in linears)
        # the tied table went straight into the head's q8_0 blocks, which the embedding looks rows up in
        head, ref = model.lm_head.qweight, cq.quantize(full.engine.runner.model.embed_tokens.weight, "q8_0")
        assert torch.equal(head.qs, ref.qs) and torch.equal(head.d, ref.d)
        assert model.embed_tokens.qweight is head and "weight" not in dict(model.embed_tokens.named_parameters())
        assert quant.engine.block_manager.root != full.engine.block_manager.root  # never each other's pages
        a, b = (llm.generate([prompt], params)[0] for llm in (full, quant))
        errors = [abs(da[t] - db[t]) for da, db, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], prompt[1:])]
        assert 0 < max(errors) < (0.02 if fmt == "q8_0" else 0.2), max(errors)
        # prefill (many rows: dequantize + GEMM) and decode (the GEMV) agree on the same tokens
        out = quant.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        again = quant.generate([prompt + out.outputs[0].token_ids[:4]], SamplingParams(temperature=0, max_tokens=4))
        assert again[0].outputs[0].token_ids == out.outputs[0].token_ids[4:]
    finally:
        full.shutdown()
        quant.shutdown()


def test_prefill_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    for flags, want in [
        ({"avx2", "avx512_bf16"}, torch.bfloat16),
        ({"amx_bf16"}, torch.bfloat16),
        ({"avx2"}, torch.float32),
    ]:
        monkeypatch.setattr(cq, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert cq.prefill_dtype("auto") == want
        assert cq.prefill_dtype("fp32") == torch.float32 and cq.prefill_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="CHATENGINE_CPU_PREFILL"):
        cq.prefill_dtype("fp16")


def test_bf16_prefill_stays_within_bf16_rounding_of_the_fp32_product():
    qw = cq.quantize(weights(n=74, k=320, seed=5), "q4_1")
    x = torch.randn(40, 320)
    ref, ours = cq.linear_ref(x, qw), cq.linear_bf16_ref(x, qw)
    # each product's two inputs move by at most 2^-9 of themselves; the output is rounded once more
    bound = (x.abs() @ cq.dequantize_ref(qw).abs().T) * (2 * 2**-9) + ref.abs() * 2**-8
    assert ((ours - ref).abs() <= bound + 1e-6).all()


@needs_kernel
def test_dense_rows_take_the_prefill_dtype_only_inside_a_prompt_step(monkeypatch):
    monkeypatch.setattr(cq, "PREFILL", "bf16")
    qw, x, b = cq.quantize(weights(n=74, k=320, seed=6), "q4_1"), torch.randn(20, 320), torch.randn(74)
    assert torch.equal(cq.linear(x, qw, b), cq.linear_ref(x, qw, b))  # outside: fp32
    with cq.prefill_step(True):
        assert torch.equal(cq.linear(x, qw, b), cq.linear_bf16_ref(x, qw, b))
        with cq.prefill_step(False):
            assert torch.equal(cq.linear(x, qw, b), cq.linear_ref(x, qw, b))


@needs_kernel
def test_a_large_table_is_multiplied_in_parts_with_the_same_products(monkeypatch):
    monkeypatch.setattr(cq, "DENSE_ROWS", 32)  # 74 rows: parts of 32, 32 and 10
    qw, x, b = cq.quantize(weights(n=74, k=320, seed=7), "q8_0"), torch.randn(3, 20, 320), torch.randn(74)
    # (the GEMM may block a narrower product otherwise: the same sums, fp32 rounding apart)
    torch.testing.assert_close(cq.dense_linear(x, qw, b, "fp32"), cq.linear_ref(x, qw, b), rtol=1e-5, atol=1e-5)
    ref = cq.linear_bf16_ref(x, qw, b)  # the output rounded to bf16: one of its steps apart at most
    assert ((cq.dense_linear(x, qw, b, "bf16") - ref).abs() <= ref.abs() * 2**-7 + 1e-5).all()


@needs_kernel
def test_the_engine_multiplies_prompt_only_steps_in_bf16_and_steps_with_decodes_in_fp32(monkeypatch):
    monkeypatch.setattr(cq, "PREFILL", "bf16")
    seen: list[bool] = []
    part = cq._dense_part
    monkeypatch.setattr(cq, "_dense_part", lambda x, w, b, bf16: (seen.append(bf16), part(x, w, b, bf16))[1])
    llm = LLM("dummy:tiny", quantization="q4_1", device="cpu", num_kv_blocks=64, max_num_batched_tokens=256)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine.add(engine.make_request(list(range(3, 40)), params, request_id="a"))
        while not any(len(s.output_token_ids) for r in engine.requests.values() for s in r.seqs):
            engine.step()  # a's prompt, alone
        assert seen and all(seen)
        seen.clear()
        engine.add(engine.make_request(list(range(5, 35)), params, request_id="b"))
        while engine.has_unfinished_requests():
            engine.step()  # b's prompt beside a's decodes, then two decoding rows (the GEMV)
        assert seen and not any(seen)
    finally:
        llm.shutdown()


def test_a_tied_table_is_quantized_from_the_checkpoint_without_an_fp32_copy(monkeypatch):
    def refuse(self, full):
        raise AssertionError("the fp32 table was copied")

    monkeypatch.setattr(VocabParallelEmbedding, "load", refuse)
    llm = LLM("dummy:tiny", quantization="q8_0", device="cpu", num_kv_blocks=32)
    try:
        model = llm.engine.runner.model
        assert model.embed_tokens.qweight is model.lm_head.qweight is not None
    finally:
        llm.shutdown()


def test_the_last_rank_pads_its_vocabulary_rows_with_zeros():
    table = torch.randn(5, 32)
    last = VocabParallelEmbedding(5, 32, TPGroup(1, 2))  # rows 3..5 of a 6-row padded vocabulary
    rows = last.rows_of(table)
    assert torch.equal(rows[:2], table[3:]) and torch.equal(rows[2], torch.zeros(32))
    last.load(table)
    assert torch.equal(last.weight.data, rows)
