"""Grammar masks onto a step's logits in one launch, from one packed buffer.

The buffer is int32 (R + R * W,): the R logits rows to mask, then each row's W = ceil(V / 32) mask
words (bit j of word w allows token 32 * w + j). The host fills it in pinned memory and copies it to
the device once, so a step with grammar rows adds one copy and one kernel, however many rows it has.
`apply_row_masks_ref` is the same in plain torch.
"""

import torch

from .paged_attention import check_device, jit, tl

BLOCK = 4096  # tokens a program masks


@jit
def _row_masks_kernel(Logits, Packed, stride_l, num_rows, vocab_size, words, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    row = tl.load(Packed + r).to(tl.int64)
    word = tl.load(Packed + num_rows + r * words + cols // 32, mask=inside, other=-1)
    allowed = (word >> (cols % 32)) & 1
    tl.store(Logits + row * stride_l + cols, float("-inf"), mask=inside & (allowed == 0))


def pack_row_masks(rows: list[int], vocab_size: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed buffer, its (R, W) mask view to fill): the rows are written, the masks left to fill."""
    R, W = len(rows), (vocab_size + 31) // 32
    packed = torch.empty(R + R * W, dtype=torch.int32, pin_memory=pin)
    packed.numpy()[:R] = rows
    return packed, packed[R:].view(R, W)


def apply_row_masks_triton(logits: torch.Tensor, packed: torch.Tensor, num_rows: int) -> None:
    """In place: logits (N, V) fp32, rows contiguous; packed on logits' device (layout above)."""
    check_device(logits)
    N, V = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("apply_row_masks_triton needs float32 logits (N, V) with contiguous rows")
    if packed.dtype != torch.int32 or packed.numel() != num_rows * (1 + (V + 31) // 32):
        raise ValueError(f"the packed masks do not fit {num_rows} rows of a vocabulary of {V}")
    if num_rows == 0:
        return
    _row_masks_kernel[(num_rows, -(-V // BLOCK))](
        logits, packed, logits.stride(0), num_rows, V, (V + 31) // 32, BLOCK=BLOCK
    )


@torch.no_grad()
def apply_row_masks_ref(logits: torch.Tensor, packed: torch.Tensor, num_rows: int) -> None:
    """apply_row_masks_triton in plain torch: unpack the bits with shifts, then one masked fill."""
    V = logits.shape[1]
    rows = packed[:num_rows].to(device=logits.device, dtype=torch.long)
    words = packed[num_rows:].view(num_rows, -1).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(num_rows, -1)[:, :V].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
