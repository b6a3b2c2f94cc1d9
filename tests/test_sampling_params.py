"""SamplingParams validation, and stop_token_ids: bounded, inside the vocabulary, a set lookup."""

import pytest

from chatengine import SamplingParams
from chatengine.sampling_params import MAX_STOP_TOKEN_IDS


def test_stop_token_ids_are_bounded_and_in_the_vocabulary():
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).validate(4, 64, vocab_size=100)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(250_000))).validate(4, 64, vocab_size=300_000)
    with pytest.raises(ValueError, match=r"in \[0, 100\) \(the model's vocabulary\); got \[100\]"):
        SamplingParams(stop_token_ids=[5, 100]).validate(4, 64, vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[True]).validate(4, 64)


def test_the_engine_checks_the_models_vocabulary(tiny):
    vocab = tiny.vocab_size
    with pytest.raises(ValueError, match="the model's vocabulary"):
        tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[vocab]))
    out = tiny.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    first = out.outputs[0].token_ids[0]
    stopped = tiny.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].token_ids == [first]


def test_api_refuses_a_huge_stop_list():
    from fastapi.testclient import TestClient

    from chatengine import AsyncLLM
    from chatengine.app.api.routes import build_api

    engine = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1, register_personas=False)
    try:
        with TestClient(build_api(engine, None, model_name="m")) as client:
            body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": list(range(1000))}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]
            body["stop_token_ids"] = [10**7]
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_row_flags_follow_the_fields_they_read_even_when_set_later():
    p = SamplingParams(temperature=0.6)
    assert (p.penalized, p.needs_history, p.processed) == (False, False, False)
    p.repetition_penalty = 1.1
    assert (p.penalized, p.needs_history, p.processed) == (True, True, True)
    p.repetition_penalty = 1.0
    p.logit_bias = {3: 1.0}
    assert (p.penalized, p.needs_history, p.processed) == (False, False, True)
    p.min_tokens = 2
    assert (p.needs_history, p.processed) == (True, True)
    q = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert q.needs_history and not q.penalized
    assert "penalized" not in repr(q)  # not a field: no argument, no repr, no equality


def test_values_that_vanish_in_fp32_are_refused_or_mean_what_they_say(tiny):
    """The sampler works in fp32: a top_p below its range would round to 0 (every token dropped) and
    a repetition penalty that small divides by 0. A tiny nucleus keeps the top token alone."""
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[0.01, 10\]"):
        SamplingParams(repetition_penalty=1e-50).validate(4, 64)
    SamplingParams(repetition_penalty=0.01).validate(4, 64)
    prompt = [[5, 9, 2, 7]]
    greedy = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    for top_p in (1e-50, 1e-44):
        sp = SamplingParams(temperature=1.0, top_p=top_p, seed=3, max_tokens=6, logprobs=1, ignore_eos=True)
        got = tiny.generate(prompt, sp)[0].outputs[0]
        assert got.token_ids == greedy.token_ids
        assert all(lp == lp for step in got.logprobs for lp in step.values())  # no NaN
