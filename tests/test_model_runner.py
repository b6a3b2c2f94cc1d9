"""ModelRunner: the batch tensors of a step (slots, lengths, tables, sampled rows), and a paged
forward over chunks equal to one forward over the whole prompt."""

import numpy as np
import torch

from chatengine.config import EngineConfig
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import ModelRunner
from chatengine.engine.sequence import Sequence
from chatengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def runner(num_kv_blocks=16, block_size=4) -> ModelRunner:
    config = EngineConfig(
        model="dummy:tiny",
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    loaded = load_model(config.model, seed=0, dtype=torch.float32, device="cpu")
    return ModelRunner(config, loaded, torch.device("cpu"), torch.float32, max_model_len=64)


def seq(tokens, table, computed=0) -> Sequence:
    s = Sequence(tokens, GREEDY, block_size=4)
    s.block_table, s.num_computed_tokens = list(table), computed
    return s


def test_prepare_builds_the_step_tensors():
    r = runner()
    a = seq([5, 6, 7, 8, 9, 10], table=[3, 7])  # prefill of 6 tokens: blocks 3 and 7
    b = seq([1, 2, 3, 4, 11], table=[2, 5], computed=4)  # decode of its 5th token
    ids, pos, meta, logits_idx, samples, _ = r.prepare([a, b], [6, 1])
    assert ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 4]
    # slot = block * block_size + offset in block
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 20]
    assert meta.cu_seqlens_q.tolist() == [0, 6, 7] and meta.seq_lens.tolist() == [6, 5]
    assert meta.block_tables[:, :2].tolist() == [[3, 7], [2, 5]]
    assert meta.max_seqlen_q == 6 and meta.max_seqlen_k == 6
    assert logits_idx.tolist() == [5, 6] and samples == [True, True]


def test_placeholders_take_the_last_steps_samples_and_other_lanes_read_minus_one():
    """A decode row whose token is still on the device (a placeholder, async scheduling) takes the
    id the last step sampled for it, filled on the device; every lane without one reads -1 in
    pending_dst (a decode graph's fill reads all its lanes), also after a step of the same shape
    that had more placeholders."""
    from chatengine.engine.sequence import PLACEHOLDER

    r = runner()
    a, b, c = (seq([1, 2, 3, 4], table=[i], computed=3) for i in range(3))
    r._last_rows = {a.seq_id: 2, b.seq_id: 0, c.seq_id: 1}  # their rows in the last step's samples
    r._sampled[:3] = torch.tensor([70, 71, 72])
    for s in (a, b, c):
        s.token_ids[-1] = PLACEHOLDER
        s.num_pending = 1
    ids, *_, d = r.prepare([a, b, c], [1, 1, 1])
    assert ids.tolist() == [72, 70, 71] and d["pending_dst"].tolist() == [0, 1, 2]
    b.token_ids[-1], c.token_ids[-1] = 9, 10  # the same shape, one placeholder left
    b.num_pending = c.num_pending = 0
    ids, *_, d = r.prepare([a, b, c], [1, 1, 1])
    assert ids.tolist() == [72, 9, 10] and d["pending_dst"].tolist() == [0, -1, -1]


def test_block_table_rows_grow_for_a_step_larger_than_them():
    from chatengine.engine.model_runner import BlockTableRows

    rows = BlockTableRows(2, 4)
    seqs = [seq([1, 2], table=[i, 10 + i]) for i in range(5)]
    out = np.zeros((5, 4), np.int32)
    rows.gather(seqs, out)
    assert out.tolist() == [[i, 10 + i, -1, -1] for i in range(5)] and rows.rows.shape == (8, 4)
    seqs[4].block_table.append(20)  # a later step: the grown rows keep what they mirror
    rows.gather(seqs[3:], out[:2])
    assert out[:2].tolist() == [[3, 13, -1, -1], [4, 14, 20, -1]]


def test_a_chunk_short_of_the_prompt_does_not_sample():
    r = runner()
    a = seq(list(range(1, 11)), table=[0, 1, 2])
    *_, logits_idx, samples, _ = r.prepare([a], [4])  # the first 4 of 10 prompt tokens
    assert samples == [False] and logits_idx.numel() == 0


def test_chunked_prefill_equals_one_pass():
    """The last prompt token's greedy pick is the same whether the prompt went in at once or in
    chunks over the paged cache."""
    prompt = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
    whole = runner()
    one = whole.run([seq(prompt, table=[0, 1, 2])], [10])
    chunked = runner()
    s = seq(prompt, table=[4, 9, 1])
    got = []
    for n in (3, 4, 3):
        got = chunked.run([s], [n])
        s.num_computed_tokens += n
    assert got == one and isinstance(one[0], int)
    # the cache holds the prompt's K/V block by block, up to fp32 rounding (a 3-row matmul and a
    # 10-row one may sum in another order)
    a, b = whole.gather_blocks([0, 1]), chunked.gather_blocks([4, 9])  # (blocks, layers, 2, bs, heads, dim)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(a, torch.zeros_like(a))


def test_copy_blocks_copies_whole_pages():
    r = runner()
    r.run([seq(list(range(1, 9)), table=[0, 1])], [8])
    r.copy_blocks([(1, 6)])
    assert torch.equal(r.gather_blocks([6]), r.gather_blocks([1]))


def test_every_sampling_step_draws_the_samplers_seed_and_keys_prompt_logprobs_or_not():
    """The fused sampler's step seed and a seeded row's key are drawn when the step is planned, the
    same for a step that also reads prompt logprobs (whose rows are then read whole on every rank)
    and for one that does not; with two ranks only the plain step is drawn from vocabulary slices."""
    import random
    import types

    import numpy as np

    from chatengine.engine import model_runner
    from chatengine.engine.parallel.group import TPGroup
    from chatengine.engine.sampler import position_key, seed_key

    seq = Sequence(list(range(20)), SamplingParams(temperature=0.7, seed=3), block_size=16)
    seq.seed_key = seed_key(3, 0)
    for size in (1, 2):
        got = {}
        for prompt in (False, True):
            fake = types.SimpleNamespace(
                fused_sampling=True, _sample_seeds=random.Random(0), group=TPGroup(0, size, torch.device("cpu"))
            )
            got[prompt] = model_runner.ModelRunner._finish(
                fake, model_runner.DECODE_GRAPH, [seq], np.array([True]), prompt, whole=False
            )
        plain, with_prompt = got[False], got[True]
        assert with_prompt.seed == plain.seed == random.Random(0).getrandbits(31) != 0
        assert with_prompt.keys == plain.keys == (position_key(seq.seed_key, 20),)
        assert (plain.rows, with_prompt.rows) == (1, None) and not with_prompt.slices
        assert plain.slices == (size == 2)
