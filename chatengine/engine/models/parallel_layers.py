"""Linear and embedding layers split over the ranks of a TPGroup, Megatron-style, and how each takes
its slice of a full Hugging Face weight (every rank reads the full tensor, keeps its rows/columns).

- ColumnParallelLinear: the output features split; no communication.
  - QKVParallelLinear: q, k and v fused; each rank a share of the query heads and the KV heads they
    read (a KV head is replicated on several ranks when there are fewer KV heads than ranks).
  - MergedColumnParallelLinear: gate and up fused; each rank a share of the intermediate features.
- RowParallelLinear: the input features split; the partial sums all-reduced (o_proj, down_proj).
- VocabParallelEmbedding: the vocabulary's rows split; ids outside a rank's rows give zeros, and
  the all-reduce puts each row back together.
- ParallelLMHead: logits of a rank's vocabulary rows (gathered by the runner where a step needs whole rows).

On one rank each is exactly the nn.Linear / nn.Embedding it replaces (same shapes, same kernels,
no collectives), so single-GPU numerics and speed do not change.

Deterministic mode (the batch-invariant matmul) also keeps answers the same on one rank and on two:
a column-parallel rank tiles its outputs as the whole layer does, and a row-parallel layer reduces
its inputs in two halves added in fp32 -- on one rank in the kernel, on two by an fp32 all-reduce of
the ranks' halves (a + b either way).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from chatengine.engine.models.fp8 import fp8_linear, quantize_rows
from chatengine.engine.parallel.group import TPGroup
from chatengine.kernels import cpu_quant, invariant_matmul


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
    """ValueError unless a model of this config splits over `size` ranks (checked before any starts)."""
    group = TPGroup(0, size)
    split(config.num_heads, group, "num_heads")
    kv_heads_per_rank(config.num_kv_heads, group)
    split(config.intermediate_size, group, "intermediate_size")


def _rows(full: torch.Tensor, n: int, group: TPGroup) -> torch.Tensor:
    """This rank's n rows of `full` (slices of n rows; when there are fewer slices than ranks, as with
    replicated KV heads, consecutive ranks share a slice)."""
    start = group.rank * (full.shape[0] // n) // group.size
    return full.narrow(0, start * n, n)


class _QuantizableWeight:
    """A linear layer whose weight may be swapped for e4m3 rows and their scales (models/fp8.py), or
    on the CPU for blocks of 32 weights in GGML's q8_0 / q4_0 / q4_1 (kernels/cpu_quant.py)."""

    fp8 = False
    invariant = False  # deterministic mode: the batch-invariant matmul (kernels/invariant_matmul.py)
    width = 0  # the whole layer's output features (over every rank): what picks the invariant tiles
    invariant_by_rows = True  # its tiles may follow the batch size (invariant_matmul.check_tiles)
    weight_fp8: torch.Tensor  # buffers once quantized (annotations only: register_buffer makes them)
    weight_scale: torch.Tensor
    qweight: cpu_quant.QuantWeight | None = None

    def invariant_segments(self) -> int:
        """Equal parts of K the invariant matmul reduces apart (deterministic mode)."""
        return 1

    @torch.no_grad()
    def quantize_blocks(self, fmt: str, source: torch.Tensor | None = None) -> None:
        """Replace the loaded weight (N, K) by its blocks in `fmt` (its planes become buffers); from
        `source` (N, K) instead when given, the weight's storage then never touched."""
        w = self.weight if source is None else source  # type: ignore[attr-defined]
        self.qweight = qw = cpu_quant.quantize(w, fmt)
        del self.weight  # type: ignore[attr-defined]
        for name in ("qs", "d", "m"):
            if getattr(qw, name) is not None:
                self.register_buffer(f"weight_{name}", getattr(qw, name))  # type: ignore[attr-defined]

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Replace the loaded weight (N, K) by e4m3 rows and fp32 scales (N,): half the bytes."""
        q, scale = quantize_rows(self.weight)  # type: ignore[attr-defined]  # the nn.Linear's
        del self.weight  # type: ignore[attr-defined]
        self.register_buffer("weight_fp8", q)  # type: ignore[attr-defined]
        self.register_buffer("weight_scale", scale)  # type: ignore[attr-defined]
        self.fp8 = True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.invariant:
            w = self.weight  # type: ignore[attr-defined]
            return invariant_matmul.linear(x, w, bias, self.width, by_rows=self.invariant_by_rows)
        if self.qweight is not None:
            return cpu_quant.linear(x, self.qweight, bias)
        if self.fp8:
            return fp8_linear(x, self.weight_fp8, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)  # type: ignore[attr-defined]


class ColumnParallelLinear(_QuantizableWeight, nn.Linear):
    """y[..., this rank's outputs] = x W_r^T (+ b_r). `out_features` is this rank's share."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.group, self.width = group, out_features * group.size

    def forward(self, x):
        return self.matmul(x, self.bias)

    @torch.no_grad()
    def load_parts(self, parts: list[tuple[torch.Tensor, int]], param: str = "weight") -> None:
        """Fill `param` from full tensors fused along the outputs (q, k, v or gate, up): from part
        (full, n) this rank takes its n rows, and the pieces are concatenated in order."""
        getattr(self, param).copy_(torch.cat([_rows(full, n, self.group) for full, n in parts]))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul: this rank's num_heads query heads, then its num_kv_heads KV heads'
    keys, then their values (num_heads, num_kv_heads: this rank's counts)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, group, all_kv_heads=None
    ):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, group)
        # the whole layer's width: KV heads replicated over ranks count once (all_kv_heads: the model's)
        kv = all_kv_heads if all_kv_heads is not None else num_kv_heads * group.size
        self.width = (num_heads * group.size + 2 * kv) * head_dim

    def load(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, param: str = "weight") -> None:
        """From the full q_proj, k_proj, v_proj weights (or biases)."""
        self.load_parts([(q, self.q_size), (k, self.kv_size), (v, self.kv_size)], param)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up in one matmul: this rank's `size` gate features, then its `size` up features."""

    def __init__(self, hidden_size: int, size: int, group: TPGroup):
        self.size = size
        super().__init__(hidden_size, 2 * size, False, group)

    def load(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        self.load_parts([(gate, self.size), (up, self.size)])


class RowParallelLinear(_QuantizableWeight, nn.Linear):
    """y = all_reduce(x[..., this rank's inputs] W_r^T): each rank a partial sum. No bias.

    On the symmetric-memory path y may be the sum buffer itself (the two-shot sum is in place): it
    holds until the next row-parallel layer writes there, so whatever reads y (the next norm, which
    makes new tensors) runs before that on the same stream."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group, self.width = group, out_features

    def forward(self, x):
        if self.invariant:
            return self._invariant(x)
        plain = self.qweight is None and not self.fp8
        out = self.group.sum_buffer((*x.shape[:-1], self.out_features), x.dtype) if plain else None
        if out is None:
            return self.group.all_reduce(self.matmul(x, None))
        torch.matmul(x, self.weight.t(), out=out)  # straight into the one-shot sum's buffer
        return self.group.all_reduce(out)

    def _invariant(self, x):
        """Deterministic mode: the two halves of the inputs (module docstring). One rank sums them in
        the kernel; two ranks each hold one and all-reduce its fp32 sums."""
        if not self.group.is_parallel:
            segments, by_rows = self.invariant_segments(), self.invariant_by_rows
            return invariant_matmul.linear(x, self.weight, None, self.width, segments, by_rows=by_rows)
        assert self.group.size == 2, "deterministic mode runs on one or two ranks"
        by_rows = self.invariant_by_rows
        partial = invariant_matmul.linear(x, self.weight, None, self.width, out_dtype=torch.float32, by_rows=by_rows)
        return self.group.all_reduce(partial).to(x.dtype)

    def invariant_segments(self) -> int:
        """One rank: the two halves two ranks would each hold (an odd width never splits over two)."""
        return 2 if not self.group.is_parallel and self.in_features % 2 == 0 else 1

    @torch.no_grad()
    def load(self, full: torch.Tensor) -> None:
        n = self.in_features
        self.weight.copy_(full.narrow(1, self.group.rank * n, n))


class _VocabRows:
    """Rows [first, first + rows) of a vocabulary padded to a multiple of the ranks."""

    group: TPGroup
    first: int
    rows: int

    @torch.no_grad()
    def load(self, full: torch.Tensor) -> None:
        weight = self.weight  # type: ignore[attr-defined]  # the nn.Embedding's or nn.Linear's
        mine = full[self.first : self.first + self.rows]
        if mine.shape[0] < self.rows:  # the last rank's padding rows past the vocabulary stay zero
            weight.zero_()
        weight[: mine.shape[0]].copy_(mine)

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full table as load() fills them (a new tensor only where the last
        rank pads with zero rows): what a quantized head takes straight from the checkpoint."""
        mine = full[self.first : self.first + self.rows]
        if mine.shape[0] < self.rows:
            mine = torch.cat([mine, mine.new_zeros(self.rows - mine.shape[0], mine.shape[1])])
        return mine


class VocabParallelEmbedding(_VocabRows, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        self.vocab_size, self.group = vocab_size, group
        self.rows = -(-vocab_size // group.size)
        nn.Embedding.__init__(self, self.rows, hidden_size)
        self.first = group.rank * self.rows

    qweight: cpu_quant.QuantWeight | None = None  # the tied LM head's blocks, when it has them

    def share_blocks(self, qweight: cpu_quant.QuantWeight) -> None:
        """Look rows up in the (tied) LM head's quantized blocks instead of the fp32 table."""
        self.qweight = qweight
        del self.weight

    def forward(self, ids):
        if not self.group.is_parallel:
            return self._lookup(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)  # another rank's rows: zeros here
        out = self._lookup(local.masked_fill(outside, 0))
        return self.group.all_reduce(out.masked_fill(outside[:, None], 0))

    def _lookup(self, ids):
        if self.qweight is not None:
            return cpu_quant.embedding(ids, self.qweight)
        return F.embedding(ids, self.weight)


class ParallelLMHead(_QuantizableWeight, _VocabRows, nn.Linear):
    """Logits of this rank's vocabulary rows: (n, rows), the columns [rank * rows, rank * rows + rows)
    of the vocabulary (padded past it on the last rank). The runner gathers whole rows only where a
    step needs them (parallel/vocab_sampling.py); one rank: (n, vocab_size)."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup):
        self.vocab_size, self.group = vocab_size, group
        self.rows = -(-vocab_size // group.size)
        nn.Linear.__init__(self, hidden_size, self.rows, bias=False)
        self.first, self.width = group.rank * self.rows, self.rows * group.size

    def forward(self, x):
        return self.matmul(x, None)
