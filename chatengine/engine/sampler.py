"""Sampler: greedy / temperature / top-k / top-p over a batch of logits, with per-sequence seeds.

A row is sampled by inverse CDF: one uniform u per row, the first token whose cumulative probability
(float64) passes u * total. That is one random number per row instead of one per vocabulary entry
(an exponential race over a 49k vocabulary spent ~3 ms a row on CPU in `exponential_`), and no host
sync (searchsorted on the device). Seeded sequences draw u from their own generator, so the same seed
gives the same tokens whatever else shares the batch. (On CUDA the engine samples rows without
top-k / top-p in kernels/sampling.py, seeded ones from a Philox key of (seed, index, position):
`position_key`.)

Top-k / top-p keep the tokens a full descending sort would keep (rank < top_k; then those whose
higher-ranked tokens' probability, renormalised over the kept ones, is still below top_p). On CPU the
sort is a `topk` of a few hundred candidates (a full sort of 49k logits costs ~10 ms a row), with a
full sort only for rows whose nucleus is not inside the candidates; on CUDA the sort stays full, so
nothing depends on the data on the host.
"""

import torch

from chatengine.engine.host_to_device import on_device

CANDIDATES = 256  # CPU: top-p candidates per row before falling back to a full sort
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """A 64-bit finalizer (splitmix64's): nearby inputs give unrelated outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def seed_key(seed: int, index: int) -> int:
    """The stream of sample `index` of a request seeded with `seed` (any int64)."""
    return _mix64((seed & _M64) ^ _mix64(index + 0x9E3779B97F4A7C15))


def position_key(key: int, position: int) -> int:
    """The fused sampler's Philox key for the token at `position` of a seeded sequence: a function
    of (seed, sample index, position) only, so neither the batch, the step, nor a restart moves it.
    Never 0 (the kernel's "unseeded"); below 2**63 (an int64 on the device)."""
    return _mix64(key ^ _mix64(position)) >> 1 or 1


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for unseeded sequences

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        # sample i of a seeded request: reproducible, and different from sample j
        return torch.Generator(device=self.device).manual_seed((seed * 1_000_003 + index) % 2**63)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
        """logits (N, V) fp32; params[i] a SamplingParams; generators[i] a Generator or None."""
        if all(p.temperature == 0 for p in params):
            return greedy(logits)
        N, V = logits.shape
        dev = logits.device
        temps = on_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
        logits = logits / temps[:, None]
        # one uniform per row: seeded rows from their own generator, the others from the shared one
        u = torch.empty(N, device=dev, dtype=torch.float32)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), device=dev, generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, device=dev, generator=g)[0]
        # rows that sample (temperature > 0): the whole vocabulary, or the top-k / top-p candidates
        truncated: list[int] = []
        full: list[int] = []
        for i, p in enumerate(params):
            if p.temperature > 0:
                (truncated if 0 < p.top_k < V or p.top_p < 1 else full).append(i)
        if len(full) == N:
            return _inverse_cdf(logits, u)
        sampled = greedy(logits)
        if full:
            idx = on_device(full, torch.long, dev)
            sampled[idx] = _inverse_cdf(logits[idx], u[idx])
        if truncated:
            idx = on_device(truncated, torch.long, dev)
            cand, ids = self._top_k_top_p(logits[idx], [params[i] for i in truncated])
            sampled[idx] = ids.gather(1, _inverse_cdf(cand, u[idx])[:, None]).squeeze(1)
        return sampled

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate logits (N, K), their token ids (N, K)), best first, the dropped ones -inf."""
        N, V = logits.shape
        dev = logits.device
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        needs_p = [k == V for k in top_k]  # top-p alone: candidates beyond any top_k
        K = V if logits.is_cuda else min(V, max([k for k in top_k if k < V] + [CANDIDATES] * any(needs_p)))
        if K == V:
            vals, ids = logits.sort(dim=-1, descending=True)
        else:
            vals, ids = logits.topk(K, dim=-1)  # sorted, descending
        rank = torch.arange(K, device=dev)[None, :]
        vals = vals.masked_fill(rank >= on_device(top_k, torch.long, dev)[:, None], float("-inf"))
        # probabilities over the kept tokens: the top-k ones, or (top-p alone) the whole row
        norm = vals.logsumexp(dim=-1, keepdim=True)
        if K < V and any(needs_p):
            full_norm = logits.logsumexp(dim=-1, keepdim=True)
            norm = torch.where(on_device(needs_p, torch.bool, dev)[:, None], full_norm, norm)
        probs = (vals - norm).exp()
        before = probs.cumsum(dim=-1) - probs  # mass ranked above each token
        top_p = on_device([p.top_p for p in params], torch.float32, dev)[:, None]
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays;
        # top_p = 1 drops nothing, though the float32 cumsum reaches 1 before the tail)
        vals = vals.masked_fill((before >= top_p) & (top_p < 1), float("-inf"))
        if K < V:  # top-p rows whose nucleus may reach past the K candidates: sort the whole row
            short = torch.nonzero(on_device(needs_p, torch.bool, dev) & (before[:, -1] + probs[:, -1] < top_p[:, 0]))
            if short.numel():
                rows = short[:, 0].tolist()
                full_vals, full_ids = Sampler._top_k_top_p_sorted(logits[rows], [params[i] for i in rows])
                vals = torch.cat([vals, vals.new_full((N, V - K), float("-inf"))], dim=1)
                ids = torch.cat([ids, ids.new_zeros(N, V - K)], dim=1)
                vals[rows], ids[rows] = full_vals, full_ids
        return vals, ids

    @staticmethod
    def _top_k_top_p_sorted(logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`_top_k_top_p` over a full descending sort (the candidates of every token)."""
        V = logits.shape[-1]
        top_k = on_device([p.top_k if 0 < p.top_k < V else V for p in params], torch.long, logits.device)
        top_p = on_device([p.top_p for p in params], torch.float32, logits.device)
        vals, ids = logits.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None, :]
        vals = vals.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
        vals = vals.masked_fill(drop, float("-inf"))
        return vals, ids


def greedy(logits: torch.Tensor, chunks: int = 32) -> torch.Tensor:
    """argmax over the vocabulary, ties to the first index, as torch.argmax. A few rows are split
    into `chunks` pieces first: torch reduces one 128k row with one block (38 us on an H200 at
    batch 1; the fused sampler walks it with one program, ~0.1 ms), a chunk's max per block then
    the first chunk holding the best is faster. On CUDA the engine's all-greedy steps take
    kernels/sampling.greedy_triton instead (H200, 128k vocabulary: 3.1 vs 23.3 us at batch 1,
    6.5 vs 23.5 at 64, 19.3 vs 46.6 at 256); this is its reference and the CPU path."""
    N, V = logits.shape
    if N * chunks > 4096 or V % chunks:
        return logits.argmax(dim=-1)
    vals, idx = logits.view(N, chunks, V // chunks).max(dim=-1)  # (N, chunks): first max per chunk
    best = vals.argmax(dim=-1, keepdim=True)  # the first chunk with the max
    return best.squeeze(1) * (V // chunks) + idx.gather(1, best).squeeze(1)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from softmax(logits) per row with the uniforms u (N,) in [0, 1): the first index
    whose float64 cumulative probability exceeds u * total, so tokens of probability 0 (-inf logits)
    are never drawn (u < 1 keeps u * total below the total)."""
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1, dtype=torch.float64)
    x = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
