"""Placeholder tokens: input ids that the previous step sampled, filled in on the device.

With async scheduling a decode row's input token is the one the step in flight samples. The host
stages it as a placeholder with two indices: `dst`, its row in the step's input ids, and `src`, its
row among the last step's samples (`sampled`, int64 on the device). `dst` is -1 in lanes without a
placeholder, so a CUDA graph can hold the fill as its first kernel over all its lanes and the host
launches nothing for it.
"""

import torch

from .paged_attention import check_device, jit, tl, triton

BLOCK = 128  # lanes a program fills: one compiled variant serves every step (lanes not specialized)
_jit_lanes = triton.jit(do_not_specialize=["lanes"]) if triton is not None else jit


@_jit_lanes
def _fill_kernel(Ids, Sampled, Dst, Src, lanes, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = tl.load(Dst + i, mask=i < lanes, other=-1)
    live = dst >= 0
    src = tl.load(Src + i, mask=live, other=0)
    token = tl.load(Sampled + src, mask=live, other=0)
    tl.store(Ids + dst, token.to(tl.int32), mask=live)


def fill_placeholders_triton(ids: torch.Tensor, sampled: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """In place: ids[dst[i]] = sampled[src[i]] for every lane i with dst[i] >= 0. ids int32; sampled
    int64; dst and src int32 of the same length."""
    check_device(ids)
    lanes = dst.numel()
    if lanes == 0:
        return
    _fill_kernel[(triton.cdiv(lanes, BLOCK),)](ids, sampled, dst, src, lanes, BLOCK=BLOCK)


def fill_placeholders_ref(ids: torch.Tensor, sampled: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """fill_placeholders_triton in plain torch (its boolean mask syncs on a GPU: CPU and tests)."""
    live = dst >= 0
    ids[dst[live].long()] = sampled[src[live].long()].to(torch.int32)
