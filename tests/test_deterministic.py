"""Deterministic mode (EngineConfig.deterministic): a request's tokens and logprobs are bit for bit
the same (a) cold and alone, (b) cold in a batch beside prompts of other lengths, (c) with its prefix
cached on the device, (d) restored from host memory, (e) restored from the disk store after a
restart, (f) prefilled with another token budget (chunk boundaries moved); greedy and seeded, in
fp32 and bf16 on the torch backend (CPU), and on CUDA with the Triton kernels when there is one."""

import random

import pytest
import torch

from chatengine import LLM, EngineConfig, SamplingParams

RNG = random.Random(0)
TARGETS = [[RNG.randrange(256) for _ in range(n)] for n in (37, 150, 230)]
NEIGHBOURS = [[RNG.randrange(256) for _ in range(n)] for n in (20, 111, 64, 180)]
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=3, ignore_eos=True),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture
def one_thread():
    """Deterministic mode on the CPU runs many small ops (attention one row at a time), and on a busy
    2-core box each wake-up of torch's thread pool costs milliseconds; one thread is faster here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def answers(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def run_cases(tmp_path, device: str, dtype: str, sp: SamplingParams, deterministic: bool = True) -> dict:
    """Each case's (tokens, logprobs) of every target prompt."""
    kw = dict(device=device, dtype=dtype, num_kv_blocks=256, deterministic=deterministic, register_personas=False)
    kv = str(tmp_path / "kv")
    cases = {}
    e = LLM("dummy:tiny", kv_store_dir=kv, max_num_batched_tokens=64, **kw)
    cases["a cold, alone"] = answers(e.generate([p], sp)[0] for p in TARGETS)
    cached = [e.generate([p], sp)[0] for p in TARGETS]
    assert all(o.num_cached_tokens >= len(p) // 16 * 16 - 16 for o, p in zip(cached, TARGETS))
    cases["c prefix cached on the device"] = answers(cached)
    restored = []
    for p in TARGETS:
        assert e.engine.offload_cached_blocks() > 0  # the conversation goes idle: its pages to host memory
        restored.append(e.generate([p], sp)[0])
    assert all(o.num_cached_tokens > 0 for o in restored)
    cases["d restored from host memory"] = answers(restored)
    e.shutdown()  # flushes the cached pages to the disk store
    e = LLM("dummy:tiny", kv_store_dir=kv, max_num_batched_tokens=64, **kw)  # a restart
    from_disk = [e.generate([p], sp)[0] for p in TARGETS]
    assert all(o.num_cached_tokens > 0 for o in from_disk)
    cases["e restored from disk after a restart"] = answers(from_disk)
    e.shutdown()
    e = LLM("dummy:tiny", max_num_batched_tokens=40, **kw)
    cases["f another token budget"] = answers(e.generate([p], sp)[0] for p in TARGETS)
    e.shutdown()
    e = LLM("dummy:tiny", max_num_batched_tokens=64, **kw)
    # prefill chunks and decodes of other requests share the targets' steps
    outs = e.generate(NEIGHBOURS[:2] + TARGETS + NEIGHBOURS[2:], sp)
    cases["b in a batch"] = answers(outs[2 : 2 + len(TARGETS)])
    e.shutdown()
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampling", list(PARAMS))
def test_answers_do_not_depend_on_batch_cache_or_budget(tmp_path, one_thread, device, dtype, sampling):
    cases = run_cases(tmp_path, device, dtype, PARAMS[sampling])
    cold = cases.pop("a cold, alone")
    assert all(len(tokens) == 10 and len(lps) == 10 for tokens, lps in cold)
    for case, got in cases.items():
        for i, (want, have) in enumerate(zip(cold, got)):
            assert have[0] == want[0], f"{case}: prompt {i}'s tokens differ from its cold run"
            assert have[1] == want[1], f"{case}: prompt {i}'s logprobs differ from its cold run"


def test_settings():
    assert EngineConfig().deterministic is False
    assert EngineConfig(deterministic=True).deterministic is True
    with pytest.raises(ValueError, match="unquantized"):
        EngineConfig(deterministic=True, quantization="q8_0")
    assert EngineConfig(deterministic=True, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="one or two devices"):
        EngineConfig(deterministic=True, tensor_parallel_size=4)
    from chatengine.app.server import build_parser  # (the app's dependencies: here only)

    assert build_parser().parse_args(["--deterministic"]).deterministic is True
    assert build_parser().parse_args([]).deterministic is None  # the engine's default


def test_linear_layers_switch_to_the_invariant_matmul():
    llm = LLM("dummy:tiny", num_kv_blocks=16, deterministic=True, register_personas=False)
    model = llm.engine.runner.model
    assert model.lm_head.invariant and model.layers[0].self_attn.qkv_proj.invariant
    assert model.layers[0].mlp.down_proj.invariant and llm.engine.runner.backend.deterministic
    llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_one_split_decode_graphs_agree_with_the_full_ones():
    """CUDA: decode steps whose keys all fall before split_keys replay graphs of one attention split
    (rows written in place, no merge); beside a sequence longer than that, the full graphs (every
    split, the merge). A target's tokens and logprobs are the same either way."""
    from chatengine.engine import model_runner
    from chatengine.kernels.paged_attention import INVARIANT_SPLIT_KEYS

    llm = LLM("dummy:smollm2-135m", deterministic=True, register_personas=False, max_model_len=2 * INVARIANT_SPLIT_KEYS)
    runner = llm.engine.runner
    assert set(runner.one_split_graphs) == set(runner.graphs)
    modes = []
    run = runner._run
    runner._run = lambda mode, key, *a: modes.append((mode, key)) or run(mode, key, *a)
    sp = PARAMS["seeded"]
    alone = answers(llm.generate(TARGETS, sp, user="alone"))
    assert {mode for mode, _ in modes} >= {model_runner.ONE_SPLIT_DECODE_GRAPH}
    assert model_runner.DECODE_GRAPH not in {mode for mode, _ in modes}
    modes.clear()
    long = [RNG.randrange(256) for _ in range(INVARIANT_SPLIT_KEYS + 100)]
    beside = answers(llm.generate([long, *TARGETS], sp, user="beside"))[1:]
    assert any(mode == model_runner.DECODE_GRAPH and key > 1 for mode, key in modes)  # targets beside it
    assert beside == alone
    llm.shutdown()
