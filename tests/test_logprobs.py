"""Logprobs of sampled and prompt tokens on the default model: equal to a transformers forward over
the same weights (fp32, CPU), whatever the batch, chunking, scheduling or sampling around them."""

import math

import pytest
import torch

from chatengine import LLM, SamplingParams
from chatengine.engine.logprobs import HostLogprobs, row_logprobs

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm.engine.hf_dir, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V): row p is the log-distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_row_logprobs_reference():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    lp = row_logprobs(logits, torch.tensor([0, 3]), 2, [0.0, 2.0])
    assert torch.allclose(lp.chosen, torch.stack([torch.log_softmax(logits[0], 0)[0], torch.tensor(math.log(0.25))]))
    assert lp.top_ids[0].tolist() == [2, 1]
    d = lp.to_host(pin=False).as_dicts([2, 1])
    assert list(d[0]) == [2, 1, 0] and list(d[1])[-1] == 3  # the chosen token is always a key
    assert d[0] == {2: lp.top_vals[0, 0].item(), 1: lp.top_vals[0, 1].item(), 0: lp.chosen[0].item()}


def test_packed_host_logprobs_keep_large_token_ids_exact():
    """The host copy packs ids as float32: exact for every id of a 262k vocabulary."""
    logits = torch.zeros(2, 262_144)
    logits[0, 262_143], logits[0, 7], logits[1, 128_255], logits[1, 200_001] = 5.0, 1.0, 4.0, 3.0
    lp = row_logprobs(logits, torch.tensor([262_141, 128_255]), 2)
    d = lp.to_host(pin=False).as_dicts([2, 1])
    assert list(d[0]) == [262_143, 7, 262_141] and list(d[1]) == [128_255]
    assert all(type(t) is int for row in d for t in row)


def test_flat_rows_of_a_step_with_several_ks_read_as_their_dicts():
    """A step's rows packed with its largest k: each row cut to its own k as float32 bytes, read
    back through TokenLogprobs as the same dicts as as_dicts, with the token's logprob beside."""
    from array import array

    from chatengine.outputs import TokenLogprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 300)
    chosen = torch.tensor([5, 299, 17])
    host = row_logprobs(logits, chosen, 5).to_host(pin=False)
    ks = [2, 5, 0]
    rows = host.flat_rows(ks)
    for (data, logprob), k, want in zip(rows, ks, host.as_dicts(ks), strict=True):
        flat = array("f")
        flat.frombytes(data)
        assert len(flat) == 2 + 2 * k and TokenLogprobs(flat, k, 1)[0] == want
        assert logprob == want[int(flat[0])]


def test_rows_copied_into_a_given_buffer_read_as_views_of_it():
    """HostLogprobs.of(into=...) copies a step's packed rows into the front of a reused buffer (the
    runner's pinned ring); a step of one k reads its rows as views of it, the same bytes as rows
    cut one by one."""
    torch.manual_seed(1)
    lp = row_logprobs(torch.randn(4, 50), torch.tensor([1, 2, 3, 49]), 3)
    packed = lp.to_host(pin=False).packed
    into = torch.full((4 * 8 + 5,), -1.0)
    host = HostLogprobs.of(packed, 3, pin=False, into=into)
    assert host.packed.data_ptr() == into.data_ptr() and torch.equal(host.packed, packed)
    assert into[32:].tolist() == [-1.0] * 5  # nothing past the rows written
    rows = host.flat_rows([3, 3, 3, 3])
    assert all(isinstance(data, memoryview) for data, _ in rows)
    assert [bytes(data) for data, _ in rows] == [packed[r].numpy().tobytes() for r in range(4)]
    assert [logprob for _, logprob in rows] == packed[:, 1].tolist()


@pytest.mark.parametrize("k", [0, 5])
def test_sampled_logprobs_equal_transformers(either, hf_model, k):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=k)
    outs = either.generate(PROMPTS, params)
    for out in outs:
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        ref = hf_logprobs(hf_model, out.prompt_token_ids + c.token_ids)
        total = 0.0
        for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(out.prompt_token_ids) - 1 + i]
            assert abs(d[tok] - row[tok].item()) < 1e-3
            top = row.topk(k)
            assert list(d)[:k] == top.indices.tolist()  # best first
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(d[t] - v) < 1e-3
            assert len(d) == k + (tok not in top.indices.tolist())
            total += d[tok]
        assert abs(c.cumulative_logprob - total) < 1e-6


def test_prompt_logprobs_equal_transformers_across_chunks(hf_model):
    # 64-token chunks: a 150-token prompt is prefilled in three, beside a plain request
    llm = LLM(max_num_batched_tokens=64, kv_cache_gib=0.1, quantization="none")
    try:
        prompt = " ".join(f"word{i}" for i in range(60))
        ids = llm.get_tokenizer()(prompt)["input_ids"]
        assert len(ids) > 128
        outs = llm.generate(
            [ids, ids], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), SamplingParams(max_tokens=2)]
        )
        plp = outs[0].prompt_logprobs
        assert outs[1].prompt_logprobs is None
        assert len(plp) == len(ids) and plp[0] is None
        ref = hf_logprobs(hf_model, ids)
        for p in range(1, len(ids)):
            assert abs(plp[p][ids[p]] - ref[p - 1, ids[p]].item()) < 1e-3
            assert list(plp[p])[:3] == ref[p - 1].topk(3).indices.tolist()
        # a second run (its prompt cached by the first) still computes every prompt row
        again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        assert again.num_cached_tokens == 0
        assert [d[t] for d, t in zip(again.prompt_logprobs[1:], ids[1:])] == pytest.approx(
            [d[t] for d, t in zip(plp[1:], ids[1:])], abs=1e-4
        )
    finally:
        llm.shutdown()


def test_logprobs_follow_temperature_and_n(llm):
    params = SamplingParams(temperature=0.7, max_tokens=6, logprobs=2, n=3, seed=3)
    out = llm.generate(PROMPTS[0], params)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, d in zip(c.token_ids, c.logprobs):
            assert tok in d and d[tok] <= 0
    # the same seed gives the same tokens and logprobs
    again = llm.generate(PROMPTS[0], params)[0]
    assert [c.logprobs for c in again.outputs] == [c.logprobs for c in out.outputs]


def test_no_logprobs_unless_asked(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


def test_a_stop_found_a_step_late_adds_no_logprob_row(llm_async):
    """Async scheduling finds a stop token one step late: the step after it ran the sequence on a
    wasted lane, and that lane's logprobs are not the output's (one row per token, the cumulative
    logprob their sum)."""
    prompt = "Write a short poem about the sea."
    greedy = llm_async.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = greedy.outputs[0].token_ids[4]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], logprobs=2, ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # keeps the steps going
    c = llm_async.generate([prompt, "Hi"], [params, longer])[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop and len(c.token_ids) <= 5
    assert len(c.logprobs._flat) == len(c.token_ids) * (2 + 2 * 2)
    assert c.cumulative_logprob == pytest.approx(sum(row[t] for row, t in zip(c.logprobs, c.token_ids)), abs=1e-5)
