"""Replica outputs travel as deltas and are put back together exactly."""

import pickle

from chatengine.engine.replicas.deltas import DeltaEncoder, OutputAssembler
from chatengine.outputs import CompletionOutput, RequestOutput


def out(texts, ids, finished=False, logprobs=None, prompt_logprobs=None):
    comps = []
    for i, (t, x) in enumerate(zip(texts, ids)):
        c = CompletionOutput(i, t, list(x), "stop" if finished else None)
        if logprobs is not None:
            c.logprobs = [{t: -0.5} for t in x]
            c.cumulative_logprob = -0.5 * len(x)
        comps.append(c)
    return RequestOutput("r", "p", [1, 2], comps, 16, finished, None, 1.0, 2.0, prompt_logprobs)


def test_the_assembled_outputs_equal_the_originals():
    enc, asm = DeltaEncoder(), OutputAssembler("r", "p", [1, 2])
    steps = [
        out(["He", "A"], [[5], [7]], logprobs=True, prompt_logprobs=[None]),
        out(["Hello", "A b"], [[5, 6], [7, 8]], logprobs=True, prompt_logprobs=[None, {2: -1.0}]),
        out(["Hel", "A b c"], [[5, 6, 9], [7, 8, 3]], logprobs=True, prompt_logprobs=[None, {2: -1.0}]),  # text shrank
        out(["Help!", "A b c."], [[5, 6, 9, 4], [7, 8, 3, 2]], True, logprobs=True, prompt_logprobs=[None, {2: -1.0}]),
    ]
    for original in steps:
        delta = enc.encode(original)
        assert asm.apply(delta) == original
    assert enc._sent == {}  # finished: nothing kept
    assert asm.token_ids(1) == [7, 8, 3, 2]


def test_deltas_carry_only_what_is_new():
    enc = DeltaEncoder()
    enc.encode(out(["ab"], [[1, 2]]))
    delta = enc.encode(out(["abc"], [[1, 2, 3]]))
    index, ids, keep, text, *_ = delta[6][0]
    assert (index, ids, keep, text) == (0, [3], 2, "c")


def test_an_output_kept_by_a_caller_does_not_change_later():
    enc, asm = DeltaEncoder(), OutputAssembler("r", "p", [1, 2])
    first = asm.apply(enc.encode(out(["a"], [[1]])))
    asm.apply(enc.encode(out(["ab"], [[1, 2]])))
    assert first.outputs[0].token_ids == [1] and first.outputs[0].text == "a"


def test_deltas_are_plain_tuples():
    # a step's list of them pickles and unpickles in C: no class to call per delta
    delta = DeltaEncoder().encode(out(["a"], [[1]], logprobs=True))
    assert type(delta) is tuple and type(delta[6][0]) is tuple
    assert pickle.loads(pickle.dumps(delta)) == delta


def test_kept_logprobs_are_views_that_later_deltas_do_not_change():
    enc, asm = DeltaEncoder(), OutputAssembler("r", "p", [1, 2])
    first = asm.apply(enc.encode(out(["a"], [[1]], logprobs=True, prompt_logprobs=[None])))
    second = asm.apply(enc.encode(out(["ab"], [[1, 2]], logprobs=True, prompt_logprobs=[None, {2: -1.0}])))
    assert list(first.outputs[0].logprobs) == [{1: -0.5}] and len(first.outputs[0].logprobs) == 1
    assert first.outputs[0].logprobs[-1] == {1: -0.5} and first.outputs[0].logprobs[1:] == []
    assert second.outputs[0].logprobs[1:] == [{2: -0.5}] and second.outputs[0].logprobs == [{1: -0.5}, {2: -0.5}]
    assert first.prompt_logprobs == [None] and second.prompt_logprobs == [None, {2: -1.0}]
    assert [None] + first.outputs[0].logprobs == [None, {1: -0.5}]
    assert pickle.loads(pickle.dumps(first.outputs[0].logprobs)) == [{1: -0.5}]


def test_an_assembler_makes_outputs_only_when_asked():
    enc, asm = DeltaEncoder(), OutputAssembler("r", "p", [1, 2])
    assert asm.add(enc.encode(out(["a"], [[1]]))) is False
    assert asm.add(enc.encode(out(["ab"], [[1, 2]]))) is False
    assert asm.add(enc.encode(out(["abc"], [[1, 2, 3]], finished=True))) is True
    assert asm.finished and asm.token_ids(0) == [1, 2, 3]
    assert asm.output_and_count() == (out(["abc"], [[1, 2, 3]], finished=True), 3)


def test_the_engines_flat_logprobs_travel_flat_and_read_the_same():
    # the engine's TokenLogprobs: rows of (token, logprob, k values, k ids); a delta carries new rows'
    # float32s as bytes, and the assembled output reads the same dicts
    from array import array

    from chatengine.outputs import TokenLogprobs

    flat = array("f")  # the engine's typecode (float32 rows)
    enc, asm = DeltaEncoder(), OutputAssembler("r", "p", [1, 2])
    rows = [(5, -0.125, -0.125, -2.0, 5, 8), (9, -3.0, -0.5, -1.0, 4, 6), (4, -0.25, -0.25, -2.5, 4, 1)]
    kept = []
    for n, row in enumerate(rows, 1):
        flat.extend(row)
        original = out(["x" * n], [[r[0] for r in rows[:n]]])
        original.outputs[0].logprobs = TokenLogprobs(flat, 2, n)
        delta = pickle.loads(pickle.dumps(enc.encode(original)))
        k, new = delta[6][0][6]
        assert k == 2 and type(new) is bytes and list(array("f", new)) == list(row)  # only the new row
        got = asm.apply(delta)
        assert got == original and isinstance(got.outputs[0].logprobs, TokenLogprobs)
        kept.append(got.outputs[0].logprobs)
    assert kept[1] == [{5: -0.125, 8: -2.0}, {4: -0.5, 6: -1.0, 9: -3.0}]  # the sampled token last, not a top-2
    assert len(kept[0]) == 1 and kept[0][-1] == {5: -0.125, 8: -2.0}  # an earlier output does not grow
