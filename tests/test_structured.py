"""Structured outputs' building block on the default model's tokenizer: every spec kind compiles,
bad specs raise ValueError naming the field, compiles are cached (and single-flight across
threads), a valid text walks token by token to termination, and the bitmask applied by xgrammar
equals the plain-torch reference bit for bit."""

import json
import threading

import pytest
import torch

from chatengine.engine.structured import (
    Grammars,
    accept_tokens,
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_ref,
    fill_ahead,
    fill_bitmasks,
    fills_in_flight,
    mask_logits,
)
from chatengine.sampling_params import StructuredOutputs as SO

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def eos(llm):
    return sorted(llm.engine.eos_token_ids)


@pytest.fixture(scope="module")
def grammars(llm, tok, eos):
    return Grammars(tok, llm.engine.model_config.vocab_size, eos)


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist())


def walk(grammars, tok, spec, text):
    """Accept text's tokens one by one; returns the state (each must be allowed by the mask first)."""
    state = grammars.matcher(grammars.compile(spec))
    mask = allocate_bitmask(1, grammars.vocab_size)
    for t in tok.encode(text, add_special_tokens=False):
        state.fill_bitmask(mask, 0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"mask refuses token {t} ({tok.decode([t])!r}) of {text!r}"
        assert state.accept(t), f"token {t} ({tok.decode([t])!r}) of {text!r} refused"
    return state


SPECS = {
    "json": SO(json=SCHEMA),
    "json_text": SO(json=json.dumps(SCHEMA)),
    "json_object": SO(json_object=True),
    "regex": SO(regex=r"\d{3}-[a-z]+"),
    "choice": SO(choice=["yes", "no", 'say "hi"\\', "café ☕", "line\nbreak"]),
    "grammar": SO(grammar='root ::= "answer: " ("yes" | "no")'),
}
VALID = {
    "json": '{"name": "Ada", "age": 36}',
    "json_text": '{"name": "Ada", "age": 36}',
    "json_object": '{"a": [1, 2.5, {"b": null}], "c": "x\\"y", "d": true}',
    "regex": "123-abc",
    "choice": 'say "hi"\\',
    "grammar": "answer: no",
}


@pytest.mark.parametrize("kind", list(SPECS))
def test_valid_text_walks_to_termination(grammars, tok, eos, kind):
    state = walk(grammars, tok, SPECS[kind], VALID[kind])
    assert not state.is_terminated()  # complete, but only a stop token terminates it
    mask = allocate_bitmask(1, grammars.vocab_size)
    state.fill_bitmask(mask, 0)
    if kind != "regex":  # [a-z]+ may go on; the others are complete here
        assert allowed(mask, 0, grammars.vocab_size) == set(eos)
    assert state.accept(eos[0]) and state.is_terminated()
    mask.fill_(0)
    state.fill_bitmask(mask, 0)
    assert allowed(mask, 0, grammars.vocab_size) == set(eos)  # terminated: stop tokens only
    assert not state.accept(tok.encode("a", add_special_tokens=False)[0])


@pytest.mark.parametrize("choice", ["café ☕", "line\nbreak", "no"])
def test_each_choice_escaped_and_matched(grammars, tok, eos, choice):
    state = walk(grammars, tok, SPECS["choice"], choice)
    assert state.accept(eos[0]) and state.is_terminated()


def test_batch_fill_equals_row_by_row_fill(grammars, tok, eos):
    """Several states at different places (inside a string, between fields, one terminated) into
    rows out of order: the threaded fill writes each row exactly as a fill of that state alone,
    and leaves the other rows as they were."""
    texts = ['{"name": "Ad', '{"name": "Ada", ', '{"name": "Ada", "age": 3', '{"name": "Ada", "age": 36}']
    states = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    assert states[-1].accept(eos[0]) and states[-1].is_terminated()
    rows = [4, 0, 2, 3]
    batch = allocate_bitmask(6, grammars.vocab_size)
    batch[1] = 7
    fill_bitmasks(states, batch, rows)
    for state, row in zip(states, rows, strict=True):
        single = allocate_bitmask(1, grammars.vocab_size)
        state.fill_bitmask(single, 0)
        assert torch.equal(batch[row], single[0])
    assert allowed(batch, 3, grammars.vocab_size) == set(eos)
    assert (batch[1] == 7).all() and (batch[5] == -1).all()


def test_masks_filled_ahead_equal_fills_made_then_and_follow_each_token(grammars, tok, eos):
    """fill_ahead starts the next masks on the grammar worker; a later fill copies them, and they
    are the masks a fill made at that moment gives. A token accepted meanwhile drops the mask made
    ahead (it waits for it first): the next fill is of the new state."""
    texts = ['{"name": "Ad', '{"name": "Ada", ', '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 3']
    states = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    twins = [walk(grammars, tok, SPECS["json"], t) for t in texts]  # the same states, never ahead
    assert states[2].accept(eos[0]) and twins[2].accept(eos[0])  # terminated: nothing to start
    fill_ahead(states)
    assert [s._ahead is not None for s in states] == [True, True, False, True]
    rows = [3, 1, 0, 2]
    ahead, now = allocate_bitmask(4, grammars.vocab_size), allocate_bitmask(4, grammars.vocab_size)
    fill_bitmasks(states, ahead, rows)
    fill_bitmasks(twins, now, rows)
    assert torch.equal(ahead, now)
    assert allowed(ahead, 0, grammars.vocab_size) == set(eos)
    (quote,) = tok.encode('"', add_special_tokens=False)
    before = ahead[rows[0]].clone()
    fill_ahead(states)  # the masks made ahead stand until a token changes the state
    assert states[0].accept(quote) and twins[0].accept(quote)  # the name's string ends
    assert states[0]._ahead is None and states[1]._ahead is not None
    fill_bitmasks(states, ahead, rows)
    fill_bitmasks(twins, now, rows)
    assert torch.equal(ahead, now) and not torch.equal(ahead[rows[0]], before)


def test_a_fill_that_fails_ahead_is_its_own_states_alone(grammars, tok):
    """A matcher whose fill fails on the worker: the batch's other states still get their masks made
    ahead; that state's is made again at sampling time (and raises there if it fails again), and its
    tokens are still accepted."""

    class Failing:
        def __init__(self, matcher):
            self.matcher, self.fail = matcher, True

        def fill_next_token_bitmask(self, bitmask, row):
            if self.fail:
                raise RuntimeError("fill failed")
            self.matcher.fill_next_token_bitmask(bitmask, row)

        def __getattr__(self, name):  # (the batch fill reaches the matcher's native handle: fails too)
            if name == "_handle" and self.fail:
                raise RuntimeError("fill failed")
            return getattr(self.matcher, name)

    texts = ['{"name": "Ad', '{"name": "Ada", ']
    states = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    twins = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    states[0]._matcher = Failing(states[0]._matcher)
    fill_ahead(states)
    with pytest.raises(RuntimeError, match="fill failed"):
        states[0].ahead_mask()
    assert states[1].ahead_mask() is not None  # the batch's other row was made alone
    fill_ahead(states)
    with pytest.raises(RuntimeError, match="fill failed"):  # made now, and failing again: raised
        fill_bitmasks(states, allocate_bitmask(2, grammars.vocab_size), [0, 1])
    fill_ahead(states)  # fails ahead again; then the fill made at sampling succeeds
    states[0]._ahead[0].result()  # (the worker's fill done before the matcher mends)
    states[0]._matcher.fail = False
    got, want = allocate_bitmask(2, grammars.vocab_size), allocate_bitmask(2, grammars.vocab_size)
    fill_bitmasks(states, got, [0, 1])
    fill_bitmasks(twins, want, [0, 1])
    assert torch.equal(got, want)
    states[0]._matcher.fail = True
    fill_ahead(states)  # a failed fill ahead never reaches accept: the state is intact
    states[0]._ahead[0].result()
    states[0]._matcher.fail = False
    (quote,) = tok.encode('"', add_special_tokens=False)
    assert states[0].accept(quote) and twins[0].accept(quote)
    got, want = allocate_bitmask(2, grammars.vocab_size), allocate_bitmask(2, grammars.vocab_size)
    fill_bitmasks(states, got, [0, 1])
    fill_bitmasks(twins, want, [0, 1])
    assert torch.equal(got, want)


def test_accept_tokens_feeds_a_batch_as_one_state_at_a_time(grammars, tok, eos):
    """One call for a step's rows: each state advances as accept() would, a refused or out-of-vocabulary
    token changes nothing, and only a state that accepted a stop token after a complete text is terminated."""
    texts = ['{"name": "Ad', '{"name": "Ada", ', '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', '{"na']
    states = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    twins = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    a = tok.encode("a", add_special_tokens=False)[0]
    brace = tok.encode("{", add_special_tokens=False)[0]
    fill_ahead(states[:2])  # a fill ahead still pending is waited for, then dropped
    feed = [a, brace, eos[0], a, grammars.vocab_size + 5]
    got = accept_tokens(states, feed)
    want = [(twin.accept(t), twin.is_terminated()) for twin, t in zip(twins, feed, strict=True)]
    assert got == want == [(True, False), (False, False), (True, True), (False, False), (False, False)]
    for state, twin in zip(states, twins, strict=True):
        x, y = allocate_bitmask(1, grammars.vocab_size), allocate_bitmask(1, grammars.vocab_size)
        state.fill_bitmask(x, 0)
        twin.fill_bitmask(y, 0)
        assert torch.equal(x, y)
    assert accept_tokens(states[:1], [a]) == [(True, False)]  # one row: no batch call


def test_fills_in_flight_until_the_newest_fill_reports(grammars, tok, monkeypatch):
    """The engine yields its lock before scheduling while a fill started ahead has not reported."""
    from chatengine.engine import structured

    gate = threading.Event()
    real = structured._fill_ahead_rows

    def held(matchers, bitmask):
        gate.wait(10)
        return real(matchers, bitmask)

    monkeypatch.setattr(structured, "_fill_ahead_rows", held)
    state = walk(grammars, tok, SPECS["json"], '{"name": "Ad')
    fill_ahead([state])
    assert fills_in_flight()
    gate.set()
    state._ahead[0].result(10)
    assert not fills_in_flight()


def test_an_invalid_token_is_refused_and_changes_nothing(grammars, tok):
    state = grammars.matcher(grammars.compile(SO(json_object=True)))
    letter = tok.encode("x", add_special_tokens=False)[0]
    assert not state.accept(letter)
    assert not state.accept(-1) and not state.accept(grammars.vocab_size)  # outside the vocabulary
    for t in tok.encode('{"k": 1}', add_special_tokens=False):  # the state is still at the start
        assert state.accept(t)
    assert not state.accept(tok.encode(" ", add_special_tokens=False)[0])  # no free whitespace


def test_json_object_mask_at_start(grammars, tok):
    state = grammars.matcher(grammars.compile(SO(json_object=True)))
    mask = allocate_bitmask(3, grammars.vocab_size)
    state.fill_bitmask(mask, 1)
    ok = allowed(mask, 1, grammars.vocab_size)
    assert ok and all(tok.decode([t]).startswith("{") for t in ok)
    assert tok.convert_tokens_to_ids("{") in ok
    assert tok.encode("a", add_special_tokens=False)[0] not in ok
    assert (mask[0] == -1).all() and (mask[2] == -1).all()  # other rows untouched


def test_schema_is_followed(grammars, tok):
    state = grammars.matcher(grammars.compile(SO(json=SCHEMA)))
    for t in tok.encode('{"name": "Ada", "age": ', add_special_tokens=False):
        assert state.accept(t)
    assert not state.accept(tok.encode('"', add_special_tokens=False)[0])  # age is an integer
    assert state.accept(tok.encode("7", add_special_tokens=False)[0])


@pytest.mark.parametrize(
    "spec, field, words",
    [
        (SO(json={"type": "objekt"}), "json", "objekt"),
        (SO(json="{not json"), "json", "not valid JSON"),
        (SO(json="[1, 2]"), "json", "schema object"),
        (SO(regex="a(b"), "regex", "parenthesis"),
        (SO(grammar='root ::= "a" | '), "grammar", "EBNF"),
        (SO(grammar='start ::= "a"'), "grammar", "root"),
        (SO(grammar="root ::= undefined_rule"), "grammar", "undefined_rule"),
    ],
)
def test_bad_specs_raise_value_error_naming_the_field(grammars, spec, field, words):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}") as e:
        grammars.compile(spec)
    assert words in str(e.value)
    assert "/project/" not in str(e.value)  # xgrammar's source location is stripped


def test_spec_must_set_exactly_one_field(grammars):
    with pytest.raises(ValueError, match="exactly one"):
        grammars.compile(SO(regex="a", json_object=True))


def test_compile_is_cached_by_canonical_spec(grammars):
    a = grammars.compile(SO(json=SCHEMA))
    assert grammars.compile(SO(json=dict(SCHEMA))) is a
    assert grammars.compile(SO(json=json.dumps(SCHEMA, indent=2))) is a  # the same schema as text
    assert grammars.compile(SO(choice=["yes", "no"])) is grammars.compile(SO(choice=["yes", "no"]))
    assert grammars.compile(SO(choice=["no", "yes"])) is not grammars.compile(SO(choice=["yes", "no"]))


def test_failed_compiles_are_not_cached(grammars):
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            grammars.compile(SO(regex="(x"))


def test_compile_from_threads_gives_one_object(tok, eos, llm):
    fresh = Grammars(tok, llm.engine.model_config.vocab_size, eos)  # nothing cached, no compiler yet
    spec = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}
    results, errors = [], []
    barrier = threading.Barrier(6)

    def work(i):
        try:
            barrier.wait()
            results.append(fresh.compile(SO(json=spec if i % 2 else json.dumps(spec))))
            with pytest.raises(ValueError):
                fresh.compile(SO(regex="[z-a]"))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert fresh.tokenizer_info_seconds is not None


def test_cache_is_bounded(tok, eos, llm, monkeypatch):
    from chatengine.engine import structured

    monkeypatch.setattr(structured, "CACHE_SIZE", 3)
    g = Grammars(tok, llm.engine.model_config.vocab_size, eos)
    first = g.compile(SO(choice=["0"]))
    for i in range(1, 4):
        g.compile(SO(choice=[str(i)]))
    assert len(g._cache) == 3 and g.compile(SO(choice=["0"])) is not first  # evicted, compiled again


def test_cache_is_bounded_in_bytes_too(tok, eos, llm, monkeypatch):
    """A few long grammars (tens of MBs compiled each) must not pile up to gigabytes."""
    from chatengine.engine import structured

    g = Grammars(tok, llm.engine.model_config.vocab_size, eos)
    sizes = [g.compile(SO(choice=[f"{i} " * (i + 1)])).memory_size_bytes for i in range(3)]
    assert g._bytes == sum(sizes) and all(sizes)
    newest_size = (
        Grammars(tok, llm.engine.model_config.vocab_size, eos).compile(SO(choice=["3 " * 4])).memory_size_bytes
    )
    monkeypatch.setattr(structured, "CACHE_BYTES", sizes[2] + newest_size)
    newest = g.compile(SO(choice=["3 " * 4]))
    assert list(g._cache) == [("choice", ("2 " * 3,)), ("choice", ("3 " * 4,))]  # the oldest two went
    assert g._bytes == sizes[2] + newest.memory_size_bytes and set(g._sizes) == set(g._cache)


def test_what_would_take_the_compiler_minutes_or_gigabytes_is_refused():
    from chatengine.sampling_params import MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH

    def nested(depth):
        schema = {"type": "string"}
        for _ in range(depth - 1):
            schema = {"type": "array", "items": schema}
        return schema

    SO(json=nested(MAX_SCHEMA_DEPTH)).validate()
    loop: dict = {"type": "object"}
    loop["properties"] = {"self": loop}
    big = {"enum": ["x" * 100] * (MAX_SCHEMA_CHARS // 100)}
    refused = {
        "nests deeper than 64": [SO(json=nested(MAX_SCHEMA_DEPTH + 1)), SO(json="[" * 5000 + "]" * 5000)],
        "contains itself": [SO(json=loop)],
        "too large": [SO(json=big), SO(json=json.dumps(big))],
        "at most 16384": [SO(grammar="root ::= " + '"x"? ' * 4000), SO(regex="a" * (MAX_GRAMMAR_CHARS + 1))],
        "at most 4096 choices": [SO(choice=["a"] * (MAX_CHOICES + 1)), SO(choice=["a" * MAX_SCHEMA_CHARS, "b"])],
    }
    for message, specs in refused.items():
        for spec in specs:
            with pytest.raises(ValueError, match=message):
                spec.validate()
    for text in ("5", "null", "true", '"a"', "{"):  # not schemas: left to the compiler's own message
        SO(json=text).validate()


def test_a_padded_model_vocabulary_is_masked(tok, eos):
    vocab = len(tok) + 45  # the model's logits are wider than the tokenizer (not a multiple of 32)
    g = Grammars(tok, vocab, eos)
    state = g.matcher(g.compile(SO(choice=["yes"])))
    mask = allocate_bitmask(1, vocab)
    assert mask.shape == (1, (vocab + 31) // 32)
    state.fill_bitmask(mask, 0)
    ok = allowed(mask, 0, vocab)
    assert ok and max(ok) < len(tok)  # padding ids are never allowed


@pytest.mark.parametrize("vocab", [49152, 1000, 77, 33, 32, 31, 5, 1])
def test_apply_bitmask_equals_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 8
    logits = torch.randn(n, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (n, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    bitmask[3, -1] = -1  # the bits past V are set: ignored
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask)
    apply_bitmask_ref(b, bitmask)
    assert torch.equal(a, b)
    assert torch.equal(a[1], logits[1]) and torch.isneginf(a[2]).all()
    kept = ~torch.isneginf(b)
    assert torch.equal(b[kept], logits[kept])  # the allowed logits are untouched


@pytest.mark.parametrize("vocab", [49152, 77, 5])
def test_apply_bitmask_by_rows_reads_and_changes_only_those_rows(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31, (6, (vocab + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([4, 1], dtype=torch.int32)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, rows)
    apply_bitmask_ref(b, bitmask, rows)
    whole = logits.clone()
    apply_bitmask_ref(whole, bitmask)
    assert torch.equal(a, b)
    assert torch.equal(a[[1, 4]], whole[[1, 4]])
    assert torch.equal(a[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])  # the other rows' (random) bits were not read


def test_apply_bitmask_writes_nothing_past_the_vocabulary():
    n, v, pad = 5, 1001, 64
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(n * (v + pad) + 128, generator=gen)
    expect = buf.clone()
    bitmask = torch.randint(-(2**31), 2**31, (n, (v + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    apply_bitmask(buf[: n * (v + pad)].view(n, v + pad)[:, :v], bitmask)  # rows strided: the pads sit between
    apply_bitmask_ref(expect[: n * (v + pad)].view(n, v + pad)[:, :v], bitmask)
    assert torch.equal(buf, expect)


def test_apply_bitmask_with_a_grammar_mask(grammars):
    v = grammars.vocab_size
    mask = allocate_bitmask(2, v)
    grammars.matcher(grammars.compile(SO(json_object=True))).fill_bitmask(mask, 0)
    logits = torch.randn(2, v)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, mask)
    apply_bitmask_ref(b, mask)
    assert torch.equal(a, b)
    assert set(torch.nonzero(~torch.isneginf(a[0])).flatten().tolist()) == allowed(mask, 0, v)
    assert torch.equal(a[1], logits[1])


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]
)
def test_mask_logits_masks_each_states_row_and_no_other(grammars, tok, device):
    """A step's grammar rows: each row gets its own state's mask (two filled ahead, two filled now),
    in rows out of order; the other rows are untouched. The GPU's packed buffer is filled the same
    way (a view past the row indices), checked here against the reference on a pack of its own."""
    from chatengine.kernels.grammar_masks import apply_row_masks_ref, pack_row_masks

    v = grammars.vocab_size
    texts = ['{"name": "Ad', '{"name": "Ada", ', '{"name": "Ada", "age": 3', '{"na']
    states = [walk(grammars, tok, SPECS["json"], t) for t in texts]
    fill_ahead(states[:2])
    rows = [5, 0, 3, 6]
    logits = torch.randn(7, v, generator=torch.Generator().manual_seed(0))
    a = logits.to(device)
    mask_logits(a, states, rows)
    a = a.cpu()
    packed, masks = pack_row_masks(rows, v, pin=False)
    fill_bitmasks(states, masks, [0, 1, 2, 3])
    b = logits.clone()
    apply_row_masks_ref(b, packed, 4)
    assert torch.equal(a, b)
    for state, row in zip(states, rows, strict=True):
        single = allocate_bitmask(1, v)
        state.fill_bitmask(single, 0)
        assert set(torch.nonzero(~torch.isneginf(a[row])).flatten().tolist()) == allowed(single, 0, v)
    assert torch.equal(a[[1, 2, 4]], logits[[1, 2, 4]])


def test_apply_bitmask_checks_shapes():
    with pytest.raises(ValueError, match="does not fit"):
        apply_bitmask(torch.zeros(2, 64), allocate_bitmask(2, 96))
