"""Logits processing: logit_bias, min_tokens, penalties, as formulas on small rows and end to end on
the default model (repetition penalty token for token equal to transformers' generate)."""

import torch

from chatengine import SamplingParams
from chatengine.engine.logits_processor import process_logits
from chatengine.engine.sequence import Sequence


def seq(prompt, output, **params) -> Sequence:
    s = Sequence(prompt, SamplingParams(**params))
    for t in output:
        s.append_token(t)
    return s


def test_untouched_rows_and_bias():
    logits = torch.zeros(2, 6)
    process_logits(logits, [seq([1], [2]), seq([1], [], logit_bias={4: 2.5, 0: -100})], {5})
    assert logits.tolist() == [[0.0] * 6, [-100.0, 0, 0, 0, 2.5, 0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    rows = [seq([1], [2], min_tokens=2, stop_token_ids=[3]), seq([1], [2, 2], min_tokens=2, stop_token_ids=[3])]
    logits = torch.zeros(2, 6)
    process_logits(logits, rows, {5})
    inf = float("-inf")
    assert logits.tolist() == [[0, 0, 0, inf, 0, inf], [0.0] * 6]


def test_penalties_formulas():
    base = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    logits = base.clone()
    process_logits(logits, [seq([0], [1, 2, 2], repetition_penalty=2.0)], set())
    assert logits.tolist() == [[1.0, -4.0, 0.5, 0.5]]  # 0 is in the prompt, 1 and 2 in the output
    logits = base.clone()
    process_logits(logits, [seq([0], [1, 2, 2], frequency_penalty=0.5, presence_penalty=0.25)], set())
    assert logits.tolist() == [[2.0, -2.75, 1.0 - 1.0 - 0.25, 0.5]]  # the prompt's token 0 is not penalized


def test_penalties_follow_tokens_added_between_steps():
    """The numpy history grows with each step's new tokens, skips a pending placeholder until it
    is filled, and outgrows its first buffer."""
    s = seq([0], [1], frequency_penalty=1.0)
    rows = []
    for t in [2, 2, 3] + [4] * 70:
        s.append_placeholder()  # sampled by the step in flight: not counted yet
        logits = torch.zeros(1, 6)
        process_logits(logits, [s], set())
        rows.append(logits[0].tolist())
        s.fill_placeholder(t)
    assert rows[0] == [0, -1, 0, 0, 0, 0]
    assert rows[3] == [0, -1, -2, -1, 0, 0]
    assert rows[-1] == [0, -1, -2, -1, -69, 0]
    logits = torch.zeros(1, 6)
    process_logits(logits, [s], set())
    assert logits[0].tolist() == [0, -1, -2, -1, -70, 0]


def test_repetition_penalty_equals_transformers(either):
    from transformers import AutoModelForCausalLM

    llm = either
    model = AutoModelForCausalLM.from_pretrained(llm.engine.hf_dir, dtype=torch.float32).eval()
    ids = llm.get_tokenizer()("Repeat after me: the cat sat on the mat, the cat sat on the mat,")["input_ids"]
    ref = model.generate(
        torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5, pad_token_id=0
    )[0, len(ids) :].tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref


def test_logit_bias_forces_a_token_and_min_tokens_holds(llm):
    tok = llm.get_tokenizer()
    target = tok(" banana")["input_ids"][0]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logit_bias={target: 100}))[0]
    assert out.outputs[0].token_ids == [target] * 4
    # greedy answers this prompt with EOS at once; min_tokens keeps it going, EOS masked meanwhile
    # (and the "." it writes before then stops nothing)
    eos = llm.engine.eos_token_ids
    prompt = "Reply with one word: yes or no?"
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids[0] in eos
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=12, stop=["."])
    c = llm.generate(prompt, params)[0].outputs[0]
    assert len(c.token_ids) >= 12 and not eos & set(c.token_ids[:12])


def test_penalties_run_in_both_schedulers_alike(llm, llm_async):
    # both penalty settings in one batch (each prompt under each): one run per scheduler
    penalties = [{"frequency_penalty": 2.0, "presence_penalty": 2.0}, {"presence_penalty": -2.0}]
    prompts = ["The cat sat on the", "Count: 1, 2, 3,"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **p) for p in penalties for _ in prompts]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts * len(penalties), params)]
    b = [o.outputs[0].token_ids for o in llm_async.generate(prompts * len(penalties), params)]
    assert a == b
    for i in range(len(penalties)):  # each setting changes the tokens
        assert a[i * len(prompts) : (i + 1) * len(prompts)] != plain, penalties[i]


def test_min_tokens_same_in_both_schedulers(llm, llm_async):
    # the async engine collects the step in flight before it counts: the count is exact there too
    prompts = ["Say hi.", "Reply with one word: yes or no?"]
    params = SamplingParams(temperature=0, max_tokens=18, min_tokens=9)  # the second ends (EOS) at 17
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in llm_async.generate(prompts, params)]
    eos = llm.engine.eos_token_ids
    assert a == b and all(len(t) >= 9 and not eos & set(t[:9]) for t in a)
