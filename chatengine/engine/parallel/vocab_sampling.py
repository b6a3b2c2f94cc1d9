"""Sampling over the ranks' slices of the vocabulary, without gathering the logits.

With tensor parallelism each rank's LM head gives its slice of every row's logits. Gathering the
whole rows to sample them on rank 0 moves 256 x 128k bf16 (64 MB) a decode step. But both of the
fused sampler's draws split over columns: the argmax of a row is the best of its slices' argmaxes,
and so is the Gumbel-max draw, whose noise is a function of (seed or key, column) alone. So each
rank draws its slice's candidate per row -- (best value, its column in the whole vocabulary) -- and
the ranks exchange those pairs (8 bytes a row from each rank); the token is the best value's column,
ties to the lowest column, as over the whole row: the token one rank draws with the same seed.

Rows that need the whole row -- top-k / top-p, logprobs, penalties, grammars, logit bias, the torch
sampler of a CPU step that samples -- and prompt logprobs gather it instead. Every rank must take
the same path (each joins the same collectives), so rank 0 decides for the step (`Finish`) and
sends it with the step's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatengine.engine.host_to_device import on_device
from chatengine.engine.parallel.group import TPGroup
from chatengine.kernels import sampling as sampling_ops
from chatengine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Finish:
    """What every rank does with a step's logits once its forward is queued."""

    rows: int | tuple[int, ...] | None  # the logits rows that sample: the first n, these, or all (None)
    slices: bool = False  # each rank draws from its slice; else the rows are gathered whole
    greedy: bool = False  # every row is greedy (the argmax kernel, no noise)
    seed: int = 0  # the fused sampler's seed for the step's unseeded rows
    keys: tuple[int, ...] = ()  # per row: a seeded row's Philox key (0: unseeded); () none seeded

    @property
    def nothing(self) -> bool:
        """No row samples and no prompt logprobs: nobody reads the logits."""
        return self.rows == ()


def in_slices(params: list[SamplingParams], fused: bool) -> bool:
    """Whether every row can be drawn slice by slice: nothing reads its whole row, and it is greedy
    or (`fused`: CUDA's Triton sampler) a plain temperature draw."""
    return all(
        p.logprobs is None and not p.processed and p.top_k == 0 and p.top_p >= 1 and (fused or p.temperature == 0)
        for p in params
    )


def select(logits: torch.Tensor, rows: int | tuple[int, ...] | None) -> torch.Tensor:
    """The rows of a forward's logits that `Finish.rows` names (a graph's output has padded rows)."""
    if rows is None:
        return logits
    if isinstance(rows, int):
        return logits[:rows]
    return logits[on_device(list(rows), torch.long, logits.device)]


def draw(logits: torch.Tensor, temps: torch.Tensor, finish: Finish, group: TPGroup, vocab_size: int) -> torch.Tensor:
    """On every rank: logits (N, n) its slice, columns [rank * n, rank * n + n) of the vocabulary
    (the last slice padded past it); temps (N,) fp32. Returns the drawn tokens (N,) int64."""
    col0 = group.rank * logits.shape[1]
    mine = logits[:, : max(0, min(logits.shape[1], vocab_size - col0))]  # not the padding columns
    if mine.shape[1] == 0:  # a toy vocabulary whose last rank holds padding alone: no candidate
        vals = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
        return pick(group, vals, torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device))
    if mine.is_cuda:
        if finish.greedy:
            vals, ids = sampling_ops.greedy_slice_triton(mine, col0)
        else:
            keys = on_device(list(finish.keys), torch.int64, mine.device) if finish.keys else None
            vals, ids = sampling_ops.sample_slice_triton(mine, temps, finish.seed, keys, col0, vocab_size)
    else:  # greedy rows only (in_slices): the first max, as torch.argmax
        x = mine.float()
        vals, ids = x.amax(dim=-1), x.argmax(dim=-1) + col0
    return pick(group, vals, ids)


def pick(group: TPGroup, vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every rank's candidates (vals (N,) fp32, ids (N,) int64) -> the winning ids (N,) int64: the
    largest value, ties to the lowest rank (its columns are the lowest)."""
    both = torch.zeros((group.size, vals.shape[0], 2), dtype=torch.float32, device=vals.device)
    both[group.rank, :, 0] = vals
    both[group.rank, :, 1] = ids.float()  # exact: vocabularies are far below 2**24 columns
    both = group.all_reduce(both)  # an all-gather as a sum of zeros: one hop on the one-shot path
    best = both[:, :, 0].argmax(dim=0, keepdim=True)  # the first maximum: the lowest rank
    return both[:, :, 1].gather(0, best).squeeze(0).long()
