"""Linear layers split over the ranks of a TPGroup, Megatron-style, and how each takes its slice of
a full Hugging Face weight.

- ColumnParallelLinear: the output features split; no communication (q/k/v, gate/up).
- RowParallelLinear: the input features split; partial sums all-reduced (o_proj, down_proj).
- VocabParallelEmbedding: rows of the vocabulary split; ids outside a rank's rows give zeros, and
  the all-reduce puts each row back together.
- ParallelLMHead: logits of a rank's vocabulary rows, all-gathered to the full vocabulary.

On one rank each is exactly the nn.Linear / nn.Embedding it replaces (same shapes, same kernels,
no collectives), so single-GPU numerics do not change.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from chatengine.engine.distributed import TPGroup


def split(n: int, group: TPGroup, what: str) -> int:
    """n / ranks, or a ValueError naming what does not divide."""
    if n % group.size:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({group.size})")
    return n // group.size


def kv_heads_per_rank(num_kv_heads: int, group: TPGroup) -> int:
    """KV heads each rank holds: its share, or one (replicated) when there are fewer than ranks."""
    if num_kv_heads >= group.size:
        return split(num_kv_heads, group, "num_kv_heads")
    if group.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({group.size}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return 1


def check_split(config, size: int) -> None:
    """ValueError unless a model of this config splits over `size` ranks."""
    group = TPGroup(0, size)
    split(config.num_heads, group, "num_heads")
    kv_heads_per_rank(config.num_kv_heads, group)
    split(config.intermediate_size, group, "intermediate_size")


class ColumnParallelLinear(nn.Linear):
    """y[..., this rank's outputs] = x W_r^T (+ b_r). `out_features` is this rank's share."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    @torch.no_grad()
    def load_rows(self, parts: list[tuple[torch.Tensor, int]], param: str = "weight") -> None:
        """Fill from full tensors, each with the row count of one of its rank's slices, concatenated
        (q, k, v or gate, up): part i contributes rows [r * n_i, (r + 1) * n_i)."""
        rows = [full.narrow(0, start * n, n) for full, n, start in ((f, n, self._start(f, n)) for f, n in parts)]
        getattr(self, param).copy_(torch.cat(rows))

    def _start(self, full: torch.Tensor, n: int) -> int:
        """Index (in slices of n rows) of this rank's slice of `full`; replicated KV heads repeat."""
        slices = full.shape[0] // n
        return self.group.rank * slices // self.group.size


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x[..., this rank's inputs] W_r^T): each rank a partial sum. No bias."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x):
        return self.group.all_reduce(F.linear(x, self.weight))

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        n = self.in_features
        self.weight.copy_(full.narrow(1, self.group.rank * n, n))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * n, (rank + 1) * n) of a vocabulary padded to a multiple of the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        self.vocab_size, self.group = vocab_size, group
        self.rows = -(-vocab_size // group.size)
        super().__init__(self.rows, hidden_size)
        self.first = group.rank * self.rows

    def forward(self, ids):
        if not self.group.is_parallel:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[:, None], 0))

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        mine = full[self.first : self.first + self.rows]
        self.weight.zero_()  # the padding rows past the vocabulary stay zero
        self.weight[: mine.shape[0]].copy_(mine)


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, all-gathered: (n, vocab_size) on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup):
        self.vocab_size, self.group = vocab_size, group
        self.rows = -(-vocab_size // group.size)
        super().__init__(hidden_size, self.rows, bias=False)
        self.first = group.rank * self.rows

    def forward(self, x):
        logits = F.linear(x, self.weight)
        if not self.group.is_parallel:
            return logits
        return self.group.all_gather_last(logits)[..., : self.vocab_size]

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        mine = full[self.first : self.first + self.rows]
        self.weight.zero_()
        self.weight[: mine.shape[0]].copy_(mine)
