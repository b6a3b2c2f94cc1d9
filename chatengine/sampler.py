"""Sampler: greedy / temperature / top-k / top-p over a batch of logits, with per-sequence seeds.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, needs no
multinomial and no host sync. Seeded sequences draw E from their own generator, so the same seed
gives the same tokens whatever else shares the batch.
"""
import torch


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)   # for unseeded sequences

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        # sample i of a seeded request: reproducible, and different from sample j
        return torch.Generator(device=self.device).manual_seed((seed * 1_000_003 + index) % 2**63)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
        """logits (N, V) fp32; params[i] a SamplingParams; generators[i] a Generator or None."""
        greedy = logits.argmax(dim=-1)
        if all(p.temperature == 0 for p in params):
            return greedy
        N, V = logits.shape
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             device=logits.device, dtype=torch.float32)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V, device=logits.device).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list) -> torch.Tensor:
        V = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=torch.float32)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None, :]
        drop = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
