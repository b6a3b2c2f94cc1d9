"""chatengine/engine/sampler.py: greedy rows exact, draws distributed as softmax(logits / T) over the tokens
top-k / top-p keep, the kept sets equal to a full sort's (CPU candidates and their fallback), seeded
rows reproducible whatever shares the batch."""

import pytest
import torch

from chatengine import SamplingParams
from chatengine.engine import sampler as sampler_mod
from chatengine.engine.sampler import Sampler


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def sample(logits, params, generators=None, seed=0):
    return Sampler(torch.device("cpu"), seed)(logits, params, generators or [None] * len(params))


def frequencies(ids, V):
    return torch.bincount(ids, minlength=V).double() / ids.numel()


def kept_probs(logits, p: SamplingParams):
    """float64 reference: softmax(logits / T) over the tokens a full sort keeps, renormalised."""
    x = logits.double() / p.temperature
    order = x.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else x.numel()
    probs = torch.softmax(x[order[:k]], -1)
    before = probs.cumsum(-1) - probs
    keep[order[:k][before < p.top_p]] = True
    out = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    return out


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 1000)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0),
    ]
    out = sample(logits, params)
    for i in (0, 2, 4):
        assert out[i] == logits[i].argmax()
    assert torch.equal(sample(logits[:1], params[:1]), logits[:1].argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.7),
    ],
)
def test_draws_follow_the_kept_distribution(params):
    V, N = 12, 6000
    logits = torch.randn(V) * 1.5
    ids = sample(logits.repeat(N, 1), [params] * N)
    p = kept_probs(logits, params)
    assert not (frequencies(ids, V)[p == 0]).any()  # never a dropped token
    sigma = (p * (1 - p) / N).sqrt()
    assert ((frequencies(ids, V) - p).abs() <= 4 * sigma + 1e-3).all(), (frequencies(ids, V), p)


@pytest.mark.parametrize("scale, top_p", [(8.0, 0.9), (1.0, 0.95), (0.3, 0.5), (8.0, 1.0)])  # peaky .. flat
@pytest.mark.parametrize("top_k", [0, 1, 40, 300])
def test_kept_tokens_equal_a_full_sort(scale, top_p, top_k):
    # the CPU candidates (topk of a few hundred) and their full-sort fallback keep what a full sort keeps
    V = 5000
    logits = torch.randn(7, V) * scale
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * 7
    vals, ids = Sampler._top_k_top_p(logits, params)
    full_vals, full_ids = Sampler._top_k_top_p_sorted(logits, params)
    for r in range(7):
        kept = set(ids[r][vals[r] > float("-inf")].tolist())
        assert kept == set(full_ids[r][full_vals[r] > float("-inf")].tolist())
        assert logits[r].argmax().item() in kept  # the top token always stays


def test_candidates_fall_back_to_a_full_sort(monkeypatch):
    monkeypatch.setattr(sampler_mod, "CANDIDATES", 8)
    logits = torch.zeros(2, 100)  # flat: the nucleus is 90 tokens
    logits[1, :3] = 20  # peaky: inside the candidates
    vals, _ = Sampler._top_k_top_p(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * 2)
    assert (vals[0] > float("-inf")).sum() == 90 and (vals[1] > float("-inf")).sum() == 3


def test_seeded_rows_do_not_depend_on_the_batch():
    s = Sampler(torch.device("cpu"))
    logits = torch.randn(4, 500)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7)

    def gens(n, index=0):
        return [s.make_generator(7, index)] + [None] * (n - 1)

    alone = s(logits[:1], [p], gens(1)).item()
    g = gens(1)
    seq_alone = [s(logits[:1], [p], g).item() for _ in range(20)]
    g = gens(4)
    others = [SamplingParams(temperature=0.5), SamplingParams(temperature=0), SamplingParams(temperature=2, top_k=5)]
    seq_batched = [s(logits, [p] + others, g)[0].item() for _ in range(20)]
    assert seq_alone == seq_batched and alone == seq_alone[0]
    g2 = [s.make_generator(7, 1)]
    assert [s(logits[:1], [p], g2).item() for _ in range(20)] != seq_alone  # sample 1 of the request differs


def test_chunked_greedy_is_argmax_with_first_index_ties():
    from chatengine.engine.sampler import greedy

    g = torch.Generator().manual_seed(0)
    for n, v in [(1, 4096), (3, 49152), (2, 100)]:  # 100: not split (100 % 32)
        logits = torch.randn(n, v, generator=g)
        assert greedy(logits).tolist() == logits.argmax(-1).tolist()
    logits = torch.zeros(2, 4096)
    logits[0, [5, 3000]] = 1.0  # ties across chunks
    logits[1, [130, 129]] = 2.0  # ties inside a chunk
    assert greedy(logits).tolist() == [5, 129]
    assert greedy(torch.zeros(1, 64)).tolist() == [0]
