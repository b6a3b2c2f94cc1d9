"""Every model family the engine serves, proven the one way possible without downloads: a tiny
random-weight model saved with transformers' `save_pretrained`, loaded by `LLM(model=dir)`, gives
transformers' greedy tokens (fp32, CPU) for prompts longer than two prefill chunks, again when
their prefix is cached, and in every sample of n > 1."""

import random

import pytest
import torch

from chatengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, EOS, CHUNK = 256, 255, 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=EOS,
    initializer_range=0.2,  # weights large enough that attention, not the embeddings alone, picks the token
)
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    # fused qkv_proj and gate_up_proj in the checkpoint
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)),
    # every layer sees its last 40 keys: prompts of 80-128 tokens, chunks of 32
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=40, tie_word_embeddings=False)),
    # Phi-4-mini's rope: 3/4 of each head rotates, LongRoPE short factors within the original context
    "phi4-mini": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            bos_token_id=1,
            tie_word_embeddings=True,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                "long_factor": [2.0, 3.0, 4.0, 6.0, 9.0, 12.0],
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    # q/k norms, sandwich norms, (1 + w) norms, scaled embeddings, GeGLU, a 24-key sliding layer with
    # its own RoPE base beside a global layer with linear RoPE scaling, query_pre_attn_scalar
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            pad_token_id=0,
            bos_token_id=1,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, saved directory, transformers model) of one family."""
    config_name, model_name, extra = FAMILIES[request.param]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms made of ones would hide a norm left out
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def prompts() -> list[list[int]]:
    rng = random.Random(7)  # 2.5 to 4 prefill chunks each
    return [[rng.randrange(1, EOS) for _ in range(rng.randint(5 * CHUNK // 2, 4 * CHUNK))] for _ in range(3)]


def reference(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
        )
    return out[0, len(ids) :].tolist()


def test_greedy_equals_transformers_chunked_cached_and_forked(family):
    name, path, model = family
    llm = LLM(str(path), device="cpu", num_kv_blocks=128, max_num_batched_tokens=CHUNK, debug_checks=True)
    try:
        refs = [reference(model, ids) for ids in prompts()]
        cold = llm.generate(prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in cold] == refs, name
        assert all(o.num_cached_tokens == 0 for o in cold)
        warm = llm.generate(prompts(), GREEDY)  # the same prompts: their full blocks come from the cache
        assert [o.outputs[0].token_ids for o in warm] == refs, name
        assert all(o.num_cached_tokens >= 16 for o in warm)
        forked = llm.generate(prompts()[:1], SamplingParams(temperature=0, max_tokens=12, n=3))
        assert [c.token_ids for c in forked[0].outputs] == [refs[0]] * 3, name
    finally:
        llm.shutdown()


def test_prompt_logprobs_equal_transformers(family):
    """Every prompt token's logprob, prefilled in chunks, within 1e-4 of one transformers forward."""
    name, path, model = family
    llm = LLM(str(path), device="cpu", num_kv_blocks=128, max_num_batched_tokens=CHUNK)
    try:
        ids = prompts()[0]
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        ours = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        with torch.no_grad():
            theirs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        expected = theirs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (name, (ours - expected).abs().max().item())
    finally:
        llm.shutdown()


def test_each_family_loads_its_options(family):
    name, path, _ = family
    from chatengine.engine.loader import load_model

    config = load_model(str(path)).config
    assert config.qk_norm == (name in ("qwen3", "gemma3"))
    if name in ("qwen3", "gemma3"):
        assert config.head_dim == 32 != config.hidden_size // config.num_heads
    assert config.layer_windows == {"mistral-window": [40, 40], "gemma3": [24, 0]}.get(name, [])
    assert config.rotary_dim == (12 if name == "phi4-mini" else None)
    # LongRoPE is served exactly up to its original context
    assert config.max_position_embeddings == (256 if name == "phi4-mini" else 512)
    if name == "gemma3":
        assert (config.hidden_act, config.sandwich_norms, config.norm_offset) == ("gelu_tanh", True, 1.0)
        assert (config.local_rope_theta, config.rope_scaling["rope_type"]) == (10000.0, "linear")
        assert config.embed_scale == 8.0 and config.query_scale == 24**-0.5


def test_a_window_past_the_context_is_full_attention(tmp_path):
    from chatengine.engine.loader import load_model

    config = transformers.MistralConfig(**{**COMMON, "sliding_window": 4096})
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).config.layer_windows == []


def test_a_dummy_qwen3_shape_makes_its_norm_weights():
    llm = LLM("dummy:tiny-qwen3", device="cpu", num_kv_blocks=32, max_num_batched_tokens=64)
    try:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        norms = [n for n, _ in llm.engine.runner.model.named_parameters() if "q_norm" in n or "k_norm" in n]
        assert len(norms) == 2 * 2  # two layers, q and k
    finally:
        llm.shutdown()


def test_partial_rotary_order_pairs_the_rotated_dims_at_half_the_head():
    from chatengine.engine.models.llama import partial_rotary_order

    assert partial_rotary_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert partial_rotary_order(8, 8).tolist() == list(range(8))


def test_a_dummy_gemma3_shape_runs():
    from chatengine.engine.loader import DUMMY_SHAPES

    shape = DUMMY_SHAPES["gemma-3-4b"]
    assert shape["layer_windows"].count(0) == 5 and len(shape["layer_windows"]) == shape["num_layers"] == 34


REALISTIC = dict(  # a 1B-class width, four layers: the kernels' real tile shapes, a short run
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    eos_token_id=2,
    pad_token_id=0,
    bos_token_id=1,
)


REALISTIC_EXTRA = {  # the families' options at that width: windows of several pages, head_dim 256
    "qwen3": dict(head_dim=128),
    "mistral-window": dict(sliding_window=300),
    "phi4-mini": dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / 8 for i in range(48)],
            "long_factor": [2.0 + i / 8 for i in range(48)],
            "original_max_position_embeddings": 4096,
        },
        original_max_position_embeddings=4096,
    ),
    "gemma3": dict(
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=300,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_fp32_realistic_width_equals_transformers(name, tmp_path):
    """On the device in fp32 (our Triton kernels, CUDA graphs): prompt logprobs within 1e-4 of
    transformers' and the same greedy tokens."""
    config_name, model_name, extra = FAMILIES[name]
    extra = {k: v for k, v in extra.items() if k not in ("rope_scaling", "head_dim")}
    config = getattr(transformers, config_name)(**{**REALISTIC, **extra, **REALISTIC_EXTRA.get(name, {})})
    torch.manual_seed(2)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(tmp_path)
    model = model.cuda()
    rng = random.Random(3)
    ids = [rng.randrange(3, 32000) for _ in range(700)]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_batched_tokens=256, register_personas=False)
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0))[0]
        ours = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        with torch.no_grad():
            theirs = torch.log_softmax(model(torch.tensor([ids], device="cuda")).logits[0, :-1].float(), -1).cpu()
            prompt = torch.tensor([ids], device="cuda")
            ref = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        expected = theirs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-4), (name, (ours - expected).abs().max().item())
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), name
    finally:
        llm.shutdown()
