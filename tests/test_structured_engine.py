"""Structured outputs through the engine on the default model: every kind of constraint gives text
that satisfies it, in both schedulers, beside plain requests that it never changes."""

import json
import re

import pytest

from chatengine import SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
}


def run(llm, prompt, spec, **kw):
    params = SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 64), **kw)
    params.structured_outputs = spec
    return llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]


@pytest.mark.slow  # every grammar kind, both schedulers: out of CI (README); the API tests cover each kind
def test_each_kind_holds_in_both_schedulers(either):
    out = run(either, "Give the capital of France as JSON.", StructuredOutputs(json=SCHEMA))
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert isinstance(value["city"], str) and isinstance(value["population"], int)
    obj = run(either, "Reply with a JSON object.", StructuredOutputs(json_object=True), max_tokens=96)
    assert obj.text.startswith("{")  # a small model may run on inside it: complete only when it stopped
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    assert run(either, "Yes or no?", StructuredOutputs(choice=["yes", "no", "maybe"])).text in {"yes", "no", "maybe"}
    text = run(either, "A date please.", StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}")).text
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text)
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    assert re.fullmatch(r"The answer is \d+\.", run(either, "2+2?", StructuredOutputs(grammar=grammar)).text)


def test_sampled_n_and_ignore_eos_still_end_with_the_grammar(llm):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=48,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(choice=["a", "b"]),
    )
    out = llm.generate("Pick one:", params)[0]
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
    assert {c.text for c in out.outputs} <= {"a", "b"}


def test_plain_neighbours_are_unchanged(llm_async):
    plain = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The sky is", "Water boils at"]
    alone = [o.outputs[0].token_ids for o in llm_async.generate(prompts, plain)]
    json_params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputs(json=SCHEMA))
    mixed = llm_async.generate(prompts + ["JSON:"], [plain, plain, json_params])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    json.loads(mixed[2].outputs[0].text)


def test_bad_specs_are_clear_errors(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(regex="(a")))
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]}))


def test_the_engine_starts_each_next_mask_as_it_feeds_a_token(llm, monkeypatch):
    """Fed a token, a grammar's next mask is started on the grammar worker, and the sampling copies
    it: the answer is the one of masks made at sampling time (fill_ahead turned off)."""
    from chatengine.engine import structured

    started = []
    real = structured.fill_ahead

    def counting(states):
        started.append(len(states))
        real(states)

    spec = StructuredOutputs(json=SCHEMA)
    monkeypatch.setattr(structured, "fill_ahead", counting)
    ahead = run(llm, "Give the capital of France as JSON.", spec, temperature=0.8, seed=3)
    monkeypatch.setattr(structured, "fill_ahead", lambda states: None)
    now = run(llm, "Give the capital of France as JSON.", spec, temperature=0.8, seed=3)
    assert ahead.token_ids == now.token_ids and json.loads(ahead.text)["city"]
    assert sum(started) >= len(ahead.token_ids) - 2  # every token fed but the last (it ended the grammar)
